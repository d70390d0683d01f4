"""`--dtype fp8` (trainer.model.fp8): which layers become float8, where it is refused, and the packing
guarantee under each recipe, on torchao's CPU emulation of the float8 arithmetic (the GPU kernels
run the same casts and scales: scripts/bench/bench_precision.py measures them on an H100)."""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchao.float8")

from test_equivalence import alone_loss_sum, n_loss, pack, params_grad  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer.config import TrainConfig, validate  # noqa: E402
from trainer.model import fp8  # noqa: E402
from trainer.model.load import build_model, decoder_layers  # noqa: E402
from trainer.model.loss import per_example_losses  # noqa: E402

LENGTHS = [9, 30, 4, 17]


def _tiny(attn: str = "sdpa") -> torch.nn.Module:
    model, _ = build_model("tiny", attn=attn, dtype=torch.float32, seed=3)
    return model


def _examples() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for n in LENGTHS:
        ids = rng.integers(3, 4096, n)
        labels = ids.copy()
        labels[0] = -100
        out.append((ids, labels))
    return out


def test_only_the_decoders_linear_layers_become_float8_with_the_same_parameters():
    from torchao.float8.float8_linear import Float8Linear

    model = _tiny()
    before = {name: p for name, p in model.named_parameters()}
    n = fp8.to_float8(model, "rowwise_with_gw_hp", decoder_layers(model), emulate=True)
    float8 = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    # 2 layers x (q, k, v, o, gate, up, down); the output head and embeddings stay as they are
    assert n == len(float8) == 14
    assert all(name.startswith("model.layers.") for name in float8)
    assert type(model.lm_head) is torch.nn.Linear
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # checkpoints unchanged


def test_lora_adapters_stay_high_precision_and_their_frozen_base_becomes_float8():
    pytest.importorskip("peft")
    from torchao.float8.float8_linear import Float8Linear

    from trainer.model.lora import add_lora

    model = _tiny()
    add_lora(model, TrainConfig(data="d", model="tiny", out="o", lora_r=4))
    fp8.to_float8(model, "rowwise_with_gw_hp", decoder_layers(model), emulate=True)
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["model.layers.0.self_attn.q_proj.base_layer"] is Float8Linear
    assert kinds["model.layers.0.self_attn.q_proj.lora_A.default"] is torch.nn.Linear


def test_a_dimension_the_float8_matmul_cannot_take_stays_high_precision():
    assert fp8.convertible(torch.nn.Linear(64, 128))
    assert not fp8.convertible(torch.nn.Linear(64, 100))  # 100 is not a multiple of 16
    assert not fp8.convertible(torch.nn.Embedding(10, 16))


def _packed_vs_alone(recipe: str) -> tuple[float, float]:
    """The largest gap between an example's packed and alone loss sum, and between their gradients,
    with both models' decoder linears in float8 (`recipe`, emulated)."""
    model = _tiny()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    for m in (model, reference):
        fp8.to_float8(m, recipe, decoder_layers(m), emulate=True)
    examples = _examples()
    batch = pack(examples)
    means = per_example_losses(model, batch)
    sums = means * torch.tensor([n_loss(e[1]) for e in examples], dtype=torch.float32)
    loss_gap = grad_gap = 0.0
    for i, (ids, labels) in enumerate(examples):
        alone = alone_loss_sum(reference, ids, labels)
        loss_gap = max(loss_gap, float((sums[i] - alone).abs().detach() / alone.abs().detach()))
        for g_packed, g_alone in zip(params_grad(model, sums[i]), params_grad(reference, alone)):
            if g_alone is None:
                continue
            g_packed = torch.zeros_like(g_alone) if g_packed is None else g_packed
            scale = float(g_alone.abs().max()) or 1.0
            grad_gap = max(grad_gap, float((g_packed - g_alone).abs().max()) / scale)
    return loss_gap, grad_gap


def test_rowwise_with_gw_hp_keeps_every_example_as_it_is_alone():
    """Per-token scales and a high-precision weight gradient: packing changes no example's loss or
    gradients (beyond float32 summation order)."""
    loss_gap, grad_gap = _packed_vs_alone("rowwise_with_gw_hp")
    assert loss_gap < 1e-5 and grad_gap < 1e-4


def test_batch_wide_scales_change_an_examples_numbers():
    """Negative control: tensorwise scales over the whole packed row make an example's numbers
    depend on its neighbours: the same comparison fails, which is why pack-train says so when asked
    for a recipe with batch-wide scales."""
    loss_gap, grad_gap = _packed_vs_alone("tensorwise")
    assert loss_gap > 1e-4 and grad_gap > 1e-2
    assert "WARNING" in fp8.recipe_note("tensorwise") and "WARNING" not in fp8.recipe_note("rowwise_with_gw_hp")


def test_fp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    with pytest.raises(UserError, match=r"--dtype fp8 needs an NVIDIA GPU .* this run is on cpu"):
        fp8.check_fp8(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(UserError, match=r"NVIDIA A100 is sm80: use --dtype bf16-weights"):
        fp8.check_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UserError, match=r"needs the torchao package: pip install torchao"):
        fp8.check_fp8(torch.device("cuda", 0))


