#!/usr/bin/env python
"""Generate the embedded sample data and the sample tokenizer, deterministically.

    python scripts/tools/make_sample_data.py                 # rewrites data/sample/ and data/tokenizer/
    python scripts/tools/make_sample_data.py --out /tmp/x    # same files under /tmp/x/sample, /tmp/x/tokenizer

Everything comes from one fixed seed and templated English (sentences, lists, code snippets,
arithmetic word problems built from the vocabularies below), so a rerun is byte-identical;
`tests/scripts/test_sample_data.py` checks that against the committed files. Files written:

- sample/instructions.jsonl  {instruction, input, output}; lognormal lengths (median ~120 tokens,
                             most 50-500, a tail into thousands, 3 examples > 8192 tokens)
- sample/chat.jsonl          {messages: [{role, content}, ...]}, multi-turn, optional system prompt
- sample/text.jsonl          {text}
- tokenizer/                 byte-level BPE (vocab 4096) trained on the three files with `tokenizers`,
                             saved in Hugging Face format (tokenizer.json + tokenizer_config.json),
                             loadable with `transformers.AutoTokenizer.from_pretrained`.
- GENERATED.json             seed, library versions and sha256 of every file above.

The tokenizer does NOT add BOS/EOS by itself (no template post-processor, add_bos_token=False): the
packing pipeline adds BOS/EOS explicitly so that it controls where they go and can count them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import OneLineParser, check_output, check_output_folder, write_output, write_text_output  # noqa: E402
from scripts.benchlib.sample_text import Gen  # noqa: E402

SEED = 20240611
N_INSTRUCTIONS = 3000
N_CHAT = 300
N_TEXT = 300
SAMPLE_FILES = ("sample/instructions.jsonl", "sample/chat.jsonl", "sample/text.jsonl")  # under --out
VOCAB_SIZE = 4096
# Target lengths (in tokens) of the forced very long examples: past 8192 so truncation shows up.
LONG_TARGETS = (10500, 12500, 16000)

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]  # ids 0..5 in this order

# ChatML-like; the {% generation %} block marks assistant tokens so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` can find them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ------------------------------------------------------------------------------------ writers


def instruction_targets(r: random.Random) -> list[int]:
    """Token-length targets: lognormal (median 120), clipped below the long examples, plus 3 > 8192."""
    targets = [int(min(6000, max(8, r.lognormvariate(math.log(110), 0.95)))) for _ in range(N_INSTRUCTIONS - len(LONG_TARGETS))]
    for i, t in enumerate(LONG_TARGETS):  # spread the long ones through the file
        targets.insert((i + 1) * N_INSTRUCTIONS // (len(LONG_TARGETS) + 1), t)
    return targets


def write_jsonl(path: Path, rows: Iterator[dict]) -> None:
    """One JSON object per line, the file written whole or not at all (`benchlib.write_output`)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    write_output(path, write)


def make_samples(out: Path) -> list[Path]:
    r = random.Random(SEED)
    g = Gen(r)
    targets = instruction_targets(r)
    files = [out / name for name in SAMPLE_FILES]
    write_jsonl(files[0], (g.instruction(t) for t in targets))
    write_jsonl(files[1], (g.chat() for _ in range(N_CHAT)))
    write_jsonl(files[2], (g.text() for _ in range(N_TEXT)))
    return files


def training_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if "messages" in row:
                    yield from (m["content"] for m in row["messages"])
                else:
                    yield from (v for v in row.values() if v)


def make_tokenizer(files: list[Path], out: Path) -> list[Path]:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json (canonical JSON)."""
    # BPE training gave identical merges with 1, 2 and 4 rayon threads (tokenizers 0.23.3); the test
    # regenerates and compares bytes, so a version where that stops holding is caught.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Deliberately no post-processor that inserts BOS/EOS: the pipeline adds them itself.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(files), trainer=trainer)
    folder = out / "tokenizer"
    tok_json = json.loads(tok.to_str())
    added_decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok_json["added_tokens"]
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [IM_START, IM_END],
        "extra_special_tokens": {},
        # The pipeline adds BOS/EOS explicitly; the tokenizer must not add them on its own.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "padding_side": "right",
        "added_tokens_decoder": added_decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    paths = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    # tokenizer.json keeps its key order (the vocab is written in id order); config keys are sorted.
    write_text_output(paths[0], json.dumps(tok_json, ensure_ascii=False, indent=1) + "\n", "--out")
    write_text_output(paths[1], json.dumps(config, ensure_ascii=False, indent=2, sort_keys=True) + "\n", "--out")
    return paths


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate(out: Path) -> dict:
    """Write everything under `out`; return the GENERATED.json record (also written)."""
    import tokenizers

    samples = make_samples(out)
    tok_files = make_tokenizer(samples, out)
    record = {
        "command": "python scripts/tools/make_sample_data.py",
        "seed": SEED,
        "python_random": "random.Random (Mersenne Twister), stable across CPython 3.x",
        "tokenizers_version": tokenizers.__version__,
        "files": {p.relative_to(out).as_posix(): sha256(p) for p in samples + tok_files},
    }
    write_text_output(out / "GENERATED.json", json.dumps(record, indent=2, sort_keys=True) + "\n", "--out")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "data"
    ap.add_argument("--out", type=Path, default=default, help="output folder (default: data/)")
    args = ap.parse_args(argv)
    check_output_folder(args.out)
    for name in (*SAMPLE_FILES, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "GENERATED.json"):
        check_output(args.out / name)  # each file this writes: none may be a folder or a device
    record = generate(args.out)
    for name, digest in record["files"].items():
        size = (args.out / name).stat().st_size
        print(f"{name:32s} {size:>9,d} bytes  sha256 {digest[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
