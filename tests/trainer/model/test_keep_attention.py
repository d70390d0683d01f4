"""`--grad-checkpointing --keep-attention` (trainer.model.keep_attention): recomputed layers keep the
attention kernel's output instead of running it again in the backward. Each example of a packed row
still gets exactly its alone loss and gradients (float32, the sdpa reference on the CPU), the
gradients are the plain checkpoint's bit for bit, the kernel runs once a layer instead of twice, and
the FLOPs count, the option's refusal and the memory check's advice say so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from families import FAMILIES, examples, gradient_error, stock_alone
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.errors import UserError
from pipeline.report.flops import LayerShape, ModelShape, causal_pairs, step_flops
from trainer import TrainConfig
from trainer.config import validate
from trainer.data.batch import collate_flat
from trainer.data.stream import Largest
from trainer.model.keep_attention import ATTENTION_OPS, KeptAttention, op_name
from trainer.model.load import decoder_layers, enable_grad_checkpointing, prepare
from trainer.model.loss import per_example_losses
from trainer.run.fit_check import Need, verdict
from trainer.run.metrics import model_shape

RTOL = 1e-5
GIB = 2**30


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels' forward operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += op_name(func) in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def _family(name: str):
    return next(f for f in FAMILIES if f.name == name)


def _packed(data, boundaries: bool = True):
    """One packed row of `data`'s examples (`boundaries` False: one example spanning the row, the leak
    a negative control needs)."""
    ids = np.concatenate([d[0] for d in data])
    labels = np.concatenate([d[1] for d in data])
    lengths = np.array([len(d[0]) for d in data]) if boundaries else np.array([len(ids)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    return collate_flat(ids, labels, positions, lengths)


def _checkpointed(name: str, keep: KeptAttention | None):
    model = _family(name).build()
    prepare(model, "sdpa")
    model.train()
    enable_grad_checkpointing(model, keep=keep)
    return model


def _example_grads(model, batch, n: int) -> list[list[torch.Tensor]]:
    """The gradients of each of the `n` examples' mean losses in one packed row, a forward each (a
    region under selective checkpointing goes backward once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(n):
        grads = torch.autograd.grad(per_example_losses(model, batch)[i], params, allow_unused=True)
        out.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    return out


def _worst(packed: list[list[torch.Tensor]], alone: list[list[torch.Tensor]]) -> float:
    """The largest `gradient_error` over the examples."""
    return max(gradient_error(p, a)[0] for p, a in zip(packed, alone))


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "llama4"])
def test_each_example_gets_its_alone_gradients_with_attention_kept(name: str) -> None:
    """Plain causal, grouped heads with q/k norms, a sliding window, chunked attention: under
    --keep-attention each example of the packed row gets the gradients it gets alone. Control: the
    same row without its boundaries (attention across examples) is far off."""
    data = examples()
    keep = KeptAttention()
    model = _checkpointed(name, keep)
    alone = stock_alone(_family(name).build(), data)[1]
    assert _worst(_example_grads(model, _packed(data), len(data)), alone) <= RTOL
    assert keep.kept > 0
    leaked = _example_grads(model, _packed(data, boundaries=False), 1)
    assert _worst(leaked, alone[:1]) > 100 * RTOL  # negative control: the comparison sees a leak


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_kept_gradients_are_the_plain_checkpoints_bit_for_bit(name: str) -> None:
    """The recompute takes the very tensors the forward made, so the gradients equal those of the
    plain checkpoint exactly, also where the kernel is written out (gemma2's soft-capping, gpt-oss's
    sinks): there nothing is kept (`kept` 0, which pack-train reports). On one thread: a CPU matmul
    library may take fewer threads on a busy machine, which changes its sums' order and their last
    bits from one call to the next."""
    batch = _packed(examples())
    grads = []
    keep = KeptAttention()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in (_checkpointed(name, None), _checkpointed(name, keep)):
            per_example_losses(model, batch).sum().backward()
            grads.append([p.grad for p in model.parameters() if p.grad is not None])
    finally:
        torch.set_num_threads(threads)
    assert len(grads[0]) == len(grads[1]) > 0
    for plain, kept in zip(*grads):
        torch.testing.assert_close(kept, plain, rtol=0, atol=0)
    assert (keep.kept == 0) == (name in ("gemma2", "gpt_oss"))


