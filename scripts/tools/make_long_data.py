#!/usr/bin/env python
"""Build a data set of long examples (tens of thousands to a million tokens each) for tests and
benchmarks of long-context training, from the data the project ships or from ../shared.

    python scripts/tools/make_long_data.py --lengths 32768,131072,524288,1048576 --count 2 --out long-chat.jsonl
    python scripts/tools/make_long_data.py --kind text --source shared --tokenizer ../shared/tokenizers/llama2 \\
        --lengths 131072 --count 4 --out long-text.jsonl
    pack-data long-chat.jsonl --tokenizer data/tokenizer --max-len 1048576 --out out/long

Kinds (one JSONL file of one format, so pack-data reads it as such):
- `chat`: long multi-turn conversations, `{"messages": [...]}`: a system prompt, then user turns
  that each ask a group of questions and assistant turns that answer them (the questions and
  answers of the source). Turns are grouped so that a conversation has at most about
  MAX_MESSAGES messages: with a template that pack-data cannot split in windows, it renders
  every prefix of a chat (`pipeline.tokenize.render.chat_segments`), in time quadratic in them.
- `text`: concatenated documents, `{"text": ...}`, joined by blank lines.

Sources: `sample` (data/sample: chat exchanges, instruction pairs and documents) or `shared`
(GSM8K questions and answers, CodeAlpaca instructions and outputs, from `$SHARED` or ../shared).
Their units are taken in a seeded order, and again in a new order when they run out.

Every example lands at its requested length exactly, counted as pack-data counts it (BOS and EOS
included, rendered with the tokenizer's chat template): its last message (or the last document)
is a token prefix of a further answer, whose length is corrected until the count is met
(`pipeline.tokenize.tokenize_inputs.lengths_of`, pack-data's own tokenization). So an example of
1048576 tokens fills a `--max-len 1048576` row exactly. The output is the same for the same
options (seed, lengths, count, source, tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer

from pipeline.errors import UserError  # noqa: E402
from scripts.benchlib import CODEALPACA, GSM8K, REPO, OneLineParser, check_output, read_records, require, shared_dir, write_jsonl  # noqa: E402

SAMPLE = REPO / "data" / "sample"
KINDS = ("chat", "text")
SOURCES = ("sample", "shared")
MAX_MESSAGES = 128  # messages per conversation at most (see the module doc)
MAX_TRIES = 8  # length corrections of one example before it is given up as not landing exactly
# The examples are held in memory until the file is written: at most this many tokens in all
# (about half a GB of text), so an absurd --lengths or --count is refused before any work.
MAX_TOTAL_TOKENS = 1 << 27
SYSTEM = "You are a patient assistant. Answer every question of the user in order, showing your work."


# ------------------------------------------------------------------------------------- sources


def exchanges(source: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of the source, in file order."""
    if source == "shared":
        shared = shared_dir()
        require(shared / GSM8K, shared / CODEALPACA)
        pairs = [(r["question"], r["answer"]) for r in read_records(shared / GSM8K)]
        for r in read_records(shared / CODEALPACA):
            extra = (r.get("input") or "").strip()
            pairs.append((r["instruction"] + (f"\n\n{extra}" if extra else ""), r["output"]))
        return pairs
    pairs = []
    for r in read_records(SAMPLE / "instructions.jsonl"):
        extra = (r.get("input") or "").strip()
        pairs.append((r["instruction"] + (f"\n\n{extra}" if extra else ""), r["output"]))
    for r in read_records(SAMPLE / "chat.jsonl"):
        msgs = [m for m in r["messages"] if m["role"] != "system"]
        pairs += [(u["content"], a["content"]) for u, a in zip(msgs[::2], msgs[1::2]) if u["role"] == "user" and a["role"] == "assistant"]
    return pairs


def documents(source: str) -> list[str]:
    """Plain documents of the source: data/sample's texts, or each pair as one document."""
    if source == "sample":
        return [r["text"] for r in read_records(SAMPLE / "text.jsonl")]
    return [f"{q}\n\n{a}" for q, a in exchanges(source)]


def seeded_cycle(items: list[Any], rng: random.Random) -> Iterator[Any]:
    """`items` in a seeded order, then in a new seeded order, without end."""
    while True:
        order = list(range(len(items)))
        rng.shuffle(order)
        yield from (items[i] for i in order)


