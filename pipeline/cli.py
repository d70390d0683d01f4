"""The three data commands: `pack-data` (tokenize and pack into shards), `pack-verify` (prove a
packed folder intact) and `pack-report` (packing statistics of a folder, or a what-if plan of raw
data). Each is a thin click wrapper over the library; bad input ends in one line
(`pipeline.errors.cli_errors`). pack-data and pack-report share the format options.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from pipeline.config_file import HintedCommand, config_option
from pipeline.engines.job import run_pack_data
from pipeline.engines.pack_config import PACK_CHECKS, PackConfig
from pipeline.errors import UserError, cli_errors
from pipeline.files.durable import write_atomic
from pipeline.foreign.config import DATA
from pipeline.option_checks import INT_MAX, MAX_PROCS, click_options, field_values, param_fields
from pipeline.plan.binpack import MAX_LEN_LIMIT, STRATEGIES, uncompiled
from pipeline.read import hub
from pipeline.read.formats import FormatOptions
from pipeline.read.remote import folder_to_read
from pipeline.report.deep_check import deep_check
from pipeline.report.flops import MAX_LAYERS, Sizes
from pipeline.report.stats import DEFAULT_BATCH_SIZE, PACKED_STRATEGIES
from pipeline.shards import MANIFEST_NAME, check_checksum, verify_eval_folder, verify_folder
from pipeline.tokenize.encode_pool import capped_workers
from pipeline.tokenize.tokenize_inputs import lengths_of

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

# the options that say how input rows become examples (`pipeline.read.formats.FormatOptions`), of
# pack-data and pack-report
format_options = click_options(FormatOptions, ranges=False)


# ------------------------------------------------------------------------------------ pack-data

PACK_DATA_EPILOG = """\b
Examples:
  pack-data data/sample/instructions.jsonl --tokenizer data/tokenizer --max-len 8192 --out out/sample
  pack-data 'corpus/*.parquet' --tokenizer meta-llama/Llama-2-7b-hf --max-len 4096 \\
      --format text --text-field body --num-proc 8 --out out/corpus --overwrite
  pack-data data/sample/chat.jsonl --tokenizer data/tokenizer --max-len 2048 --out out/chat --limit 100
  pack-data HuggingFaceH4/ultrachat_200k:train_sft --tokenizer Qwen/Qwen2.5-0.5B-Instruct \\
      --max-len 4096 --out out/ultrachat   # Hub ids: org/name[@revision], a dataset's [config:]split
  pack-data 'HuggingFaceH4/ultrachat_200k:train_sft[:20%]' --tokenizer Qwen/Qwen2.5-0.5B-Instruct \
      --max-len 4096 --out out/ultrachat-20   # a share of a split, as datasets selects it
  pack-data --config data/configs/pack-data.yaml --max-len 4096   # options from a file, flags win
  pack-data 's3://bucket/corpus/*.jsonl' --tokenizer tok --max-len 8192 --out s3://bucket/packed \\
      --engine ray --ray-address 10.0.0.1:6379   # on a Ray cluster
