"""`pack-train`: train a causal LM on a packed folder (single process, or under torchrun)."""

from __future__ import annotations

import os
import sys

import click

from pipeline.config_file import HintedCommand, config_option
from pipeline.foreign_config import TRAIN
from pipeline.errors import cli_errors
from pipeline.read.hub import OFFLINE_HELP, no_progress_bars, offline_flag
from pipeline.report.flops import rates_line
from pipeline.tokenize.tokenizer import tokenizer_folder
from trainer.config import OPTIMIZERS, REPORT_TO, TOKENS_PER_STEP, TRAIN_CHECKS, TrainConfig, uri_problem, validate
from trainer.data.check import open_data
from trainer.run.nesting import refuse_nested_run
from trainer.run.preflight import refuse_before_torch
from trainer.model.presets import model_folder


class LocalFolder(click.Path):
    """A local folder: a URI (s3://...) is refused in one line (`uri_problem`), not taken as a path."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        problem = uri_problem(param.opts[0] if param else "", value)
        if problem:
            self.fail(f"{value}: {problem}", param, ctx)
        return super().convert(value, param, ctx)


@click.command(cls=HintedCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@config_option(checks=TRAIN_CHECKS, fields={"compile_": "compile"}, foreign=TRAIN)
@click.option("--data", required=True, type=LocalFolder(exists=True, file_okay=False),
              help="Packed folder written by pack-data.")
@click.option("--model", "model", required=True,
              help="Hugging Face model: a Hub id such as Qwen/Qwen2.5-0.5B (org/name[@revision]; from the local "
                   "Hugging Face cache, downloaded there when missing), a local folder (config + safetensors), "
                   "or a preset: tiny, llama-100m, llama-1b, llama-8b (random weights).")
@click.option("--out", required=True, type=LocalFolder(file_okay=False),
              help="Run folder: metrics.jsonl, checkpoints/, summary.json.")
@click.option("--tokenizer", default=None,
              help="Tokenizer the model expects (a folder or a Hub id); the data's tokenizer fingerprint must "
                   "match it. Default: the tokenizer files inside the --model folder (local or the Hub id's), if any.")
@click.option("--tokens-per-step", default=None, type=click.IntRange(min=1),
              help="Micro-batch token budget: rows are concatenated into one flat [1, T] batch up "
                   f"to it (a longer row is a micro-batch of its own). Default: {TOKENS_PER_STEP['cuda']} "
                   f"on a GPU, {TOKENS_PER_STEP['cpu']} on the CPU.")
@click.option("--grad-accum", default=1, type=click.IntRange(min=1),
              help="Micro-batches per optimizer step on each rank.")
@click.option("--step-by-group/--no-step-by-group", default=None,
              help="One optimizer step per group of examples of a `pack-data --strategy minibatch` folder "
                   "(the padded batch of TRL/Axolotl without packing: the same examples, the same gradient), "
                   "cut into micro-batches of --tokens-per-step; the groups come in a seeded order each "
                   "epoch. Default: on for a folder with groups; --no-step-by-group steps by token budget.")
@click.option("--lr", default=3e-4, type=click.FloatRange(min=0, min_open=True), help="Peak learning rate (AdamW).")
@click.option("--min-lr-ratio", default=0.1, type=click.FloatRange(0, 1),
              help="Final LR as a fraction of --lr for cosine/linear.")
@click.option("--warmup", default=0, type=click.IntRange(min=0), help="Linear warmup steps.")
@click.option("--warmup-ratio", default=0.0, type=click.FloatRange(0, 1, max_open=True),
              help="Linear warmup over this share of the run's optimizer steps (rounded up), instead of --warmup.")
@click.option("--warmup-rule", default="hf", type=click.Choice(["hf", "axolotl"]),
              help="hf: --warmup-ratio rounded up (the Hugging Face Trainer). axolotl: as Axolotl computes it: the "
                   "ratio rounded down, and without --warmup or --warmup-ratio 3% of the steps (at most 100).")
@click.option("--schedule", default="cosine", type=click.Choice(["cosine", "linear", "constant"]))
@click.option("--epochs", default=None, type=click.IntRange(min=1),
              help="Passes over the data (default 1 when --max-steps is not given).")
@click.option("--max-steps", default=None, type=click.IntRange(min=1),
              help="Optimizer steps (the schedule's length); with --epochs, whichever ends first.")
@click.option("--stop-at", default=None, type=click.IntRange(min=1),
              help="Stop (and checkpoint) after this step while keeping the full schedule; "
                   "continue later with --resume. For time-sliced jobs.")
@click.option("--attn", default="auto", type=click.Choice(["auto", "fa4", "flash_attn", "torch", "flex", "sdpa", "cudnn"]),
              help="Packed attention backend. auto: the fastest that runs here and reproduces every "
                   "attention feature of the model (sliding window, soft-capping, sinks, chunks), "
                   "in the order fa4 (FlashAttention-4, flash-attn-4 package, Hopper or newer), "
                   "flash_attn (flash-attn 2), torch (PyTorch's varlen kernel), flex, sdpa (reference). "
                   "cudnn (cuDNN through PyTorch, each example alone) is never picked by auto: the "
                   "fastest on long examples (32K+ tokens), slower on rows of many short ones.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "bf16", "bf16-weights", "fp8", "fp32"]),
              help="bf16: autocast over fp32 weights. bf16-weights: the weights themselves in bf16 "
                   "(fewer casts, a bf16 residual stream), fp32 master weights, gradient accumulation "
                   "and AdamW (one fused update that also writes the bf16 weights; AdamW only). "
                   "fp8: bf16-weights with the decoder's linear layers computing in float8 (torchao; "
                   "NVIDIA sm89 or newer, see --fp8-recipe; under torchrun with --parallel fsdp). "
                   "fp32: no autocast. auto: bf16 on GPU, fp32 on CPU.")
@click.option("--fp8-recipe", default="rowwise_with_gw_hp",
              type=click.Choice(["rowwise_with_gw_hp", "rowwise", "tensorwise"]),
              help="With --dtype fp8, torchao's float8 scaling. rowwise_with_gw_hp (default): per-token "
                   "scales and a bf16 weight gradient, so packing changes no example's numbers. rowwise "
                   "and tensorwise scales span the micro-batch: an example's gradients then depend on "
                   "the examples packed beside it. On an H100, tensorwise was faster than the default "
                   "at the 8B shape and slower at 1B; rowwise was slower. Under --parallel fsdp, "
                   "tensorwise also all-gathers the weights in float8 (half the bytes).")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="torch.compile each decoder layer and each chunk of the loss (dynamic shapes). "
                   "Default: on for CUDA (faster than eager there: HISTORY.md), off on CPU.")
@click.option("--grad-checkpointing", is_flag=False, flag_value=1, default=0, type=click.IntRange(min=0),
              metavar="[N]",
              help="Recompute activations in the backward pass instead of keeping them: of every "
                   "decoder layer (the flag alone), or of every Nth one (--grad-checkpointing 2: half "
                   "the layers; more memory than all, less recompute); 0: off.")
@click.option("--activation-memory-budget", default=1.0, type=click.FloatRange(0, 1, min_open=True),
              metavar="F",
              help="With compiled layers: the share of their activations the backward keeps "
                   "(torch.compile's activation_memory_budget). Below 1, the compiled backward "
                   "recomputes the cheapest ones (norms, SwiGLU's product) instead, so that more layers "
                   "fit without --grad-checkpointing; 0.7 keeps a Llama layer's matmul outputs and "
                   "little else (8B LoRA at 16,384 tokens on an 80 GB GPU: --grad-checkpointing 0 "
                   "--activation-memory-budget 0.7). 1 (default): keep what makes the step fastest.")
@click.option("--parallel", default="ddp", type=click.Choice(["ddp", "fsdp"]),
              help="Data-parallel mode under torchrun (FSDP2 shards parameters per decoder layer).")
@click.option("--context-parallel", default=1, type=click.IntRange(min=1),
              help="Split each micro-batch (one packed row) over N neighbouring ranks of torchrun, for "
                   "examples longer than one GPU holds: each rank keeps a share of the row's tokens and "
                   "attention gathers the row's keys and values, so every example computes what it does in "
                   "one process. N divides the number of ranks; the rest is data parallelism (DDP, or FSDP2 "
                   "sharding over all ranks). Attention: flash_attn (GPU) or sdpa.")
@click.option("--tile-mlp", default=0, type=click.IntRange(min=0), metavar="TOKENS",
              help="Run each decoder layer's MLP over the sequence TOKENS at a time, each tile recomputed in "
                   "the backward, so a long row keeps one tile's MLP activations instead of the whole "
                   "row's (exact: the MLP works token by token). 0: off. Each tile's forward runs once more, so use "
                   "it for rows that do not fit without it (64k tokens and more at the 8B's width).")
@click.option("--offload-activations", is_flag=True, default=False,
              help="Keep what the forward saves for the backward in (pinned) CPU memory; with "
                   "--grad-checkpointing those are the decoder layers' inputs. For rows whose checkpoints "
                   "do not fit the GPU; slower.")
@click.option("--offload-states", is_flag=True, default=False,
              help="With --parallel fsdp under torchrun: keep each rank's fp32 weight shards, their gradients "
                   "and AdamW's moments in pinned CPU memory, and step the optimizer there (FSDP2's CPU "
                   "offload); a layer's weights come to the GPU for its forward and backward only. Frees the "
                   "16 bytes a parameter of full fine-tuning for long rows' activations; slower steps.")
@click.option("--grad-reduce", default="fp32", type=click.Choice(["fp32", "bf16"]),
              help="Dtype of the gradient all-reduce (DDP) / reduce-scatter (FSDP2) across ranks: "
                   "bf16 halves the traffic at some precision cost. No effect on one process.")
@click.option("--reshard-after-forward/--no-reshard-after-forward", default=True,
              help="FSDP2: free each layer's gathered parameters after its forward (default) or keep "
                   "them until its backward (one all-gather per micro-batch instead of two, more memory).")
@click.option("--ddp-bucket-mb", default=250, type=click.IntRange(min=1), show_default=True,
              help="DDP: size (MiB) of the gradient buckets all-reduced while the backward runs; "
                   "larger: fewer, longer all-reduces and a longer one after the last layer. "
                   "PyTorch's own default is 25 (BENCHMARKS.md, Scaling across GPUs, compares them).")
@click.option("--seed", default=0, type=click.IntRange(min=0), help="Seeds the data order and preset weights.")
@click.option("--save-every", default=0, type=click.IntRange(min=0),
              help="Checkpoint every N steps (0: only at the end).")
@click.option("--keep-last", default=None, type=click.IntRange(min=1), help="Keep only the newest N checkpoints.")
@click.option("--resume", is_flag=False, flag_value="newest", default=None, metavar="[newest|strict|PATH]",
              help="Continue the run in --out from its newest intact checkpoint (each checkpoint's "
                   "files are checked against the sha256 it lists); a damaged newer one is named "
                   "and stepped over. --resume=strict refuses instead. --resume PATH: that checkpoint, any intact "
                   "one: an older one of --out rolls back (the newer ones move to OUT/superseded/N/), one of "
                   "another folder starts a new --out from its step.")
@click.option("--log-every", default=10, type=click.IntRange(min=1), help="Metrics line every N steps.")
@click.option("--optimizer", default="adamw", type=click.Choice(OPTIMIZERS),
              help="adamw: two fp32 moments per parameter (16 bytes per parameter with weights and "
                   "gradients). adafactor: torch.optim.Adafactor, no first moment and a row and a "
                   "column of second-moment statistics per matrix (about 8 bytes per parameter); --lr "
                   "caps its step relative to each weight's RMS. Not with --parallel fsdp. adamw8bit / "
                   "adamw4bit: torchao's AdamW8bit / AdamW4bit, moments stored in 8 or 4 bits by blocks "
                   "(Axolotl's and TRL's adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit, adamw_torch_4bit); "
                   "with --parallel ddp.")
@click.option("--weight-decay", default=0.1, type=click.FloatRange(min=0))
@click.option("--beta1", default=0.9, type=click.FloatRange(0, 1, max_open=True), help="AdamW's first-moment decay.")
@click.option("--beta2", default=0.95, type=click.FloatRange(0, 1, max_open=True), help="AdamW's second-moment decay.")
@click.option("--adam-eps", default=1e-8, type=click.FloatRange(min=0, min_open=True),
              help="AdamW's epsilon (added to the second moment's root).")
@click.option("--grad-clip", default=1.0, type=click.FloatRange(min=0), help="Max global gradient norm (0: no clipping).")
@click.option("--num-workers", default=2, type=click.IntRange(min=0), help="DataLoader worker processes.")
@click.option("--peak-flops", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Peak FLOP/s per device for the MFU estimate. Default: the GPU's bf16 dense peak where "
                   "known (H100/H200 989e12, A100 312e12); elsewhere (the CPU) no MFU is logged.")
@click.option("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N.")
@click.option("--verify-hashes/--no-verify-hashes", default=True,
              help="Check every shard's sha256 against the manifest in a background thread while "
                   "training runs (the fast structural checks always run at startup): a damaged "
                   "shard stops the run in one line, and no checkpoint is written before all are "
                   "verified.")
@click.option("--report-to", default="none", type=click.Choice(REPORT_TO),
              help="Also log every metrics line's scalars to TensorBoard (RUN/tensorboard) or W&B (offline unless "
                   "your W&B settings say otherwise); metrics.jsonl is always written.")
@click.option("--eval-data", default=None,
              help="Held-out packed folder to evaluate on (token-mean loss over all of it, no gradients, exact "
                   "across ranks). Default: DATA/eval when pack-data wrote one (--eval-fraction); 'none': off.")
@click.option("--eval-every", default=0, type=click.IntRange(min=0),
              help="Evaluate every N steps (0: only after the last step). Logged as eval_loss/eval_ppl.")
@click.option("--evals-per-epoch", default=0, type=click.IntRange(min=0),
              help="Instead of --eval-every: evaluate N times an epoch (every ceil(steps / (N x epochs)) steps, "
                   "as Axolotl's evals_per_epoch).")
@click.option("--saves-per-epoch", default=0, type=click.IntRange(min=0),
              help="Instead of --save-every: checkpoint N times an epoch (as Axolotl's saves_per_epoch).")
@click.option("--wandb-project", default=None, help="With --report-to wandb: the W&B project (default pack-train).")
@click.option("--wandb-entity", default=None, help="With --report-to wandb: the W&B entity (team or user).")
@click.option("--run-name", default=None, help="With --report-to wandb: the run's name.")
@click.option("--lora-r", default=0, type=click.IntRange(min=0),
              help="Train LoRA adapters of this rank (peft) instead of every weight; 0: full fine-tune. "
                   "Checkpoints then hold the adapter (PeftModel.from_pretrained(base, CHECKPOINT/model)).")
@click.option("--lora-alpha", default=16.0, type=float, help="LoRA scaling numerator (scale = alpha / r).")
@click.option("--lora-dropout", default=0.0, type=click.FloatRange(0, 1, max_open=True), help="Dropout on the LoRA input.")
@click.option("--lora-target", default="all",
              help="Modules that get adapters: 'all' linear layers of the decoder, 'default': peft's own choice "
                   "for the model's type (as TRL's use_peft without target modules), or names such as q_proj,v_proj.")
@click.option("--qlora", is_flag=True,
              help="With --lora-r: store the frozen base's decoder linear layers in 4-bit NF4 (QLoRA, "
                   "torchao): about a quarter of their bf16 memory, dequantized for every matmul.")
@click.option("--merge-lora", is_flag=True, help="At the end, also write RUN/merged: the base model with the adapters merged in.")
@click.option("--save-best", is_flag=True,
              help="Checkpoint every evaluated step whose eval loss is the lowest so far (RUN/best.json names "
                   "it; --keep-last never removes it).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--profile-steps", default=None, metavar="FIRST-LAST",
              help="Profile these optimizer steps (e.g. 6-8; the first steps compile) with torch.profiler "
                   "on every rank: RUN/profile/rank{r}.json says per step where the GPU's time went (by "
                   "kernel kind, top kernels, idle gaps, host waits); rank{r}.trace.json.gz is the "
                   "Chrome trace (chrome://tracing, Perfetto).")
@click.option("--offline", is_flag=True, callback=offline_flag, expose_value=False, is_eager=True, help=OFFLINE_HELP)
def pack_train(**options: object) -> None:
    """Train a causal LM on pre-packed shards with varlen (packed) attention.

    Example: pack-train --data out/sample --model tiny --out runs/tiny --max-steps 20

    Or from a file (flags win): pack-train --config data/configs/pack-train.yaml --max-steps 50
    """
    with cli_errors(interrupted="checkpoints saved before are intact (continue with --resume)",
                    disk_full="free some space (or choose another --out); checkpoints saved before are intact "
                              "(continue with --resume)"):
        options["compile"] = options.pop("compile_")
        options["progress"] = not options.pop("no_progress")
        if not options["progress"]:
            no_progress_bars()
        config = TrainConfig(**options)  # type: ignore[arg-type]
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
            click.echo("pack-train: options and data checked; importing torch and building the model "
                       "(seconds; compiling on a GPU takes longer) ...", err=True)
        from trainer.run.loop import train

        summary = train(config, opened)
        if summary["stopped_by_sigterm"]:
            if summary["rank"] == 0:
                click.echo(f"terminated (SIGTERM): stopped after step {summary['steps']} and saved "
                           f"{summary['checkpoint']}; continue with --resume", err=True)
            sys.exit(143)
        if summary["rank"] == 0:
            click.echo(format_summary(summary))


def format_summary(summary: dict) -> str:
    """The few lines printed when training ends (all of it is in RUN_DIR/summary.json)."""
    loss = summary.get("final_loss")
    return "\n".join([
        f"steps         {summary['steps']} / {summary['total_steps']}",
        f"tokens        {summary['tokens']:,} ({summary['tokens_this_run']:,} in this run)",
        f"tokens/s      {summary['tokens_per_s']:,.0f} (all ranks, real tokens only)",
        *([f"compute       {rates_line(summary)}"] if rates_line(summary) else []),
        f"final loss    {loss:.4f}" if loss is not None else "final loss    -",
        *([f"eval loss     {summary['eval_loss']:.4f} (perplexity {summary['eval_ppl']:.2f}, "
           f"{summary['eval_loss_tokens']:,} tokens)"] if summary.get("eval_loss") is not None else []),
        f"attention     {summary['attention']}"
        + (" (decoder layers compiled)" if summary.get("compiled") else ""),
        f"checkpoint    {summary['checkpoint']}",
    ])


def main() -> None:
    """The `pack-train` console script."""
    pack_train(prog_name="pack-train")


if __name__ == "__main__":  # torchrun -m trainer.cli, where the console script is not installed
    main()