# ------------------------------------------------------------------------------------ building


class Counter:
    """Token counts: estimates with the tokenizer alone (`estimate`), and the exact count of an
    example as pack-data makes it (`exact`: its rendering, BOS and EOS)."""

    def __init__(self, tokenizer_path: str, kind: str, tmp: Path) -> None:
        from pipeline.tokenize.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.backend = self.tokenizer.backend_tokenizer
        self.kind, self.tmp = kind, tmp

    def estimate(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def ids(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def exact(self, record: dict[str, Any]) -> int:
        from pipeline.tokenize.tokenize_inputs import lengths_of

        path = self.tmp / "one.jsonl"
        path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
        lengths = lengths_of(str(path), self.tokenizer, format=self.kind)
        return int(lengths[0]) if len(lengths) else 0


def grouped_turns(
    pairs: Iterator[tuple[str, str]], counter: Counter, budget: int, turn_tokens: int
) -> tuple[list[dict[str, str]], int, Iterator[tuple[str, str]]]:
    """Whole user/assistant turns of about `turn_tokens` tokens each while their estimate stays
    below `budget`: (messages, estimated tokens, the pairs left)."""
    messages: list[dict[str, str]] = []
    used = 0
    while True:
        questions, answers, size = [], [], 0
        while size < turn_tokens:
            q, a = next(pairs)
            k = len(questions) + 1
            questions.append(f"Question {k}: {q}")
            answers.append(f"Answer {k}: {a}")
            size += sum(counter.estimate([questions[-1], answers[-1]])) + 8
        if used + size >= budget:
            return messages, used, pairs
        messages += [{"role": "user", "content": "\n\n".join(questions)}, {"role": "assistant", "content": "\n\n".join(answers)}]
        used += size


def filler_ids(counter: Counter, texts: Iterator[str], need: int, ids: list[int] | None = None) -> list[int]:
    """`ids` extended by the token ids of further texts, joined by blank lines and each encoded on
    its own (the tail is decoded from them and counted again), to at least `need` ids."""
    ids = list(ids or [])
    while len(ids) < need:
        ids += counter.ids(("\n\n" if ids else "") + next(texts))
    return ids


def land(counter: Counter, target: int, head: Any, ids: list[int], first_guess: int, more: Iterator[str]) -> tuple[dict[str, Any], int]:
    """The example `head(tail_text)` whose exact count is `target`: the tail is a token prefix of
    `ids`, its length corrected by the difference until the count is met (ids are extended from
    `more` as needed). Returns (record, count); the count differs from `target` only when
    MAX_TRIES corrections did not meet it (the closest below it is kept)."""
    k = max(1, first_guess)
    best: tuple[dict[str, Any], int] | None = None
    tried: set[int] = set()
    for _ in range(MAX_TRIES):
        if k > len(ids):
            ids = filler_ids(counter, more, k, ids)
        record = head(counter.decode(ids[:k]))
        count = counter.exact(record)
        if count == target:
            return record, count
        if count < target and (best is None or count > best[1]):
            best = (record, count)
        tried.add(k)
        step = target - count
        k = max(1, k + step)
        while k in tried:  # a correction that comes back to a tried prefix: step past it
            k += 1 if step > 0 else -1
            if k < 1:
                break
        if k < 1:
            break
    if best is None:
        raise SystemExit(f"cannot build an example of {target} tokens: its fixed part alone is longer; ask for a longer length")
    return best


def chat_example(counter: Counter, target: int, pairs: Iterator[tuple[str, str]], turn_tokens: int) -> tuple[dict[str, Any], int]:
    """One conversation of `target` tokens (module doc)."""
    system = {"role": "system", "content": SYSTEM}
    messages, used, pairs = grouped_turns(pairs, counter, int(target * 0.95) - 64, turn_tokens)
    question, answer = next(pairs)
    last_user = {"role": "user", "content": f"Question 1: {question}"}
    fixed = [system, *messages, last_user]
    guess = target - used - sum(counter.estimate([SYSTEM, last_user["content"]])) - 6 * (len(fixed) + 1) - 2
    answers = chain([f"Answer 1: {answer}"], (a for _, a in pairs))
    ids = filler_ids(counter, answers, max(guess, 1) + 64)
    return land(counter, target, lambda tail: {"messages": [*fixed, {"role": "assistant", "content": tail}]}, ids, guess, answers)


def text_example(counter: Counter, target: int, docs: Iterator[str]) -> tuple[dict[str, Any], int]:
    """One text of `target` tokens: whole documents, then a token prefix of the next ones."""
    parts, used = [], 0
    while True:
        doc = next(docs)
        size = counter.estimate([doc])[0] + 2
        if used + size >= int(target * 0.95) - 16:
            break
        parts.append(doc)
        used += size
    head_text = "\n\n".join(parts)
    guess = target - used - 2
    tail_docs = chain([doc], docs)  # (not a generator of ours: closing one would close `docs`)
    ids = filler_ids(counter, tail_docs, max(guess, 1) + 64)
    return land(counter, target, lambda tail: {"text": f"{head_text}\n\n{tail}" if head_text else tail}, ids, guess, tail_docs)


def build(
    kind: str,
    source: str,
    tokenizer: str,
    lengths: list[int],
    count: int,
    seed: int,
) -> list[tuple[dict[str, Any], int, int]]:
    """(record, its token count, the length asked for) of each example: `count` per length."""
    rng = random.Random(seed)
    out = []
    with tempfile.TemporaryDirectory(prefix="make-long-") as tmp:
        counter = Counter(tokenizer, kind, Path(tmp))
        units = seeded_cycle(exchanges(source) if kind == "chat" else documents(source), rng)
        for target in lengths:
            for _ in range(count):
                if kind == "chat":
                    turn_tokens = max(256, target // (MAX_MESSAGES // 2))
                    record, got = chat_example(counter, target, units, turn_tokens)
                else:
                    record, got = text_example(counter, target, units)
                out.append((record, got, target))
    return out


def _lengths(text: str) -> list[int]:
    from pipeline.plan.binpack import MAX_LEN_LIMIT  # the longest row pack-data packs

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:100]!r}: expected comma-separated integers, e.g. 32768,131072")
    if not values or min(values) < 64 or max(values) > MAX_LEN_LIMIT:
        raise argparse.ArgumentTypeError(
            f"{text[:100]!r}: each length must be at least 64 tokens and at most {MAX_LEN_LIMIT} (pack-data's longest --max-len)"
        )
    return values


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=[32768, 131072, 524288, 1048576],
        help="token lengths of the examples, comma-separated (default: 32768,131072,524288,1048576)",
    )
    p.add_argument("--count", type=int, default=1, help="examples per length (default 1)")
    p.add_argument("--kind", choices=KINDS, default="chat", help="chat conversations or plain text (default chat)")
    p.add_argument(
        "--source", choices=SOURCES, default="sample", help="data/sample, or GSM8K + CodeAlpaca from $SHARED or ../shared (default sample)"
    )
    p.add_argument(
        "--tokenizer",
        default=str(REPO / "data" / "tokenizer"),
        help="the tokenizer pack-data will use (lengths are counted with it; default data/tokenizer)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the order the source's units are taken in")
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be at least 1")
    if args.count * sum(args.lengths) > MAX_TOTAL_TOKENS:
        p.error(
            f"--count {args.count} examples of each of --lengths ({sum(args.lengths)} tokens) make more "
            f"than {MAX_TOTAL_TOKENS} tokens in all, which are held in memory: ask for fewer"
        )
    check_output(args.out)
    if not args.out.absolute().parent.is_dir():
        p.error(f"--out {args.out}: folder {args.out.absolute().parent} does not exist")
    try:
        made = build(args.kind, args.source, args.tokenizer, args.lengths, args.count, args.seed)
    except UserError as exc:  # the tokenizer or the data refused by pack-data's own checks
        raise SystemExit(f"error: {exc}") from None
    write_jsonl(args.out, [record for record, _, _ in made])  # whole or not at all, one line on failure
    for i, (_, got, target) in enumerate(made):
        note = "" if got == target else f" (not exact: {target - got} short)"
        print(f"example {i}: {got} tokens{note}")
    print(f"wrote {args.out}: {len(made)} {args.kind} examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