"""


def _special_tokens(ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    """--special-token NAME=TEXT values as a dict; a config file's mapping (Axolotl's) as it is."""
    given = (ctx.default_map or {}).get("special_tokens")
    if isinstance(given, dict) and ctx.get_parameter_source("special_tokens") == click.core.ParameterSource.DEFAULT_MAP:
        return given
    pairs = {}
    for item in value:
        name, sep, text = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: give NAME=TEXT, e.g. eos_token=<|im_end|>")
        pairs[name.strip()] = text
    return pairs


@click.command(cls=HintedCommand, context_settings=CONTEXT, epilog=PACK_DATA_EPILOG)
@config_option(checks=PACK_CHECKS, fields=param_fields(PackConfig), foreign=DATA)
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click_options(
    PackConfig,
    ranges=False,
    skip=("inputs",),
    settings={"tmp_dir": {"type": click.Path(file_okay=False)}, "special_tokens": {"callback": _special_tokens}},
)
@click.option("--offline", is_flag=True, callback=hub.offline_flag, expose_value=False, is_eager=True, help=hub.OFFLINE_HELP)
def pack_data(inputs: tuple[str, ...], **options: object) -> None:
    """Tokenize INPUT... (JSONL, JSON, Parquet, Arrow, CSV, save_to_disk folders, globs, URIs of
    remote storage such as s3://bucket/data/*.jsonl, and Hugging Face Hub datasets such as
    HuggingFaceH4/ultrachat_200k:train_sft, org/name[@revision][:config]:split, or files of one as
    hf://datasets/org/name[@revision]/PATH) and write bin-packed Arrow shards plus manifest.json to --out.
    A share of an input's rows is written after its split in the datasets syntax: org/name:train[:20%],
    data.jsonl:train[10:100], 'data/*.jsonl:train[-5%:]' (a local file's split is train): the rows
    datasets.load_dataset(..., split=...) selects, counted over all the input's files.

    Every example starts with BOS and ends with EOS, but a chat, which is its chat template's rendering
    as apply_chat_template tokenizes it (its own BOS, if any; an EOS only where it writes no
    end-of-turn token of its own); loss is taken on responses / assistant turns
    (all tokens of plain text), never on the first token of an example. Rows hold no padding;
    position_ids restart per example. The output folder appears only when complete.
    """
    with cli_errors():  # click parses the options' types; the job checks their values (job.validate)
        if not options["progress"]:
            hub.no_progress_bars()
        config = PackConfig(inputs=list(inputs), **field_values(PackConfig, options))
        run_pack_data(config, echo=click.echo)


# ---------------------------------------------------------------------------------- pack-verify


@click.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--no-hash", is_flag=True, help="Skip the sha256 of each shard and the manifest's checksum (structure only).")
@click.option("--deep", is_flag=True, help="Also re-tokenize a sample of the source examples and compare token ids.")
@click.option("--tokenizer", default=None, help="Tokenizer for --deep (default: the one recorded in the manifest's config).")
@click.option("--sample", default=100, show_default=True, type=click.IntRange(min=1), help="How many examples --deep re-tokenizes.")
@click.option("--offline", is_flag=True, callback=hub.offline_flag, expose_value=False, is_eager=True, help=hub.OFFLINE_HELP)
def pack_verify(folder: str, no_hash: bool, deep: bool, tokenizer: str | None, sample: int) -> None:
    """Check that FOLDER (written by pack-data) is intact and follows the shard contract; with a
    held-out eval folder inside (pack-data --eval-fraction), that one too, and that no example is
    in both. FOLDER may be a URI (s3://, gs://, hdfs://, file://): it is downloaded and checked."""
    with (
        cli_errors(interrupted="the packed folder was not changed", disk_full="free some space; the packed folder was not changed"),
        folder_to_read(folder) as folder,
    ):  # type: ignore[assignment]
        manifest = verify_folder(folder, check_hashes=not no_hash)
        folders = [(folder, manifest, "ok")]
        if manifest.eval.get("folder"):
            held = folder / manifest.eval["folder"]
            folders.append((held, verify_eval_folder(folder, manifest, check_hashes=not no_hash), "eval ok"))
        for path, m, word in folders:
            extra = ""
            if deep:
                n = deep_check(path, m, tokenizer, sample)
                extra = f", {n} examples re-tokenized and matched"
            hashed = " (sha256 not checked)" if no_hash else ""
            click.echo(f"{word}: {m.rows} rows, {m.total_tokens} tokens, {len(m.shards)} shards verified{hashed}{extra}")


# ---------------------------------------------------------------------------------- pack-report

DEFAULT_MAX_LENS = "2048,4096,8192"
DEFAULT_TOKENIZER = "data/tokenizer"
PACK_REPORT_EPILOG = """\b
Examples:
  pack-report out/sample --json r.json --html r.html
  pack-report --input data.jsonl --tokenizer data/tokenizer --max-len 2048,4096,8192 --html r.html
"""


@click.command(context_settings=CONTEXT, epilog=PACK_REPORT_EPILOG)
@click.argument("folder", required=False, type=click.Path(file_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write every figure to this JSON file.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write a self-contained HTML report (embedded charts) to this file.",
)
@click.option(
    "--sources-csv",
    "csv_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the per-input table (weight, examples read, uses, tokens, loss tokens, share) of FOLDER as CSV.",
)
@click.option(
    "--batch-size",
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    type=click.IntRange(min=1),
    help="Examples per batch of the pad-to-longest baseline (example-id order).",
)
@click.option(
    "--hidden",
    default=Sizes.hidden,
    show_default=True,
    type=click.IntRange(min=1, max=INT_MAX),
    help="Model width of the training-FLOP count (speedups, attention's share of the work).",
)
@click.option(
    "--layers", default=Sizes.layers, show_default=True, type=click.IntRange(min=1, max=MAX_LAYERS), help="Decoder layers of that model."
)
@click.option(
    "--heads",
    default=Sizes.heads,
    show_default=True,
    type=click.IntRange(min=1, max=INT_MAX),
    help="Its query heads (head_dim = hidden / heads).",
)
@click.option(
    "--kv-heads",
    default=Sizes.kv_heads,
    show_default=True,
    type=click.IntRange(min=1, max=INT_MAX),
    help="Its key/value heads (grouped-query attention).",
)
@click.option(
    "--intermediate",
    default=Sizes.intermediate,
    show_default=True,
    type=click.IntRange(min=1, max=INT_MAX),
    help="Its MLP width (a gated MLP of three matrices).",
)
@click.option("--strategy", "strategy", multiple=True, help="Packing strategies to compare (repeat or comma-separate; default: all).")
@click.option("--seed", default=None, type=click.IntRange(min=0), help="Planner seed (default: the folder's, or 0).")
@click.option("--no-hash", is_flag=True, help="Do not check shard sha256 sums.")
@click.option("--input", "inputs", multiple=True, help="What-if mode: data files/folders to tokenize and plan (no shards written).")
@click.option(
    "--tokenizer",
    default=None,
    help="What-if (required with --input): the tokenizer folder or Hub id you will pack with, or a packed "
    "folder, whose recorded tokenizer is taken. The report names it.",
)
@click.option(
    "--max-len",
    "max_lens",
    default=DEFAULT_MAX_LENS,
    show_default=True,
    help="What-if: comma-separated row lengths to try. With a packed FOLDER, plans its examples' stored "
    "lengths at each (no re-tokenizing).",
)
@format_options
@click.option("--limit", default=None, type=click.IntRange(min=1), help="What-if: read only the first N examples.")
@click.option("--num-proc", default=1, show_default=True, type=click.IntRange(min=1, max=MAX_PROCS), help="What-if: tokenizer processes.")
def pack_report(
    folder: str | None,
    json_path: Path | None,
    html_path: Path | None,
    csv_path: Path | None,
    batch_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    strategy: tuple[str, ...],
    seed: int | None,
    no_hash: bool,
    inputs: tuple[str, ...],
    tokenizer: str | None,
    max_lens: str,
    fmt: str,
    limit: int | None,
    num_proc: int,
    **format_fields: Any,
) -> None:
    """Packing report of FOLDER (written by pack-data), or a what-if plan with --input: the
    first form reads the manifest and shards; the second tokenizes (or reads the `input_ids` of
    pre-tokenized data) and runs the planner for every max_len and strategy without writing shards.
    FOLDER may also be a pack-train run folder: its steps, losses, evals and best checkpoint, and
    a URI (s3://, gs://, hdfs://, file://), which is downloaded first."""
    # polars (pipeline.report.folder_report) is imported by this command only: pack-data and pack-verify run
    # where it is not installed (the GPU benchmark box)
    from pipeline.report.folder_report import folder_report, folder_whatif, load_folder, report_sources, to_json, whatif_report
    from pipeline.report.report_render import write_html
    from pipeline.report.report_text import format_text
    from pipeline.report.run_summary import format_run, is_run_folder, run_report

    with (
        cli_errors(
            interrupted="no report file was left half-written",
            disk_full="free some space or write the report elsewhere (--json, --html, --sources-csv); no report file was left half-written",
        ),
        folder_to_read(folder) if folder is not None else nullcontext() as local,
    ):
        shown, folder = folder, local  # the folder as given names it in the report
        sizes = Sizes(hidden, layers, heads, kv_heads, intermediate)
        sizes.shape()  # sizes that make no model: one line before any work
        strategies = _strategies(strategy)
        for path, flag in ((json_path, "--json"), (html_path, "--html"), (csv_path, "--sources-csv")):  # fail first
            if path is not None:
                _check_report_target(Path(path), flag, [Path(p) for p in (folder, *inputs) if p and Path(p).exists()])
        given = click.get_current_context().get_parameter_source("max_lens") != click.core.ParameterSource.DEFAULT
        max_len_list = _int_list(max_lens, "--max-len") if inputs or given else None
        data = None
        if folder is not None and inputs:
            raise UserError("give either a packed FOLDER or --input (what-if mode), not both")
        if csv_path is not None and folder is None:
            raise UserError("--sources-csv needs a packed FOLDER (what-if mode has no sources)")
        if folder is not None and is_run_folder(folder):  # a pack-train run folder
            if csv_path is not None or html_path is not None:
                raise UserError("--sources-csv and --html describe packed folders; a run folder has --json")
            report = run_report(folder)
            click.echo(format_run(report), nl=False)
            if json_path is not None:
                write_atomic(json_path, lambda p: p.write_text(to_json(report), encoding="utf-8"))
                click.echo(f"wrote {json_path}")
            return
        cold = uncompiled(strategies)
        if cold:
            click.echo(
                f"pack-report: compiling the planner's numba kernels for {', '.join(cold)} (their first "
                "use here; cached for later runs): up to half a minute",
                err=True,
            )
        if folder is not None:
            data = load_folder(folder, check_hashes=not no_hash)
            report = folder_report(data, batch_size=batch_size, sizes=sizes, strategies=strategies, seed=seed)
            _refuse_unchecked(folder, report, no_hash)
            recorded = data.manifest.config.get("inputs") or [i.get("path") for i in data.manifest.inputs]
            report.update(
                report_sources(
                    data.manifest.config.get("tokenizer") or data.manifest.tokenizer.get("name"),
                    "recorded by the folder",
                    [str(i) for i in recorded],
                )
            )
            if given:  # a what-if across --max-len values, from the lengths the shards hold
                report["whatif"] = folder_whatif(
                    data,
                    max_len_list,
                    strategies=strategies,
                    batch_size=batch_size,
                    seed=data.manifest.seed if seed is None else seed,
                    sizes=sizes,
                )
            title = f"packlm packing report: {shown}"
        elif inputs:
            options = {"format": fmt, "num_proc": capped_workers(num_proc, "pack-report"), "limit": limit, **format_fields}
            options = {k: v for k, v in options.items() if v is not None}
            tok, name, via = whatif_tokenizer(tokenizer)
            lengths = lengths_of(list(inputs), tok, **options)
            if len(lengths) == 0:
                raise UserError(
                    f"no non-empty examples in {', '.join(inputs)}: check --format and the field options "
                    "(--text-field, --instruction-field, ...) against the file's fields"
                )
            report = whatif_report(
                lengths, max_len_list, strategies=strategies, batch_size=batch_size, seed=seed or 0, sizes=replace(sizes, vocab=len(tok))
            )  # its vocabulary
            report.update(report_sources(name, via, list(inputs)))
            title = f"packlm what-if report: {', '.join(inputs)}"[:200]
        else:
            raise UserError("nothing to report: give a packed FOLDER, or --input DATA for a what-if plan (see pack-report --help)")
        click.echo(format_text(report), nl=False)
        if json_path is not None:
            write_atomic(json_path, lambda p: p.write_text(to_json(report), encoding="utf-8"))
            click.echo(f"wrote {json_path}")
        if html_path is not None:
            write_atomic(html_path, lambda p: write_html(report, p, data, title))
            click.echo(f"wrote {html_path}")
        if csv_path is not None:
            import polars as pl

            if not report["sources"]:
                raise UserError(
                    f"{folder}: its manifest records no sources (written by an older pack-data): "
                    "pack the data again to get the per-input table"
                )
            write_atomic(csv_path, lambda p: pl.DataFrame(report["sources"]).write_csv(p))
            click.echo(f"wrote {csv_path}")


def _check_report_target(path: Path, flag: str, read: list[Path]) -> None:
    """A report file replaces only a regular file (or none) outside what the report reads: a device
    node would be replaced by a file, the packed folder's manifest or an input by the report."""
    if not path.absolute().parent.is_dir():
        raise UserError(
            f"{flag} {path}: folder {path.absolute().parent} does not exist: create it, or write the report into an existing folder"
        )
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path}: not a regular file (a device, a pipe): write the report to a file")
    for source in read:
        if path.resolve() == source.resolve() or path.resolve().is_relative_to(source.resolve()):
            raise UserError(
                f"{flag} {path}: it is {source} or inside it, which the report reads: pack-report "
                "writes nothing there; write the report elsewhere"
            )


def _refuse_unchecked(folder: Path, report: dict[str, Any], no_hash: bool) -> None:
    """Refuse, before anything is shown or written, to report on a folder that fails its checks: a
    shard whose sha256 differs from the manifest's, a manifest whose checksum is wrong or missing
    (unless --no-hash), or a manifest figure (rows, tokens, loss tokens) that the shards contradict."""
    damaged = [s["file"] for s in report["shards"] if s["sha256_ok"] is False]
    if damaged:
        raise UserError(
            f"{folder}: {damaged[0]} does not match its sha256 in the manifest "
            f"({len(damaged)} shard(s) damaged): run pack-verify {folder} for details; no report written"
        )
    if not no_hash:
        check_checksum(Path(folder) / MANIFEST_NAME)
    wrong = [key for key, ok in report["manifest_matches"].items() if not ok]
    if wrong:
        raise UserError(
            f"{folder}: the manifest's {wrong[0]} is not what the shards hold: run pack-verify {folder} for details; no report written"
        )


def whatif_tokenizer(tokenizer: str | None) -> tuple[Any, str, str]:
    """The tokenizer a what-if counts with: `--tokenizer` (a folder, a Hub id, or a packed folder,
    whose recorded tokenizer and chat template are taken); none given is a UserError, since the
    counts depend on it. Returns (tokenizer, its name, how it was chosen)."""
    from pipeline.shards import read_manifest
    from pipeline.tokenize.tokenizer import apply_recorded, load_tokenizer

    if tokenizer is None:
        raise UserError(
            "--input needs --tokenizer: the tokenizer you will pack with (a folder or a Hub id such as "
            f"meta-llama/Llama-2-7b-hf, e.g. --tokenizer {DEFAULT_TOKENIZER}), or a packed folder, "
            "whose recorded tokenizer is taken"
        )
    if (Path(tokenizer) / "manifest.json").is_file():
        manifest = read_manifest(Path(tokenizer))
        recorded = manifest.tokenizer
        name = manifest.config.get("tokenizer") or recorded.get("name")  # the config's: absolute when local
        if not name:
            raise UserError(f"--tokenizer {tokenizer}: the packed folder records no tokenizer name: give the tokenizer")
        return (apply_recorded(load_tokenizer(str(name)), recorded), str(name), f"recorded by the packed folder {tokenizer}")
    return load_tokenizer(tokenizer), tokenizer, "--tokenizer"


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"{name} {text!r}: expected comma-separated integers, e.g. 2048,4096") from None
    if not values or any(not 2 <= v <= MAX_LEN_LIMIT for v in values):
        bad = next((v for v in values if not 2 <= v <= MAX_LEN_LIMIT), None)
        raise UserError(f"--max-len must be between 2 and {MAX_LEN_LIMIT}, got {bad if bad is not None else text!r}")
    return values


def _strategies(values: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(s for v in values for s in v.split(",") if s) or PACKED_STRATEGIES
    for s in names:
        if s not in STRATEGIES or s == "pad":
            choices = ", ".join(x for x in STRATEGIES if x != "pad")
            raise UserError(f"--strategy {s!r}: choose from {choices} (padding is always shown)")
    return names
