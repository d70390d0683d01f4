"""Every key of the Axolotl and TRL config schemas, with its default.

`pipeline.foreign.config` maps the keys it knows (`KEYS`); a key of these schemas that it does not map
is accepted when its value is the tool's default or empty (nothing changes: `lora_model_dir:`,
`ddp_find_unused_parameters: false`) and refused otherwise, named with every other such key in one
line. The lists are read from the sources, not imported (neither tool is a dependency):

- Axolotl 0.19.0 (PyPI sdist, Apache-2.0): the fields of the pydantic models in
  `src/axolotl/utils/schemas/*.py` and `integrations/base.py`, with their `Field(default=...)`.
- TRL 1.16.0 (Apache-2.0): the fields of `SFTConfig` (which extends transformers 5.24's
  `TrainingArguments`), `ModelConfig`, `ScriptArguments` and `DatasetMixtureConfig`.

`*_NO_VALUE`: keys whose default is None (or computed); `*_VALUES`: the others and their defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.foreign.batch import group_size, padded
from pipeline.foreign.keys import AXOLOTL_MIN_LEN, DATA, TRAIN, TRL, TRL_LEARNING_RATE, TRL_MAX_LENGTH, show, shown


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


AXOLOTL_NO_VALUE = _names("""
accelerator_config activation_checkpointing activation_dtype adam_beta1 adam_beta2 adam_beta3 adam_epsilon
adam_epsilon2 adapter added_tokens_overrides additional_special_tokens attn_implementation
auto_find_batch_size auto_resume_from_checkpoints auto_wrap_policy axolotl_config_path base_model
base_model_config batch_flattening batch_size bench_dataset bench_split beta bfloat16 bnb_config_kwargs
bos_token capabilities center_rewards_coefficient chat_template chat_template_jinja chat_template_kwargs
chosen_format chunked_cross_entropy chunked_cross_entropy_num_chunks cls_model_config comet_api_key
comet_experiment_config comet_experiment_key comet_mode comet_online comet_project_name comet_workspace
completion_format context_parallel_size conversation cosine_constant_lr_ratio cosine_min_lr_ratio cpo_alpha
cpu_offload_pin_memory cpu_ram_efficient_loading curriculum_sampling data_files data_parallel_size
dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor
dataset_exact_deduplication dataset_keep_in_memory dataset_num_proc dataset_prepared_path dataset_processes
dataset_shard_idx dataset_shard_num datasets ddp ddp_broadcast_buffers ddp_bucket_cap_mb
ddp_find_unused_parameters ddp_timeout deepcompile deepspeed default_system_message device device_map dion_lr
dion_momentum do_bench_eval do_causal_lm_eval dp_replicate_size dp_shard_size dpo_beta
dpo_generate_during_eval dpo_label_smoothing dpo_loss_type dpo_loss_weights dpo_norm_loss dpo_padding_free
dpo_use_liger_kernel dpo_use_logits_to_keep dpo_use_weighting drop_system_message ds_type dynamic_checkpoint
eager_attention early_stopping_patience ebft embedding_lr embedding_lr_scale embeddings_skip_upcast
enable_prefix_caching enable_reasoning end enforce_eager entropy_coef entropy_coef_delta entropy_coef_max
entropy_coef_min entropy_target env_capabilities eos_token eot_tokens epsilon epsilon_high eval_batch_size
eval_causal_lm_metrics eval_max_new_tokens eval_sample_packing eval_sequence_len eval_steps eval_strategy
eval_table_size evals_per_epoch evaluation_strategy excess_length_strategy experts_implementation
fake_quant_after_n_steps feature_layers field field_chosen field_completion field_human field_input
field_instruction field_label field_messages field_model field_output field_prompt field_rejected field_system
field_thinking field_tools final_state_dict_type fix_untrained_tokens flash_attention flash_attn_cross_entropy
flash_attn_d512 flash_attn_fuse_mlp flash_attn_rms_norm flash_optimum flex_attention flex_attn_compile_kwargs
float16 float32 format fp16 fp32_norm_classes fp32_norms fp8 fp8_config fp8_enable_fsdp_float8_all_gather
freeze_mm_modules fsdp fsdp_config fsdp_final_state_dict_type fsdp_version fused_attn_kernel gc_collect_steps
gc_steps gemma4_hybrid_attn_impl generation_batch_size generation_kwargs generation_top_k generation_top_p
gptq gpu_memory_limit gradient_checkpointing_kwargs gradio_max_new_tokens gradio_server_name
gradio_server_port gradio_share gradio_temperature gradio_title greater_is_better group_by_length
heads_k_stride hf_mlflow_log_artifacts hf_use_auth_token hub_model_id hub_revision hub_strategy
image_resize_algorithm image_size importance_sampling_level include_tokens_per_second input_format
input_transform is_falcon_derived_model is_llama_derived_model is_mistral_derived_model is_preprocess
is_qwen_derived_model jagged_restart_anneal_steps jagged_restart_steps jagged_restart_warmup_steps
kto_desirable_weight kto_undesirable_weight large_head_attention learning_rate lisa_n_layers
lisa_step_interval llama4_linearized_experts local_rank loftq_config log_multimodal logging_steps
logprobs_field lora_alpha lora_alpha_pattern lora_embedding_kernel lora_fan_in_fan_out lora_mlp_kernel
lora_model_dir lora_modules_to_save lora_o_kernel lora_on_cpu lora_qkv_kernel lora_r lora_rank_pattern
lora_target_linear lora_target_modules lora_target_parameters loraplus_lr_ratio loss_type
loss_watchdog_patience loss_watchdog_threshold low_cpu_mem_usage lr lr_div_factor lr_groups
lr_quadratic_warmup lr_scheduler_kwargs max_completion_length max_grad_norm max_input_id max_memory
max_model_len max_packed_sequence_len max_prompt_len max_steps merge_lora message_field_content
message_field_role message_field_training message_field_training_detail message_property_mappings
metric_for_best_model min_num_params min_p min_sample_len mixed_precision_policy mlflow_experiment_name
mlflow_run_name mlflow_tracking_uri model_quantization_config model_quantization_config_kwargs modules
multi_objective_aggregation multipack_real_batches name neftune_noise_alpha no_input_format
noisy_embedding_alpha num_completions_to_print num_dataset_shards_to_save num_generations num_iterations
num_labels off_policy_mask_threshold offload_params optim_args optim_target_modules orpo_alpha
overrides_of_model_config overrides_of_model_kwargs pad_to_multiple_of pad_to_sequence_len pad_token path peft
peft_autocast_adapter_dtype peft_ensure_weight_tying peft_init_lora_weights peft_layer_replication
peft_layers_pattern peft_layers_to_transform peft_trainable_token_indices peft_use_dora peft_use_rslora
plugins pose_max_context_len pose_num_chunks pose_split_on_token_ids precompute_ref_log_probs prefetch_depth
preprocess_iterable preprocess_shards pretrain_multipack_buffer_size pretraining_dataset
pretraining_sample_concatenation process_reward_model processor_kwargs processor_type profiler_steps
prompt_format push_dataset_to_hub qat quantization ray_run_name reasoning_parser recipe recompute_layer_types
reinit_weights rejected_format relora relora_cpu_offload relora_prune_ratio remove_unused_columns
repetition_penalty reshard_after_forward resize_token_embeddings_to_32x resources_per_worker
resume_from_checkpoint revision revision_of_model reward_funcs reward_model reward_weights ring_attn_func rl
rl_beta role role_boundaries roles roles_to_train rollout_func rope_scaling rpo_alpha s2_attention
sage_attention sample_packing sample_packing_eff_est sample_packing_mp_start_method
sample_packing_sequentially save save_first_step save_steps save_strategy save_total_limit saves_per_epoch
scaling_softmax scaling_softmax_bias scaling_softmax_factor sdp_attention sdpa_varlen seed
selective_checkpointing sequence_length sequence_parallel_degree serve_module shards shards_idx
shrink_embeddings simpo_gamma skip special_tokens split split_thinking start state_dict_type step_separator
streaming streaming_min_groups streaming_partial_batch sync_module_states system_format system_prompt
template_thinking_key tensor_parallel_size test_datasets tiled_mlp tiled_mlp_num_shards tokenizer_config
tokenizer_legacy tokenizer_type tokenizer_use_fast tokenizer_use_mistral_common tokens top_k torch_compile
torch_compile_backend torch_compile_mode torch_compile_options torch_empty_cache_steps torchdistx_path
total_num_tokens total_supervised_tokens trackio_project_name trackio_run_name trackio_space_id train_on_eos
train_on_eot train_on_last_step_only trainer_cls transformer_layer_cls_to_wrap trl type type_of_model
unfrozen_parameters unk_token use_adaptive_entropy use_bias_correction_kl use_comet use_eaft use_kernels
use_liger_loss use_mlflow use_onebitllms use_orig_params use_pose use_tensorboard use_trackio use_wandb vllm
vllm_enable_sleep_mode vllm_guided_decoding_regex vllm_importance_sampling_cap
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min vllm_importance_sampling_correction
vllm_importance_sampling_mode vllm_mode vllm_server_timeout vllm_sync_interval wandb_entity wandb_log_model
wandb_mode wandb_name wandb_project wandb_run_id wandb_watch warmup_ratio warmup_steps weight_dtype
worker_extension_cls world_size xformers_attention
""")
# fmt: off
# Tables of the tools' defaults, several keys a line as read from their code: ruff format would give each a line.
AXOLOTL_VALUES: dict[str, Any] = {
    'activation_offloading': False, 'adaptive_max_tokens': True, 'advantage_estimator': 'rloo', 'alignment_coef':
    1.0, 'async_prefetch': False, 'bf16': 'auto', 'ce_coef': 0.0, 'check_interval': 10, 'context_length': 8,
    'dion_rank_fraction': 1.0, 'dion_rank_multiple_of': 1, 'diversity_coef': 1.0, 'dtype': 'auto', 'eaft_alpha':
    1.0, 'eaft_k': 20, 'embed_method': 'last_token', 'enabled': False, 'experimental_skip_move_to_device': True,
    'generate_max_len': 8, 'generate_samples': False, 'generation_do_sample': True, 'generation_max_new_tokens':
    50, 'generation_prompt_ratio': 0.5, 'generation_temperature': 0.7, 'gpu_memory_utilization': 0.9,
    'gradient_accumulation_steps': 1, 'gradient_checkpointing': False, 'group_size': 32, 'gt_length_multiplier':
    1.5, 'host': '0.0.0.0', 'include_end': True, 'include_start': False, 'include_tkps': True, 'layer_offloading':
    False, 'length': 1000, 'lisa_layers_attribute': 'model.layers', 'load_best_model_at_end': False,
    'load_in_4bit': False, 'load_in_8bit': False, 'loftq_bits': 4, 'log_completions': False, 'lora_dropout': 0.0,
    'lora_like': False, 'loraplus_lr_embedding': 1e-06, 'lr_scheduler': 'cosine', 'mask_truncated_completions':
    False, 'mean_resizing_embeddings': False, 'merge_method': 'memory_efficient', 'micro_batch_size': 1,
    'min_completion_prefix': 0, 'min_input_id': 100, 'mode': 'structured', 'n_samples_per_prompt': 4,
    'num_epochs': 1.0, 'num_generation_samples': 3, 'offload': False, 'optimizer': 'adamw_torch_fused',
    'otel_metrics_host': 'localhost', 'otel_metrics_port': 8000, 'output_dir': './model-out', 'ple_cpu_offload':
    False, 'port': 8000, 'pretrain_multipack_attn': True, 'profiler_steps_start': 0, 'qgalore_cos_threshold': 0.4,
    'qgalore_gamma_proj': 2, 'qgalore_proj_bits': 4, 'qgalore_proj_group_size': 256, 'qgalore_proj_quant': True,
    'qgalore_proj_type': 'std', 'qgalore_queue_size': 5, 'qgalore_rank': 256, 'qgalore_scale': 0.25,
    'qgalore_update_proj_gap': 200, 'qlora_sharded_model_loading': False, 'quantize_embedding': False,
    'quantize_moe_experts': False, 'ray_num_workers': 1, 'ref_model_mixup_alpha': 0.9, 'ref_model_sync_steps': 64,
    'relora_prune_method': 'magnitude', 'replay_buffer_size': 0, 'replay_recompute_logps': True,
    'reroll_max_groups': 1, 'reroll_start_fraction': 1.0, 'reward_num_workers': 1, 'rl_coef': 1.0,
    'sample_packing_bin_size': 200, 'sample_packing_group_size': 100000, 'save_only_model': False,
    'save_safetensors': True, 'save_sliding_window': False, 'scale_rewards': True, 'sequence_len': 512,
    'shuffle_before_merging_datasets': False, 'shuffle_merged_datasets': True, 'skip_prepare_dataset': False,
    'skip_zero_advantage_batches': True, 'streaming_multipack_buffer_size': 10000, 'strict': False, 'stride': 8,
    'sync_ref_model': False, 'temperature': 0.6, 'text_column': 'text', 'tf32': 'auto',
    'tiled_mlp_use_original_mlp': True, 'tokenizer_save_jinja_files': True, 'top_p': 1.0, 'train_on_inputs':
    False, 'trigger_file_path': '', 'trust_remote_code': False, 'use_data_producer': False, 'use_otel_metrics':
    False, 'use_ray': False, 'use_vllm': False, 'use_whitening': False, 'val_set_size': 0.0, 'vllm_lora_sync':
    False, 'vllm_server_host': '0.0.0.0', 'vllm_server_port': 8000, 'weight_decay': 0.0
}
# fmt: on

TRL_NO_VALUE = _names("""
accelerator_config activation_checkpointing activation_checkpointing_kwargs attn_implementation bf16
bnb_4bit_quant_storage chat_template_path completion_only_loss data_seed dataloader_multiprocessing_context
dataloader_prefetch_factor dataset_config dataset_kwargs dataset_name dataset_num_proc datasets ddp_backend
ddp_broadcast_buffers ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph deepspeed disable_tqdm
eos_token eval_accumulation_steps eval_packing eval_steps fsdp fsdp_config gradient_checkpointing_kwargs
greater_is_better hub_model_id hub_private_repo hub_revision hub_token include_for_metrics label_names
liger_kernel_config lora_modules_to_save lora_target_modules lora_target_parameters lr_scheduler_kwargs
metric_for_best_model model_init_kwargs model_name_or_path neftune_noise_alpha optim_args optim_target_modules
output_dir pad_token parallelism_config resume_from_checkpoint router_aux_loss_coef run_name save_total_limit
test_split_size tf32 torch_compile_backend torch_compile_mode torch_empty_cache_steps trackio_bucket_id
trackio_space_id trackio_static_space_id
""")
# fmt: off
# The same for TRL's.
TRL_VALUES: dict[str, Any] = {
    'activation_offloading': False, 'adam_beta1': 0.9, 'adam_beta2': 0.999, 'adam_epsilon': 1e-08,
    'assistant_only_loss': False, 'auto_find_batch_size': False, 'average_tokens_across_devices': True,
    'batch_eval_metrics': False, 'bf16_full_eval': False, 'bnb_4bit_quant_type': 'nf4', 'dataloader_drop_last':
    False, 'dataloader_in_order': True, 'dataloader_num_workers': 0, 'dataloader_persistent_workers': False,
    'dataloader_pin_memory': True, 'dataset_streaming': False, 'dataset_test_split': 'test', 'dataset_text_field':
    'text', 'dataset_train_split': 'train', 'ddp_timeout': 1800, 'debug': '', 'do_eval': False, 'do_predict':
    False, 'do_train': False, 'dtype': 'float32', 'enable_jit_checkpoint': False, 'eval_delay': 0,
    'eval_do_concat_batches': True, 'eval_on_start': False, 'eval_strategy': 'no', 'eval_use_gather_object':
    False, 'fp16': False, 'fp16_full_eval': False, 'full_determinism': False, 'gradient_accumulation_steps': 1,
    'gradient_checkpointing': True, 'hub_always_push': False, 'hub_strategy': 'every_save', 'ignore_bias_buffers':
    False, 'ignore_data_skip': False, 'include_num_input_tokens_seen': 'no', 'label_smoothing_factor': 0.0,
    'learning_rate': 2e-05, 'length_column_name': 'length', 'load_best_model_at_end': False, 'load_in_4bit':
    False, 'load_in_8bit': False, 'local_rank': -1, 'log_level': 'passive', 'log_level_replica': 'warning',
    'log_on_each_node': True, 'logging_first_step': False, 'logging_nan_inf_filter': True, 'logging_steps': 10,
    'logging_strategy': 'steps', 'lora_alpha': 32, 'lora_dropout': 0.05, 'lora_r': 16, 'lora_task_type':
    'CAUSAL_LM', 'loss_type': 'nll', 'lr_scheduler_type': 'linear', 'max_grad_norm': 1.0, 'max_length': 1024,
    'max_steps': -1, 'model_revision': 'main', 'num_train_epochs': 3.0, 'optim': 'adamw_torch_fused', 'packing':
    False, 'packing_strategy': 'bfd', 'pad_to_multiple_of': 'auto', 'padding_free': False,
    'per_device_eval_batch_size': 8, 'per_device_train_batch_size': 8, 'prediction_loss_only': False, 'project':
    'huggingface', 'push_to_hub': False, 'remove_unused_columns': True, 'report_to': 'none',
    'restore_callback_states_from_checkpoint': False, 'save_on_each_node': False, 'save_only_model': False,
    'save_steps': 500, 'save_strategy': 'steps', 'seed': 42, 'shuffle_dataset': False, 'skip_memory_metrics':
    True, 'streaming': False, 'torch_compile': False, 'train_sampling_strategy': 'random', 'truncation_mode':
    'keep_start', 'trust_remote_code': False, 'use_bnb_nested_quant': False, 'use_cache': False, 'use_cpu': False,
    'use_dora': False, 'use_liger_kernel': False, 'use_peft': False, 'use_rslora': False, 'warmup_steps': 0,
    'weight_decay': 0.0
}
# fmt: on


def _a(tool: str) -> str:
    """The tool's name with its article: "an Axolotl", "a TRL"."""
    return f"{'an' if tool.startswith('A') else 'a'} {tool}"