def test_the_backward_does_not_run_attention_again() -> None:
    """One forward + backward of a packed row: with --keep-attention the attention kernel runs once a
    layer; the plain checkpoint runs it twice (control), as does no checkpoint once."""
    batch = _packed(examples())
    counts = {}
    for label, keep in (("plain", None), ("kept", KeptAttention())):
        model = _checkpointed("llama", keep)
        with AttentionCalls() as calls:
            per_example_losses(model, batch).sum().backward()
        counts[label] = calls.calls
    layers = len(decoder_layers(_family("llama").build()))
    assert counts == {"plain": 2 * layers, "kept": layers}


def _fa4_layers(name: str, keep: KeptAttention | None, compiled: bool):
    """`_checkpointed` in bf16 on the "fa4" kernel (faked on the CPU: `fake_fa4`), its layers compiled
    or not."""
    from trainer.attention import backend, positions
    from trainer.model.load import compile_decoder_layers
    from trainer.model.loss import find_decoder

    model = _family(name).build().to(torch.bfloat16)
    positions.install(model, find_decoder(model))
    backend.install(model, "fa4")
    model.train()
    enable_grad_checkpointing(model, keep=keep)
    if compiled:
        compile_decoder_layers(model)
    return model


@pytest.mark.usefixtures("one_thread")
def test_compiled_layers_keep_attention_too(monkeypatch) -> None:
    """--compile --grad-checkpointing --keep-attention: torch.compile traces each recomputed layer
    with the policy (a checkpoint's `context_fn` must be a plain function for it to), and the
    compiled backward does not run attention's forward again: the FlashAttention-4 custom op (its
    kernel faked on the CPU, bf16) runs once a layer a step, twice in the compiled plain checkpoint
    and in the eager one (controls). The gradients are the compiled plain checkpoint's bit for bit."""
    from fake_fa4 import fake_fa4

    calls: list[dict] = []
    fake_fa4(monkeypatch, calls)
    batch = _packed(examples())
    counts, grads = {}, {}
    for label, keep, compiled in (("eager", None, False), ("compiled", None, True), ("kept", KeptAttention(), True)):
        torch._dynamo.reset()
        model = _fa4_layers("llama", keep, compiled)
        per_example_losses(model, batch).sum().backward()  # the first step compiles
        model.zero_grad()
        calls.clear()
        per_example_losses(model, batch).sum().backward()
        counts[label] = len(calls)
        grads[label] = [p.grad for p in model.parameters() if p.grad is not None]
    torch._dynamo.reset()
    layers = len(decoder_layers(_family("llama").build()))
    assert counts == {"eager": 2 * layers, "compiled": 2 * layers, "kept": layers}
    assert len(grads["kept"]) == len(grads["compiled"]) > 0
    for kept, plain in zip(grads["kept"], grads["compiled"]):
        torch.testing.assert_close(kept, plain, rtol=0, atol=0)


def test_the_policy_keeps_only_attention() -> None:
    """A checkpointed function of attention and other operators: attention's output is kept, the
    others recomputed; written-out attention (matmul, softmax) keeps nothing."""
    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def fused(x):
        return F.scaled_dot_product_attention(x * 2, x, x, is_causal=True).sin()

    def written_out(x):
        scores = (x * 2) @ x.transpose(-1, -2)
        return torch.softmax(scores.masked_fill(torch.ones(8, 8).triu(1).bool(), -1e9), -1) @ x

    from trainer.model.keep_attention import checkpoint_kwargs

    for fn, kept in ((fused, 1), (written_out, 0)):
        keep = KeptAttention()
        with AttentionCalls() as calls:
            torch.utils.checkpoint.checkpoint(fn, q, **checkpoint_kwargs(keep)).sum().backward()
        assert keep.kept == kept and calls.calls == kept  # kept: not run again in the backward


def test_hardware_flops_leave_out_the_kept_attention_forward() -> None:
    """Hand count: one recomputed layer of 2 heads of dim 4, 100 weights, examples [3, 5] and [8]
    (57 causal pairs): the recompute is 2 x 100 x 16 = 3,200 dense FLOPs plus attention's forward
    4 x 2 x 4 x 57 = 1,824, which --keep-attention does not run again; model FLOPs are the same."""
    lengths = [3, 5, 8]
    assert causal_pairs(lengths) == 57

    def flops(kept: bool):
        layer = LayerShape(params=100, heads=2, head_dim=4, recompute=True, recompute_attention=not kept)
        return step_flops(ModelShape(layers=(layer,), head_params=0), lengths)

    plain, kept = flops(False), flops(True)
    assert plain.recompute == 3200 + 1824 and kept.recompute == 3200
    assert plain.model == kept.model == 6 * 100 * 16 + 12 * 2 * 4 * 57


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"data": "packed", "model": "tiny", "out": "run", **kw})


