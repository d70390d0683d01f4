"""Training FLOPs counted against hand counts (`pipeline.report.flops`, read from a model by
`trainer.run.metrics.model_shape`): attention from each example's length, not the row's, per query
head (GQA), per layer kind (sliding windows), LoRA against a full fine-tune, recompute as hardware
FLOPs; and a tiny CPU run's metrics.jsonl and summary agree with the hand count of its rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from packed_factory import make_packed_folder  # noqa: E402

from pipeline.report.flops import LayerShape, ModelShape, causal_pairs, step_flops  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.batch import collate_flat  # noqa: E402
from trainer.data.row_split import shard_microbatch  # noqa: E402
from trainer.run.metrics import batch_flops, model_shape  # noqa: E402

ROWS = [[3, 5], [8]]  # two rows of 8 tokens: examples of 3 and 5, and one of 8
EXAMPLES = np.array([3, 5, 8])


def one_layer(**kw: object) -> ModelShape:
    layer = LayerShape(**{"params": 100, "heads": 2, "head_dim": 4, **kw})  # type: ignore[arg-type]
    return ModelShape(layers=(layer,), head_params=0)


def test_attention_counts_each_example_not_the_row() -> None:
    # pairs: 3*4/2 + 5*6/2 + 8*9/2 = 6 + 15 + 36 = 57; 12 x heads 2 x head_dim 4 x 57 = 5,472
    assert causal_pairs(EXAMPLES) == 57
    assert step_flops(one_layer(), EXAMPLES, tokens=0).attention == 5472
    # negative control: each row's length squared (8*9/2 twice = 72 pairs) is another number
    assert step_flops(one_layer(), np.array([8, 8]), tokens=0).attention == 6912


def test_sliding_window_and_chunks_count_only_their_pairs() -> None:
    # window 3 over one example of 8: 1 + 2 + 3 x 6 = 21 pairs; over 3 and 5: 6 + (6 + 2 x 3) = 18
    assert causal_pairs(np.array([8]), window=3) == 21
    assert causal_pairs(np.array([3, 5]), window=3) == 18
    assert step_flops(one_layer(window=3), EXAMPLES, tokens=0).attention == 12 * 2 * 4 * (18 + 21)
    # a window as long as the example changes nothing; chunks of 3 over 8: 6 + 6 + 3 = 15 pairs
    assert causal_pairs(EXAMPLES, window=8) == 57
    assert causal_pairs(np.array([8]), chunk=3) == 15


def test_dense_lora_against_full_fine_tune() -> None:
    # layer weights 100, adapters 10, head 50; 16 tokens, 10 of them loss tokens
    full = ModelShape(layers=(LayerShape(params=100, heads=2, head_dim=4),), head_params=50)
    assert step_flops(full, np.zeros(0), tokens=16, loss_tokens=10).dense == 6 * 100 * 16 + 6 * 50 * 10  # 12,600
    lora = ModelShape(layers=(LayerShape(params=100, heads=2, head_dim=4, adapter_params=10),), head_params=50, lora=True)
    # frozen weights: forward 2 + input gradient 2; adapters 6
    assert step_flops(lora, np.zeros(0), tokens=16, loss_tokens=10).dense == 4 * 100 * 16 + 6 * 10 * 16 + 4 * 50 * 10


def test_recompute_is_hardware_flops_only() -> None:
    layers = (
        LayerShape(params=100, heads=2, head_dim=4, mlp_params=60, recompute=True),
        LayerShape(params=100, heads=2, head_dim=4, mlp_params=60),
    )
    plain = step_flops(ModelShape(layers=layers, head_params=0), EXAMPLES)
    # layer 0 recomputes its forward: 2 x 100 x 16 dense + 4 x 2 x 4 x 57 attention = 3,200 + 1,824
    assert plain.recompute == 5024
    assert plain.hardware == plain.model + 5024
    # tiles of 5 tokens: 16 tokens are 4 tiles, each layer's MLP runs once more tile by tile, and
    # layer 0's own recompute runs the MLP over the first 3 tiles (15 tokens), not 16
    tiled = step_flops(ModelShape(layers=layers, head_params=0, tiled_mlp=5), EXAMPLES)
    assert tiled.recompute == 5024 - 2 * 60 * 1 + 2 * (2 * 60 * 16)
    whole = step_flops(ModelShape(layers=layers, head_params=0, tiled_mlp=16), EXAMPLES)
    assert whole.recompute == plain.recompute  # a micro-batch of one tile runs whole: nothing more
    assert tiled.model == plain.model  # the model FLOPs (MFU) do not change
    head = step_flops(ModelShape(layers=(), head_params=50), EXAMPLES, loss_tokens=10, head_recompute=True)
    assert head.recompute == 2 * 50 * 10


def tiny(config_class: type, **kw: object) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = config_class(hidden_size=32, intermediate_size=64, vocab_size=100, **kw)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_model_shape_counts_query_heads_and_each_layers_kind() -> None:
    """Qwen2 with 4 query heads sharing 1 K/V head (head_dim 8), layers full, sliding (window 4), full."""
    model = tiny(
        transformers.Qwen2Config,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
    )
    shape = model_shape(model, TrainConfig(data="d", model="m", out="o", grad_checkpointing=2, tile_mlp=8))
    # q 32x32 + bias, k and v 32x8 + bias, o 32x32, MLP 3 x 32 x 64, two norms of 32
    assert [layer.params for layer in shape.layers] == [1056 + 264 + 264 + 1024 + 6144 + 64] * 3
    assert [layer.mlp_params for layer in shape.layers] == [6144] * 3
    assert [(layer.heads, layer.head_dim) for layer in shape.layers] == [(4, 8)] * 3  # not the 1 K/V head
    assert [layer.window for layer in shape.layers] == [None, 4, None]
    assert [layer.recompute for layer in shape.layers] == [True, False, True]  # layers 0, 2
    assert shape.head_params == 100 * 32 and not shape.lora and shape.tiled_mlp == 8
    # full layers 57 pairs each; the sliding one: 6 + (10 + 1 x 4) + (10 + 4 x 4) = 46
    assert step_flops(shape, EXAMPLES, tokens=0).attention == 12 * 4 * 8 * (57 + 46 + 57)


def test_model_shape_of_a_lora_model_splits_the_adapters() -> None:
    from trainer.model.lora import add_lora

    model = tiny(transformers.LlamaConfig, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config = TrainConfig(data="d", model="m", out="o", lora_r=2, lora_target="q_proj,v_proj")
    add_lora(model, config)
    shape = model_shape(model, config)
    # q: A 32x2 + B 2x32; v: A 32x2 + B 2x16 (2 K/V heads of 8)
    assert [layer.adapter_params for layer in shape.layers] == [128 + 96] * 2
    assert [layer.params for layer in shape.layers] == [1024 + 512 + 512 + 1024 + 6144 + 64] * 2
    assert shape.lora


def test_context_parallel_shares_sum_to_the_whole_row() -> None:
    ids = np.arange(16)
    batch = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in (3, 5, 8)]), EXAMPLES)
    shape = ModelShape(layers=(LayerShape(params=100, heads=2, head_dim=4),), head_params=50)
    whole = batch_flops(shape, batch)
    shares = [batch_flops(shape, shard_microbatch(batch, rank, 2)) for rank in range(2)]
    assert shares[0].attention == shares[1].attention == whole.attention / 2
    assert sum(s.dense for s in shares) == whole.dense
    assert whole.attention == 12 * 2 * 4 * 57


def rows_folder(folder: Path) -> dict:
    """ROWS as a packed folder; the config of one pack-train step over both rows."""
    rng = np.random.default_rng(0)
    ids = iter(range(3))  # example ids 0, 1, 2
    make_packed_folder(folder / "data", [[(next(ids), rng.integers(3, 300, n)) for n in row] for row in ROWS], 8)
    return dict(
        data=str(folder / "data"),
        model="tiny",
        out=str(folder / "run"),
        tokens_per_step=16,
        max_steps=1,
        log_every=1,
        num_workers=0,
        progress=False,
        peak_flops=1e12,
        save_every=0,
    )


# The tiny preset (hidden 64, 2 layers, 4 query heads of 16, 2 K/V heads, MLP 128, vocab 4096, untied
# head) on one step of ROWS: 16 tokens, 2 + 4 + 7 = 13 loss tokens
LAYER = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64  # 36,992
DENSE = 6 * LAYER * 2 * 16 + 6 * 4096 * 64 * 13  # 7,102,464 + 20,447,232
ATTENTION = 12 * 4 * 16 * 57 * 2  # 87,552


@pytest.mark.parametrize(("checkpointing", "lora_r"), [(0, 0), (1, 0), (0, 2)])
def test_a_cpu_run_logs_the_hand_count_of_its_rows(tmp_path: Path, checkpointing: int, lora_r: int) -> None:
    summary = train(TrainConfig(**rows_folder(tmp_path), grad_checkpointing=checkpointing, lora_r=lora_r))
    dense, attention = DENSE, ATTENTION
    if lora_r:  # frozen weights 4 x, the adapters (rank 2 on every linear layer: 2 x (in + out)) 6 x
        adapters = 2 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) * 2 + (128 + 64))  # 2,048
        dense = 4 * LAYER * 2 * 16 + 6 * adapters * 2 * 16 + 4 * 4096 * 64 * 13
    recompute = checkpointing * 2 * (2 * LAYER * 16 + 4 * 4 * 16 * 57)
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    seconds = record["step_time_s"]
    assert record["tflops"] * 1e12 * seconds == pytest.approx(dense + attention, rel=1e-9)
    assert record["mfu"] * 1e12 * seconds == pytest.approx(dense + attention, rel=1e-9)
    assert record["hfu"] * 1e12 * seconds == pytest.approx(dense + attention + recompute, rel=1e-9)
    assert record["attn_flop_share"] == pytest.approx(attention / (dense + attention), rel=1e-12)
    # the summary's figures are over the whole run's time, of the same FLOPs
    assert summary["mfu"] * 1e12 * summary["elapsed_s"] == pytest.approx(dense + attention, rel=1e-6)
    assert summary["attn_flop_share"] == record["attn_flop_share"]


def test_pack_report_on_a_run_shows_its_flop_rates(tmp_path: Path) -> None:
    """pack-report RUN prints the run's TFLOP/s, MFU, HFU and attention share (summary.json), as
    pack-train's summary did; a value of another type in them is one line."""
    from click.testing import CliRunner

    from pipeline.cli import pack_report
    from pipeline.report.flops import rates_line

    summary = train(TrainConfig(**rows_folder(tmp_path)))
    result = CliRunner().invoke(pack_report, [str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert f"compute         {rates_line(summary)}" in result.output
    assert f"attention {100 * ATTENTION / (DENSE + ATTENTION):.1f}% of the model FLOPs" in result.output
    got = json.loads((tmp_path / "r.json").read_text())["flops"]
    assert got == {
        "mfu": summary["mfu"],
        "tflops": summary["tflops"],
        "hfu": summary["hfu"],
        "attn_flop_share": summary["attn_flop_share"],
        "over": "run",
    }
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    (tmp_path / "run" / "summary.json").write_text(json.dumps({**saved, "tflops": "fast"}))
    result = CliRunner().invoke(pack_report, [str(tmp_path / "run")])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "the run folder is damaged" in result.output


def _train_rank(rank: int, world: int, config: dict) -> dict:
    return train(TrainConfig(**config))


@pytest.mark.slow
def test_context_parallel_ranks_count_the_rows_once(tmp_path: Path) -> None:
    """Two gloo ranks sharing each row (--context-parallel 2): the FLOPs over both devices are the
    hand count of the rows, not twice it."""
    from gloo_ranks import run_on_ranks

    config = {**rows_folder(tmp_path), "context_parallel": 2, "attn": "sdpa"}
    ranks = run_on_ranks(_train_rank, 2, args=(config,), deadline_s=300)
    s = ranks[0]
    assert s["tflops"] * 1e12 * 2 * s["elapsed_s"] == pytest.approx(DENSE + ATTENTION, rel=1e-6)
    assert s["mfu"] * 2e12 * s["elapsed_s"] == pytest.approx(DENSE + ATTENTION, rel=1e-6)
    assert s["attn_flop_share"] == pytest.approx(ATTENTION / (DENSE + ATTENTION), rel=1e-9)


def test_a_mixture_of_experts_counts_the_experts_a_token_uses() -> None:
    """Mixtral with 4 experts, 2 a token: half the experts' weights count, the router and attention whole."""
    model = tiny(
        transformers.MixtralConfig,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    shape = model_shape(model, TrainConfig(data="d", model="m", out="o"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    everything = sum(p.numel() for p in model.model.layers[0].parameters())
    assert experts > 0 and shape.layers[0].params == everything - experts // 2


@pytest.mark.parametrize(
    "checkpointing,tile,lengths",
    [(1, 8, [5, 9, 3, 15]), (1, 8, [5, 9, 3, 16]), (1, 64, [5, 9, 3, 15]), (0, 8, [5, 9, 3, 15]), (1, 0, [5, 9, 3, 15]), (0, 0, [32])],
)
def test_recompute_counts_the_mlp_tokens_the_backward_runs(checkpointing: int, tile: int, lengths: list[int]) -> None:
    """One forward + backward of a packed row through the tiny model: the tokens each layer's MLP
    runs over beyond the forward's are what the count's recompute says (--grad-checkpointing with and
    without --tile-mlp, a row of whole tiles and one with a short last tile, a row shorter than a
    tile)."""
    from trainer.data.batch import collate_rows
    from trainer.model.load import build_model, decoder_layers, enable_grad_checkpointing
    from trainer.model.long_rows import layer_mlp, tile_mlp
    from trainer.model.loss import packed_loss

    model, _ = build_model("tiny", attn="sdpa", seed=0)
    if checkpointing:
        enable_grad_checkpointing(model)
    layers = decoder_layers(model)
    ran = [0]
    for layer in layers:
        mlp = layer_mlp(layer)
        whole = mlp.forward
        mlp.forward = lambda hidden, *a, _whole=whole, **k: (ran.__setitem__(0, ran[0] + hidden.shape[-2]), _whole(hidden, *a, **k))[1]
    if tile:
        tile_mlp(layers, tile)
    tokens = sum(lengths)
    ids = np.arange(1, tokens + 1, dtype=np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    row = dict(input_ids=ids, labels=ids.copy(), position_ids=positions, seq_lens=np.array(lengths, np.int32))
    total, _ = packed_loss(model, collate_rows([row]))
    total.backward()
    again = ran[0] / len(layers) - tokens  # tokens through each MLP beyond the forward's
    layer = LayerShape(params=10, heads=0, head_dim=0, mlp_params=10, recompute=bool(checkpointing))
    counted = step_flops(ModelShape(layers=(layer,), head_params=0, tiled_mlp=tile), np.zeros(0), tokens=tokens).recompute
    assert counted == 2 * 10 * again
    assert again > 0 or not (checkpointing or tile)  # control: something runs again where asked
