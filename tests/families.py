"""Tiny random models of the Hugging Face decoder families a fine-tuning user would pick, each with
its packing-relevant features exaggerated so that ignoring one shows on 17-38-token examples:
windows of 8 tokens, chunks of 8, soft-caps of 0.1-1, sink logits up to 3, logit scales far from 1.

Used by tests/trainer/test_model_families.py (CPU, float32) and tests/gpu/check_gpu_families.py (the GPU
kernels in bf16). A family either trains packed exactly (`features`: the attention features its
layers use, `head`: whether its forward post-processes the logits) or is refused in one line
(`refused`: a regex of that line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # larger than real models' 0.02: peakier attention shows every feature
)
# Example lengths of the comparisons: longer than every window and chunk below.
LENGTHS = (17, 23, 38, 30)
WINDOW = 8
BOUNDARIES = "without example boundaries"
STATE = "carry state from one example to the next"
NO_INTERFACE = "does not use transformers' AttentionInterface"
FAILED = "a packed forward pass failed"
HEAD = "post-processes its hidden states or logits"
ROPE_THRESHOLD = 29  # position thresholds of the RoPE-by-length families: passed by 2 of the 4 LENGTHS,
# and by the row before the second example ends; above the short probe row (28 tokens)
DROP = None.__class__  # a config value that removes the key from TINY (Falcon has no head_dim)


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    head: bool = False
    refused: str | None = None
    sinks: bool = False  # gpt-oss: sink logits set large after init
    # dynamic NTK RoPE keeps the longest length it has seen: run each example alone on a fresh copy
    fresh_alone: bool = False

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The model in float32, train mode, stock eager attention, seeded random weights (the
        comparisons switch to eval mode: PhiMoE's router samples in training)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs = {k: v for k, v in {**TINY, **self.config}.items() if v is not DROP}
        config = AutoConfig.for_model(self.model_type, **kwargs)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
        if self.sinks:
            with torch.no_grad():
                for module in model.modules():
                    if hasattr(module, "sinks"):
                        module.sinks.copy_(torch.linspace(-3.0, 3.0, module.sinks.numel()))
        return model.train()


def fam(
    name: str,
    model_type: str | None = None,
    *features: str,
    head: bool = False,
    refused: str | None = None,
    sinks: bool = False,
    fresh_alone: bool = False,
    **config,
) -> Family:
    return Family(name, model_type or name, config, frozenset(features), head, refused, sinks, fresh_alone)


FAMILIES = [
    fam("llama"),
    fam("mistral", None, "window", sliding_window=WINDOW),
    fam("mistral-no-window", "mistral", sliding_window=None),
    fam("ministral", None, "window", sliding_window=WINDOW),
    fam("qwen2", None, "window", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    fam("qwen2-no-window", "qwen2"),
    fam("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    fam("qwen3"),
    fam("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    fam("phi3", None, "window", sliding_window=WINDOW),
    fam("phimoe", None, "window", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    fam("starcoder2", None, "window", sliding_window=WINDOW, residual_dropout=0.0, embedding_dropout=0.0),
    fam("mixtral", None, "window", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    fam("olmo2"),
    fam("olmo3", None, "window", sliding_window=WINDOW),
    fam("olmoe", num_experts=4, num_experts_per_tok=2),
    fam("gemma"),
    fam(
        "gemma2",
        None,
        "window",
        "softcap",
        head=True,
        sliding_window=WINDOW,
        initializer_range=0.2,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.1,
    ),
    fam("gemma3", "gemma3_text", "window", head=True, sliding_window=WINDOW, final_logit_softcapping=0.1),
    # its per-layer input embeddings get a table of their own: 262,144 x 512 by default (134M
    # parameters, gigabytes once the comparisons hold gradients of each example and float64 copies)
    fam(
        "gemma4",
        "gemma4_text",
        "window",
        "wide_head",
        head=True,
        sliding_window=WINDOW,
        final_logit_softcapping=0.1,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
    ),
    fam("gpt_oss", None, "window", "sinks", sinks=True, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    fam("granite", None, head=True, logits_scaling=4.0),
    fam("granitemoe", None, head=True, logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
    fam("cohere", None, head=True, logit_scale=0.25),
    fam("cohere2", None, "window", head=True, logit_scale=0.25, sliding_window=WINDOW),
    fam("exaone4", None, "window", sliding_window=WINDOW, sliding_window_pattern=2),
    fam("llama4", "llama4_text", "chunk", attention_chunk_size=WINDOW),
    fam(
        "deepseek_v3",
        None,
        "value_dim",
        num_key_value_heads=4,
        head_dim=8,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
    ),
    fam("glm4"),
    fam("smollm3"),
    fam("seed_oss"),
    fam("apertus"),
    fam("arcee"),
    fam("hunyuan_v1_dense"),
    fam("gpt_neox", hidden_dropout=0.0),
    fam("gpt2", n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    fam("phi", resid_pdrop=0.0, embd_pdrop=0.0),
    fam("opt", ffn_dim=128, word_embed_proj_dim=64, dropout=0.0),
    # decoder layers that do not pass keyword arguments to attention: boundaries via trainer.attention.packed_row
    fam("stablelm"),
    fam("nemotron"),
    fam("hyperclovax", None, head=True, logits_scaling=4.0),  # multiplies its logits by logits_scaling
    # position features that transformers computes from the row: per example (trainer.attention.positions),
    # with thresholds far below the examples' lengths
    fam(
        "llama-dynamic-rope",
        "llama",
        fresh_alone=True,
        max_position_embeddings=ROPE_THRESHOLD,
        rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0},
    ),
    fam(
        "phi3-longrope",
        "phi3",
        original_max_position_embeddings=ROPE_THRESHOLD,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": ROPE_THRESHOLD,
            "short_factor": [1.0 + i / 4 for i in range(8)],
            "long_factor": [1.0 + 4 * i for i in range(8)],
        },
    ),
    fam(
        "llama4-temperature",
        "llama4_text",
        "chunk",
        attention_chunk_size=WINDOW,
        no_rope_layers=[1, 0],
        floor_scale=ROPE_THRESHOLD,
        attn_scale=2.0,
    ),
    # refused, each with one line
    fam("gpt2-dropout", "gpt2", refused="attention dropout", n_embd=64, n_layer=2, n_head=4),
    fam("modernbert-decoder", refused=HEAD),  # its output Linear is named `decoder`
    fam("lfm2", refused=STATE, layer_types=["conv", "full_attention"]),
    fam("granitemoehybrid", refused=STATE),
    fam(
        "qwen3_next", refused=FAILED, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),  # 512 experts by default
    fam("qwen3_5", "qwen3_5_text", refused=FAILED),
    fam("falcon", refused=NO_INTERFACE, head_dim=DROP),
    fam("bloom", refused=NO_INTERFACE, n_layer=2, n_head=4),
]


def examples(seed: int = 0, vocab: int = 256) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of len(LENGTHS) examples; labels mask the first token and three tokens
    in the middle (a masked prompt turn, as in chat data), so every example's first tokens, where
    a state leaking from the previous example shows most, carry a loss."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        ids = rng.integers(3, vocab, n)
        labels = ids.copy()
        labels[0] = -100
        labels[5:8] = -100
        out.append((ids, labels))
    return out


def fresh_rope(model: torch.nn.Module) -> None:
    """Give RoPE modules the frequencies of a freshly built model: dynamic NTK RoPE keeps those of
    the longest sequence it has seen until one no longer than max_position_embeddings comes, so an
    example run alone after a longer one would get the longer one's."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
            module._buffers["inv_freq"] = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


