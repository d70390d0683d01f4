"""Axolotl and TRL (`trl sft`) YAML keys in `--config FILE`: what each means for pack-train and for
pack-data.

`read_config_file` (pipeline.config_file) reads such a file as it is. A key listed in `KEYS` is, for
the command reading the file, either mapped to options of ours (`Map`: `learning_rate: 2e-4` is
`--lr 0.0002`; `micro_batch_size: 2` with `sequence_len: 2048` and `sample_packing: true` is
`--tokens-per-step 4096`) or named as not used, with what to do instead (`Unused`: `wandb_entity`).
A value that has no exact equivalent here (`fp16: true`, `num_epochs: 1.5`) is refused in one line
by the `Map`'s conversion. One file can hold both commands' keys, as an Axolotl config does: the
data keys map for pack-data and are named as pack-data's by pack-train, and the other way round.

The same table writes the settings table of docs/from-trl-axolotl.md (`markdown_table`), so that
the page and the code cannot disagree (tests/e2e/test_config_files.py compares them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipeline.foreign.adapter_keys import _adapter, _load_in_4bit, _load_in_8bit, _lora_linear, _lora_r, _lora_target, _use_peft
from pipeline.foreign.batch import _excess_length, _grad_accum, _groups, _packing, _tokens_per_step
from pipeline.foreign.data import DROP_FIRST_SYSTEM, add_tokens, axolotl_datasets, dataset_name, drops_system, special_tokens, trl_mixture
from pipeline.foreign.keys import (  # noqa: F401 (DATA, TRAIN, NotUsed, Unused: the commands import them from here)
    ATTN,
    AXOLOTL,
    AXOLOTL_MIN_LEN,
    BOTH,
    DATA,
    DATA_KEY,
    HUB,
    PACKED,
    TRAIN,
    TRAIN_KEY,
    TRL,
    TRL_MAX_LENGTH,
    WATCHDOG,
    Convert,
    Key,
    Map,
    NotUsed,
    Rule,
    Unused,
    _bf16,
    _bfloat16,
    _chat_template,
    _chat_template_jinja,
    _evaluations,
    _fp16,
    _grad_checkpointing,
    _in_dataset_name,
    _max_steps,
    _model,
    _model_tokenizer,
    _optimizer,
    _report_to,
    _same,
    _schedule,
    _trl_loss_key,
    _trl_template_path,
    _val_set_size,
    _wandb_project,
    _whole,
    refuse,
    show,
)
from pipeline.foreign.parallel_keys import TILE_TOKENS, _activation_offloading, _fsdp, _fsdp_config, _fsdp_version, _plugins, _tiled_mlp
from pipeline.foreign.recipe_keys import (
    _average_tokens,
    _eos_token,
    _min_sample_len,
    _packing_strategy,
    _scheduler_kwargs,
    _unfrozen_parameters,
    _use_fast,
    _use_tensorboard,
)
from pipeline.foreign.schema import AXOLOTL_VALUES, schema_key, source_defaults  # noqa: F401 (config_file calls them here)

PACKED_DOC = (
    "true: rows are packed here anyway; false or absent (both tools' default): padded batches, "
    "trained as packed groups of the same examples, one group a step (the same gradient)"
)


def _strategy(key: str, steps_key: str) -> Convert:
    """TRL's save_strategy / eval_strategy: steps (steps_key counts them), epoch (once an epoch) or no
    (none along the way); what it names replaces the every-N-steps default."""
    every, per_epoch = ("save_every", "saves_per_epoch") if key == "save_strategy" else ("eval_every", "evals_per_epoch")

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value == "steps":
            raise NotUsed(f"{steps_key} sets the steps")
        if value == "epoch":
            return {per_epoch: 1, every: 0}
        if value == "no":
            if key == "eval_strategy":
                raise NotUsed("no: no evaluation along the way, as there")
            return {every: 0}
        raise refuse(key, value, "use steps, epoch or no")

    return convert


def _dropping(convert: Convert) -> Convert:
    """A chat template's conversion that, when the file's datasets set drop_system_message, puts
    `DROP_FIRST_SYSTEM` before the template (its name or text; `pipeline.tokenize.chat_templates`
    resolves what follows it): each conversation is rendered without its first message when that is a
    system message, as Axolotl renders it (`pipeline.tokenize.render.render_chat`)."""

    def dropping(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        out = convert(value, settings)
        if drops_system(settings) and out.get("chat_template"):
            out["chat_template"] = DROP_FIRST_SYSTEM + str(out["chat_template"])
        return out

    return dropping


def _datasets(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`datasets:` is Axolotl's list of entries, or in a TRL file TRL's mixture (not chat data)."""
    return (trl_mixture if looks_foreign(settings) == TRL else axolotl_datasets)(value, settings)


