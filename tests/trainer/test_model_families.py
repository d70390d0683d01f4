"""The family matrix: for every decoder family in tests/families.py, a packed row gives each example
exactly the loss and the gradients the stock model (eager attention) gives it alone, in float32
(within 1e-5, or within the stock model's own float32 rounding where that is larger: gemma4's),
or the model is refused in one line. Each feature has a negative control: switched off in the
packed path, the comparison must fail."""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from families import FAMILIES, LENGTHS, Family, examples
from pipeline.errors import UserError
from trainer import attention, loss
from trainer.batch import collate_flat
from trainer.loss import per_example_losses
from trainer.model import prepare

RTOL = 1e-5


def _installed(family: Family) -> None:
    from transformers import CONFIG_MAPPING

    if family.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {family.model_type} here")


def stock_alone(model, data) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Mean token loss of each example run alone through the stock eager model, and its gradients."""
    means, grads = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for ids, labels in data:
        logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0]
        mean = F.cross_entropy(logits[:-1].float(), torch.from_numpy(labels[1:]), ignore_index=-100)
        means.append(mean.detach())
        grads.append(torch.autograd.grad(mean, params, allow_unused=True))
    return torch.stack(means), grads


def packed_batch(data):
    ids = np.concatenate([d[0] for d in data])
    labels = np.concatenate([d[1] for d in data])
    positions = np.concatenate([np.arange(len(d[0])) for d in data])
    return collate_flat(ids, labels, positions, np.array([len(d[0]) for d in data]))


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


def float32_rounding(model, data) -> float:
    """How far the stock model's own float32 gradients are from its float64 ones (the largest
    `gradient_error` over the examples): what float32 arithmetic alone does to them."""
    _, grads32 = stock_alone(model, data)
    _, grads64 = stock_alone(copy.deepcopy(model).double(), data)
    return max(gradient_error(a, b)[0] for a, b in zip(grads32, grads64))


def assert_grads_close(packed, alone, names, what, rounding=None):
    """Each gradient within RTOL of the stock one (`gradient_error`), or, for a model whose own
    float32 rounding is larger than that, within that rounding (`rounding()`, computed only then):
    attention summed in another order (PyTorch's fused CPU kernel) may differ by as much."""
    err, where = gradient_error(packed, alone)
    tolerance = RTOL if err <= RTOL or rounding is None else max(RTOL, rounding())
    assert err <= tolerance, f"{what}, {names[where]}: gradient differs by {err:.2e} (relative, tolerance {tolerance:.1e})"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs()).max())


@pytest.fixture(scope="module")
def data():
    return examples()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_packed_equals_each_example_alone_or_refused(family: Family, data) -> None:
    _installed(family)
    model = family.build()
    if family.refused:
        with pytest.raises(UserError, match=family.refused) as refused:
            prepare(model, "sdpa")
        message = str(refused.value)
        assert "\n" not in message and message.startswith(type(model).__name__), message
        return
    reference = copy.deepcopy(model).eval()
    backend, why = prepare(model, "sdpa")
    model.eval()
    assert backend == "sdpa" and "\n" not in why
    assert attention.select_backend("auto", "cpu") == "sdpa"
    assert set(family.features) == features_of(model), "the exaggerated features are not all in use"

    alone, alone_grads = stock_alone(reference, data)
    batch = packed_batch(data)
    packed = per_example_losses(model, batch)
    assert relative_error(packed.detach(), alone) <= RTOL
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    rounding = functools.cache(lambda: float32_rounding(reference, data))
    for i in range(len(data)):
        grads = torch.autograd.grad(packed[i], params, retain_graph=True, allow_unused=True)
        assert_grads_close(grads, alone_grads[i], names, f"{family.name} example {i}", rounding)

    # flex runs the same batch on the CPU without gradients (PyTorch has no flex backward there)
    attention.install(model, "flex")
    with torch.no_grad():
        assert relative_error(per_example_losses(model, batch), alone) <= RTOL


def features_of(model) -> set[str]:
    from trainer.model_check import check_model

    return check_model(model)


# --------------------------------------------------------------------------- negative controls


def _with_feature_off(monkeypatch, feature: str) -> None:
    """The packed path ignores `feature` from now on (what a backend that drops it would do)."""
    if feature == "head":
        monkeypatch.setattr(loss, "logit_transform", lambda model: None)
        return
    real = attention.layer_features
    off = {"window": None, "chunk": None, "softcap": None, "sinks": False}[feature]
    monkeypatch.setattr(
        attention, "layer_features",
        lambda *a, **k: dataclasses.replace(real(*a, **k), **{feature: off}),
    )