def stock_alone(model, data, fresh: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Mean token loss of each example run alone through the stock eager model, and its gradients
    (`fresh`: each on the RoPE state of a freshly built model)."""
    means, grads = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for ids, labels in data:
        if fresh:
            fresh_rope(model)
        logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0]
        mean = F.cross_entropy(logits[:-1].float(), torch.from_numpy(labels[1:]), ignore_index=-100)
        means.append(mean.detach())
        grads.append(torch.autograd.grad(mean, params, allow_unused=True))
    return torch.stack(means), grads


def gradient_error(packed, alone) -> tuple[float, int]:
    """The largest difference between two lists of gradients, each relative to its own largest
    entry (or to a hundredth of the largest gradient anywhere, for gradients that are zero but for
    rounding: a key bias cannot change a softmax); and where it is."""
    floor = 1e-2 * max(float(g.abs().max()) for g in alone if g is not None)
    worst, where = 0.0, 0
    for i, (gp, ga) in enumerate(zip(packed, alone)):
        if ga is None and gp is None:
            continue
        gp = torch.zeros_like(ga) if gp is None else gp
        ga = torch.zeros_like(gp) if ga is None else ga
        err = float((gp.double() - ga.double()).abs().max()) / max(float(ga.abs().max()), floor)
        if err > worst:
            worst, where = err, i
    return worst, where