FROM_DATA = (
    "pack-data adds them to the tokenizer and records the grown vocabulary in the packed folder; pack-train resizes the embeddings to it"
)
KERNEL = "a kernel of Axolotl's that computes the same: the loss here is chunked and exact, attention is --attn's"
TOKENIZER = "the model's tokenizer (NAME@REVISION as the model)"
REVISED = "the model (with model_revision / revision_of_model: NAME@REVISION)"
COMPILING = "how torch.compile runs changes no number: pack-train compiles each decoder layer (--compile)"


# fmt: off
# A table, a key a row or two: ruff format would give every argument of every Key(...) a line of its own.
KEYS: tuple[Key, ...] = (
    # model and tokenizer
    Key("base_model", AXOLOTL, Map(("model",), _model, REVISED), Map(("tokenizer",), _model_tokenizer, TOKENIZER)),
    Key("model_name_or_path", TRL, Map(("model",), _model, REVISED), Map(("tokenizer",), _model_tokenizer, TOKENIZER)),
    *(Key(k, tool, Unused("read with the model's name: NAME@REVISION"), Unused("the same"))
      for k, tool in (("model_revision", TRL), ("revision_of_model", AXOLOTL))),
    Key("tokenizer_config", AXOLOTL, _same("tokenizer"), _same("tokenizer")),
    Key("model_type", AXOLOTL, Unused("the model class comes from the model's config.json"),
        Unused("the model class comes from the model's config.json")),
    Key("tokenizer_type", AXOLOTL, Unused("the tokenizer class comes from its folder"),
        Unused("the tokenizer class comes from its folder")),
    Key("trust_remote_code", BOTH, Unused("models run without remote code: use a transformers model class"),
        Unused("tokenizers load without remote code: use a tokenizer.json tokenizer")),
    Key("torch_dtype", TRL, Unused("bf16 (or --dtype) sets the precision"), TRAIN_KEY),
    Key("attn_implementation", BOTH, Unused(ATTN), TRAIN_KEY),
    Key("flash_attention", AXOLOTL, Unused(ATTN), TRAIN_KEY),
    Key("sdp_attention", AXOLOTL, Unused(ATTN), TRAIN_KEY),
    Key("xformers_attention", AXOLOTL, Unused(ATTN), TRAIN_KEY),
    Key("special_tokens", AXOLOTL, Unused(FROM_DATA), Map(("special_tokens",), special_tokens,
        "each NAME: TEXT as --special-token NAME=TEXT (added to the vocabulary when missing); pad_token: not "
        "needed, rows hold no padding")),
    Key("tokens", AXOLOTL, Unused(FROM_DATA), Map(("add_tokens",), add_tokens, "each as --add-token TEXT")),
    # data
    Key("datasets", BOTH, DATA_KEY, Map(("inputs", "fmt", "messages_field", "text_field", "template",
                                         "roles_to_train", "train_on_eos", "per_input"), _datasets,
        "each entry's path is an input: a Hub id as org/name[@revision][:name]:split, a local path, data_files inside a "
        "local folder or of a Hub dataset (hf://datasets/org/name/FILE); a share of a split (train[:20%], "
        "train[10:100], train[-5%:]) as the input's :split[...], the rows datasets selects; drop_system_message: "
        "see chat_template; type chat_template or sharegpt: --format "
        "chat, alpaca: instruction (alpaca:chat, alpaca:chatml, alpaca:phi: Axolotl's prompt of that style as "
        "--template, its markers the tokenizer's tokens), completion: text; field_messages, field: the fields; "
        "message_property_mappings (or message_field_role/content): role from role/from, content from "
        "content/value; roles_to_train, train_on_eos: --roles-to-train, --train-on-eos; a type or sub-key that differs "
        "between entries: each entry's own, as --per-input INPUT:OPTION=VALUE (drop_system_message: one for all); "
        "shards other than 1 refused. In a TRL file, its mixture: path, name, split, data_files of each entry")),
    Key("dataset_name", TRL, DATA_KEY, Map(("inputs",), dataset_name,
        "the input: a Hub dataset as dataset_name[:dataset_config]:dataset_train_split, or a local path")),
    Key("dataset_config", TRL, DATA_KEY, Map((), _in_dataset_name("dataset_config"), "part of dataset_name's input")),
    Key("dataset_train_split", TRL, DATA_KEY, Map((), _in_dataset_name("dataset_train_split"),
                                                  "part of dataset_name's input")),
    Key("dataset_text_field", TRL, DATA_KEY, _same("text_field")),
    Key("dataset_prepared_path", AXOLOTL, _same("data"), _same("out")),
    Key("dataset_processes", AXOLOTL, DATA_KEY, _same("num_proc")),
    Key("dataset_num_proc", TRL, DATA_KEY, _same("num_proc")),
    Key("sequence_len", AXOLOTL, Unused("the packed folder's row length, set by pack-data --max-len"),
        _same("max_len")),
    Key("max_length", TRL, Unused("the packed folder's row length, set by pack-data --max-len"), _same("max_len")),
    Key("max_seq_length", TRL, Unused("the packed folder's row length, set by pack-data --max-len"),
        _same("max_len")),
    Key("excess_length_strategy", AXOLOTL, DATA_KEY, Map(("overlong",), _excess_length,
        "drop (Axolotl's default), truncate, raise (error) as --overlong")),
    Key("sample_packing", AXOLOTL, Map((), _packing, PACKED_DOC), Map((), _packing, PACKED_DOC)),
    Key("packing", TRL, Map((), _packing, PACKED_DOC), Map((), _packing, PACKED_DOC)),
    Key("pad_to_sequence_len", AXOLOTL, Unused("rows hold no padding"), Unused("rows hold no padding")),
    Key("chat_template", AXOLOTL, DATA_KEY, Map(("chat_template",), _dropping(_chat_template),
        "a template name (chatml, llama3, ...) as --chat-template; tokenizer_default: the tokenizer's own; "
        "with a dataset's drop_system_message, after a Jinja comment that has the first system message of each "
        "conversation dropped before rendering")),
    Key("chat_template_jinja", AXOLOTL, DATA_KEY, Map(("chat_template",), _dropping(_chat_template_jinja),
        "with chat_template: jinja, the template text as --chat-template (drop_system_message: as chat_template)")),
    Key("chat_template_path", TRL, DATA_KEY, Map(("chat_template",), _trl_template_path,
        "as --chat-template (with assistant_only_loss: true, TRL's training version of it where TRL ships one)")),
    Key("train_on_inputs", AXOLOTL, DATA_KEY, _same("train_on_prompt")),
    Key("assistant_only_loss", TRL, DATA_KEY, Map(("train_on_prompt", "chat_template"), _trl_loss_key("assistant_only_loss"),
                                                  "true: loss on the assistant's turns only (no --train-on-prompt), rendered "
                                                  "with TRL's training version of a template TRL ships (Qwen3, Llama 3, ...), "
                                                  "as its SFTTrainer swaps it")),
    Key("completion_only_loss", TRL, DATA_KEY, Map(("train_on_prompt",), _trl_loss_key("completion_only_loss"),
                                                   "false: --train-on-prompt (unless assistant_only_loss); no effect "
                                                   "on messages data, as in TRL")),
    Key("val_set_size", AXOLOTL, Unused("pack-data holds out the eval folder (DATA/eval), which pack-train evaluates on"),
        Map(("eval_fraction", "eval_examples"), _val_set_size,
            "a fraction below 1: --eval-fraction; a whole number: --eval-examples")),
    Key("test_datasets", AXOLOTL, Unused("pack them into a folder of their own and give it as eval_data"),
        Unused("pack them with pack-data into a folder of their own (pack-train's eval_data)")),
    Key("eval_dataset_name", TRL, Unused("pack it into a folder of its own and give it as eval_data"),
        Unused("pack it with pack-data into a folder of its own (pack-train's eval_data)")),
    # training
    Key("output_dir", BOTH, _same("out"), Unused("pack-train's run folder; pack-data writes to dataset_prepared_path "
                                                 "or out")),
    Key("learning_rate", BOTH, _same("lr"), TRAIN_KEY),
    Key("num_epochs", AXOLOTL, Map(("epochs",), _whole("num_epochs", "epochs"), "a whole number"), TRAIN_KEY),
    Key("num_train_epochs", TRL, Map(("epochs",), _whole("num_train_epochs", "epochs"), "a whole number"), TRAIN_KEY),
    Key("max_steps", BOTH, Map(("max_steps",), _max_steps, "-1: none (the epochs decide)"), TRAIN_KEY),
    Key("warmup_ratio", BOTH, _same("warmup_ratio"), TRAIN_KEY),
    Key("warmup_steps", BOTH, _same("warmup"), TRAIN_KEY),
    Key("gradient_accumulation_steps", BOTH, Map(("grad_accum",), _grad_accum(TRAIN),
        "with packing; padded batches: a factor of the group size (--grad-accum 1)"),
        Map((), _grad_accum(DATA), "padded batches: a factor of --group-size")),
    Key("micro_batch_size", AXOLOTL, Map(("tokens_per_step", "step_by_group"), _tokens_per_step(
        "micro_batch_size", ("sequence_len",), "sample_packing", None, AXOLOTL_VALUES["sequence_len"]),
        "micro_batch_size x sequence_len tokens, exact with sample_packing: true; without it (padded batches) "
        "--step-by-group, micro-batches of that many tokens"),
        Map(("strategy", "group_size"), _groups("micro_batch_size"), "padded batches (no sample_packing): "
            "--strategy minibatch --group-size micro_batch_size x gradient_accumulation_steps")),
    Key("per_device_train_batch_size", TRL, Map(("tokens_per_step", "step_by_group"), _tokens_per_step(
        "per_device_train_batch_size", ("max_length", "max_seq_length"), "packing", TRL_MAX_LENGTH, TRL_MAX_LENGTH),
        f"per_device_train_batch_size x max_length (TRL's default {TRL_MAX_LENGTH}) tokens, exact with "
        "packing: true; without it (padded batches, TRL's default) --step-by-group, micro-batches of that many "
        "tokens"),
        Map(("strategy", "group_size"), _groups("per_device_train_batch_size"), "padded batches (no packing): "
            "--strategy minibatch --group-size per_device_train_batch_size x gradient_accumulation_steps")),
    Key("micro_batch_size_eval", AXOLOTL, Unused("evaluation reads the eval folder in tokens_per_step batches"),
        TRAIN_KEY),
    Key("eval_batch_size", AXOLOTL, Unused("evaluation reads the eval folder in tokens_per_step batches"), TRAIN_KEY),
    Key("per_device_eval_batch_size", TRL, Unused("evaluation reads the eval folder in tokens_per_step batches"),
        TRAIN_KEY),
    Key("save_steps", BOTH, _same("save_every"), TRAIN_KEY),
    Key("save_total_limit", BOTH, _same("keep_last"), TRAIN_KEY),
    Key("logging_steps", BOTH, _same("log_every"), TRAIN_KEY),
    Key("eval_steps", BOTH, Map(("eval_every",), _evaluations("eval_every"), "when the tool evaluates: Axolotl "
                                 "with val_set_size, TRL with eval_strategy: steps"), TRAIN_KEY),
    Key("save_strategy", TRL, Map(("save_every", "saves_per_epoch"), _strategy("save_strategy", "save_steps"),
                                  "steps: save_steps; epoch: --saves-per-epoch 1; no: --save-every 0 (the last "
                                  "step's checkpoint only)"), TRAIN_KEY),
    Key("eval_strategy", TRL, Map(("eval_every", "evals_per_epoch"), _strategy("eval_strategy", "eval_steps"),
                                  "steps: eval_steps; epoch: --evals-per-epoch 1; no: none"), TRAIN_KEY),
    Key("logging_strategy", TRL, Unused("logging_steps (--log-every) sets when metrics are logged"), TRAIN_KEY),
    Key("bf16", BOTH, Map(("dtype",), _bf16, "true: --dtype bf16, false: fp32, auto: auto"), TRAIN_KEY),
    Key("bfloat16", AXOLOTL, Map(("dtype",), _bfloat16, "true: --dtype bf16 (Axolotl: bf16 or bfloat16)"),
        TRAIN_KEY),
    Key("fp16", BOTH, Map(("dtype",), _fp16, "true is refused (no float16 training here)"), TRAIN_KEY),
    Key("tf32", BOTH, Unused("not an option here: bf16 (or --dtype) sets the precision"), TRAIN_KEY),
    Key("gradient_checkpointing", BOTH, Map(("grad_checkpointing",), _grad_checkpointing,
                                            "true: every layer (1), false: 0"), TRAIN_KEY),
    Key("gradient_checkpointing_kwargs", BOTH, Unused("activations are recomputed without reentrant autograd"),
        TRAIN_KEY),
    Key("lr_scheduler", AXOLOTL, Map(("schedule", "min_lr_ratio"), _schedule("lr_scheduler"),
        "cosine, linear, constant (constant_with_warmup: constant); cosine and linear decay to 0 "
        "(--min-lr-ratio 0) unless cosine_min_lr_ratio is given"), TRAIN_KEY),
    Key("lr_scheduler_type", TRL, Map(("schedule", "min_lr_ratio"), _schedule("lr_scheduler_type"),
        "as lr_scheduler"), TRAIN_KEY),
    Key("cosine_min_lr_ratio", AXOLOTL, _same("min_lr_ratio"), TRAIN_KEY),
    Key("weight_decay", BOTH, None, TRAIN_KEY),
    Key("optimizer", AXOLOTL, Map(("optimizer",), _optimizer("optimizer"),
                                  "adamw_torch, adamw_torch_fused, adamw_hf: adamw; adafactor"), TRAIN_KEY),
    Key("optim", TRL, Map(("optimizer",), _optimizer("optim"), "as optimizer"), TRAIN_KEY),
    Key("adam_beta1", BOTH, _same("beta1"), TRAIN_KEY),
    Key("adam_beta2", BOTH, _same("beta2"), TRAIN_KEY),
    Key("adam_epsilon", BOTH, _same("adam_eps"), TRAIN_KEY),
    Key("max_grad_norm", BOTH, _same("grad_clip"), TRAIN_KEY),
    Key("average_tokens_across_devices", TRL, Map(("loss_average",), _average_tokens,
                                                  "true (TRL's default): tokens; false: ranks"), TRAIN_KEY),
    Key("seed", BOTH, None, None),
    Key("resume_from_checkpoint", BOTH, Map(("resume",), None, "any intact checkpoint folder, an earlier one or "
                                              "another run's (a new output_dir starts its own history there)"),
        TRAIN_KEY),
    Key("dataloader_num_workers", TRL, _same("num_workers"), TRAIN_KEY),
    Key("torch_compile", BOTH, _same("compile_"), TRAIN_KEY),
    Key("fsdp", BOTH, Map(("parallel", "offload_states"), _fsdp,
                          "any value: --parallel fsdp (under torchrun); with `offload`: and --offload-states"),
        TRAIN_KEY),
    Key("fsdp_config", BOTH, Map(("offload_states",), _fsdp_config,
                                 "`offload_params` (or `fsdp_offload_params`) true: --offload-states; nothing else "
                                 "is used (FSDP2 wraps each decoder layer)"), TRAIN_KEY),
    Key("deepspeed", BOTH, Unused("use --parallel fsdp (or ddp) under torchrun"), TRAIN_KEY),
    Key("report_to", TRL, Map(("report_to",), _report_to, "none, tensorboard or wandb"), TRAIN_KEY),
    Key("wandb_project", AXOLOTL, Map(("wandb_project", "report_to"), _wandb_project,
                                      "the W&B project; --report-to wandb unless report_to is given"), TRAIN_KEY),
    Key("wandb_entity", AXOLOTL, _same("wandb_entity"), TRAIN_KEY),
    Key("wandb_name", AXOLOTL, _same("run_name"), TRAIN_KEY),
    Key("run_name", TRL, _same("run_name"), TRAIN_KEY),
    Key("logging_dir", TRL, Unused("TensorBoard writes to OUT/tensorboard"), TRAIN_KEY),
    Key("push_to_hub", TRL, Unused(HUB), TRAIN_KEY),
    Key("hub_always_push", TRL, Unused(HUB), TRAIN_KEY),
    *(Key(k, TRL, Unused(f"{k} only tells a script what to run; pack-train trains, and evaluates as eval_strategy "
                         "says"), Unused("the same")) for k in ("do_train", "do_eval")),
    Key("ddp_timeout", TRL, Unused("how long a collective waits before it fails: torch's default here"), TRAIN_KEY),
    Key("packing_strategy", TRL, DATA_KEY, Map((), _packing_strategy, "bfd (TRL's default) or ffd: not used, "
                                                                      "pack-data's planner packs whole examples; "
                                                                      "wrapped is refused")),
    Key("lr_scheduler_kwargs", BOTH, Map((), _scheduler_kwargs, "min_lr_rate or min_lr of cosine_with_min_lr: "
                                                                "--min-lr-ratio (with lr_scheduler_type); others "
                                                                "refused"), TRAIN_KEY),
    Key("log_level", TRL, Unused("how much the trainer logs: pack-train prints its lines, metrics go to "
                                 "metrics.jsonl"), Unused("the same")),
    Key("use_liger_kernel", TRL, Unused(KERNEL), TRAIN_KEY),
    Key("save_only_model", TRL, Unused("checkpoints hold the optimizer state too (what --resume continues "
                                       "from); the model files are the same"), TRAIN_KEY),
    Key("overwrite_output_dir", TRL, Unused("pack-train writes only into a new or empty folder or a run folder of "
                                            "its own (--resume continues one)"), TRAIN_KEY),
    Key("eos_token", TRL, DATA_KEY, Map(("special_tokens",), _eos_token, "--special-token eos_token=TEXT (SFTConfig's "
                                                                         "end of each example)")),
    Key("pad_token", TRL, Unused("rows hold no padding"), Unused("rows hold no padding")),
    Key("hub_model_id", BOTH, Unused(HUB), TRAIN_KEY),
    # LoRA
    Key("adapter", AXOLOTL, Map(("qlora",), _adapter, "qlora: --qlora; lora: lora_r gives the rank"), TRAIN_KEY),
    Key("use_peft", TRL, Map(("lora_r", "lora_alpha", "lora_dropout"), _use_peft,
        "true: LoRA with TRL's defaults (lora_r 16, lora_alpha 32, lora_dropout 0.05) for the keys not given"),
        TRAIN_KEY),
    Key("lora_r", BOTH, Map(("lora_r",), _lora_r, "the rank, when adapter (Axolotl) or use_peft (TRL) asks for "
                                                   "adapters; a rank below 1 is then refused"), TRAIN_KEY),
    Key("lora_alpha", BOTH, None, TRAIN_KEY),
    Key("lora_dropout", BOTH, None, TRAIN_KEY),
    Key("lora_target_modules", BOTH, Map(("lora_target",), _lora_target("lora_target_modules"),
                                         "a list of names joined with commas; all-linear: all"), TRAIN_KEY),
    Key("lora_target_linear", AXOLOTL, Map(("lora_target",), _lora_linear, "true: --lora-target all"), TRAIN_KEY),
    Key("load_in_4bit", BOTH, Map(("qlora",), _load_in_4bit, "true: --qlora"), TRAIN_KEY),
    # run control of the tools themselves
    Key("strict", AXOLOTL, Unused("Axolotl's own validation switch: every key here is checked"),
        Unused("Axolotl's own validation switch: every key here is checked")),
    Key("debug", AXOLOTL, Unused("pack-data --limit N packs a slice to try options on"),
        Unused("--limit N packs a slice to try options on")),
    Key("saves_per_epoch", AXOLOTL, _same("saves_per_epoch"), TRAIN_KEY),
    Key("evals_per_epoch", AXOLOTL, Map(("evals_per_epoch",), _evaluations("evals_per_epoch"),
                                        "with val_set_size (Axolotl evaluates only then)"), TRAIN_KEY),
    Key("early_stopping_patience", AXOLOTL, Unused("no early stopping: save_best keeps the best checkpoint"),
        TRAIN_KEY),
    Key("group_by_length", BOTH, Unused(PACKED), TRAIN_KEY),
    Key("wandb_watch", AXOLOTL, Unused("no gradient histograms are logged"), TRAIN_KEY),
    Key("wandb_log_model", AXOLOTL, Unused("checkpoints are not uploaded to W&B"), TRAIN_KEY),
    Key("lora_modules_to_save", AXOLOTL, Unused("only the LoRA adapters train: remove it, or train every weight "
                                                "(lora_r: 0)"), TRAIN_KEY),
    Key("lora_fan_in_fan_out", AXOLOTL, Unused("the adapters follow each layer's own weight layout"), TRAIN_KEY),
    Key("load_in_8bit", BOTH, Map(("int8_base",), _load_in_8bit, "true, with adapter: lora or use_peft: an int8 "
                                                                 "base (not LLM.int8's int8 matmuls)"), TRAIN_KEY),
    # long rows (Axolotl's ALST example)
    Key("context_parallel_size", AXOLOTL, _same("context_parallel"), TRAIN_KEY),
    Key("tiled_mlp", AXOLOTL, Map(("tile_mlp",), _tiled_mlp, f"true: --tile-mlp sequence_len / tiled_mlp_num_shards, "
                                                          f"or {TILE_TOKENS} tokens (tiles change no number)"), TRAIN_KEY),
    Key("tiled_mlp_num_shards", AXOLOTL, Unused("tiled_mlp's tile length"), TRAIN_KEY),
    Key("activation_offloading", AXOLOTL, Map(("offload_activations",), _activation_offloading,
                                              "true or legacy: --offload-activations"), TRAIN_KEY),
    Key("fsdp_version", AXOLOTL, Map(("parallel",), _fsdp_version, "1 or 2: --parallel fsdp (FSDP2)"), TRAIN_KEY),
    # Axolotl's own machinery: kernels and checks that compute the same
    Key("plugins", AXOLOTL, Map((), _plugins, "Cut Cross Entropy and Liger: not used (kernels that compute the "
                                             "same); any other plugin is refused"), Unused("pack-train's")),
    *(Key(k, AXOLOTL, Unused(KERNEL), TRAIN_KEY) for k in (
        "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "liger_fused_linear_cross_entropy",
        "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "cut_cross_entropy", "flash_attn_rms_norm",
        "flash_attn_fuse_mlp", "flash_attn_cross_entropy", "fused_attn_kernel")),
    *(Key(k, AXOLOTL, Unused(COMPILING), TRAIN_KEY) for k in (
        "torch_compile_mode", "torch_compile_backend", "flex_attn_compile_kwargs")),
    Key("dataset_exact_deduplication", AXOLOTL, DATA_KEY, _same("dedup")),
    Key("low_cpu_mem_usage", AXOLOTL, Unused("how the weights are loaded: the model computes the same"), TRAIN_KEY),
    Key("tokenizer_use_fast", AXOLOTL, Map((), _use_fast, "true (Axolotl's default): not used, the tokenizer is "
                                                         "tokenizer.json's fast one; false is refused"),
        Map((), _use_fast, "the same")),
    Key("use_tensorboard", AXOLOTL, Map(("report_to",), _use_tensorboard, "true: --report-to tensorboard"),
        TRAIN_KEY),
    *(Key(k, AXOLOTL, Unused("metrics go to metrics.jsonl and --report-to (tensorboard, wandb)"), TRAIN_KEY)
      for k in ("use_swanlab", "use_otel_metrics")),
    Key("eval_sample_packing", AXOLOTL, Unused(PACKED), Unused(PACKED)),
    *(Key(k, AXOLOTL, Unused("pack-train evaluates the held-out loss (eval_loss, eval_ppl), without generating "
                             "samples or other metrics"), TRAIN_KEY)
      for k in ("eval_table_size", "eval_max_new_tokens", "eval_causal_lm_metrics", "do_causal_lm_eval")),
    Key("loss_watchdog_threshold", AXOLOTL, Unused(WATCHDOG), TRAIN_KEY),
    Key("loss_watchdog_patience", AXOLOTL, Unused(WATCHDOG), TRAIN_KEY),
    Key("ddp_find_unused_parameters", BOTH, Unused("every trained parameter gets a gradient in each step here: "
                                                   "DDP has no unused parameters to look for"), TRAIN_KEY),
    Key("min_sample_len", AXOLOTL, DATA_KEY, Map(("min_len",), _min_sample_len, "examples of fewer tokens dropped "
                                                 f"and counted; absent, null or 0: Axolotl's {AXOLOTL_MIN_LEN}; below 1: "
                                                 "none dropped")),
    Key("unfrozen_parameters", AXOLOTL, Map(("unfrozen_parameters",), _unfrozen_parameters,
                                            "only the parameters a pattern matches train, read as Axolotl reads "
                                            "them; refused with an adapter, and a pattern with a [start:end] range"),
        TRAIN_KEY),
    Key("eot_tokens", AXOLOTL, Unused("pack-data's"), Unused("the chat template's own end-of-turn marker ends each "
                                                              "turn and takes the loss (train_on_eos)")),
    Key("resize_token_embeddings_to_32x", AXOLOTL, Unused("the embeddings keep the vocabulary's size (padding rows "
                                                          "to a multiple of 32 trains nothing)"), TRAIN_KEY),
)
# fmt: on
BY_NAME = {k.name: k for k in KEYS}


