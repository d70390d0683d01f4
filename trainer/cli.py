"""`pack-train`: train a causal LM on a packed folder (single process, or under torchrun)."""

from __future__ import annotations

import os
import sys

import click

from pipeline.contract import (
    OFFLINE_HELP,
    TRAIN,
    HintedCommand,
    cli_errors,
    click_options,
    config_option,
    field_values,
    no_progress_bars,
    offline_flag,
    param_fields,
    rates_line,
    tokenizer_folder,
)
from trainer.config import TRAIN_CHECKS, TrainConfig, uri_problem, validate
from trainer.model.presets import model_folder
from trainer.run.nesting import refuse_nested_run
from trainer.run.preflight import open_data, refuse_before_torch


class LocalFolder(click.Path):
    """A local folder: a URI (s3://...) is refused in one line (`uri_problem`), not taken as a path."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        problem = uri_problem(param.opts[0] if param else "", value)
        if problem:
            self.fail(f"{value}: {problem}", param, ctx)
        return super().convert(value, param, ctx)


@click.command(cls=HintedCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@config_option(checks=TRAIN_CHECKS, fields=param_fields(TrainConfig), foreign=TRAIN)
@click_options(
    TrainConfig,
    ranges=True,
    settings={"data": {"type": LocalFolder(exists=True, file_okay=False)}, "out": {"type": LocalFolder(file_okay=False)}},
)
@click.option("--offline", is_flag=True, callback=offline_flag, expose_value=False, is_eager=True, help=OFFLINE_HELP)
def pack_train(**options: object) -> None:
    """Train a causal LM on pre-packed shards with varlen (packed) attention.

    Example: pack-train --data out/sample --model tiny --out runs/tiny --max-steps 20

    Or from a file (flags win): pack-train --config data/configs/pack-train.yaml --max-steps 50
    """
    with cli_errors(
        interrupted="checkpoints saved before are intact (continue with --resume)",
        disk_full="free some space (or choose another --out); checkpoints saved before are intact (continue with --resume)",
    ):
        config = TrainConfig(**field_values(TrainConfig, options))
        if not config.progress:
            no_progress_bars()
        # what needs no torch is checked before torch is imported (seconds): options, model name, data
        validate(config)
        refuse_before_torch(config)
        refuse_nested_run(config)
        model_folder(config.model)
        if config.tokenizer is not None:
            tokenizer_folder(config.tokenizer)  # a mistyped path fails here, a Hub id is found in open_data
        opened = open_data(config)
        # PyTorch's OpenMP threads wait passively (read when torch is imported, just below): spinning
        # idle threads take the cores that the other threads, and other jobs of a shared machine,
        # need (BENCHMARKS.md and the README's quick start have the timings).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if sys.stderr.isatty() and os.environ.get("RANK", "0") == "0":
            click.echo(
                "pack-train: options and data checked; importing torch and building the model "
                "(seconds; compiling on a GPU takes longer) ...",
                err=True,
            )
        from trainer.run.loop import train

        summary = train(config, opened)
        if summary["stopped_by_sigterm"]:
            if summary["rank"] == 0:
                click.echo(
                    f"terminated (SIGTERM): stopped after step {summary['steps']} and saved "
                    f"{summary['checkpoint']}; continue with --resume",
                    err=True,
                )
            sys.exit(143)
        if summary["rank"] == 0:
            click.echo(format_summary(summary))


def format_summary(summary: dict) -> str:
    """The few lines printed when training ends (all of it is in RUN_DIR/summary.json)."""
    loss = summary.get("final_loss")
    return "\n".join(
        [
            f"steps         {summary['steps']} / {summary['total_steps']}",
            f"tokens        {summary['tokens']:,} ({summary['tokens_this_run']:,} in this run)",
            f"tokens/s      {summary['tokens_per_s']:,.0f} (all ranks, real tokens only)",
            *([f"compute       {rates_line(summary)}"] if rates_line(summary) else []),
            f"final loss    {loss:.4f}" if loss is not None else "final loss    -",
            *(
                [f"eval loss     {summary['eval_loss']:.4f} (perplexity {summary['eval_ppl']:.2f}, {summary['eval_loss_tokens']:,} tokens)"]
                if summary.get("eval_loss") is not None
                else []
            ),
            f"attention     {summary['attention']}" + (" (decoder layers compiled)" if summary.get("compiled") else ""),
            f"checkpoint    {summary['checkpoint']}",
        ]
    )


def main() -> None:
    """The `pack-train` console script."""
    pack_train(prog_name="pack-train")


if __name__ == "__main__":  # torchrun -m trainer.cli, where the console script is not installed
    main()