def test_fp8_options_are_checked():
    with pytest.raises(UserError, match="--dtype fp8 needs --optimizer adamw"):
        validate(TrainConfig(data="d", model="m", out="o", dtype="fp8", optimizer="adafactor"))
    with pytest.raises(UserError, match="unknown --fp8-recipe 'blockwise'"):
        validate(TrainConfig(data="d", model="m", out="o", dtype="fp8", fp8_recipe="blockwise"))
    with pytest.raises(UserError, match="unknown --fp8-recipe"):
        fp8.fp8_config("blockwise")
    config = fp8.fp8_config("tensorwise")
    assert config.pad_inner_dim  # a micro-batch's token count is any number


def test_pack_train_on_cpu_refuses_fp8_in_one_line(tmp_path):
    """The whole stderr of the console command is that one line: no torchao or torch logging from
    the imports that precede it."""
    import subprocess
    import sys

    from packed_factory import make_packed_folder, pack_lengths

    data = tmp_path / "data"
    make_packed_folder(data, pack_lengths([10, 20, 30], 64, vocab=300), 64)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-train'; from trainer.cli import main; main()",
            "--data",
            str(data),
            "--model",
            "tiny",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "1",
            "--dtype",
            "fp8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: --dtype fp8 needs an NVIDIA GPU with float8 tensor cores (sm89 or newer: Ada, Hopper, Blackwell); "
        "this run is on cpu: use --dtype bf16-weights"
    ], proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _emulated_fp8(monkeypatch) -> dict:
    """pack-train's fp8 path on the CPU: the GPU check passes and torchao emulates the float8
    arithmetic; returns what `to_float8` was given and returned."""
    from trainer.run import start

    monkeypatch.setattr(start, "check_fp8", lambda device: None)
    real_config, real_convert, seen = fp8.fp8_config, start.to_float8, {}
    monkeypatch.setattr(fp8, "fp8_config", lambda recipe, emulate=False, fsdp=False: real_config(recipe, emulate=True, fsdp=fsdp))

    def convert(model, recipe, layers, **kwargs):
        seen.update(model=model, recipe=recipe, swapped=real_convert(model, recipe, layers, **kwargs))
        return seen["swapped"]

    monkeypatch.setattr(start, "to_float8", convert)
    return seen


