"""The one count of training FLOPs: pack-train's metrics (MFU, TFLOP/s, HFU), `pack-report` and the
benchmarks all count through `step_flops` (the trainer reads a model's shape with
`trainer.run.metrics.model_shape`; `pack-report` builds one from its options: `Sizes`).

Model FLOPs of one optimizer step (what MFU divides by the time and the peak):

- Dense, per decoder layer: 6 x its weights x tokens for a full fine-tune (forward 2, input
  gradient 2, weight gradient 2 per weight and token); with LoRA the frozen weights get no weight
  gradient, so 4 x weights x tokens, and the adapters 6 x their weights x tokens. The output head
  (vocab x hidden) runs over the loss tokens only (`trainer.model.loss` gathers them first): 6 x
  (4 x under LoRA) head weights x loss tokens. The input embedding is a lookup: no FLOPs. A
  mixture of experts' layer counts the weights a token uses (its top-k experts' share).
- Causal attention, per layer, from each row's EXAMPLE lengths (packed attention never crosses
  examples): the forward's two matmuls (Q K^T and P V) each do 2 x heads x head_dim FLOPs per
  query-key pair, the backward twice the forward, so 12 x heads x head_dim x pairs in all, where
  pairs = sum over examples of L(L+1)/2 (`causal_pairs`). `heads` are the QUERY heads (grouped-query
  attention shares K/V heads, not the work); a sliding-window layer (window w: query i sees keys
  i-w+1 .. i) counts only those pairs, a chunked layer only the pairs inside a chunk; models whose
  layers differ (gemma's local and global layers) count each layer by its own kind.

Hardware FLOPs (HFU) add what is computed again (`StepFlops.recompute`):

- `--grad-checkpointing`: each recomputed layer's forward once more (dense 2 x weights, plus the
  adapters' 2 x, x tokens, and attention's forward 4 x heads x head_dim x pairs, which
  `--keep-attention` does not run again);
- `--tile-mlp T`: in a micro-batch longer than T tokens, each layer's MLP forward once more (2 x MLP
  weights x tokens), tile by tile; a recomputed layer's own recompute then runs the MLP only over the
  tiles before the last (it stops once it has the last tile's input), so its MLP counts those tokens;
  a micro-batch of at most T tokens runs whole, as without the option;
- a loss whose logits are cut into checkpointed chunks: the head's forward once more (2 x head
  weights x loss tokens).

Worked example: one layer of 2 query heads of dim 4, rows [3, 5] and [8] (two examples in the first
row, one in the second): pairs = 3*4/2 + 5*6/2 + 8*9/2 = 6 + 15 + 36 = 57, attention = 12 x 2 x 4 x 57
= 5,472 FLOPs. Counting each row's length squared instead (8*9/2 twice, 72 pairs) would give 6,912.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.errors import UserError

# llama-3.2-1B's shape: pack-report's defaults for a model it is not told about
DEFAULT_HIDDEN, DEFAULT_LAYERS, DEFAULT_HEADS, DEFAULT_KV_HEADS = 2048, 16, 32, 8
DEFAULT_INTERMEDIATE, DEFAULT_VOCAB = 8192, 128256
MAX_LAYERS = 10_000  # pack-report's --layers at most (more than any model has; the count walks each layer)


def causal_pairs(lengths: Sequence[int] | np.ndarray, window: int | None = None, chunk: int | None = None) -> int:
    """Causal query-key pairs of examples of these lengths: sum L(L+1)/2. With `window` w a query
    sees at most w keys (itself included): w(w+1)/2 + (L-w) x w for L > w. With `chunk` c each
    example is cut into pieces of c tokens that attend only within themselves.

        >>> causal_pairs([3, 5, 8]), causal_pairs([8], window=3), causal_pairs([8], chunk=3)
        (57, 21, 15)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if chunk:
        full, rest = lengths // chunk, lengths % chunk
        lengths = np.concatenate([np.repeat(np.int64(chunk), int(full.sum())), rest])
    if window:
        inside = np.minimum(lengths, window)
        return int((inside * (inside + 1) // 2 + (lengths - inside) * window).sum())
    return int((lengths * (lengths + 1) // 2).sum())


@dataclass(frozen=True)
class LayerShape:
    """What the count needs of one decoder layer."""

    params: int  # the weights each token multiplies (the frozen base's under LoRA)
    heads: int  # query heads
    head_dim: int
    window: int | None = None  # sliding window (keys a query sees), None: full causal
    chunk: int | None = None  # chunked attention's chunk length
    mlp_params: int = 0  # of `params`, the MLP's (what --tile-mlp runs again)
    adapter_params: int = 0  # LoRA adapters in the layer
    recompute: bool = False  # --grad-checkpointing recomputes this layer
    recompute_attention: bool = True  # ... and its attention (False: --keep-attention keeps its output)


@dataclass(frozen=True)
class ModelShape:
    """A model as the count sees it: its decoder layers, its output head and how it trains."""

    layers: tuple[LayerShape, ...]
    head_params: int  # vocab x hidden
    vocab: int = 0
    lora: bool = False  # frozen base weights: no weight gradients
    tiled_mlp: int = 0  # --tile-mlp: tokens a tile (0: off)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of some rows, forward and backward: model = dense + attention; hardware adds recompute."""

    dense: float = 0.0
    attention: float = 0.0
    recompute: float = 0.0

    @property
    def model(self) -> float:
        return self.dense + self.attention

    @property
    def hardware(self) -> float:
        return self.model + self.recompute

    def __add__(self, other: StepFlops) -> StepFlops:
        return StepFlops(self.dense + other.dense, self.attention + other.attention, self.recompute + other.recompute)

    def scaled(self, factor: float) -> StepFlops:
        return StepFlops(self.dense * factor, self.attention * factor, self.recompute * factor)

    def as_list(self) -> list[float]:
        return [self.dense, self.attention, self.recompute]


def step_flops(
    shape: ModelShape,
    lengths: Sequence[int] | np.ndarray | None,
    *,
    tokens: int | None = None,
    loss_tokens: int | None = None,
    head_recompute: bool = False,
    pairs: int | None = None,
) -> StepFlops:
    """FLOPs of training on examples of `lengths` (all rows' examples, in any order): see the module.
    `tokens` defaults to their sum, `loss_tokens` (the head's tokens) to `tokens`. `pairs` instead
    of `lengths`: their causal pairs, counted already (for a model whose layers all attend fully)."""
    if pairs is not None and any(layer.window or layer.chunk for layer in shape.layers):
        raise ValueError("pairs counted already apply to full causal layers only: give the lengths")
    lengths = np.asarray(lengths if lengths is not None else [], dtype=np.int64)
    tokens = int(lengths.sum()) if tokens is None else tokens
    loss_tokens = tokens if loss_tokens is None else loss_tokens
    base = 4.0 if shape.lora else 6.0
    dense = base * shape.head_params * loss_tokens
    attention = recompute = 0.0
    # --tile-mlp cuts a micro-batch longer than a tile into `tiles`, each run again in the backward; a
    # recomputed layer's own recompute then stops (torch's checkpoint stops once it has every tensor
    # the backward saved) at the last tile's input: it runs the MLP over the tiles before it only
    tile = shape.tiled_mlp
    tiles = -(-tokens // tile) if tile and tokens > tile else 0
    mlp_again = (tiles - 1) * tile if tiles else tokens  # tokens a recomputed layer's MLP runs again
    pairs_of: dict[tuple[int | None, int | None], int] = {}  # layers of one kind share their count
    for layer in shape.layers:
        key = (layer.window, layer.chunk)
        if key not in pairs_of:
            pairs_of[key] = causal_pairs(lengths, layer.window, layer.chunk) if pairs is None else pairs
        forward = 4.0 * layer.heads * layer.head_dim * pairs_of[key]
        dense += (base * layer.params + 6.0 * layer.adapter_params) * tokens
        attention += 3.0 * forward
        if layer.recompute:
            mlp = layer.mlp_params * (mlp_again - tokens)  # the MLP tiles the layer's recompute skips
            recompute += 2.0 * ((layer.params + layer.adapter_params) * tokens + mlp) + (forward if layer.recompute_attention else 0.0)
        if tiles:
            recompute += 2.0 * layer.mlp_params * tokens
    if head_recompute:
        recompute += 2.0 * shape.head_params * loss_tokens
    return StepFlops(dense, attention, recompute)


@dataclass(frozen=True)
class Sizes:
    """A llama-style model by its sizes (a gated MLP of three matrices, head_dim = hidden / heads):
    what `pack-report` counts a folder's work with (`--hidden`, `--layers`, `--heads`, `--kv-heads`,
    `--intermediate`; the vocabulary of the folder's tokenizer where it is recorded, or of a
    what-if's --tokenizer). Defaults: llama-3.2-1B's shape."""

    hidden: int = DEFAULT_HIDDEN
    layers: int = DEFAULT_LAYERS
    heads: int = DEFAULT_HEADS
    kv_heads: int = DEFAULT_KV_HEADS
    intermediate: int = DEFAULT_INTERMEDIATE
    vocab: int = DEFAULT_VOCAB

    def shape(self) -> ModelShape:
        """The `ModelShape` of these sizes (full causal attention in every layer); sizes that do not
        make a model (a width the heads do not divide) are one line."""
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise UserError(
                f"--hidden {self.hidden}, --heads {self.heads}, --kv-heads {self.kv_heads}: the heads "
                "must divide the width and the K/V heads the heads (e.g. --hidden 2048 --heads 32 "
                "--kv-heads 8)"
            )
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate
        layer = LayerShape(params=attention + mlp, heads=self.heads, head_dim=head_dim, mlp_params=mlp)
        return ModelShape(layers=(layer,) * self.layers, head_params=self.vocab * self.hidden, vocab=self.vocab)

    def describe(self) -> str:
        return (
            f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads ({self.kv_heads} K/V), "
            f"MLP {self.intermediate}, vocab {self.vocab:,}"
        )


def attention_share(flops: StepFlops) -> float:
    """Attention's share of the model FLOPs (0 for no work)."""
    return flops.attention / flops.model if flops.model else 0.0


def rates_line(record: dict) -> str | None:
    """A run's FLOP figures as pack-train's summary and `pack-report RUN` print them, from the keys
    of summary.json or a metrics line (`tflops`, `mfu`, `hfu`, `attn_flop_share`); None without them.

        >>> rates_line({"tflops": 41.5, "mfu": 0.42, "hfu": 0.5, "attn_flop_share": 0.25})
        '41.5 TFLOP/s a device, MFU 42.0%, HFU 50.0% (attention 25.0% of the model FLOPs)'
    """
    if record.get("tflops") is None:
        return None
    mfu, hfu = record.get("mfu"), record.get("hfu")
    peak = (
        f"MFU {100 * float(mfu):.1f}%, HFU {100 * float(hfu):.1f}%"
        if mfu is not None and hfu is not None
        else "MFU - (no peak known: --peak-flops)"
    )
    return (
        f"{float(record['tflops']):,.1f} TFLOP/s a device, {peak} "
        f"(attention {100 * float(record.get('attn_flop_share') or 0):.1f}% of the model FLOPs)"
    )