def schema_key(key: str, value: Any, tool: str, command: str) -> str:
    """The mapping's line for a key of `tool`'s schema that `foreign_config.KEYS` does not map: not
    used when its value is the tool's default or empty (nothing changes), else a UserError (its
    meaning cannot be honoured here); a key of neither schema is a UserError too."""
    schemas = [(n, v) for t, n, v in (("Axolotl", AXOLOTL_NO_VALUE, AXOLOTL_VALUES), ("TRL", TRL_NO_VALUE, TRL_VALUES)) if t in tool]
    known = [(None if key in none else values[key]) for none, values in schemas if key in none or key in values]
    if not known:
        raise UserError(
            f"unknown option {key!r}: neither an option of {command} nor {_a(tool)} key: remove it "
            "(docs/from-trl-axolotl.md lists the keys it maps)"
        )
    if value in (None, "", [], {}) or any(value == d and type(value) is type(d) for d in known) or (value is False and None in known):
        return f"  {key}: {show(value)}: not used ({tool}'s default: nothing to change)"
    raise UserError(f"{shown(value)} is {_a(tool)} setting with no equivalent in {command}: remove it to train without it")


# The recipe each tool trains with for the training keys a file leaves out: (our option, value,
# what the summary says). TRL: SFTConfig of trl 1.16.0 (trl/trainer/sft_config.py, base_config.py)
# over transformers 5.24's TrainingArguments; Axolotl 0.19.0: utils/schemas/training.py (optimizer,
# lr_scheduler, weight_decay, num_epochs), core/builders/base.py (warmup), and TrainingArguments for
# what Axolotl leaves None (adam_beta1/2, adam_epsilon, max_grad_norm, seed).
_HF = [
    ("weight_decay", 0.0, "weight decay 0"),
    ("beta1", 0.9, "beta1 0.9"),
    ("beta2", 0.999, "beta2 0.999"),
    ("adam_eps", 1e-8, "adam eps 1e-8"),
    ("grad_clip", 1.0, "grad clip 1.0"),
    ("seed", 42, "seed 42"),
]
TRAIN_DEFAULTS = {
    "TRL": [
        ("lr", TRL_LEARNING_RATE, "lr 2e-5"),
        ("schedule", "linear", "linear"),
        ("min_lr_ratio", 0.0, "to 0"),
        *_HF,
        ("epochs", 3, "3 epochs"),
        ("grad_checkpointing", 1, "gradient checkpointing on"),
        ("log_every", 10, "log every 10 steps"),
        ("save_every", 500, "save every 500 steps"),
        ("out", "trainer_output", "output_dir trainer_output"),
    ],
    "Axolotl": [
        ("schedule", "cosine", "cosine"),
        ("min_lr_ratio", 0.0, "to 0"),
        *_HF,
        ("out", "./model-out", "output_dir ./model-out"),  # schemas/config.py
        ("data", "last_run_prepared", "dataset_prepared_path last_run_prepared"),  # common/const.py
        ("warmup_rule", "axolotl", "warmup as Axolotl counts it (3% of the steps, at most 100, when none is given)"),
        # core/builders/base.py sets transformers' average_tokens_across_devices false
        ("loss_average", "ranks", "each rank's loss its own mean, the ranks' means averaged"),
    ],
}


