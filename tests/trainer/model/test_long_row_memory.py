"""Memory for long rows (`trainer.model.long_rows`): the MLP in tiles computes exactly what it does whole,
and a run with tiles and offloaded activations logs the losses of one without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fake_cudart import FakeCudart
from families import FAMILIES, TINY, examples
from packed_factory import make_packed_folder, pack_lengths
from run_metrics import logged_losses

from pipeline.errors import UserError
from trainer import TrainConfig, train
from trainer.data.batch import collate_flat
from trainer.model.load import decoder_layers, enable_grad_checkpointing, prepare
from trainer.model.long_rows import HostOffload, layer_mlp, offload_activations, tile_mlp
from trainer.model.loss import packed_loss


def _row():
    data = examples()
    lengths = np.array([len(d[0]) for d in data])
    return collate_flat(
        np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data]), np.concatenate([np.arange(n) for n in lengths]), lengths
    )


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss, _ = packed_loss(model, batch)
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3"])
def test_tiled_mlp_computes_what_the_whole_does(name: str) -> None:
    """Loss and gradients of a 108-token row with the MLP in 16-token tiles equal the whole MLP's
    (float32, within 1e-5 of each gradient's largest entry), and the MLP really runs in tiles: 7 calls per layer per forward, and as many again
    when the backward recomputes them."""
    family = next(f for f in FAMILIES if f.name == name)
    model = family.build().eval()
    prepare(model, "sdpa", "cpu")
    model.eval()
    batch = _row()
    want_loss, want = _loss_and_grads(model, batch)
    layers = decoder_layers(model)
    calls = []
    for layer in layers:
        inner = layer_mlp(layer)
        for module in inner.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, a, o, seen=calls: seen.append(a[0].shape[-2]))
                break
    tile_mlp(layers, 16)
    tile_mlp(layers, 16)  # idempotent
    got_loss, got = _loss_and_grads(model, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for a, b in zip(got, want):  # the weight gradients sum the tokens in another order: rounding
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert max(calls) == 16 and len(calls) == 2 * len(layers) * 7  # forward + recompute, 108 = 6 x 16 + 12


TRAINED = [f.name for f in FAMILIES if not f.refused]


@pytest.mark.parametrize("name", TRAINED)
def test_every_family_tiles_exactly_or_is_refused(name: str) -> None:
    """The family matrix: with --tile-mlp 16 a 108-token row gives the whole MLP's loss and gradients
    (float32, within 1e-5 of each gradient's largest entry), or the family is refused in one line
    (an MLP that is not one module, or one that returns more than its hidden states)."""
    from transformers import CONFIG_MAPPING

    family = next(f for f in FAMILIES if f.name == name)
    if family.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {family.model_type} here")
    model = family.build().eval()
    prepare(model, "sdpa", "cpu")
    model.eval()  # PhiMoE's router samples in training
    batch = _row()
    want_loss, want = _loss_and_grads(model, batch)
    try:
        tile_mlp(decoder_layers(model), 16)
        got_loss, got = _loss_and_grads(model, batch)
    except UserError as exc:
        assert "--tile-mlp" in str(exc) and "\n" not in str(exc)
        return
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-30)


def test_tiled_mlp_refuses_a_layer_without_one() -> None:
    with pytest.raises(UserError, match="has no MLP module"):
        tile_mlp([torch.nn.Linear(2, 2)], 8)
    with pytest.raises(UserError, match="tile's length"):
        tile_mlp([], 0)


def test_offloaded_activations_wait_on_the_cpu() -> None:
    """What the forward saves goes to host memory (HostOffload, counting the bytes moved) and comes
    back for the backward: the gradients are those of the plain forward."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    offload = offload_activations(True, torch.device("cpu"))
    assert isinstance(offload, HostOffload)
    assert not isinstance(offload_activations(False, torch.device("cpu")), HostOffload)
    HostOffload.moved = 0
    with offload:
        y = (x @ w).tanh().sum()
    assert HostOffload.moved == 3 * 64 * 4  # x and w for the matmul, its tanh output for tanh's backward
    y.backward()
    want_x, want_w = torch.autograd.grad((x @ w).tanh().sum(), (x, w))
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(w.grad, want_w)


def test_parameters_and_their_views_stay_where_they_are() -> None:
    """A weight the forward saves (itself, or transposed as a matmul saves it) is not copied out:
    it lives on its device anyway. Its gradients are those of the plain forward; negative control:
    the same weight as a plain tensor is copied."""
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8))
    HostOffload.moved = 0
    with offload_activations(True, torch.device("cpu")):
        y = (x @ w.t()).tanh().sum() + (x * w).sum()
    assert HostOffload.moved == 3 * 64 * 4  # x twice and tanh's output; neither w nor w.t()
    y.backward()
    want_x, want_w = torch.autograd.grad((x @ w.t()).tanh().sum() + (x * w).sum(), (x, w))
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(w.grad, want_w)
    plain = w.detach().clone().requires_grad_()
    HostOffload.moved = 0
    with offload_activations(True, torch.device("cpu")):
        (x @ plain.t()).sum().backward()
    assert HostOffload.moved == 2 * 64 * 4


