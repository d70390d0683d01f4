"""`TrainConfig`: every option of a training run, each declared once (`pipeline.option_checks.opt`:
its type, default, range or choices, help and section), from which pack-train's click options
(`trainer/cli.py`), the checks of `validate` and of `pack-train --config FILE` values (`TRAIN_CHECKS`)
and the README's option tables (`python -m pipeline.option_checks pack-train`) are generated.
`refuse_combinations` is the one place where options that contradict each other are refused.
`train()` and `pack-train` both go through `validate`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.contract import MAX_PROCS, PATH, UserError, check_options, checks_of, opt

SCHEDULES = ("cosine", "linear", "constant")
RESUME = ("newest", "strict")
PARALLEL = ("ddp", "fsdp")
REPORT_TO = ("none", "tensorboard", "wandb")
GRAD_REDUCE = ("fp32", "bf16")
DTYPES = ("auto", "bf16", "bf16-weights", "fp8", "fp32")
FP8_RECIPES = ("rowwise_with_gw_hp", "rowwise", "tensorwise")  # trainer.model.fp8.RECIPES
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
WARMUP_RULES = ("hf", "axolotl")
LOSS_AVERAGES = ("tokens", "ranks")  # trainer.run.loop.backward_window
ATTENTION = ("auto", "fa4", "flash_attn", "torch", "flex", "sdpa", "cudnn")  # auto, trainer.attention BACKENDS
PIECE_ATTENTION = ("fa4", "flash_attn", "sdpa")  # trainer.attention.features.PIECE_KERNELS (--context-parallel)
# Micro-batch token budget when none is given: a GPU step's worth on CUDA; on the CPU one row of the
# README's 8192-token packing, so that a step of the tiny model takes a second rather than several.
TOKENS_PER_STEP = {"cuda": 16384, "cpu": 8192}

RUN, BATCHES, SCHEDULE, OPTIMIZER = "Run", "Batches", "Schedule", "Optimizer"
PRECISION, MEMORY, PARALLELISM = "Precision and kernels", "Memory and long rows", "Parallel"
LORA, EVAL, CHECKPOINTS, LOGGING = "LoRA", "Evaluation", "Checkpoints", "Logging"


@dataclass
class TrainConfig:
    """Every option of `pack-train`, declared once (see the module); the comments say which code
    reads an option where that is not plain."""

    # fmt: off
    # A table, one declaration an option in a few lines: ruff format would give every argument of
    # every `opt(...)` a line of its own and the table three times the height.
    data: str = opt(kind=PATH, section=RUN, help="Packed folder written by pack-data.")
    model: str = opt(kind=PATH, section=RUN, help=(
        "Hugging Face model: a Hub id such as Qwen/Qwen2.5-0.5B (org/name[@revision]; from the local "
        "Hugging Face cache, downloaded there when missing), a local folder (config + safetensors), "
        "or a preset: tiny, llama-100m, llama-1b, llama-8b (random weights)."))
    out: str = opt(kind=PATH, section=RUN, help="Run folder: metrics.jsonl, checkpoints/, summary.json.")
    tokenizer: str | None = opt(None, kind=PATH, section=RUN, help=(
        "Tokenizer the model expects (a folder or a Hub id); the data's tokenizer fingerprint must "
        "match it. Default: the tokenizer files inside the --model folder (local or the Hub id's), if any."))
    # None: TOKENS_PER_STEP of the device (resolved by `resolved`)
    tokens_per_step: int | None = opt(None, low=1, section=BATCHES, help=(
        "Micro-batch token budget: rows are concatenated into one flat [1, T] batch up "
        f"to it (a longer row is a micro-batch of its own). Default: {TOKENS_PER_STEP['cuda']} "
        f"on a GPU, {TOKENS_PER_STEP['cpu']} on the CPU."))
    grad_accum: int = opt(1, low=1, section=BATCHES, help="Micro-batches per optimizer step on each rank.")
    loss_average: str = opt("tokens", choices=LOSS_AVERAGES, section=BATCHES, help=(
        "The step's loss over its data-parallel ranks (torchrun): tokens: the sum of all token losses over "
        "the count of all the ranks' loss tokens, as one batch (TRL, transformers' "
        "average_tokens_across_devices); ranks: each rank's mean over its own loss tokens, the ranks' means "
        "averaged (Axolotl 0.19.0). One process: the same."))
    # one optimizer step per group of a --strategy minibatch folder (trainer.data.plan.group_plan);
    # None: on exactly when the folder has groups (resolved by trainer.run.start)
    step_by_group: bool | None = opt(None, section=BATCHES, help=(
        "One optimizer step per group of examples of a `pack-data --strategy minibatch` folder "
        "(the padded batch of TRL/Axolotl without packing: the same examples, the same gradient; "
        "under torchrun one group a rank), "
        "cut into micro-batches of --tokens-per-step; the groups come in a seeded order each "
        "epoch. Default: on for a folder with groups; --no-step-by-group steps by token budget."))
    lr: float = opt(3e-4, low=0, low_open=True, section=SCHEDULE, help="Peak learning rate (AdamW).")
    min_lr_ratio: float = opt(0.1, low=0, high=1, section=SCHEDULE,
                              help="Final LR as a fraction of --lr for cosine/linear.")
    warmup: int = opt(0, low=0, section=SCHEDULE, help="Linear warmup steps.")
    warmup_ratio: float = opt(0.0, low=0, high=1, high_open=True, section=SCHEDULE, help=(
        "Linear warmup over this share of the run's optimizer steps (rounded up), instead of --warmup."))
    warmup_rule: str = opt("hf", choices=WARMUP_RULES, section=SCHEDULE, help=(  # `warmup_steps`
        "hf: --warmup-ratio rounded up (the Hugging Face Trainer). axolotl: as Axolotl computes it: the "
        "ratio rounded down, and without --warmup or --warmup-ratio 3% of the steps (at most 100)."))
    schedule: str = opt("cosine", choices=SCHEDULES, section=SCHEDULE, help=(
        "Learning-rate decay after the warmup: cosine or linear down to --min-lr-ratio, or constant."))
    epochs: int | None = opt(None, low=1, section=SCHEDULE,
                             help="Passes over the data (default 1 when --max-steps is not given).")
    max_steps: int | None = opt(None, low=1, section=SCHEDULE,
                                help="Optimizer steps (the schedule's length); with --epochs, whichever ends first.")
    stop_at: int | None = opt(None, low=1, section=SCHEDULE, help=(
        "Stop (and checkpoint) after this step while keeping the full schedule; "
        "continue later with --resume. For time-sliced jobs."))
    attn: str = opt("auto", choices=ATTENTION, section=PRECISION, help=(  # trainer.attention.backend
        "Packed attention backend. auto: the fastest that runs here and reproduces every "
        "attention feature of the model (sliding window, soft-capping, sinks, chunks), "
        "in the order fa4 (FlashAttention-4, flash-attn-4 package, Hopper or newer), "
        "flash_attn (flash-attn 2), torch (PyTorch's varlen kernel), flex, sdpa (reference). "
        "cudnn (cuDNN through PyTorch, each example alone): the fastest on long examples, "
        "slower on rows of many short ones; on a Hopper GPU auto pairs flash_attn or torch with it "
        "(flash_attn+cudnn: cuDNN for rows whose examples average 4,096 tokens or more)."))
    dtype: str = opt("auto", choices=DTYPES, section=PRECISION, help=(  # trainer.model.precision
        "bf16: autocast over fp32 weights. bf16-weights: the weights themselves in bf16 "
        "(fewer casts, a bf16 residual stream), fp32 master weights, gradient accumulation "
        "and AdamW (one fused update that also writes the bf16 weights; AdamW only). "
        "fp8: bf16-weights with the decoder's linear layers computing in float8 (torchao; "
        "NVIDIA sm89 or newer, see --fp8-recipe; under torchrun with --parallel fsdp). "
        "fp32: no autocast. auto: bf16 on GPU, fp32 on CPU."))
    fp8_recipe: str = opt("rowwise_with_gw_hp", choices=FP8_RECIPES, section=PRECISION, help=(  # trainer.model.fp8
        "With --dtype fp8, torchao's float8 scaling. rowwise_with_gw_hp (default): per-token "
        "scales and a bf16 weight gradient, so packing changes no example's numbers. rowwise "
        "and tensorwise scales span the micro-batch: an example's gradients then depend on "
        "the examples packed beside it. On an H100, tensorwise was faster than the default "
        "at the 8B shape and slower at 1B; rowwise was slower. Under --parallel fsdp, "
        "tensorwise also all-gathers the weights in float8 (half the bytes)."))
    compile: bool | None = opt(None, flags=("--compile/--no-compile", "compile_"), section=PRECISION, help=(
        "torch.compile each decoder layer and each chunk of the loss (dynamic shapes). "
        "Default: on for CUDA (faster than eager there: HISTORY.md), off on CPU."))
    grad_checkpointing: int = opt(0, low=0, is_flag=False, flag_value=1, metavar="[N]", section=MEMORY, help=(
        "Recompute activations in the backward pass instead of keeping them: of every "
        "decoder layer (the flag alone), or of every Nth one (--grad-checkpointing 2: half "
        "the layers; more memory than all, less recompute); 0: off."))
    # torch.compile's activation_memory_budget for the compiled layers (trainer.run.start)
    activation_memory_budget: float = opt(1.0, low=0, low_open=True, high=1, metavar="F", section=MEMORY, help=(
        "With compiled layers: the share of their activations the backward keeps "
        "(torch.compile's activation_memory_budget). Below 1, the compiled backward "
        "recomputes the cheapest ones (norms, SwiGLU's product) instead, so that more layers "
        "fit without --grad-checkpointing; 0.7 keeps a Llama layer's matmul outputs and "
        "little else (8B LoRA at 16,384 tokens on an 80 GB GPU: --grad-checkpointing 0 "
        "--activation-memory-budget 0.7). 1 (default): keep what makes the step fastest."))
    seed: int = opt(0, low=0, section=RUN, help="Seeds the data order and preset weights.")
    save_every: int = opt(0, low=0, section=CHECKPOINTS, help="Checkpoint every N steps (0: only at the end).")
    keep_last: int | None = opt(None, low=1, section=CHECKPOINTS, help="Keep only the newest N checkpoints.")
    # "newest" (intact checkpoint), "strict" (the latest, or refuse), or a checkpoint folder (trainer.run.resume)
    resume: str | None = opt(None, is_flag=False, flag_value="newest", metavar="[newest|strict|PATH]",
                             section=CHECKPOINTS, help=(
        "Continue the run in --out from its newest intact checkpoint (each checkpoint's "
        "files are checked against the sha256 it lists); a damaged newer one is named "
        "and stepped over. --resume=strict refuses instead. --resume PATH: that checkpoint, any intact "
        "one: an older one of --out rolls back (the newer ones move to OUT/superseded/N/), one of "
        "another folder starts a new --out from its step."))
    log_every: int = opt(10, low=1, section=LOGGING, help="Metrics line every N steps.")
    report_to: str = opt("none", choices=REPORT_TO, section=LOGGING, help=(  # trainer.run.metrics
        "Also log every metrics line's scalars to TensorBoard (RUN/tensorboard) or W&B (offline unless "
        "your W&B settings say otherwise); metrics.jsonl is always written."))
    eval_data: str | None = opt(None, kind=PATH, section=EVAL, help=(  # trainer.data.evaluate
        "Held-out packed folder to evaluate on (token-mean loss over all of it, no gradients, exact "
        "across ranks). Default: DATA/eval when pack-data wrote one (--eval-fraction); 'none': off."))
    eval_every: int = opt(0, low=0, section=EVAL, help=(
        "Evaluate every N steps (0: only after the last step). Logged as eval_loss/eval_ppl."))
    evals_per_epoch: int = opt(0, low=0, section=EVAL, help=(  # `per_epoch`
        "Instead of --eval-every: evaluate N times an epoch (every ceil(steps / (N x epochs)) steps, "
        "as Axolotl's evals_per_epoch)."))
    saves_per_epoch: int = opt(0, low=0, section=CHECKPOINTS, help=(  # `per_epoch`
        "Instead of --save-every: checkpoint N times an epoch (as Axolotl's saves_per_epoch)."))
    wandb_project: str | None = opt(None, section=LOGGING,
                                    help="With --report-to wandb: the W&B project (default pack-train).")
    wandb_entity: str | None = opt(None, section=LOGGING, help="With --report-to wandb: the W&B entity (team or user).")
    run_name: str | None = opt(None, section=LOGGING, help="With --report-to wandb: the run's name.")
    lora_r: int = opt(0, low=0, section=LORA, help=(  # trainer.model.lora
        "Train LoRA adapters of this rank (peft) instead of every weight; 0: full fine-tune. "
        "Checkpoints then hold the adapter (PeftModel.from_pretrained(base, CHECKPOINT/model))."))
    # type=float: the flag takes any number and `validate` names the range ("--lora-alpha must be > 0")
    lora_alpha: float = opt(16.0, low=0, low_open=True, type=float, section=LORA,
                            help="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = opt(0.0, low=0, high=1, high_open=True, section=LORA, help="Dropout on the LoRA input.")
    lora_target: str = opt("all", comma_list=True, section=LORA, help=(
        "Modules that get adapters: 'all' linear layers of the decoder, 'default': peft's own choice "
        "for the model's type (as TRL's use_peft without target modules), or names such as q_proj,v_proj."))
    merge_lora: bool = opt(False, section=LORA,
                           help="At the end, also write RUN/merged: the base model with the adapters merged in.")
    qlora: bool = opt(False, section=LORA, help=(
        "With --lora-r: store the frozen base's decoder linear layers in 4-bit NF4 (QLoRA, "
        "torchao): about a quarter of their bf16 memory, dequantized for every matmul."))
    int8_base: bool = opt(False, section=LORA, help=(
        "With --lora-r: store the frozen base's decoder linear layers in int8, one scale per output "
        "row (torchao): half their bf16 memory, dequantized for every matmul. Unlike bitsandbytes' "
        "LLM.int8 (Axolotl's and TRL's load_in_8bit), which also quantizes the activations and keeps "
        "outlier columns in fp16, only the weights are int8: every matmul runs in the compute dtype."))
    # trainer.model.freeze (Axolotl's unfrozen_parameters)
    unfrozen_parameters: tuple[str, ...] = opt((), multiple=True, metavar="REGEX", section=LORA, help=(
        "Instead of LoRA: a full fine-tune of only the model's parameters whose name matches one of these "
        "regexes (repeat it), the others frozen. Read as Axolotl's unfrozen_parameters: from the name's "
        "start, a '.' is a dot, e.g. '^lm_head.*' or 'model.layers.1[0-9].mlp.'; one that matches no "
        "parameter is refused."))
    save_best: bool = opt(False, section=CHECKPOINTS, help=(
        "Checkpoint every evaluated step whose eval loss is the lowest so far (RUN/best.json names "
        "it; --keep-last never removes it)."))
    parallel: str = opt("ddp", choices=PARALLEL, section=PARALLELISM, help=(
        "Data-parallel mode under torchrun (FSDP2 shards parameters per decoder layer)."))
    # ranks that share each micro-batch (trainer.distributed.context_parallel)
    context_parallel: int = opt(1, low=1, section=PARALLELISM, help=(
        "Split each micro-batch (one packed row) over N neighbouring ranks of torchrun, for "
        "examples longer than one GPU holds: each rank keeps a share of the row's tokens and "
        "attention gathers the row's keys and values, so every example computes what it does in "
        "one process. N divides the number of ranks; the rest is data parallelism (DDP, or FSDP2 "
        "sharding over all ranks). Attention: fa4 or flash_attn (GPU), or sdpa."))
    tile_mlp: int = opt(0, low=0, metavar="TOKENS", section=MEMORY, help=(  # trainer.model.long_rows
        "Run each decoder layer's MLP over the sequence TOKENS at a time, each tile recomputed in "
        "the backward, so a long row keeps one tile's MLP activations instead of the whole "
        "row's (exact: the MLP works token by token). 0: off. Each tile's forward runs once more, so use "
        "it for rows that do not fit without it (64k tokens and more at the 8B's width)."))
    offload_activations: bool = opt(False, section=MEMORY, help=(
        "Keep what the forward saves for the backward in (pinned) CPU memory; with "
        "--grad-checkpointing those are the decoder layers' inputs. For rows whose checkpoints "
        "do not fit the GPU; slower. The backward copies the next layer's input back while a layer "
        "runs, unless the memory check finds room for the row only without that."))
    keep_attention: bool = opt(False, section=MEMORY, help=(  # trainer.model.keep_attention
        "With --grad-checkpointing: each recomputed layer keeps its attention output (and "
        "log-sum-exp) for the backward instead of running attention's forward again there: the "
        "same tensors, so the same gradients. At long rows attention is most of a layer's "
        "recompute; the cost is GPU memory, T x hidden x 2 bytes a layer, also under "
        "--offload-activations (the 8B at 131,072 tokens: 32 GiB)."))
    offload_states: bool = opt(False, section=MEMORY, help=(
        "With --parallel fsdp under torchrun: keep each rank's fp32 weight shards, their gradients "
        "and AdamW's moments in pinned CPU memory, and step the optimizer there (FSDP2's CPU "
        "offload); a layer's weights come to the GPU for its forward and backward only. Frees the "
        "16 bytes a parameter of full fine-tuning for long rows' activations; slower steps."))
    grad_reduce: str = opt("fp32", choices=GRAD_REDUCE, section=PARALLELISM, help=(
        "Dtype of the gradient all-reduce (DDP) / reduce-scatter (FSDP2) across ranks: "
        "bf16 halves the traffic at some precision cost. No effect on one process."))
    reshard_after_forward: bool = opt(True, section=PARALLELISM, help=(
        "FSDP2: free each layer's gathered parameters after its forward (default) or keep "
        "them until its backward (one all-gather per micro-batch instead of two, more memory)."))
    ddp_bucket_mb: int = opt(250, low=1, section=PARALLELISM, help=(  # trainer.distributed.parallel
        "DDP: size (MiB) of the gradient buckets all-reduced while the backward runs; "
        "larger: fewer, longer all-reduces and a longer one after the last layer. "
        "PyTorch's own default is 25 (BENCHMARKS.md, Scaling across GPUs, compares them)."))
    optimizer: str = opt("adamw", choices=OPTIMIZERS, section=OPTIMIZER, help=(  # trainer.run.optim
        "adamw: two fp32 moments per parameter (16 bytes per parameter with weights and "
        "gradients). adafactor: torch.optim.Adafactor, no first moment and a row and a "
        "column of second-moment statistics per matrix (about 8 bytes per parameter); --lr "
        "caps its step relative to each weight's RMS. Not with --parallel fsdp. adamw8bit / "
        "adamw4bit: torchao's AdamW8bit / AdamW4bit, moments stored in 8 or 4 bits by blocks "
        "(Axolotl's and TRL's adamw_8bit, adamw_bnb_8bit, paged_adamw_8bit, adamw_torch_4bit); "
        "with --parallel ddp."))
    weight_decay: float = opt(0.1, low=0, section=OPTIMIZER, help="AdamW's decoupled weight decay.")
    beta1: float = opt(0.9, low=0, high=1, high_open=True, section=OPTIMIZER, help="AdamW's first-moment decay.")
    beta2: float = opt(0.95, low=0, high=1, high_open=True, section=OPTIMIZER, help="AdamW's second-moment decay.")
    adam_eps: float = opt(1e-8, low=0, low_open=True, section=OPTIMIZER,
                          help="AdamW's epsilon (added to the second moment's root).")
    grad_clip: float = opt(1.0, low=0, section=OPTIMIZER, help="Max global gradient norm (0: no clipping).")
    num_workers: int = opt(2, low=0, high=MAX_PROCS, section=RUN, help="DataLoader worker processes.")
    prefetch: int = opt(4, low=1, cli=False, section=RUN, help="Micro-batches each DataLoader worker loads ahead.")
    # None: the device's known peak (trainer.run.metrics.known_peak_flops), if any
    peak_flops: float | None = opt(None, low=0, low_open=True, section=LOGGING, help=(
        "Peak FLOP/s per device for the MFU estimate. Default: the GPU's bf16 dense peak where "
        "known (H100/H200 989e12, A100 312e12); elsewhere (the CPU) no MFU is logged."))
    device: str = opt("auto", section=RUN, help="auto (cuda if available), cpu, cuda, cuda:N.")
    verify_hashes: bool = opt(True, section=RUN, help=(
        "Check every shard's sha256 against the manifest in a background thread while "
        "training runs (the fast structural checks always run at startup): a damaged "
        "shard stops the run in one line, and no checkpoint is written before all are "
        "verified."))
    progress: bool = opt(True, flags=("--no-progress",), invert=True, is_flag=True, section=LOGGING,
                         help="No progress bar.")
    profile_steps: str | None = opt(None, metavar="FIRST-LAST", section=LOGGING, help=(  # trainer.run.profiling
        "Profile these optimizer steps (e.g. 6-8; the first steps compile) with torch.profiler "
        "on every rank: RUN/profile/rank{r}.json says per step where the GPU's time went (by "
        "kernel kind, top kernels, idle gaps, host waits); rank{r}.trace.json.gz is the "
        "Chrome trace (chrome://tracing, Perfetto)."))
    # fmt: on


# the type and range of every TrainConfig field: `validate`, and the values of `pack-train --config FILE`
TRAIN_CHECKS = checks_of(TrainConfig)


def resolved(config: TrainConfig, device_type: str) -> TrainConfig:
    """`config` with the defaults that depend on the device filled in (tokens_per_step)."""
    if config.tokens_per_step is not None:
        return config
    return replace(config, tokens_per_step=TOKENS_PER_STEP.get(device_type, TOKENS_PER_STEP["cpu"]))


def validate(config: TrainConfig) -> None:
    """Raise UserError (one line) for an option of the wrong type, out of range or outside its
    choices, or options that contradict each other (`refuse_combinations`)."""
    check_options(config, TRAIN_CHECKS)
    for name in ("data", "eval_data", "out"):
        refuse_uri(f"--{name.replace('_', '-')}", getattr(config, name))
    if config.resume is not None and config.resume not in RESUME and not Path(config.resume).is_dir():
        raise UserError(
            f"--resume={config.resume}: expected newest, strict, or a checkpoint folder "
            "(RUN/checkpoints/step-...), and there is no such folder"
        )
    if config.profile_steps is not None:
        parse_step_range(config.profile_steps)
    refuse_combinations(config)


def refuse_combinations(config: TrainConfig) -> None:
    """The one place for options that contradict each other, whatever the data, model or machine:
    a UserError naming both. (What depends on those is refused where it is known: see the README.)"""
    if config.warmup and config.warmup_ratio:
        raise UserError(f"--warmup {config.warmup} and --warmup-ratio {config.warmup_ratio} both set the warmup: give one")
    if config.evals_per_epoch and config.eval_every or config.saves_per_epoch and config.save_every:
        raise UserError("--evals-per-epoch / --saves-per-epoch and --eval-every / --save-every both say when: give one")
    if config.stop_at is not None and config.max_steps is not None and config.stop_at > config.max_steps:
        raise UserError(f"--stop-at {config.stop_at} is past --max-steps {config.max_steps}")
    if config.qlora and not config.lora_r:
        raise UserError("--qlora needs --lora-r (it stores the frozen base of a LoRA run in 4 bits)")
    if config.qlora and config.dtype == "fp8":
        raise UserError("--qlora and --dtype fp8 both choose how the frozen base computes: use one of them")
    if config.int8_base and not config.lora_r:
        raise UserError("--int8-base needs --lora-r (it stores the frozen base of a LoRA run in int8)")
    if config.int8_base and config.qlora:
        raise UserError("--int8-base and --qlora both choose how the frozen base is stored: use one of them")
    if config.int8_base and config.dtype == "fp8":
        raise UserError("--int8-base and --dtype fp8 both choose how the frozen base computes: use one of them")
    if config.merge_lora and not config.lora_r:
        raise UserError("--merge-lora needs --lora-r (there is no adapter to merge)")
    if config.lora_r and config.parallel == "fsdp":
        raise UserError(
            "--lora-r is not supported with --parallel fsdp yet: use --parallel ddp (the base "
            "weights are frozen, so DDP holds no optimizer state for them)"
        )
    if config.unfrozen_parameters and config.lora_r:
        raise UserError(
            "--unfrozen-parameters chooses which of the model's own parameters train, --lora-r trains "
            "adapters instead of them: use one of them"
        )
    if config.unfrozen_parameters and config.parallel == "fsdp":
        raise UserError(
            "--unfrozen-parameters is not run with --parallel fsdp here (FSDP2 would shard frozen "
            "and trained parameters of a layer together): use --parallel ddp"
        )
    if config.keep_attention and not config.grad_checkpointing:
        raise UserError(
            "--keep-attention keeps attention's output in layers that are recomputed, and without "
            "--grad-checkpointing none is: add --grad-checkpointing, or drop --keep-attention"
        )
    if config.offload_states and config.parallel != "fsdp":
        raise UserError(
            "--offload-states needs --parallel fsdp (FSDP2 keeps each rank's shards, their gradients "
            "and the optimizer's states in CPU memory)"
        )
    if config.offload_states and config.dtype == "fp8":
        raise UserError(
            "--offload-states does not combine with --dtype fp8 (its float8 all-gathers run on the "
            "GPU's copies of the weights): use --dtype bf16"
        )
    if config.context_parallel > 1 and config.attn not in ("auto", *PIECE_ATTENTION):
        raise UserError(
            f"--context-parallel needs --attn fa4 or flash_attn (GPU), or sdpa: {config.attn} cannot attend a "
            "share of an example to the keys of the whole row"
        )
    if config.optimizer in ("adamw8bit", "adamw4bit") and config.parallel == "fsdp":
        raise UserError(
            f"--optimizer {config.optimizer} (torchao's low-bit AdamW) is not run with --parallel fsdp "
            "here: use --parallel ddp, or --optimizer adamw"
        )
    if config.dtype in ("bf16-weights", "fp8") and config.optimizer != "adamw":
        raise UserError(
            f"--dtype {config.dtype} needs --optimizer adamw (its fp32 masters are updated by a "
            f"fused AdamW step); with --optimizer {config.optimizer} use --dtype bf16"
        )


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    """The warmup's optimizer steps: --warmup, or --warmup-ratio of `total_steps` rounded up (as the
    Hugging Face Trainer rounds it): a ratio of 0.1 over 25 steps warms up for 3.

    >>> warmup_steps(TrainConfig(data="d", model="m", out="o", warmup_ratio=0.1), 25)
    3
    """
    if config.warmup_rule == "axolotl":  # axolotl 0.19.0, core/builders/base.py
        steps = (
            config.warmup
            if config.warmup
            else int(config.warmup_ratio * total_steps)
            if config.warmup_ratio
            else min(int(0.03 * total_steps), 100)
        )
        return 2 if steps == 1 else steps
    return math.ceil(config.warmup_ratio * total_steps) if config.warmup_ratio else config.warmup


def per_epoch(config: TrainConfig, total_steps: int) -> TrainConfig:
    """--evals-per-epoch / --saves-per-epoch as --eval-every / --save-every, as Axolotl computes them:
    every ceil(total_steps / (n * epochs)) steps (transformers' fractional eval_steps/save_steps of
    1 / (n * epochs)); a fraction of 1 or more evaluates (saves) at the end only.

    >>> per_epoch(TrainConfig(data="d", model="m", out="o", epochs=2, evals_per_epoch=4), 40).eval_every
    5
    """
    changes = {}
    for n, field in ((config.evals_per_epoch, "eval_every"), (config.saves_per_epoch, "save_every")):
        if n and n * (config.epochs or 1) > 1:
            changes[field] = math.ceil(total_steps / (n * (config.epochs or 1)))
    return replace(config, **changes) if changes else config


def parse_step_range(text: str) -> tuple[int, int]:
    """`--profile-steps` as (first, last) optimizer steps, both counted from 1 and included:
    "6-8" -> (6, 8), "7" -> (7, 7); anything else is a UserError saying what is expected.

    >>> parse_step_range("6-8"), parse_step_range("7")
    ((6, 8), (7, 7))
    """
    parts = str(text).split("-")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        first, last = int(parts[0]), int(parts[-1])
        if 1 <= first <= last:
            return first, last
    raise UserError(f"--profile-steps {text}: expected FIRST-LAST optimizer steps counted from 1, e.g. 6-8 (or one step, e.g. 7)")


def refuse_uri(option: str, value: str | None) -> None:
    """pack-train reads and writes local folders (or mounted file systems): a URI such as
    s3://bucket/packed is refused in one line rather than taken as a local path."""
    problem = uri_problem(option, value)
    if problem:
        raise UserError(f"{option} {value}: {problem}")


def uri_problem(option: str, value: str | None) -> str | None:
    """Why `value` cannot be given to `option` (it is a URI), or None."""
    if value is None or not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(value)):
        return None
    fix = (
        "give a local (or mounted) folder and copy the run folder afterwards"
        if option == "--out"
        else "copy the packed folder to a local (or mounted) path first and give that path"
    )
    return f"pack-train reads and writes local folders only, not URIs: {fix}"