def source_defaults(
    tool: str, command: str, data: Mapping[str, Any], out: dict[str, Any], take: Callable[..., Any], refused: list[str]
) -> list[str]:
    """Fill `out` (through `take`) with `tool`'s defaults for what the file leaves out, and give the
    summary's line saying which recipe was read."""
    said = []
    if command == TRAIN:
        for option, value, words in TRAIN_DEFAULTS[tool]:
            if option in out or (option == "epochs" and "max_steps" in out):
                continue
            if option == "warmup_rule" and "warmup" in out:  # warmup_steps given: taken as it is
                continue
            try:
                take(f"({tool} default)", option, value)
            except UserError as exc:
                refused.append(str(exc))
                continue
            if words.startswith("to ") and said and said[-1] in ("linear", "cosine"):
                said[-1] += " " + words  # "linear to 0"
            else:
                said.append(words)
        if "lr" not in out:
            said.append("no learning_rate (Axolotl requires one): pack-train's --lr, unless given as a flag")
        source = "SFTConfig of trl 1.16.0" if tool == TRL else "Axolotl 0.19.0's schema"
    else:
        if tool == TRL and "max_len" not in out and any(k in data and data[k] is None for k in ("max_length", "max_seq_length")):
            refused.append(
                "key 'max_length': null: TRL then cuts no example, and pack-data packs rows of a fixed "
                "length: give max_length (at least the longest example's tokens)"
            )
        elif "max_len" not in out:
            length = 1024 if tool == TRL else AXOLOTL_VALUES["sequence_len"]
            take(f"({tool} default)", "max_len", length)
            said.append(f"rows of {length} tokens")
        if tool != TRL and "overlong" not in out:  # Axolotl drops what is past sequence_len; TRL truncates
            take(f"({tool} default)", "overlong", "drop")
            said.append("examples longer than sequence_len dropped (excess_length_strategy drop)")
        if tool != TRL and "min_len" not in out:  # Axolotl drops the 1-token examples (keys.AXOLOTL_MIN_LEN)
            take(f"({tool} default)", "min_len", AXOLOTL_MIN_LEN)
            said.append(f"examples of fewer than {AXOLOTL_MIN_LEN} tokens dropped (min_sample_len {AXOLOTL_MIN_LEN})")
        if tool != TRL and "out" not in out:
            take(f"({tool} default)", "out", "last_run_prepared")
            said.append("dataset_prepared_path last_run_prepared")
        if tool == TRL and "train_on_prompt" not in out:
            said.append(_trl_loss(out, take))
        source = "SFTConfig of trl 1.16.0" if tool == TRL else "Axolotl 0.19.0's schema"
    groups = padded_groups(tool, command, data, out, take) if padded(data) else []
    return groups + ([f"  {tool} defaults for the keys the file leaves out ({source}): {', '.join(said)}"] if said else [])


