"""`pack-report`: packing statistics of a packed folder, or a what-if plan of raw data.

    pack-report out/sample [--json r.json] [--html r.html]
    pack-report --input data.jsonl --tokenizer data/tokenizer --max-len 2048,4096,8192 \
        [--html r.html]

The first form reads the manifest and shards; the second tokenizes (or reads the `input_ids` of
pre-tokenized data) and runs the planner for every max_len and strategy without writing shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pipeline.console import run_and_exit
from pipeline.durable import write_atomic
from pipeline.errors import UserError, cli_errors
from pipeline.report import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_HIDDEN,
    PACKED_STRATEGIES,
    folder_report,
    format_text,
    load_folder,
    to_json,
    whatif_report,
    write_html,
)

DEFAULT_MAX_LENS = "2048,4096,8192"
DEFAULT_TOKENIZER = "data/tokenizer"


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(
            f"{name} {text!r}: expected comma-separated integers, e.g. 2048,4096"
        ) from None
    if not values or any(v < 2 for v in values):
        bad = next((v for v in values if v < 2), None)
        raise UserError(f"--max-len must be at least 2, got {bad if bad is not None else text!r}")
    return values


def _strategies(values: tuple[str, ...]) -> tuple[str, ...]:
    from pipeline.binpack import STRATEGIES  # noqa: PLC0415

    names = tuple(s for v in values for s in v.split(",") if s) or PACKED_STRATEGIES
    for s in names:
        if s not in STRATEGIES or s == "pad":
            choices = ", ".join(x for x in STRATEGIES if x != "pad")
            raise UserError(f"--strategy {s!r}: choose from {choices} (padding is always shown)")
    return names


def _write_atomic(path: Path, write: Any) -> None:
    """Write via a temporary file in the same folder, renamed into place when complete."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"{path}: folder {path.parent} does not exist")
    write_atomic(path, write)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write every figure to this JSON file.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained HTML report (embedded charts) to this file.")
@click.option("--batch-size", default=DEFAULT_BATCH_SIZE, show_default=True,
              type=click.IntRange(min=1),
              help="Examples per batch of the pad-to-longest baseline (example-id order).")
@click.option("--hidden", default=DEFAULT_HIDDEN, show_default=True, type=click.IntRange(min=1),
              help="Model width used by the speedup estimate (token vs attention work).")
@click.option("--strategy", "strategy", multiple=True,
              help="Packing strategies to compare (repeat or comma-separate; default: all).")
@click.option("--seed", default=None, type=click.IntRange(min=0),
              help="Planner seed (default: the folder's, or 0).")
@click.option("--no-hash", is_flag=True, help="Do not check shard sha256 sums.")
@click.option("--input", "inputs", multiple=True,
              help="What-if mode: data files/folders to tokenize and plan (no shards written).")
@click.option("--tokenizer", default=None,
              help=f"What-if: tokenizer folder or name [default: {DEFAULT_TOKENIZER}].")
@click.option("--max-len", "max_lens", default=DEFAULT_MAX_LENS, show_default=True,
              help="What-if: comma-separated row lengths to try.")
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "text", "instruction", "chat", "tokenized"]),
              help="What-if: input format (as pack-data).")
@click.option("--text-field", default=None, help="What-if: text column (as pack-data).")
@click.option("--prompt-field", default=None, help="What-if: prompt column.")
@click.option("--input-field", default=None, help="What-if: optional input/context column.")
@click.option("--response-field", default=None, help="What-if: response column.")
@click.option("--messages-field", default=None, help="What-if: chat messages column.")
@click.option("--template", default=None, help="What-if: prompt template (name or text).")
@click.option("--limit", default=None, type=click.IntRange(min=1),
              help="What-if: read only the first N examples.")
@click.option("--num-proc", default=1, show_default=True, type=click.IntRange(min=1),
              help="What-if: tokenizer processes.")
def pack_report(folder: Path | None, json_path: Path | None, html_path: Path | None,
                batch_size: int, hidden: int, strategy: tuple[str, ...], seed: int | None,
                no_hash: bool, inputs: tuple[str, ...], tokenizer: str | None, max_lens: str,
                fmt: str, text_field: str | None, prompt_field: str | None,
                input_field: str | None, response_field: str | None,
                messages_field: str | None, template: str | None, limit: int | None,
                num_proc: int) -> None:
    """Packing report of FOLDER (written by pack-data), or a what-if plan with --input."""
    with cli_errors():
        strategies = _strategies(strategy)
        for path, flag in ((json_path, "--json"), (html_path, "--html")):  # fail before the work
            if path is not None and not Path(path).absolute().parent.is_dir():
                raise UserError(f"{flag} {path}: folder {Path(path).absolute().parent} does not exist")
        max_len_list = _int_list(max_lens, "--max-len") if inputs else None
        data = None
        if folder is not None and inputs:
            raise UserError("give either a packed FOLDER or --input (what-if mode), not both")
        if folder is not None:
            data = load_folder(folder, check_hashes=not no_hash)
            report = folder_report(data, batch_size=batch_size, hidden=hidden,
                                   strategies=strategies, seed=seed)
            title = f"packlm packing report: {folder}"
        elif inputs:
            from pipeline.tokenize import lengths_of  # noqa: PLC0415

            options = {
                "format": fmt, "text_field": text_field, "prompt_field": prompt_field,
                "input_field": input_field, "response_field": response_field,
                "messages_field": messages_field, "template": template,
                "num_proc": num_proc, "limit": limit,
            }
            options = {k: v for k, v in options.items() if v is not None}
            lengths = lengths_of(list(inputs), tokenizer or DEFAULT_TOKENIZER, **options)
            if len(lengths) == 0:
                raise UserError(f"no non-empty examples in {', '.join(inputs)}")
            report = whatif_report(lengths, max_len_list,
                                   strategies=strategies, batch_size=batch_size,
                                   seed=seed or 0, hidden=hidden)
            report["inputs"] = list(inputs)
            title = f"packlm what-if report: {', '.join(inputs)}"[:200]
        else:
            raise UserError("nothing to report: give a packed FOLDER, or --input DATA for a "
                            "what-if plan (see pack-report --help)")
        click.echo(format_text(report), nl=False)
        if json_path is not None:
            _write_atomic(json_path, lambda p: p.write_text(to_json(report), encoding="utf-8"))
            click.echo(f"wrote {json_path}")
        if html_path is not None:
            _write_atomic(html_path, lambda p: write_html(report, p, data, title))
            click.echo(f"wrote {html_path}")
        damaged = [s["file"] for s in report.get("shards", []) if s["sha256_ok"] is False]
        if damaged:
            raise UserError(f"{folder}: {damaged[0]} does not match its sha256 in the manifest "
                            f"({len(damaged)} shard(s) damaged): run pack-verify {folder} for details")


def main() -> None:
    """The `pack-report` console script. Its process loads no model, so a tokenizer it loads comes
    without torch (`tokenizer_load.hide_torch`: importing torch takes seconds)."""
    from pipeline.tokenizer_load import hide_torch

    hide_torch()
    run_and_exit(pack_report, "pack-report")
