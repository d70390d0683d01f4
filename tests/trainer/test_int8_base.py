"""--int8-base: the frozen base of a LoRA run stored in int8, one scale per output row (trainer.model.lora).

- an `Int8Linear` computes exactly what an `nn.Linear` with its dequantized weight computes (forward
  and the input's gradient, float32), and not what the float weight computed (the rounding is real);
- only the LoRA adapters get gradients, and the backward keeps no float copy of a base weight
  (negative control: torchao's own int8 weight-only linear does keep one);
- pack-train --int8-base trains, says how many layers are int8, records it in config.json, merges
  into the dequantized base, resumes bitwise only as an --int8-base run, and matches one process
  under DDP; the options it contradicts are refused in one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("torchao.quantization")

sys.path.insert(0, str(Path(__file__).parents[1]))
from gloo_ranks import train_on_two_ranks  # noqa: E402
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.batch import collate_rows  # noqa: E402
from trainer.model.load import build_model, decoder_layers, load_model  # noqa: E402
from trainer.model.lora import Int8Linear, add_lora, dequantize_base, quantize_base_int8  # noqa: E402
from trainer.model.loss import per_example_losses  # noqa: E402

VOCAB = 300
LAYERS = 14  # the tiny preset: 2 decoder layers x 7 projections

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("int8")
    lengths = np.random.default_rng(0).integers(4, 40, size=40).tolist()
    make_packed_folder(
        folder, pack_lengths(lengths, 64, vocab=VOCAB), 64, tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB}
    )
    return folder


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
        int8_base=True,
    )
    return TrainConfig(**{**base, **kw})


def _int8_lora_model():
    """The tiny preset with LoRA adapters (B nonzero, so A gets gradients too) and an int8 base."""
    model, _ = build_model("tiny", attn="sdpa", vocab_size=VOCAB, seed=0)
    add_lora(model, TrainConfig(data="x", model="tiny", out="y", lora_r=4))
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    assert quantize_base_int8(decoder_layers(model)) == LAYERS
    return model


def _batch(lengths: list[int]):
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


def test_an_int8_layer_computes_what_a_linear_with_its_dequantized_weight_computes():
    from torchao.quantization import Int8Tensor, PerRow

    torch.manual_seed(0)
    original = torch.nn.Linear(96, 40, bias=True).requires_grad_(False)
    layer = Int8Linear(original)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (40, 96)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (40, 1)
    # torchao's symmetric int8: each row's scale is its largest magnitude over 127.5
    torch.testing.assert_close(layer.weight_scale[:, 0] * 127.5, original.weight.abs().amax(dim=1))
    reference = layer.dequantized()
    assert type(reference) is torch.nn.Linear and reference.weight.dtype == torch.float32
    # the weight is torchao's int8 weight-only quantization of the original, dequantized
    torch.testing.assert_close(reference.weight, Int8Tensor.from_hp(original.weight, PerRow()).dequantize(), rtol=0, atol=0)

    x = torch.randn(5, 7, 96)
    outputs, grads = [], []
    for module in (layer, reference, original):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        (y * torch.linspace(-1, 1, 40)).sum().backward()
        outputs.append(y.detach())
        grads.append(xi.grad)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    # negative control: the float weight computes something else (the int8 rounding is real)
    assert (outputs[0] - outputs[2]).abs().max() > 1e-4 and (grads[0] - grads[2]).abs().max() > 1e-5


def _saved_float_shapes(model, batch) -> set[tuple[int, ...]]:
    """Shapes of the floating-point tensors the forward of `model` saves for its backward."""
    shapes: set[tuple[int, ...]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            shapes.add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = per_example_losses(model, batch).sum()
    loss.backward()
    return shapes


def test_only_the_adapters_get_gradients_and_the_backward_keeps_no_float_base_weight():
    model = _int8_lora_model()
    base = [m for m in model.modules() if isinstance(m, Int8Linear)]
    weights = {s for m in base for s in (tuple(m.weight.shape), tuple(m.weight.shape)[::-1])}
    batch = collate_rows(_batch([9, 17, 5]))  # 31 tokens: no activation has a weight's shape
    saved = _saved_float_shapes(model, batch)
    assert saved and not saved & weights
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got and all("lora_" in n for n in got)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == got
    assert all(m.weight.grad is None and m.weight_scale.grad is None for m in base)

    # negative control: torchao's own int8 weight-only linear (quantize_) saves a float copy
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    plain, _ = build_model("tiny", attn="sdpa", vocab_size=VOCAB, seed=0)
    plain.requires_grad_(False)
    plain.get_input_embeddings().weight.requires_grad_(True)  # so the decoder's backward runs
    for layer in decoder_layers(plain):
        quantize_(layer, Int8WeightOnlyConfig())
    assert _saved_float_shapes(plain, batch) & weights


def test_packed_int8_base_matches_each_example_alone():
    """Packing changes nothing with an int8 base: each example's loss and the summed adapter
    gradients are those of the examples run alone (float32)."""
    model = _int8_lora_model()
    rows = _batch([9, 17, 5, 30])

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        losses = per_example_losses(model, batch)
        losses.sum().backward()
        return losses.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])

    packed_losses, packed_grads = loss_and_grads(collate_rows(rows))
    alone = [loss_and_grads(collate_rows([row])) for row in rows]
    torch.testing.assert_close(packed_losses, torch.cat([a[0] for a in alone]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_grads, sum(a[1] for a in alone), rtol=1e-4, atol=1e-6)
    assert packed_grads.abs().sum() > 0


def test_an_int8_layer_compiles_as_one_graph_with_the_eager_numbers():
    """pack-train compiles each decoder layer on a GPU: the int8 matmul's autograd function traces
    into one graph (dynamic shapes), forward and backward, and gives what the eager layer gives."""
    mlp = decoder_layers(_int8_lora_model())[0].mlp
    compiled = torch.compile(mlp, dynamic=True, fullgraph=True)
    for n in (37, 50):
        x = torch.randn(1, n, 64)
        eager_x, compiled_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        eager, got = mlp(eager_x), compiled(compiled_x)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        eager.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(compiled_x.grad, eager_x.grad, rtol=1e-5, atol=1e-6)


def test_pack_train_int8_base_trains_records_it_and_merges_into_the_dequantized_base(
    packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    from peft import PeftModel

    summary = train(_config(packed, tmp_path / "run", merge_lora=True, max_steps=3))
    assert f"--int8-base: {LAYERS} linear layers of the decoder stored in int8" in capsys.readouterr().err
    assert np.isfinite(summary["final_loss"])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["int8_base"] is True
    merged = load_model(summary["merged_model"], vocab_size=VOCAB).eval()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # plain weights again
    # the merged model is the dequantized int8 base plus the saved adapter
    base = load_model("tiny", vocab_size=VOCAB, seed=0).requires_grad_(False)  # a frozen base, as under LoRA
    assert quantize_base_int8(decoder_layers(base)) == LAYERS
    dequantize_base(base)
    adapted = PeftModel.from_pretrained(base.eval(), Path(summary["checkpoint"]) / "model").eval()
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        # negative control: the float base with the same adapter is another model
        fresh = PeftModel.from_pretrained(load_model("tiny", vocab_size=VOCAB, seed=0).eval(), Path(summary["checkpoint"]) / "model").eval()
        assert not torch.allclose(fresh(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


def test_under_bf16_the_int8_base_comes_from_the_bf16_base_and_merges_back_to_bf16(packed: Path, tmp_path: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    summary = train(_config(packed, tmp_path / "bf16", dtype="bf16", max_steps=2, merge_lora=True))
    assert np.isfinite(summary["final_loss"])
    adapter = load_file(str(Path(summary["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    merged = AutoModelForCausalLM.from_pretrained(summary["merged_model"], dtype="auto")
    assert merged.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_an_int8_base_run_resumes_bitwise_and_only_as_one(packed: Path, tmp_path: Path):
    from safetensors.torch import load_file

    full = train(_config(packed, tmp_path / "full"))
    train(_config(packed, tmp_path / "part", stop_at=2))
    with pytest.raises(
        UserError,
        match=r"it was trained with int8_base=True, this run without it, and the adapter it "
        r"saved was trained for that: resume with int8_base=True, or",
    ):
        train(_config(packed, tmp_path / "part", resume="newest", int8_base=False))
    with pytest.raises(UserError, match=r"it was trained without qlora=True, this run with it"):  # a 4-bit base
        train(_config(packed, tmp_path / "part", resume="newest", int8_base=False, qlora=True))
    rest = train(_config(packed, tmp_path / "part", resume="newest"))
    a = load_file(str(Path(full["checkpoint"]) / "model" / "adapter_model.safetensors"))
    b = load_file(str(Path(rest["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda run: [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(tmp_path / "full") == losses(tmp_path / "part")


def test_int8_base_under_ddp_matches_one_process_with_the_same_window(packed: Path, tmp_path: Path):
    """Two gloo ranks of one micro-batch each per step: the same losses and adapter as one process
    accumulating both (DDP does not broadcast the frozen int8 base, which every rank builds the same)."""
    from safetensors.torch import load_file

    config = _config(packed, tmp_path / "ddp", max_steps=3)
    train_on_two_ranks(config, tmp_path)
    single = train(replace(config, out=str(tmp_path / "single"), grad_accum=2))
    losses = lambda run: [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)
    ddp = json.loads((tmp_path / "rank0.json").read_text())
    a = load_file(str(Path(ddp["checkpoint"]) / "model" / "adapter_model.safetensors"))
    b = load_file(str(Path(single["checkpoint"]) / "model" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(lora_r=0), "int8_base=True needs lora_r"),
        (dict(qlora=True), "int8_base=True and qlora=True both choose how the frozen base is stored"),
        (dict(dtype="fp8"), "int8_base=True and dtype fp8 both choose how the frozen base computes"),
    ],
)
def test_options_int8_base_contradicts_are_one_line(packed: Path, tmp_path: Path, change: dict, words: str):
    from trainer.config import refuse_combinations

    with pytest.raises(UserError, match=words):
        train(_config(packed, tmp_path / "run", **change))
    assert not (tmp_path / "run").exists()
    # negative control: the same options without --int8-base are not refused (with adapters)
    refuse_combinations(_config(packed, tmp_path / "run", **{"lora_r": 4, **change, "int8_base": False}))


# ---- Axolotl's and TRL's load_in_8bit (pipeline.foreign): an int8 base where those tools train one

AXOLOTL = "base_model: tiny\nlearning_rate: 0.0002\n"
TRL = "model_name_or_path: tiny\n"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (AXOLOTL + "adapter: lora\nlora_r: 8\nload_in_8bit: true\n", {"lora_r": 8, "int8_base": True}),
        (AXOLOTL + "adapter: lora\nlora_r: 8\nload_in_8bit: true\nload_in_4bit: false\n", {"lora_r": 8, "int8_base": True}),
        (TRL + "use_peft: true\nload_in_8bit: true\n", {"lora_r": 16, "int8_base": True}),  # TRL's default rank
        # negative controls: false, or no key, keeps the base as it is
        (AXOLOTL + "adapter: lora\nlora_r: 8\nload_in_8bit: false\n", {"lora_r": 8, "int8_base": None}),
        (TRL + "use_peft: true\n", {"lora_r": 16, "int8_base": None}),
    ],
)
def test_load_in_8bit_with_lora_adapters_is_an_int8_base(tmp_path: Path, text: str, want: dict):
    from pipeline.config_file import read_config_file
    from trainer.cli import pack_train
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    assert {k: got.get(k) for k in want} == want
    assert got.get("qlora") is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # Axolotl: "Can't load qlora in 8bit"
        (
            AXOLOTL + "adapter: qlora\nlora_r: 8\nload_in_8bit: true\n",
            "key 'load_in_8bit': True has no equivalent here: adapter: qlora takes a 4-bit base",
        ),
        # TRL: "You can't use 8 bit and 4 bit precision at the same time"
        (TRL + "use_peft: true\nload_in_8bit: true\nload_in_4bit: true\n", "load_in_4bit: true asks for a 4-bit base too"),
        # Axolotl: not supported without an adapter; transformers' Trainer: no training of a purely quantized model
        (AXOLOTL + "load_in_8bit: true\n", "an 8-bit base is not supported without LoRA adapters"),
        (TRL + "use_peft: false\nload_in_8bit: true\n", "add adapter: lora (Axolotl) or use_peft: true (TRL)"),
        (AXOLOTL + "load_in_8bit: 'true'\n", "key 'load_in_8bit': 'true'"),  # quoted text, not a boolean
    ],
)
def test_load_in_8bit_where_its_tool_refuses_it_is_one_line(tmp_path: Path, text: str, needle: str):
    from click.testing import CliRunner

    from trainer.cli import pack_train

    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    result = CliRunner().invoke(pack_train, ["--config", str(cfg), "--data", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and str(cfg) in lines[0] and "Traceback" not in result.output, lines
    assert not (tmp_path / "o").exists()


def test_the_int8_base_refusals_are_one_line_on_the_command_line(packed: Path, tmp_path: Path):
    from click.testing import CliRunner

    from trainer.cli import pack_train

    common = ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "o"), "--int8-base"]
    for extra, words in (
        (["--qlora", "--lora-r", "4"], "--int8-base and --qlora both choose"),
        (["--dtype", "fp8", "--lora-r", "4"], "--int8-base and --dtype fp8 both choose"),
        ([], "--int8-base needs --lora-r"),
    ):
        result = CliRunner().invoke(pack_train, common + extra)
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and words in lines[0], lines
        assert not (tmp_path / "o").exists()