def padded_groups(tool: str, command: str, data: Mapping[str, Any], out: dict[str, Any], take: Callable[..., Any]) -> list[str]:
    """A file without packing trains steps of B padded examples (B: per-device batch x
    gradient_accumulation_steps, the tool's default batch when the file gives none): pack-data packs
    each B as one group, pack-train takes one group a step; the summary line saying so."""
    batch_key, default, length_keys, length = (
        ("per_device_train_batch_size", 8, ("max_length", "max_seq_length"), TRL_MAX_LENGTH)
        if tool == TRL
        else ("micro_batch_size", AXOLOTL_VALUES["micro_batch_size"], ("sequence_len",), AXOLOTL_VALUES["sequence_len"])
    )
    batch = default if data.get(batch_key) is None else data[batch_key]
    try:
        size = group_size(batch, batch_key, data)
    except UserError:  # the key's own line has refused it
        return []
    length = next((data[k] for k in length_keys if isinstance(data.get(k), int)), length)
    if command == DATA and "group_size" not in out:
        take(f"({tool} default)", "strategy", "minibatch")
        take(f"({tool} default)", "group_size", size)
    if command == TRAIN and "step_by_group" not in out:
        take(f"({tool} default)", "step_by_group", True)
        if "tokens_per_step" not in out:
            take(f"({tool} default)", "tokens_per_step", batch * length)
    return [
        f"  {tool}: batches of {size} padded examples a step, trained as packed groups of those {size} (same "
        f"gradient): pack-data --strategy minibatch --group-size {size}, pack-train --step-by-group, one group a "
        "process (under torchrun N groups a step, one a rank, as N processes of the tool); each epoch takes "
        "pack-data's groups in a new order, where "
        f"{tool} draws new batches (another random draw, the same recipe)"
    ]


