"""The pack-data job: `run_pack_data(PackConfig(...))`, which the `pack-data` command calls (tests
and benchmarks call it directly). It reads as the pipeline, one step per line:

    resolve inputs -> detect formats -> load tokenizer -> tokenize to spill -> overlong -> eval split
    -> mix -> plan -> write shards (and the eval folder's) -> manifest -> verify -> commit

Everything is written inside a hidden temporary sibling of the output folder
(`pipeline.write.outdir.output_folder`), renamed to the output only when complete. Inputs and --out may
be URIs of remote storage (`pipeline.read.remote`: inputs downloaded first; `pipeline.write.remote_out`:
the output uploaded last).
With `engine="ray"` the tokenize and write steps run as Ray tasks (`pipeline.engines.ray_engine`); the
shards are the same.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline import splits
from pipeline.api_errors import python_spelling
from pipeline.background import Background
from pipeline.engines.pack_config import PACK_CHECKS, PackConfig, refuse_combinations
from pipeline.engines.ray_engine import (
    check_shared,
    columns_on_ray,
    download_on_ray,
    fingerprints_on_ray,
    ray_session,
    tokenize_on_ray,
    write_on_ray,
)
from pipeline.errors import UserError
from pipeline.files.folder_lock import folder_lock
from pipeline.option_checks import check_options
from pipeline.plan.dedup import drop_duplicates
from pipeline.plan.eval_split import EVAL_FOLDER, split_off_eval
from pipeline.plan.mix import apply_mix, file_weights, parse_mix
from pipeline.plan.rows import Pieces, RowPlan, apply_overlong, plan_rows
from pipeline.progress import bar, estimate_rows
from pipeline.read.formats import ResolvedFormat, absolute_per_input, parse_per_input
from pipeline.read.remote import Staged, download_here, is_uri, staged_inputs
from pipeline.read.sources import changed_inputs, input_fingerprints, resolve_inputs
from pipeline.report.stats import DEFAULT_BATCH_SIZE, Layout, pad_to_longest
from pipeline.shards import Manifest, manifest_vocab, verify_folder, write_manifest
from pipeline.tokenize.chat_templates import resolve_chat_template
from pipeline.tokenize.encode_pool import capped_workers, default_workers, encode_pool
from pipeline.tokenize.spill import Spill
from pipeline.tokenize.tokenize_inputs import file_formats, needs_encoder, tokenize_to_spill
from pipeline.tokenize.tokenizer import check_token_options, load_tokenizer, tokenizer_info
from pipeline.write.nesting import check_out_nesting
from pipeline.write.outdir import check_out, local_inputs_folder, output_folder
from pipeline.write.remote_out import remote_out
from pipeline.write.shard_writer import Written, check_sizes, write_shards

SHARD_TARGET_BYTES = 128 << 20  # auto --rows-per-shard aims at shards of about this size (bounds RAM)
BYTES_PER_TOKEN = 12  # input_ids + labels + position_ids, int32 each


@python_spelling(PackConfig)
def run_pack_data(
    config: PackConfig,
    *,
    echo: Callable[[str], None] | None = None,
    stats: dict[str, Any] | None = None,
) -> Manifest:
    """Run the whole job; return the manifest of the finished output folder.

    `echo` receives the final summary lines; `stats`, when given, is filled with per-phase seconds
    and totals (for benchmarks).
    """
    clock = _Clock()
    validate(config)
    on_ray = config.engine == "ray"
    with (
        out_lock(config.out),
        ray_session(config.ray_address, config.num_proc) if on_ray else nullcontext(),
        remote_out(config.out, config.overwrite, config.tmp_dir) as out,
    ):
        if on_ray:  # every node sees where the output (and downloaded inputs) go, and the local inputs
            check_shared(out.absolute().parent, [p for p in config.inputs if not is_uri(p) and os.path.exists(p)])
        download = download_on_ray if on_ray else download_here
        with staged_inputs(list(config.inputs), local_inputs_folder(out), download) as staged:
            try:
                return _run(config, out, staged, clock, on_ray, echo, stats)
            except UserError as exc:
                if not staged.prefixes:
                    raise
                raise UserError(staged.in_message(str(exc))) from None  # remote inputs named by their URIs


def out_lock(out: str) -> AbstractContextManager:
    """The lock that keeps a second pack-data off a local --out while this one runs
    (`.OUT.lock` beside it, `pipeline.files.folder_lock`); a remote --out is written from a folder of its own."""
    if is_uri(out):
        return nullcontext()
    path = Path(out).absolute()
    return folder_lock(path.parent / f".{path.name}.lock", out, "pack-data")


def _run(
    config: PackConfig,
    out: Path,
    staged: Staged,
    clock: _Clock,
    on_ray: bool,
    echo: Callable[[str], None] | None,
    stats: dict[str, Any] | None,
) -> Manifest:
    """The job on local paths: `out` is the local output folder, `staged.inputs` the local inputs."""
    files = staged.as_given(resolve_inputs(staged.inputs))
    # each input file's own format and fields
    fmts = file_formats(files, config.format_options(), columns_on_ray(files) if on_ray else None)
    tokenizer = load_tokenizer(config.tokenizer, config.chat_template, config.add_tokens, config.special_tokens)
    tok_info = tokenizer_info(tokenizer, config.tokenizer, config.chat_template, config.add_tokens, config.special_tokens)
    if not on_ray and config.num_proc > 1 and needs_encoder(fmts):
        encode_pool(config.num_proc)  # its workers are forked before this process starts any thread
    # the sha256 of every input byte, meanwhile
    fingerprints = Background(fingerprints_on_ray if on_ray else input_fingerprints, files)
    with output_folder(out, config.overwrite) as tmp:
        clock.lap("setup")
        with closing(_tokenize(config, files, fmts, tokenizer, tmp)) as spill:
            clock.lap("read_tokenize")
            pieces, held, sources, plan, reference = _plan(config, staged, files, spill)
            # the packed folders: OUT itself and, with held-out examples, OUT/eval (one of their own)
            folders = [(tmp, pieces, plan)]
            if held is not None:
                (tmp / EVAL_FOLDER).mkdir()
                folders.append((tmp / EVAL_FOLDER, held, plan_rows(held, config.max_len, config.strategy, config.seed, config.group_size)))
            clock.lap("plan")
            write = write_on_ray if on_ray else write_shards
            written = [
                write(
                    folder,
                    spill,
                    rows,
                    max_len=config.max_len,
                    rows_per_shard=config.rows_per_shard,
                    vocab=manifest_vocab(tok_info),
                    progress=config.progress,
                )
                for folder, _, rows in folders
            ]
        shutil.rmtree(tmp / "_spill", ignore_errors=True)
        changed_inputs(files, fingerprints.result())
        inputs = [{**entry, "path": staged.to_uri(entry["path"])} for entry in fingerprints.result()]
        manifests = [
            _manifest(config, staged, files, fmts, tok_info, parts, rows, w, inputs) for (_, parts, rows), w in zip(folders, written)
        ]
        manifest = manifests[0]
        manifest.sources = sources
        if held is not None:
            manifest.eval = {"folder": EVAL_FOLDER, "examples": held.counts.examples_packed}
            manifests[1].eval = {"role": "eval"}
        for (folder, _, _), m in zip(folders, manifests):
            write_manifest(folder, m)
        clock.lap("write")
        # folder-level checks (manifest, files, totals, example ids) from the per-shard results of
        # the checker thread; no second pass over the tokens, no second sha256 pass over every byte
        for (folder, _, _), w in zip(folders, written):
            verify_folder(folder, check_hashes=False, checked=w.checked)
            check_sizes(folder, w.sizes)
        clock.lap("verify")
    clock.times["total"] = time.perf_counter() - clock.start
    for line in summary_lines(manifest, clock.times, stats, reference):
        if echo is not None:
            echo(line)
    if stats is not None:
        stats["times"] = clock.times
    return manifest


class _Clock:
    """Seconds per phase, each from the end of the previous one."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.times: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] = now - self.last
        self.last = now


