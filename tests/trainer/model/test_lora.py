"""trainer.model.lora: LoRA adapters (peft) on packed rows.

- packed LoRA gives every example the loss it has alone and the adapter gradients of the examples
  run one by one (float32), with a negative control;
- pack-train --lora-r trains and saves only the adapter, which reloads with peft and reproduces the
  merged model; --resume continues it bitwise on the CPU.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parents[2]))
from gloo_ranks import train_on_two_ranks  # noqa: E402
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.batch import collate_rows  # noqa: E402
from trainer.model.load import build_model, load_model  # noqa: E402
from trainer.model.lora import add_lora  # noqa: E402
from trainer.model.loss import per_example_losses  # noqa: E402

VOCAB = 300

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora")
    lengths = np.random.default_rng(0).integers(4, 40, size=40).tolist()
    make_packed_folder(
        folder, pack_lengths(lengths, 64, vocab=VOCAB), 64, tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB}
    )
    return folder


def _lora_model(r: int = 4, name: str = "tiny"):
    model, _ = build_model(name, attn="sdpa", vocab_size=VOCAB, seed=0)
    peft = add_lora(model, TrainConfig(data="x", model=name, out="y", lora_r=r))
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero (A's gradient would be zero too): make both matter
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    return model, peft


def _rows(lengths: list[int]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    rows = []
    for n in lengths:
        ids = rng.integers(3, VOCAB, n).astype(np.int32)
        labels = ids.copy()
        labels[0] = -100
        rows.append(
            {"input_ids": ids, "labels": labels, "position_ids": np.arange(n, dtype=np.int32), "seq_lens": np.array([n], dtype=np.int32)}
        )
    return rows


def _lora_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for n, p in model.named_parameters() if p.requires_grad])


def test_packed_lora_matches_each_example_alone(packed: Path):
    model, _ = _lora_model()
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    rows = _rows([9, 17, 5, 30])
    batch = collate_rows(rows)
    losses = per_example_losses(model, batch)
    (losses * torch.tensor([r["labels"][1:].size for r in rows], dtype=torch.float32)).sum().backward()
    packed_grads = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    alone = []
    for row in rows:
        loss = per_example_losses(model, collate_rows([row]))[0]
        alone.append(float(loss.detach()))
        (loss * (row["labels"][1:].size)).backward()  # grads accumulate: the sum over examples
    torch.testing.assert_close(losses.detach(), torch.tensor(alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_grads, _lora_grads(model), rtol=1e-4, atol=1e-6)
    assert packed_grads.abs().sum() > 0

    # negative control: the first two examples run as one sequence (their boundary lost): the second
    # one's tokens see the first, and the loss is no longer the token mean of the two alone
    merged = {k: np.concatenate([rows[0][k], rows[1][k]]) for k in ("input_ids", "labels")}
    merged.update(position_ids=np.arange(26, dtype=np.int32), seq_lens=np.array([26], dtype=np.int32))
    with torch.no_grad():
        joined = float(per_example_losses(model, collate_rows([merged]))[0])
    assert abs(joined - (alone[0] * 8 + alone[1] * 16) / 24) > 1e-4


def _config(packed: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(packed),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        grad_accum=1,
        lr=5e-3,
        max_steps=4,
        log_every=1,
        num_workers=0,
        progress=False,
        lora_r=4,
        attn="sdpa",
    )
    return TrainConfig(**{**base, **kw})


def test_lora_target_names_get_adapters_and_only_they():
    """Negative control of the refused unknown name: every name given gets adapters, nothing else does."""
    model, _ = build_model("tiny", attn="sdpa", vocab_size=VOCAB, seed=0)
    add_lora(model, TrainConfig(data="x", model="tiny", out="y", lora_r=2, lora_target="q_proj, v_proj"))
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A" in name}
    assert adapted == {"q_proj", "v_proj"}


def test_pack_train_saves_only_the_adapter_which_reloads_with_peft(packed: Path, tmp_path: Path):
    from peft import PeftModel

    summary = train(_config(packed, tmp_path / "run", merge_lora=True))
    saved = Path(summary["checkpoint"]) / "model"
    assert (saved / "adapter_model.safetensors").is_file() and (saved / "adapter_config.json").is_file()
    assert not list(saved.glob("model*.safetensors"))  # no base weights in the checkpoints
    base = load_model("tiny", vocab_size=VOCAB, seed=0).eval()
    reloaded = PeftModel.from_pretrained(base, saved).eval()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(summary["merged_model"]).eval()
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        fresh = load_model("tiny", vocab_size=VOCAB, seed=0).eval()
        assert not torch.allclose(fresh(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)  # it trained


# bf16-weights: the adapters' fp32 masters; qlora: the NF4 base, quantized anew on resume
@pytest.mark.parametrize("dtype", ["auto", "bf16-weights", "qlora"])
def test_resume_with_lora_and_eval_is_bitwise(packed: Path, tmp_path: Path, dtype: str, request: pytest.FixtureRequest):
    from safetensors.torch import load_file

    lengths = np.random.default_rng(1).integers(4, 40, size=12).tolist()  # a held-out folder of other rows
    make_packed_folder(
        tmp_path / "held",
        pack_lengths(lengths, 64, vocab=VOCAB, seed=1),
        64,
        tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB},
    )
    held = dict(eval_data=str(tmp_path / "held"), eval_every=1, dtype=dtype)
    if dtype == "qlora":
        held.update(dtype="auto", qlora=True, model=str(request.getfixturevalue("nf4_model_folder")))
    full = train(_config(packed, tmp_path / "full", **held))
    train(_config(packed, tmp_path / "part", stop_at=2, **held))
    rest = train(_config(packed, tmp_path / "part", resume="newest", **held))
    a = load_file(str(Path(full["checkpoint"]) / "model" / "adapter_model.safetensors"))
    b = load_file(str(Path(rest["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.float32}  # with bf16-weights too: the masters are saved
    lines = lambda run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    losses = lambda run, key: [r[key] for r in lines(run) if key in r]  # noqa: E731
    assert losses(tmp_path / "full", "loss") == losses(tmp_path / "part", "loss")
    assert losses(tmp_path / "full", "eval_loss") == losses(tmp_path / "part", "eval_loss")
    assert len(losses(tmp_path / "full", "eval_loss")) == 4 and full["eval_loss"] == rest["eval_loss"]


def test_a_bf16_lora_base_is_loaded_and_frozen_on_the_cpu_before_it_moves(packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Under bf16 a LoRA base is loaded, proven, given its adapters and frozen in bf16 on the CPU, and
    only then moved to the device, so its fp32 weights never occupy the device; other runs load on
    the device. What moves: a bf16 base, fp32 adapters, fp32 rotary frequencies."""
    from trainer.run import start

    gpu = torch.device("cuda", 0)  # only compared, never used
    assert start.load_device(_config(packed, tmp_path, dtype="bf16"), gpu, bf16=True) == torch.device("cpu")
    assert start.load_device(_config(packed, tmp_path, lora_r=0), gpu, bf16=True) == gpu  # full fine-tune
    assert start.load_device(_config(packed, tmp_path, dtype="fp32"), gpu, bf16=False) == gpu  # fp32 LoRA

    real_freeze, seen = start.freeze_in_bf16, {}

    def freeze(model):
        real_freeze(model)
        seen.update(model=model, dtypes={("adapter" if "lora_" in n else "base"): p.dtype for n, p in model.named_parameters()})

    monkeypatch.setattr(start, "freeze_in_bf16", freeze)
    monkeypatch.setattr(start, "_wrap", lambda model, *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        train(_config(packed, tmp_path / "run", dtype="bf16", device="cpu"))
    assert seen["dtypes"] == {"base": torch.bfloat16, "adapter": torch.float32}
    assert {b.dtype for n, b in seen["model"].named_buffers() if "inv_freq" in n} == {torch.float32}


def test_bad_lora_options_are_one_line(packed: Path, tmp_path: Path):
    with pytest.raises(UserError, match="merge_lora=True needs lora_r"):
        train(_config(packed, tmp_path / "a", lora_r=0, merge_lora=True))
    with pytest.raises(UserError, match="lora_target nope"):
        train(_config(packed, tmp_path / "b", lora_target="nope"))
    with pytest.raises(
        UserError,
        match=r"lora_target q_proj,bogus_proj: the model has no module named 'bogus_proj' "
        r"\(its linear layers: .*q_proj",
    ):
        train(_config(packed, tmp_path / "b2", lora_target="q_proj,bogus_proj"))  # peft alone adapts q_proj only
    assert not (tmp_path / "b2").exists()
    train(_config(packed, tmp_path / "c", lora_r=0, stop_at=1))  # a full fine-tune, resumed with an adapter
    with pytest.raises(UserError, match="it was trained with lora_r 0 but this run has lora_r 4"):
        train(_config(packed, tmp_path / "c", resume="newest"))
    assert replace(_config(packed, tmp_path), lora_r=2).lora_r == 2


@pytest.mark.parametrize("qlora", [False, True])
def test_lora_under_ddp_matches_one_process_with_the_same_window(packed: Path, tmp_path: Path, qlora: bool, request: pytest.FixtureRequest):
    """Two gloo ranks of one micro-batch each per step: the same losses and adapter as one process
    accumulating both micro-batches; with --qlora too (DDP does not broadcast the frozen NF4 base,
    which every rank builds the same)."""
    from safetensors.torch import load_file

    model = str(request.getfixturevalue("nf4_model_folder")) if qlora else "tiny"
    config = _config(packed, tmp_path / "ddp", max_steps=3, model=model, qlora=qlora)
    train_on_two_ranks(config, tmp_path)
    single = train(replace(config, out=str(tmp_path / "single"), grad_accum=2))
    losses = lambda run: [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)
    ddp = json.loads((tmp_path / "rank0.json").read_text())
    a = load_file(str(Path(ddp["checkpoint"]) / "model" / "adapter_model.safetensors"))
    b = load_file(str(Path(single["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_bf16_keeps_the_frozen_base_in_bf16_and_the_adapters_in_fp32(packed: Path, tmp_path: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    summary = train(_config(packed, tmp_path / "bf16", dtype="bf16", max_steps=2, merge_lora=True))
    adapter = load_file(str(Path(summary["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    merged = AutoModelForCausalLM.from_pretrained(summary["merged_model"], dtype="auto")
    assert merged.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert np.isfinite(summary["final_loss"])


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example losses of `batch` and the adapter gradients of their sum (float32)."""
    model.zero_grad(set_to_none=True)
    losses = per_example_losses(model, batch)
    losses.sum().backward()
    return losses.detach(), _lora_grads(model)


# ---- QLoRA (--qlora): the frozen base's decoder linear layers in torchao's 4-bit NF4


@pytest.fixture(scope="module")
def nf4_model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama whose every decoder weight NF4 can hold (a multiple of 64 x 256 values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao.quantization")
    folder = tmp_path_factory.mktemp("nf4-model")
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _qlora_model(folder: Path):
    from trainer.model.load import decoder_layers
    from trainer.model.lora import quantize_base_nf4

    model, peft = _lora_model(name=str(folder))
    assert quantize_base_nf4(decoder_layers(model)) == (14, 0)  # 2 layers x 7 projections
    return model


def test_qlora_stores_the_base_in_a_quarter_of_bf16_and_computes_with_its_dequantized_weights(nf4_model_folder):
    from trainer.model.lora import NF4Linear, dequantize_base

    model = _qlora_model(nf4_model_folder)
    base = [m for m in model.modules() if isinstance(m, NF4Linear)]
    stored = sum(
        sum(t.numel() * t.element_size() for t in (m.weight.quantized_data, m.weight.quantized_scalers, m.weight.quantization_factor))
        for m in base
    )
    assert stored < 0.26 * sum(m.weight.numel() * 2 for m in base)  # bf16: 2 bytes a weight
    assert all(type(m.lora_A["default"]) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))

    # the same losses and adapter gradients as LoRA over the dequantized base (float32)
    reference = copy.deepcopy(model)
    dequantize_base(reference)
    assert not any(isinstance(m, NF4Linear) for m in reference.modules())
    batch = collate_rows(_rows([9, 17, 5, 30]))
    q, ref = _loss_and_grads(model, batch), _loss_and_grads(reference, batch)
    torch.testing.assert_close(q[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q[1], ref[1], rtol=1e-5, atol=1e-7)
    # negative control: the unquantized base is a different model (NF4 rounds its weights)
    unquantized, _ = _lora_model(name=str(nf4_model_folder))
    assert (_loss_and_grads(unquantized, batch)[0] - q[0]).abs().max() > 1e-4


def test_packed_qlora_matches_each_example_alone(nf4_model_folder):
    model = _qlora_model(nf4_model_folder)
    rows = _rows([9, 17, 5, 30])
    packed_losses, packed_grads = _loss_and_grads(model, collate_rows(rows))
    alone = [_loss_and_grads(model, collate_rows([row])) for row in rows]
    torch.testing.assert_close(packed_losses, torch.cat([a[0] for a in alone]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_grads, sum(a[1] for a in alone), rtol=1e-4, atol=1e-6)


def test_pack_train_qlora_trains_saves_the_adapter_and_merges_into_the_dequantized_base(
    packed: Path, tmp_path: Path, nf4_model_folder: Path, capsys: pytest.CaptureFixture
):
    from safetensors.torch import load_file

    summary = train(_config(packed, tmp_path / "run", model=str(nf4_model_folder), qlora=True, merge_lora=True, max_steps=3))
    assert "--qlora: 14 linear layers of the decoder stored in 4-bit NF4" in capsys.readouterr().err
    assert np.isfinite(summary["final_loss"])
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-00000003" / "model" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    merged = load_model(str(tmp_path / "run" / "merged"), vocab_size=VOCAB)
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # plain weights again


def test_bad_qlora_options_are_one_line(packed: Path, tmp_path: Path):
    with pytest.raises(UserError, match="qlora=True needs lora_r"):
        train(_config(packed, tmp_path / "a", lora_r=0, qlora=True))
    with pytest.raises(UserError, match="qlora=True and dtype fp8 both"):
        train(_config(packed, tmp_path / "b", qlora=True, dtype="fp8"))
    with pytest.raises(UserError, match=r"none of the decoder's 14 linear layers has a weight NF4 can store"):
        train(_config(packed, tmp_path / "c", qlora=True))  # the tiny preset's 64-wide layers
    assert not (tmp_path / "c").exists()


def test_a_qlora_layer_compiles_as_one_graph_with_the_eager_numbers(nf4_model_folder):
    """pack-train compiles each decoder layer on a GPU: torchao's NF4 weight and its linear_nf4
    trace into one graph (dynamic shapes) and give what the eager layer gives."""
    from trainer.model.load import decoder_layers

    mlp = decoder_layers(_qlora_model(nf4_model_folder))[0].mlp
    compiled = torch.compile(mlp, dynamic=True, fullgraph=True)
    for n in (37, 50):
        x = torch.randn(1, n, 256)
        torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, -8.0, float("nan")])
def test_a_lora_alpha_that_scales_the_adapter_to_nothing_is_refused(packed: Path, tmp_path: Path, alpha: float):
    with pytest.raises(UserError, match=r"^lora_alpha must be (> 0|a number), got"):
        train(_config(packed, tmp_path / "run", lora_alpha=alpha))
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "change, flag", [({"lora_alpha": 32.0}, "lora_alpha 16.0"), ({"lora_r": 8}, "lora_r 4"), ({"lora_target": "q_proj"}, "lora_target all")]
)
def test_resuming_a_lora_run_with_another_adapter_option_is_one_line(packed: Path, tmp_path: Path, change: dict, flag: str):
    train(_config(packed, tmp_path / "run", stop_at=2))
    with pytest.raises(UserError) as err:
        train(_config(packed, tmp_path / "run", resume="newest", **change))
    line = str(err.value)
    assert "\n" not in line and f"it was trained with {flag} but this run has" in line, line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-00000002"]