def _moved(layers: int, tokens: int, checkpointed: bool = True) -> int:
    """Bytes the forward of one `tokens`-token example through a tiny float32 Llama of `layers`
    decoder layers moves to the host (every layer recomputed, or none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    prepare(model, "sdpa", "cpu")
    if checkpointed:
        enable_grad_checkpointing(model)
    ids = np.arange(tokens) % 200 + 3
    batch = collate_flat(ids, ids, np.arange(tokens), np.array([tokens]))
    HostOffload.moved = 0
    with offload_activations(True, torch.device("cpu")):
        loss, _ = packed_loss(model, batch)
    moved = HostOffload.moved
    loss.backward()
    return moved


def test_with_every_layer_recomputed_a_layer_offloads_its_input_alone() -> None:
    """The count the memory check reads: two more checkpointed decoder layers move exactly two more
    [T, hidden] float32 inputs (T x 64 x 4 bytes each), at any T; the loss and the final norm move
    the same whatever the depth. Negative control: without recomputation two more layers move
    several times that (every activation they save)."""
    for tokens in (40, 96):
        assert _moved(4, tokens) - _moved(2, tokens) == 2 * tokens * 64 * 4
    assert _moved(4, 40, checkpointed=False) - _moved(2, 40, checkpointed=False) > 4 * 2 * 40 * 64 * 4


def _backward_fetches(monkeypatch: pytest.MonkeyPatch, prefetch: bool) -> tuple[list[tuple[int, bool]], int, int, int]:
    """The offloaded backward of a tiny float32 Llama with 4 decoder layers, every one recomputed:
    for each saved tensor the backward asks for, in order, (its size, whether its copy back had
    started before it was asked for); the most bytes waiting copied back ahead of the backward at
    once, as the test counts it and as `HostOffload.ahead` (what the memory check reads) counts it;
    the largest saved tensor. `prefetch=False` turns the read-ahead off (`HostOffload.prefetch`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model import long_rows

    monkeypatch.setattr(HostOffload, "prefetch", prefetch)
    monkeypatch.setattr(HostOffload, "ahead", 0)
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": 4})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    prepare(model, "sdpa", "cpu")
    enable_grad_checkpointing(model)
    ids = np.arange(48) % 200 + 3
    batch = collate_flat(ids, ids, np.arange(48), np.array([48]))
    offload = HostOffload(pin=False)
    saved_all: list = []
    asked: list[tuple[int, bool]] = []
    ahead = [0]

    def pack(tensor: torch.Tensor):
        saved = offload.pack_hook(tensor)
        if isinstance(saved, long_rows._Saved):  # not a parameter, which stays where it is
            saved_all.append(saved)
        return saved

    def unpack(saved):
        if isinstance(saved, long_rows._Saved):
            asked.append((saved.nbytes, saved.back is not None))
        tensor = offload.unpack_hook(saved)
        waiting = sum(s.nbytes for s in saved_all if s.back is not None)
        ahead[0] = max(ahead[0], waiting)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss, _ = packed_loss(model, batch)
    loss.backward()
    return asked, ahead[0], HostOffload.ahead, max(s.nbytes for s in saved_all)


def test_the_backward_starts_copying_back_the_layer_before_it_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the backward takes a layer's offloaded input, the input of the layer before it starts its
    copy back (on a GPU, on the copy stream beside the compute), so every layer input is on its way
    before the backward asks for it (the last layer's when the final norm's tensors are taken); at
    most about one saved tensor's worth waits ahead, and `HostOffload.ahead` counts the most that
    did. Negative control: with the read-ahead off (the memory check's switch) none is started early
    and none is counted."""
    hidden = 48 * 64 * 4  # a layer input: [48, 64] float32
    asked, ahead, counted, largest = _backward_fetches(monkeypatch, prefetch=True)
    inputs = [early for nbytes, early in asked if nbytes == hidden]
    assert len(inputs) >= 4 and all(inputs), asked
    assert hidden <= ahead <= 2 * largest and counted == ahead
    asked, ahead, counted, _ = _backward_fetches(monkeypatch, prefetch=False)
    assert not any(early for _, early in asked) and ahead == counted == 0


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_a_run_with_tiles_and_offloaded_checkpoints_logs_the_same_losses(tmp_path: Path, compiled: bool) -> None:
    """--tile-mlp with --offload-activations logs the losses of a plain run, in eager and in compiled
    LoRA layers (where the tiled MLP is a graph break: torch 2.11's dynamo failed to trace its
    checkpoint there)."""
    folder = tmp_path / "data"
    lengths = np.random.default_rng(2).integers(20, 200, size=24).tolist()
    make_packed_folder(folder, pack_lengths(lengths, 256, vocab=300), 256)
    base = dict(
        data=str(folder),
        model="tiny",
        tokens_per_step=256,
        lr=1e-3,
        max_steps=3,
        log_every=1,
        num_workers=0,
        progress=False,
        grad_checkpointing=1,
        lora_r=8 if compiled else 0,
    )
    train(TrainConfig(**base, out=str(tmp_path / "plain")))
    train(TrainConfig(**base, out=str(tmp_path / "long"), tile_mlp=32, offload_activations=True, compile=compiled))

    assert logged_losses(tmp_path / "long") == pytest.approx(logged_losses(tmp_path / "plain"), rel=1e-5)


def _pinned_host(monkeypatch: pytest.MonkeyPatch, exact_from: int) -> tuple[FakeCudart, list[bool]]:
    """No CUDA here: exact pinning registers with a fake driver (blocks of `exact_from` bytes or
    more, into a fresh pool) and torch's pinned allocator hands out pageable memory; returns the fake
    driver and the pin_memory flags torch.empty was called with."""
    from trainer.model import long_rows

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(long_rows, "EXACT_PIN_BYTES", exact_from)
    monkeypatch.setattr(long_rows, "PINNED", long_rows.PinnedBlocks())
    pinned_by_torch: list[bool] = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        pinned_by_torch.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return fake, pinned_by_torch


def _offloaded_step(x: torch.Tensor, w: torch.Tensor) -> list[int]:
    """One forward of (x @ w).sum() under HostOffload(pin=True) and its backward, checked against the
    plain gradients; returns the host addresses its saved tensors (x and w) went to."""
    import gc

    addresses: list[int] = []
    offload = HostOffload(pin=True)

    def pack(tensor: torch.Tensor):
        packed = offload.pack_hook(tensor)
        addresses.append(packed.host.data_ptr())
        return packed

    x.grad = w.grad = None
    HostOffload.moved = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack_hook):
        y = (x @ w).sum()
    y.backward()
    torch.testing.assert_close(x.grad, w.detach().sum(1).expand_as(x))
    torch.testing.assert_close(w.grad, x.detach().sum(0, keepdim=True).T.expand_as(w))
    del y
    gc.collect()
    return addresses


def test_large_offloaded_blocks_are_pinned_at_their_exact_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of EXACT_PIN_BYTES or more are page-locked at their own byte count (not torch's pinned
    allocator's power of two) and come back with the same gradients; smaller blocks take torch's
    pinned allocator (negative control: never registered). A freed block stays registered in the
    pool until the run ends (`PINNED.clear()`), then is unregistered once."""
    from trainer.model import long_rows

    fake, pinned_by_torch = _pinned_host(monkeypatch, exact_from=3 * 64 * 4)
    x = torch.randn(3, 64, requires_grad=True)  # 768 bytes: exact
    w = torch.randn(64, 2, requires_grad=True)  # 512 bytes: torch's pinned allocator
    _offloaded_step(x, w)
    assert sorted(n for _, n in fake.registered) == [768]  # x alone, at its size (1,024 rounded)
    assert pinned_by_torch.count(True) == 1  # w went to torch's pinned allocator
    assert HostOffload.moved == 768 + 512
    assert fake.unregistered == [] and len(long_rows.PINNED.free) == 1  # back in the pool
    long_rows.PINNED.clear()
    import gc

    gc.collect()
    assert fake.unregistered == [fake.registered[0][0]]


def test_the_next_step_copies_into_the_same_pinned_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locking is slow, so each step reuses the blocks the last one freed: three steps of the
    same row register each block once and copy into the same addresses, with the same gradients; two
    tensors saved by one forward never share a block (negative control: they are live together)."""
    fake, _ = _pinned_host(monkeypatch, exact_from=256)
    x = torch.randn(3, 64, requires_grad=True)  # 768 bytes
    w = torch.randn(64, 2, requires_grad=True)  # 512 bytes: both exact
    first = _offloaded_step(x, w)
    assert len(set(first)) == 2 and len(fake.registered) == 2
    for _ in range(2):
        assert sorted(_offloaded_step(x, w)) == sorted(first)
    assert len(fake.registered) == 2 and fake.unregistered == []


def test_a_longer_row_lets_go_of_the_shorter_rows_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose tensor is larger than every free block unregisters those (a shorter row's) and
    registers its own; a shorter step after it reuses the larger block: the pool holds at most what
    the longest step needed."""
    import gc

    from trainer.model import long_rows

    fake, _ = _pinned_host(monkeypatch, exact_from=512)
    w = torch.randn(64, 1, requires_grad=True)  # 256 bytes: torch's pinned allocator
    _offloaded_step(torch.randn(2, 64, requires_grad=True), w)  # x: 512 bytes
    _offloaded_step(torch.randn(4, 64, requires_grad=True), w)  # 1,024: the 512 block goes
    gc.collect()
    assert [n for _, n in fake.registered] == [512, 1024]
    assert fake.unregistered == [fake.registered[0][0]]
    _offloaded_step(torch.randn(3, 64, requires_grad=True), w)  # 768 fits in the 1,024 block
    assert len(fake.registered) == 2
    assert [b.nbytes for b in long_rows.PINNED.free] == [1024]


def test_exact_pinning_refused_by_the_driver_keeps_pageable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where cudaHostRegister fails the block stays ordinary memory (copies synchronous), never lost."""
    from trainer.model.long_rows import pinned_exact

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(refuse=True))
    tensor, locked = pinned_exact(torch.Size([4, 4]), torch.float32)
    assert not locked and tensor.shape == (4, 4) and tensor.dtype == torch.float32
