"""`pack-verify --deep`: re-tokenize a seeded sample of the source examples and compare them with
what the shards hold."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from pipeline.errors import ShardFormatError, UserError, one_line
from pipeline.read import hub
from pipeline.shards.format import IGNORE_INDEX, load_shard, shard_paths
from pipeline.shards.manifest import Manifest
from pipeline.tokenize.tokenize_inputs import tokenize_examples


def deep_check(folder: Path, manifest: Manifest, tokenizer: str | None, sample: int, seed: int = 0) -> int:
    """Re-tokenize a seeded sample of source examples and compare token ids and labels.

    Uses `pipeline.tokenize.tokenize_inputs.tokenize_examples(config, ids)` on the manifest's `config` (inputs,
    format options, tokenizer; `tokenizer` overrides the recorded one), Hub ids pinned to the
    commits the manifest records (`pinned_config`). A split example is compared
    piece by piece: its pieces are the consecutive max_len chunks of the fresh tokens, each chunk's
    first label -100, found in any order in the shards. Returns the number of examples compared.
    """
    config = pinned_config(manifest)
    if tokenizer:
        config["tokenizer"] = tokenizer
    config["chat_template"] = recorded_template(manifest)
    for key in ("inputs", "tokenizer"):
        if not config.get(key):
            raise UserError(f"--deep: the manifest's config has no {key!r}: cannot re-tokenize")
    pieces: dict[int, list[tuple[str, int, np.ndarray, np.ndarray]]] = {}
    flats = [(path.name, load_shard(path)) for path in shard_paths(folder, manifest)]
    all_ids = np.unique(np.concatenate([f.example_ids for _, f in flats])) if flats else []
    chosen = sorted(random.Random(seed).sample(list(map(int, all_ids)), min(sample, len(all_ids))))
    if not chosen:
        return 0
    wanted = set(chosen)
    for name, flat in flats:
        cum = np.concatenate(([0], np.cumsum(flat.seq_lens)))
        for k in np.flatnonzero(np.isin(flat.example_ids, chosen)):
            r = int(np.searchsorted(flat.ex_off, k, side="right") - 1)
            sl = slice(int(cum[k]), int(cum[k + 1]))
            pieces.setdefault(int(flat.example_ids[k]), []).append(
                (f"{name} row {r} example {k - int(flat.ex_off[r])}", r, flat.input_ids[sl], flat.labels[sl])
            )
    assert wanted == set(pieces)
    # a --mix use k of source example i has id k * examples_read + i
    fresh = tokenize_examples(config, [eid % manifest.counts.examples_read for eid in chosen])
    for eid, (ids, labels) in zip(chosen, fresh, strict=True):
        ids, labels = np.asarray(ids), np.asarray(labels)
        stored = pieces[eid]
        if len(stored) == 1:
            expect = [(ids, labels)]
        else:  # split: consecutive max_len chunks, each chunk's first label masked
            step = manifest.max_len
            expect = []
            for i in range(0, len(ids), step):
                lab = labels[i : i + step].copy()
                lab[0] = IGNORE_INDEX
                expect.append((ids[i : i + step], lab))
        got = sorted(((p[2].tolist(), p[3].tolist()) for p in stored))
        want = sorted(((e[0].tolist(), e[1].tolist()) for e in expect))
        if got != want:
            what = "token ids" if [g[0] for g in got] != [w[0] for w in want] else "labels"
            raise ShardFormatError(
                f"{stored[0][0]} (id {eid}): stored {what} differ from a fresh tokenization of the "
                f"source ({sum(len(p[2]) for p in stored)} stored vs {len(ids)} fresh tokens): "
                "wrong input, tokenizer or format options (or shards from an older pack-data, whose "
                "tokenization differed, e.g. a BOS before chats whose template writes none: pack the data again)"
            )
    return len(chosen)


def recorded_template(manifest: Manifest) -> str | None:
    """The `--chat-template` a folder was packed with, as the manifest's text holds it
    (`chat_template_text`); a template the config names without that text is never read from the
    path it names (a manifest is a file from others): a UserError."""
    text = manifest.tokenizer.get("chat_template_text")
    named = manifest.config.get("chat_template")
    if text is not None:
        if not isinstance(text, str):
            raise UserError(
                f"--deep: the manifest's tokenizer.chat_template_text is a {type(text).__name__}, not "
                "the template's text: pack the folder again"
            )
        return text
    from pipeline.foreign.keys import TRL_TRAINING
    from pipeline.tokenize.chat_templates import NAMED

    if named is None or named == TRL_TRAINING:  # a TRL file's assistant_only_loss, no template to swap
        return None

    if named in NAMED:
        return NAMED[named]
    raise UserError(
        f"--deep: the manifest's config names the chat template {one_line(named, 200)!r} but holds "
        "no tokenizer.chat_template_text; pack-verify reads a template only from the manifest, never "
        "from a path it names (it may lead outside the folder): pack the folder again"
    )


def pinned_config(manifest: Manifest) -> dict:
    """The manifest's `config` with every Hub-named input and tokenizer at the commit it was packed
    from (`org/name@commit[:config][:split]`), so that a re-check reads the very same files."""
    config = dict(manifest.config)
    pins = {e["hub"]["input"]: e["hub"] for e in manifest.inputs if isinstance(e.get("hub"), dict)}
    config["inputs"] = [hub.pinned_input(pins[i]) if i in pins else i for i in config.get("inputs") or []]
    recorded = manifest.tokenizer.get("hub")
    if isinstance(recorded, dict) and config.get("tokenizer") and recorded.get("commit"):
        config["tokenizer"] = hub.HubRef(recorded["id"]).pinned(recorded["commit"])
    return config