def test_the_run_counts_its_layers_as_keeping_attention() -> None:
    model = _family("llama").build()
    shapes = {keep: model_shape(model, _config(grad_checkpointing=1, keep_attention=keep)) for keep in (False, True)}
    assert all(layer.recompute and layer.recompute_attention for layer in shapes[False].layers)
    assert all(layer.recompute and not layer.recompute_attention for layer in shapes[True].layers)


def test_keep_attention_without_checkpointing_is_refused_in_one_line() -> None:
    with pytest.raises(UserError) as refused:
        validate(_config(keep_attention=True))
    assert str(refused.value) == (
        "--keep-attention keeps attention's output in layers that are recomputed, and without "
        "--grad-checkpointing none is: add --grad-checkpointing, or drop --keep-attention"
    )
    validate(_config(keep_attention=True, grad_checkpointing=2))  # every other layer recomputes: accepted


def test_a_row_that_does_not_fit_is_told_to_drop_keep_attention_first() -> None:
    need = Need(gpu=140 * GIB, host=0, gpu_line=(10 * GIB, 0.25 * 2**20), host_line=(0.0, 0.0), probes=(20480, 40960))
    args = dict(cp_size=1, tokens_per_step=16384, data="packed", tile_mlp=8192, offload=True, checkpointing=1)
    kept, _ = verdict(Largest(524288, "row 0 of x"), need, 0, 80 * GIB, None, keep_attention=True, **args)
    plain, _ = verdict(Largest(524288, "row 0 of x"), need, 0, 80 * GIB, None, **args)
    assert "to train it, drop --keep-attention and use --context-parallel N" in kept
    assert "--keep-attention" not in plain


def test_a_run_with_attention_kept_logs_the_plain_checkpoints_losses(tmp_path, capsys) -> None:
    """pack-train end to end: --grad-checkpointing with and without --keep-attention, the same losses
    step by step; nothing said about keeping nothing (the sdpa kernel's output is kept)."""
    import json

    from packed_factory import random_packed_folder

    from trainer import train

    packed = random_packed_folder(tmp_path / "packed", 64, count=30, low=4, high=40, rows_per_shard=7)
    losses = {}
    for keep in (False, True):
        out = tmp_path / f"run-{keep}"
        config = dict(tokens_per_step=128, max_steps=3, log_every=1, num_workers=0, progress=False, lr=2e-3)
        train(TrainConfig(data=str(packed), model="tiny", out=str(out), grad_checkpointing=1, keep_attention=keep, **config))
        losses[keep] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-6)
    assert "kept nothing" not in capsys.readouterr().err


def _train_rank(rank: int, world: int, config: dict) -> dict:
    from trainer import train

    return train(TrainConfig(**config))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_attention_kept_under_context_parallel_gives_the_single_process_losses(tmp_path, parallel: str) -> None:
    """Each row split over 2 gloo ranks, every layer recomputed with its attention kept (the gathered
    keys' all-gather runs again in the recompute, the kernel does not; under FSDP2 the layer's
    weights are gathered again too): the losses of one process without the option, step by step."""
    from gloo_ranks import run_on_ranks
    from packed_factory import make_packed_folder, pack_lengths
    from run_metrics import logged_losses

    from trainer import train

    lengths = np.random.default_rng(1).integers(3, 200, size=24).tolist()
    make_packed_folder(tmp_path / "long", pack_lengths(lengths, 256, vocab=300), 256, rows_per_shard=5)
    base = dict(
        data=str(tmp_path / "long"),
        model="tiny",
        tokens_per_step=256,
        lr=1e-3,
        warmup=1,
        max_steps=3,
        log_every=1,
        num_workers=0,
        progress=False,
        attn="sdpa",
        grad_checkpointing=1,
    )
    run_on_ranks(
        _train_rank,
        2,
        args=(dict(base, out=str(tmp_path / "cp"), context_parallel=2, keep_attention=True, parallel=parallel),),
        deadline_s=300,
    )
    train(TrainConfig(**base, out=str(tmp_path / "one")))
    got, want = logged_losses(tmp_path / "cp"), logged_losses(tmp_path / "one")
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=1e-5)