def validate(config: PackConfig) -> None:
    """Refuse impossible options in one line each, and fill in the defaults that depend on the
    machine (`num_proc`) or on max_len (`rows_per_shard`): the manifest records those."""
    check_options(config, PACK_CHECKS, {"inputs": "inputs"})
    if not config.inputs:
        raise UserError("no INPUT given: pass one or more files, folders or globs")
    check_out_nesting(config.out, config.inputs, is_uri(config.out))  # no input read back or replaced
    if not is_uri(config.out):
        check_out(Path(config.out), config.overwrite)
    parse_mix(config.mix)  # a malformed --mix fails before any work
    for entry in config.per_input:  # so does a malformed --per-input
        parse_per_input(entry)
    if config.chat_template is not None:
        resolve_chat_template(config.chat_template)  # an unknown name or missing file, too
    check_token_options(config.add_tokens, config.special_tokens)
    refuse_combinations(config)
    if config.num_proc is None:
        config.num_proc = default_workers()
    elif config.engine != "ray":  # a Ray cluster's CPUs are not this machine's
        config.num_proc = capped_workers(config.num_proc, "pack-data")
    if config.rows_per_shard is None:
        config.rows_per_shard = max(1, SHARD_TARGET_BYTES // (config.max_len * BYTES_PER_TOKEN))


def _tokenize(config: PackConfig, files: list[Any], fmts: list[ResolvedFormat], tokenizer: Any, tmp: Path) -> Spill:
    """Read and tokenize every input into a spill in `tmp`, with a progress bar."""
    if config.engine == "ray":
        # tasks that load the tokenizer load the folder it came from (a Hub id's: the commit resolved here)
        folder = str(getattr(tokenizer, "name_or_path", "") or config.tokenizer)
        chat_template = tokenizer.chat_template if config.chat_template is not None else None
        source = (folder, chat_template, tuple(config.add_tokens), tuple(sorted(config.special_tokens.items())))
        spill = tokenize_on_ray(
            files,
            fmts,
            tokenizer,
            source,
            tmp / "_spill",
            max_len=config.max_len,
            overlong=config.overlong,
            limit=config.limit,
            batch_rows=config.batch_rows,
            chunk_bytes=config.chunk_bytes,
            progress=config.progress,
        )
    else:
        spill = _tokenize_here(config, files, fmts, tokenizer, tmp)
    if spill.examples_read == 0:
        raise UserError(f"the inputs {' '.join(map(str, config.inputs))} hold no rows: nothing to pack")
    if len(spill.lengths) == 0:
        raise UserError(
            f"all {spill.examples_read} examples are empty after rendering: check the field names "
            "(--text-field, --prompt-field, ...) and --format"
        )
    return spill


def _tokenize_here(config: PackConfig, files: list[Any], fmts: list[ResolvedFormat], tokenizer: Any, tmp: Path) -> Spill:
    """The local engine's read and tokenize (`tokenize_to_spill`), with a progress bar of examples."""
    total = estimate_rows(files, config.limit) if config.progress else None
    with bar(config.progress, desc="read+tokenize", unit="ex", total=total) as progress:
        return tokenize_to_spill(
            files,
            fmts,
            tokenizer,
            tmp / "_spill",
            max_len=config.max_len,
            overlong=config.overlong,
            num_proc=config.num_proc,
            limit=config.limit,
            batch_rows=config.batch_rows,
            progress=progress,
        )


def _plan(config: PackConfig, staged: Staged, files: list[Any], spill: Spill) -> tuple[Pieces, Pieces | None, list[dict], RowPlan, Layout]:
    """Overlong policy, held-out examples (`--eval-fraction`/`--eval-examples`), mixture (`--mix`)
    and row plan; also the pad-to-longest layout pack-report compares against (batches of 32
    stored sequences in example-id order)."""
    with bar(config.progress, desc="plan", total=1, unit="step") as progress:
        pieces = apply_overlong(spill, config.max_len, config.overlong, config.min_len)
        if config.dedup:
            pieces = drop_duplicates(spill, pieces)
        if len(pieces.lengths) == 0:
            short = pieces.counts.too_short
            raise UserError(
                f"all {len(spill.lengths)} examples were dropped ({short} shorter than --min-len {config.min_len}, "
                f"{pieces.counts.dropped} longer than --max-len {config.max_len}): lower --min-len, raise --max-len "
                "or use --overlong truncate|split"
                if short
                else f"all {len(spill.lengths)} examples are longer than --max-len {config.max_len} and were dropped: "
                "raise --max-len or use --overlong truncate|split"
            )
        held = None
        if config.eval_fraction is not None or config.eval_examples is not None:
            cut = spill.example_ids[spill.lengths > config.max_len] if config.overlong == "truncate" else None
            pieces, held = split_off_eval(
                pieces, fraction=config.eval_fraction, examples=config.eval_examples, seed=config.seed, truncated_ids=cut
            )
        mix = {staged.local_of.get(name, name): w for name, w in parse_mix(config.mix).items()}
        weights = file_weights(mix, staged.inputs, files)
        pieces, sources = apply_mix(pieces, spill.file_examples, weights, config.seed, [staged.to_uri(f.path) for f in files])
        plan = plan_rows(pieces, config.max_len, config.strategy, config.seed, config.group_size)
        reference = pad_to_longest(pieces.lengths, DEFAULT_BATCH_SIZE)
        progress.update(1)
    return pieces, held, sources, plan, reference


def _manifest(
    config: PackConfig,
    staged: Staged,
    files: list[Any],
    fmts: list[ResolvedFormat],
    tok_info: dict[str, Any],
    pieces: Pieces,
    plan: RowPlan,
    written: Written,
    inputs: list[dict],
) -> Manifest:
    """The manifest of the finished shards; refuses data in which no token carries a loss."""
    if written.loss_tokens == 0:
        raise UserError(
            "no packed example has a token that carries a loss (e.g. chat rows without an assistant "
            "turn, or responses all cut off by --max-len): there is nothing to train on; check the "
            "data and its format options (pack-report --input shows what the format resolves to)"
        )
    pieces.counts.no_loss = sum(summary.no_loss for summary in written.checked.values())
    dicts = [f.to_dict() for f in fmts]
    tok_info = {**tok_info, "format": dicts[0] if all(d == dicts[0] for d in dicts) else {"kind": "mixed"}}
    config_dict = asdict(config)
    # local paths absolute, so `pack-verify --deep` can re-read the inputs from any folder
    config_dict["inputs"] = [_absolute_if_local(p) for p in config.inputs]
    config_dict["tokenizer"] = _absolute_if_local(config.tokenizer)
    config_dict["per_input"] = absolute_per_input(config.per_input, _absolute_if_local)
    # what --format auto (or the field options) resolved to, per input file
    config_dict["resolved_formats"] = [{"file": staged.to_uri(f.path), **x.to_dict()} for f, x in zip(files, fmts)]
    return Manifest(
        max_len=config.max_len,
        strategy=config.strategy,
        seed=config.seed,
        rows=plan.n_rows,
        total_tokens=written.total_tokens,
        loss_tokens=written.loss_tokens,
        efficiency=round(written.total_tokens / (plan.n_rows * config.max_len), 6),
        counts=pieces.counts,
        shards=written.shards,
        tokenizer=tok_info,
        inputs=inputs,
        config=config_dict,
        groups=plan.group_rows,
        group_size=config.group_size if plan.group_rows else None,
    )


def _absolute_if_local(path: str) -> str:
    """An existing local path (or a local glob) made absolute; anything else (a URI, a Hub name)
    unchanged; a share of an input's rows (`pipeline.splits`) follows its input."""
    if is_uri(path) or path.startswith(splits.HF_FILES):
        return path
    if not os.path.lexists(path) and (sliced := splits.split_share(path)) is not None:
        return f"{_absolute_if_local(sliced[0])}:{sliced[2].text}"
    if os.path.exists(path) or any(c in path for c in "*?["):
        return os.path.abspath(path)
    return path


def no_loss_causes(manifest: Manifest) -> str:
    """What can leave an example of this job without a loss token, from its formats and counts:
    a cut at --max-len before the response, a chat without an assistant turn, pre-tokenized labels
    of only -100."""
    kinds = {f.get("kind") for f in manifest.config.get("resolved_formats", [])}
    c = manifest.counts
    causes = []
    if c.truncated:
        causes.append(f"examples cut at --max-len {manifest.max_len} before their response begins: {c.truncated} were truncated")
    if c.split:
        causes.append("pieces of split examples that hold only prompt tokens")
    if "chat" in kinds:
        causes.append("chat rows without an assistant turn")
    if "tokenized" in kinds:
        causes.append("pre-tokenized rows whose labels are all -100")
    if not causes:
        return "check the data and its format options"
    return "likely " + "; or ".join(causes)


def summary_lines(
    manifest: Manifest,
    times: dict[str, float],
    stats: dict[str, Any] | None = None,
    reference: Layout | None = None,
) -> list[str]:
    """Human summary: counts, rows, efficiency, padding against pad-to-longest, time per phase.

    `reference` is `pipeline.report.stats.pad_to_longest` of the stored sequences (batches of 32 in
    example-id order), the same baseline and figure as `pack-report`'s "padding tokens avoided".
    """
    c = manifest.counts
    pad_packed = manifest.rows * manifest.max_len - manifest.total_tokens
    tok_s = manifest.total_tokens / times["total"] if times.get("total") else 0.0
    phases = ", ".join(f"{k.replace('_', '+')} {v:.2f}s" for k, v in times.items() if not k.startswith("_"))
    lines = [
        (
            f"examples: {c.examples_read} read, {c.examples_packed} packed, {c.empty_skipped} empty skipped, "
            f"{c.truncated} truncated, {c.split} split, {c.dropped} dropped"
            + (
                f", {c.too_short} shorter than --min-len {manifest.config['min_len']} dropped"
                if manifest.config.get("min_len", 1) > 1
                else ""
            )
            + (f", {c.duplicates} duplicates dropped (--dedup)" if manifest.config.get("dedup") else "")
        ),
        (
            f"rows: {manifest.rows} in {len(manifest.shards)} shard(s), {manifest.total_tokens} tokens "
            f"({manifest.loss_tokens} with loss), efficiency {manifest.efficiency:.2%} of {manifest.rows} x {manifest.max_len}"
        ),
    ]
    if manifest.groups:
        lines.append(
            f"groups: {len(manifest.groups)} of {manifest.group_size} examples (the last may hold fewer), "
            "each packed on its own: pack-train takes one group an optimizer step"
        )
    if manifest.eval.get("folder"):
        lines.append(
            f"eval: {manifest.eval['examples']} examples held out in {manifest.eval['folder']}/ "
            "(a packed folder of its own; pack-train evaluates on it)"
        )
    if any(src.get("weight", 1) != 1 for src in manifest.sources):
        lines.append(
            "mix: "
            + "; ".join(
                f"{Path(src['input']).name} x{src['weight']:g}: {src['examples_used']} of {src['examples_read']} "
                f"examples used, {src['uses']} uses"
                for src in manifest.sources
            )
        )
    if c.no_loss:
        lines.append(
            f"warning: {c.no_loss} packed example(s) have no token that carries a loss "
            f"({no_loss_causes(manifest)}): they take room but train nothing"
        )
    if reference is not None:
        avoided = reference.padding - pad_packed
        verdict = f"{avoided:,} avoided" if avoided >= 0 else f"{-avoided:,} more than pad-to-longest"
        lines.append(
            f"padding: pad-to-longest batches of {DEFAULT_BATCH_SIZE} (example order) {reference.padding:,} "
            f"tokens (efficiency {reference.efficiency:.2%}); this packing {pad_packed:,} "
            f"(efficiency {manifest.efficiency:.2%}): {verdict}"
        )
        if stats is not None:
            stats.update(pad_longest=reference.padding, pad_packed=pad_packed, padding_avoided=avoided)
    if stats is not None:
        stats.update(tokens=manifest.total_tokens, rows=manifest.rows, pieces=reference.rows if reference else None)
    lines.append(f"time: {phases} ({tok_s / 1e6:.2f}M tokens/s)")
    return lines