def _trl_loss(out: dict[str, Any], take: Callable[..., Any]) -> str:
    every = trl_loss_default([str(i) for i in out.get("inputs", [])])
    if every:
        take("(TRL default)", "train_on_prompt", True)
        return "loss on every token of the messages (assistant_only_loss: false)"
    if every is None:
        return (
            "loss on every token for messages data, on the completion for prompt/completion data: the data's "
            "shape is seen only when packing: give completion_only_loss: false for TRL's messages default "
            "(pack-data's own: loss on the assistant's turns)"
        )
    return "loss on the completion (completion_only_loss)"


def trl_loss_default(inputs: list[str]) -> bool | None:
    """TRL's loss when the file sets neither assistant_only_loss nor completion_only_loss: every token
    of conversational `messages` data, the completion of prompt/completion data. True (train on the
    prompt) when every input is a local JSON file whose first record holds messages, False when one
    holds a prompt and completion, None when that cannot be read before packing (a Hub dataset)."""
    shapes = set()
    for name in inputs:
        path = Path(name)
        if not path.is_file() or path.suffix not in (".jsonl", ".json"):
            return None
        try:
            with path.open(encoding="utf-8") as f:
                head = f.read(1 << 20).lstrip()
            first = json.loads(head.splitlines()[0]) if path.suffix == ".jsonl" else None
        except (OSError, ValueError, IndexError, RecursionError):
            return None
        if not isinstance(first, dict):
            return None
        shapes.add("chat" if {"messages", "conversations"} & set(first) else "prompt" if "prompt" in first else "other")
    return {"chat"} == shapes if shapes else None