NEGATIVE = [
    (f, feature)
    for f in FAMILIES
    if not f.refused
    for feature in sorted(f.features - {"value_dim", "wide_head"}) + (["head"] if f.head else [])
]


@pytest.mark.parametrize("family,feature", NEGATIVE, ids=lambda x: x if isinstance(x, str) else x.name)
def test_negative_control_feature_switched_off_fails(family: Family, feature: str, data, monkeypatch) -> None:
    _installed(family)
    model = family.build()
    reference = copy.deepcopy(model).eval()
    prepare(model, "sdpa")
    model.eval()
    _with_feature_off(monkeypatch, feature)
    with torch.no_grad():
        alone, _ = stock_alone_no_grad(reference, data)
        packed = per_example_losses(model, packed_batch(data))
    assert relative_error(packed, alone) > 10 * RTOL, f"{family.name} without {feature} still matches"


def stock_alone_no_grad(model, data):
    means = []
    for ids, labels in data:
        logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0]
        means.append(F.cross_entropy(logits[:-1].float(), torch.from_numpy(labels[1:]), ignore_index=-100))
    return torch.stack(means), None


def test_value_dim_negative_control(data, monkeypatch) -> None:
    """MLA's narrower value heads: a kernel that zero-pads v must slice the output back; keeping
    the padded width breaks the model (here: its output projection refuses the shape)."""
    family = next(f for f in FAMILIES if "value_dim" in f.features)
    _installed(family)
    model = family.build()
    prepare(model, "sdpa")
    real = attention.varlen_attention

    def padded(q, k, v, *args, **kwargs):
        out = real(q, k, v, *args, **kwargs)
        return F.pad(out, (0, q.shape[-1] - out.shape[-1]))

    monkeypatch.setattr(attention, "varlen_attention", padded)
    with pytest.raises(RuntimeError), torch.no_grad():
        per_example_losses(model, packed_batch(data))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.refused == "carry state from one example to the next"],
                         ids=lambda f: f.name)
def test_refused_hybrids_really_leak(family: Family, data, monkeypatch) -> None:
    """The refusal is warranted: forced through, the packed losses of later examples differ."""
    _installed(family)
    model = family.build()
    reference = copy.deepcopy(model).eval()
    monkeypatch.setattr("trainer.model.check_model", lambda m: set())
    prepare(model, "sdpa")
    model.eval()
    with torch.no_grad():
        alone, _ = stock_alone_no_grad(reference, data)
        packed = per_example_losses(model, packed_batch(data))
    assert relative_error(packed[:1], alone[:1]) <= RTOL  # the row's first example is unaffected
    assert relative_error(packed[1:], alone[1:]) > 10 * RTOL


def test_examples_are_longer_than_every_window() -> None:
    assert min(LENGTHS) > 2 * 8


def test_a_logit_post_processing_the_loss_does_not_know_is_refused(monkeypatch) -> None:
    """The start-up check compares the trainer's decoder + head with the model's own logits."""
    family = next(f for f in FAMILIES if f.name == "granite")
    _installed(family)
    monkeypatch.setattr(loss, "logit_transform", lambda model: None)  # as if logits_scaling were unknown
    with pytest.raises(UserError, match="GraniteForCausalLM cannot be trained on packed rows: its logits differ "
                                        "from the trainer's decoder \\+ output head"):
        prepare(family.build(), "sdpa")


def test_the_decoder_is_found_where_get_decoder_returns_the_model_itself() -> None:
    family = next(f for f in FAMILIES if f.name == "llama4")
    _installed(family)
    model = family.build()
    if model.get_decoder() is not model:
        pytest.skip("this transformers' Llama 4 get_decoder() returns the decoder")
    assert loss.find_decoder(model) is model.model


def test_an_attention_feature_the_backends_do_not_know_is_refused_not_ignored(monkeypatch) -> None:
    """A future model may pass a new feature to attention (as sliding_window and s_aux arrived), or
    mark a layer with a new kind: refused in one line, never ignored (which would train wrong)."""
    from transformers.models.llama import modeling_llama

    family = next(f for f in FAMILIES if f.name == "llama")
    real = modeling_llama.LlamaAttention.forward

    def with_new_feature(self, *args, **kwargs):
        return real(self, *args, **kwargs, attention_temperature=0.5)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_new_feature)
    with pytest.raises(UserError, match="LlamaForCausalLM cannot be trained on packed rows: LlamaAttention "
                                        "passes attention_temperature=0.5 to attention"):
        prepare(family.build(), "sdpa")
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", real)
    model = family.build()
    model.config.layer_types = ["full_attention", "local_attention"]
    with pytest.raises(UserError, match="LlamaAttention is a 'local_attention' layer"):
        prepare(model, "sdpa")