def rule(key: str, command: str) -> Rule | None:
    """`key`'s rule for `command` (TRAIN or DATA), or None when it is not an Axolotl/TRL key or the
    command's own option of the same spelling."""
    found = BY_NAME.get(key)
    if found is None:
        return None
    return found.train if command == TRAIN else found.data


def looks_foreign(settings: Mapping[str, Any]) -> str | None:
    """Which tool's keys the file uses ("Axolotl", "TRL", "Axolotl/TRL"), or None for none."""
    tools = {BY_NAME[k].tools for k in settings if k in BY_NAME and BY_NAME[k].train is not None}
    if not tools:
        return None
    if tools <= {AXOLOTL, BOTH} and AXOLOTL in tools:
        return AXOLOTL
    if tools <= {TRL, BOTH} and TRL in tools:
        return TRL
    return "Axolotl/TRL"


def _cell(rule_: Rule | None, flag: Callable[[str], str]) -> str:
    if rule_ is None:
        return "the same option"
    if isinstance(rule_, Unused):
        return f"not used: {rule_.why}"
    flags = ", ".join(f"`{flag(o)}`" for o in rule_.options)
    return f"{flags}: {rule_.doc}" if flags and rule_.doc else flags or rule_.doc


def markdown_table(flag: Callable[[str], str] | None = None) -> str:
    """Every key of `KEYS` as a Markdown table: key, tool, pack-train, pack-data (the page
    docs/from-trl-axolotl.md holds this text between its table markers)."""
    flag = flag or (lambda o: "--" + {"fmt": "format"}.get(o, o).rstrip("_").replace("_", "-"))
    lines = ["| key | tool | pack-train | pack-data |", "|---|---|---|---|"]
    for k in KEYS:
        cells = [f"`{k.name}`", k.tools, _cell(k.train, flag), _cell(k.data, flag)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