@pytest.mark.usefixtures("one_thread")
def test_pack_train_fp8_trains_float8_layers_over_fp32_masters_and_saves_fp32(tmp_path, monkeypatch):
    """--dtype fp8 in one process: the decoder's linears become float8 after the model is built,
    AdamW keeps fp32 masters (bf16-weights' optimizer), and the checkpoint holds fp32 weights
    under the stock names, loadable by a plain model."""
    from packed_factory import make_packed_folder, pack_lengths
    from safetensors.torch import load_file
    from torchao.float8.float8_linear import Float8Linear

    from trainer import train

    data = tmp_path / "data"
    make_packed_folder(data, pack_lengths(np.random.default_rng(0).integers(4, 40, 30).tolist(), 64, vocab=300), 64)
    seen = _emulated_fp8(monkeypatch)
    config = TrainConfig(
        data=str(data),
        model="tiny",
        out=str(tmp_path / "run"),
        tokens_per_step=128,
        max_steps=2,
        dtype="fp8",
        lr=1e-3,
        num_workers=0,
        progress=False,
        device="cpu",
        log_every=1,
        eval_data="none",
    )
    summary = train(config)
    assert seen["recipe"] == "rowwise_with_gw_hp" and seen["swapped"] == 14
    up = seen["model"].model.layers[0].mlp.up_proj
    assert isinstance(up, Float8Linear) and up.weight.dtype == torch.bfloat16  # bf16 weights over fp32 masters
    assert np.isfinite(summary["final_loss"]) and summary["steps"] == 2
    saved = load_file(str(next((tmp_path / "run" / "checkpoints").glob("step-*")) / "model" / "model.safetensors"))
    assert saved["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32  # the masters, not bf16 copies
    plain, _ = build_model("tiny", attn="sdpa", dtype=torch.float32, seed=3)
    assert saved.keys() == plain.state_dict().keys() - {k for k in plain.state_dict() if "rotary" in k}


@pytest.mark.usefixtures("one_thread")
def test_pack_train_fp8_under_fsdp2_agrees_across_ranks_and_ddp_is_refused(tmp_path, monkeypatch):
    """--dtype fp8 on two gloo ranks (emulated float8): FSDP2 (bf16 parameters over fp32 shards)
    trains the float8 layers and ends with one loss on both ranks. DDP is refused in one line, as
    for bf16-weights: it would average bf16 gradients."""
    from dataclasses import replace

    from gloo_ranks import train_on_two_ranks
    from packed_factory import make_packed_folder, pack_lengths

    data = tmp_path / "data"
    make_packed_folder(data, pack_lengths(np.random.default_rng(1).integers(4, 40, 40).tolist(), 64, vocab=300), 64)
    seen = _emulated_fp8(monkeypatch)  # forked ranks inherit the patches
    config = TrainConfig(
        data=str(data),
        model="tiny",
        out=str(tmp_path / "run"),
        tokens_per_step=128,
        max_steps=2,
        dtype="fp8",
        parallel="fsdp",
        lr=1e-3,
        num_workers=0,
        progress=False,
        device="cpu",
        log_every=1,
        eval_data="none",
    )
    ranks = train_on_two_ranks(config, tmp_path)
    assert seen == {}  # the conversion ran in the ranks, not here
    assert ranks[0]["final_loss"] == ranks[1]["final_loss"] and np.isfinite(ranks[0]["final_loss"])
    assert all(r["steps"] == 2 and r["world_size"] == 2 for r in ranks)
    from trainer.run import start

    with pytest.raises(UserError, match="--dtype fp8 under torchrun needs --parallel fsdp"):
        start._refuse_under_torchrun(replace(config, parallel="ddp"), "fp8")


@pytest.mark.usefixtures("one_thread")
def test_tensorwise_under_fsdp2_all_gathers_float8_weights_and_computes_the_same(tmp_path, monkeypatch):
    """--fp8-recipe tensorwise under FSDP2 (two gloo ranks, emulated float8): the float8 layers'
    weight shards are torchao's float8-all-gather tensors and their scales are refreshed after every
    step; the losses equal those of the same run all-gathering bf16 weights (each weight's one scale
    comes from its whole value either way: equal at step 1 from bf16-exact weights, a bf16 rounding
    apart after). The per-token recipes all-gather bf16 weights."""
    from gloo_ranks import train_on_two_ranks
    from packed_factory import make_packed_folder, pack_lengths

    from trainer.run import loop, start

    assert fp8.float8_all_gather("tensorwise", fsdp=True)
    assert not fp8.float8_all_gather("tensorwise", fsdp=False)
    assert not fp8.float8_all_gather("rowwise_with_gw_hp", fsdp=True)
    assert fp8.fp8_config("tensorwise", fsdp=True).enable_fsdp_float8_all_gather
    assert not fp8.fp8_config("rowwise", fsdp=True).enable_fsdp_float8_all_gather

    data = tmp_path / "data"
    make_packed_folder(data, pack_lengths(np.random.default_rng(2).integers(4, 40, 40).tolist(), 64, vocab=300), 64)
    _emulated_fp8(monkeypatch)
    real_refresh, calls = loop.refresh_fp8_weight_scales, itertools.count()

    def refresh(module):  # leaves a file per rank and step: how many weights all-gather in float8
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        n = sum(isinstance(getattr(p, "_local_tensor", None), WeightWithDynamicFloat8CastTensor) for p in module.parameters())
        Path(tmp_path, f"refresh-{os.getpid()}-{next(calls)}").write_text(str(n))
        real_refresh(module)

    monkeypatch.setattr(loop, "refresh_fp8_weight_scales", refresh)
    real_load = start.load_model

    def bf16_exact(*args, **kwargs):  # initial weights that bf16 holds exactly
        model = real_load(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        return model

    monkeypatch.setattr(start, "load_model", bf16_exact)

    def run(name: str, recipe: str) -> list[dict]:
        config = TrainConfig(
            data=str(data),
            model="tiny",
            out=str(tmp_path / name),
            tokens_per_step=128,
            max_steps=3,
            dtype="fp8",
            fp8_recipe=recipe,
            parallel="fsdp",
            lr=1e-3,
            num_workers=0,
            progress=False,
            device="cpu",
            log_every=1,
            eval_data="none",
        )
        return train_on_two_ranks(config, tmp_path / name)

    gathered = run("fp8-gather", "tensorwise")
    marks = sorted(tmp_path.glob("refresh-*"))
    assert len(marks) == 2 * 3 and {m.read_text() for m in marks} == {"14"}  # every step, 14 float8 weights
    for m in marks:
        m.unlink()
    monkeypatch.setattr(start, "float8_all_gather", lambda recipe, fsdp: False)
    monkeypatch.setattr(fp8, "float8_all_gather", lambda recipe, fsdp: False)
    run("bf16-gather", "tensorwise")
    assert not list(tmp_path.glob("refresh-*"))  # no float8 all-gather, nothing to refresh
    assert gathered[0]["final_loss"] == gathered[1]["final_loss"]
    losses = {
        name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("fp8-gather", "bf16-gather")
    }
    # step 1 from bf16-exact weights: the same float8 weights whether cast from the fp32 shard or its
    # bf16 copy; later steps' fp32 weights round to bf16 first on one side only
    assert losses["fp8-gather"][0] == pytest.approx(losses["bf16-gather"][0], rel=1e-6)
    assert losses["fp8-gather"] == pytest.approx(losses["bf16-gather"], rel=1e-3)
