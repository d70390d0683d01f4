"""The family matrix: for every decoder family in tests/families.py, a packed row gives each example
exactly the loss and the gradients the stock model (eager attention) gives it alone, in float32
(within 1e-5, or within what float32 rounding does to the two where that is larger: gemma4's),
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
from families import FAMILIES, LENGTHS, ROPE_THRESHOLD, Family, examples, fresh_rope, gradient_error, stock_alone

from pipeline.errors import UserError
from trainer.attention import backend as attention
from trainer.attention import packed_row, positions
from trainer.data.batch import collate_flat
from trainer.model import check as model_check
from trainer.model import loss
from trainer.model.load import prepare
from trainer.model.loss import per_example_losses

RTOL = 1e-5


def _installed(family: Family) -> None:
    from transformers import CONFIG_MAPPING

    if family.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {family.model_type} here")


def packed_batch(data):
    ids = np.concatenate([d[0] for d in data])
    labels = np.concatenate([d[1] for d in data])
    positions = np.concatenate([np.arange(len(d[0])) for d in data])
    return collate_flat(ids, labels, positions, np.array([len(d[0]) for d in data]))


def packed_grads(model, batch, n: int) -> list[tuple[torch.Tensor | None, ...]]:
    """The gradients of each of the `n` examples' mean losses in one packed row."""
    losses = per_example_losses(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True) for i in range(n)]


def float32_rounding(reference, packed_model, data) -> float:
    """How far float32 arithmetic alone moves the gradients of each side: the largest
    `gradient_error` between float32 and float64 gradients of the stock model run alone, plus the
    same of the packed row. If packing is exact, the two float32 results differ by at most that
    sum (each is that far from its float64 value, and the float64 values agree); a packing error
    adds its own difference on top, which no rounding covers."""
    _, alone32 = stock_alone(reference, data)
    _, alone64 = stock_alone(copy.deepcopy(reference).double(), data)
    batch = packed_batch(data)
    packed32 = packed_grads(packed_model, batch, len(data))
    packed64 = packed_grads(copy.deepcopy(packed_model).double(), batch, len(data))
    return max(gradient_error(a, b)[0] for a, b in zip(alone32, alone64)) + max(gradient_error(a, b)[0] for a, b in zip(packed32, packed64))


def assert_grads_close(packed, alone, names, what, rounding=None):
    """Each gradient within RTOL of the stock one (`gradient_error`), or, where float32 rounding
    is larger than that, within it (`rounding()`, computed only then): attention summed in another
    order (PyTorch's fused CPU kernel) or a scalar parameter's gradient summed over a longer row
    may differ by as much."""
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

    alone, alone_grads = stock_alone(reference, data, family.fresh_alone)
    batch = packed_batch(data)
    packed = per_example_losses(model, batch)
    assert relative_error(packed.detach(), alone) <= RTOL
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    rounding = functools.cache(lambda: float32_rounding(reference, model, data))
    for i in range(len(data)):
        grads = torch.autograd.grad(packed[i], params, retain_graph=True, allow_unused=True)
        assert_grads_close(grads, alone_grads[i], names, f"{family.name} example {i}", rounding)

    # flex runs the same batch on the CPU without gradients (PyTorch has no flex backward there)
    attention.install(model, "flex")
    with torch.no_grad():
        assert relative_error(per_example_losses(model, batch), alone) <= RTOL


def features_of(model) -> set[str]:
    from trainer.model.check import check_model

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
        attention,
        "layer_features",
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
        alone, _ = stock_alone_no_grad(reference, data, family.fresh_alone)
        packed = per_example_losses(model, packed_batch(data))
    assert relative_error(packed, alone) > 10 * RTOL, f"{family.name} without {feature} still matches"


def stock_alone_no_grad(model, data, fresh: bool = False):
    means = []
    for ids, labels in data:
        if fresh:
            fresh_rope(model)
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


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.refused == "carry state from one example to the next"], ids=lambda f: f.name)
def test_refused_hybrids_really_leak(family: Family, data, monkeypatch) -> None:
    """The refusal is warranted: forced through, the packed losses of later examples differ."""
    _installed(family)
    model = family.build()
    reference = copy.deepcopy(model).eval()
    monkeypatch.setattr("trainer.model.load.check_model", lambda m: set())
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
    with pytest.raises(
        UserError, match="GraniteForCausalLM cannot be trained on packed rows: its logits differ from the trainer's decoder \\+ output head"
    ):
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
    with pytest.raises(
        UserError, match="LlamaForCausalLM cannot be trained on packed rows: LlamaAttention passes attention_temperature=0.5 to attention"
    ):
        prepare(family.build(), "sdpa")
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", real)
    model = family.build()
    model.config.layer_types = ["full_attention", "local_attention"]
    with pytest.raises(UserError, match="LlamaAttention is a 'local_attention' layer"):
        prepare(model, "sdpa")


# --------------------------------------------------------------------------- position features by length


POSITION_FAMILIES = [f for f in FAMILIES if f.name in ("llama-dynamic-rope", "phi3-longrope", "llama4-temperature")]


def _row_based_positions(monkeypatch) -> None:
    """trainer.attention.positions only records the boundaries: every position feature is the row's, as
    transformers computes it for an unpacked batch."""
    monkeypatch.setattr(positions, "install", lambda model, decoder: packed_row.install(decoder))


@pytest.mark.parametrize("family", POSITION_FAMILIES, ids=lambda f: f.name)
def test_position_features_taken_from_the_row_train_wrong_and_the_check_says_so(family: Family, data, monkeypatch) -> None:
    """Negative control: without trainer.attention.positions, packed examples get the row's RoPE
    frequencies or temperature, their losses differ from the examples run alone, and the start-up
    check refuses the model (its probe passes the feature's threshold); the check with the short
    probe (PROBE_LENGTHS, 28 tokens) would have missed it."""
    _installed(family)
    _row_based_positions(monkeypatch)
    name = type(family.build()).__name__
    with pytest.raises(UserError, match=f"^{name} cannot be trained on packed rows: a packed example's logits differ"):
        prepare(family.build(), "sdpa")
    short_probe = family.build()
    with monkeypatch.context() as m:
        m.setattr(model_check, "probe_lengths", lambda model: model_check.PROBE_LENGTHS)
        prepare(short_probe, "sdpa")  # the short probe passes no threshold: the check is blind

    monkeypatch.setattr("trainer.model.load.check_model", lambda m: set())
    model = family.build()
    reference = copy.deepcopy(model).eval()
    prepare(model, "sdpa")
    model.eval()
    with torch.no_grad():
        alone, _ = stock_alone_no_grad(reference, data, family.fresh_alone)
        packed = per_example_losses(model, packed_batch(data))
    assert relative_error(packed, alone) > 10 * RTOL, f"{family.name}: the row's positions still match"


@pytest.mark.parametrize("family", POSITION_FAMILIES, ids=lambda f: f.name)
def test_the_start_up_probe_passes_every_position_threshold(family: Family) -> None:
    _installed(family)
    model = family.build()
    assert list(positions.thresholds(model).values()) == [ROPE_THRESHOLD]
    first, long, last = model_check.probe_lengths(model)
    assert long > ROPE_THRESHOLD  # an example past the threshold...
    assert first + long > ROPE_THRESHOLD and last < ROPE_THRESHOLD  # ...and a short one starting past it
    llama = next(f for f in FAMILIES if f.name == "llama").build()
    assert positions.thresholds(llama) == {} and model_check.probe_lengths(llama) == model_check.PROBE_LENGTHS


def test_llama4_default_floor_scale_is_probed_and_a_threshold_too_far_is_refused_in_one_line() -> None:
    family = next(f for f in POSITION_FAMILIES if f.name == "llama4-temperature")
    _installed(family)
    default = dataclasses.replace(family, config={k: v for k, v in family.config.items() if k != "floor_scale"})
    assert model_check.probe_lengths(default.build()) == (7, 8194, 9)  # floor_scale 8192
    dynamic = next(f for f in POSITION_FAMILIES if f.name == "llama-dynamic-rope")
    far = dataclasses.replace(dynamic, config={**dynamic.config, "max_position_embeddings": 32768})
    with pytest.raises(UserError) as refused:
        prepare(far.build(), "sdpa")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        "LlamaForCausalLM cannot be trained on packed rows: its dynamic NTK RoPE (rope_type 'dynamic') changes past 32768 tokens"
    ), message
    assert "use a static RoPE scaling" in message


def test_example_lengths_from_restarting_positions() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert positions.example_lengths(position_ids).tolist() == [[3, 3, 3, 2, 2, 4, 4, 4, 4], [9] * 9]


# --------------------------------------------------------------------------- boundaries, logit heads


def _llama_attention_without_kwargs(monkeypatch) -> None:
    """LlamaAttention drops every keyword argument but its tensors (as StableLM's and Nemotron's
    decoder layers do): the boundaries never reach the attention function as arguments."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaAttention.forward
    kept = ("hidden_states", "position_embeddings", "attention_mask")

    def dropping(self, *args, **kwargs):
        return real(self, *args, **{k: v for k, v in kwargs.items() if k in kept})

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", dropping)


def test_a_layer_that_drops_keyword_arguments_still_gets_each_examples_boundaries(data, monkeypatch) -> None:
    family = next(f for f in FAMILIES if f.name == "llama")
    _llama_attention_without_kwargs(monkeypatch)
    seen = []
    real = attention.varlen_attention

    def recording(q, k, v, cu, *args, **kwargs):
        seen.append(cu)
        return real(q, k, v, cu, *args, **kwargs)

    monkeypatch.setattr(attention, "varlen_attention", recording)
    model = family.build()
    reference = copy.deepcopy(model).eval()
    prepare(model, "sdpa")
    model.eval()
    alone, alone_grads = stock_alone(reference, data)
    seen.clear()
    packed = per_example_losses(model, packed_batch(data))
    assert [c.tolist() for c in seen] == [np.cumsum([0, *LENGTHS]).tolist()] * 2  # both layers
    assert relative_error(packed.detach(), alone) <= RTOL
    names = [n for n, p in model.named_parameters()]
    for i in range(len(data)):
        grads = torch.autograd.grad(packed[i], list(model.parameters()), retain_graph=True, allow_unused=True)
        assert_grads_close(grads, alone_grads[i], names, f"example {i}")
    # negative control: without the decoder's record of the row, the layer has no boundaries
    monkeypatch.setattr(packed_row, "current", lambda: None)
    with pytest.raises(
        UserError, match="LlamaForCausalLM cannot be trained on packed rows: LlamaAttention was called without example boundaries"
    ):
        prepare(family.build(), "sdpa")


def test_logits_scaling_multiplied_hyperclovax_is_not_divided_as_granite(monkeypatch) -> None:
    family = next(f for f in FAMILIES if f.name == "hyperclovax")
    _installed(family)
    monkeypatch.setattr(loss, "MULTIPLIES_LOGITS_SCALING", frozenset())  # as Granite: divide
    with pytest.raises(
        UserError,
        match="HyperCLOVAXForCausalLM cannot be trained on packed rows: its logits differ from the trainer's decoder \\+ output head",
    ):
        prepare(family.build(), "sdpa")


def test_an_output_linear_named_decoder_is_not_taken_for_the_decoder_stack() -> None:
    family = next(f for f in FAMILIES if f.name == "modernbert-decoder")
    _installed(family)
    model = family.build()
    assert model.get_decoder() is model.get_output_embeddings()  # transformers' own lookup is fooled
    assert loss.find_decoder(model) is model.model


@pytest.mark.parametrize("name", ["stablelm", "llama4-temperature"])
def test_activation_checkpointing_recomputes_with_the_rows_boundaries_and_positions(name: str, data) -> None:
    """A checkpointed layer runs again in the backward, after the decoder's forward returned: it
    still gets the row's boundaries (StableLM) and per-example temperature (Llama 4)."""
    from trainer.model.load import enable_grad_checkpointing

    family = next(f for f in FAMILIES if f.name == name)
    _installed(family)
    plain, checkpointed = family.build(), family.build()
    for model in (plain, checkpointed):
        prepare(model, "sdpa")
        model.train()
    enable_grad_checkpointing(checkpointed)
    batch = packed_batch(data)
    grads = []
    for model in (plain, checkpointed):
        per_example_losses(model, batch).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    names = [n for n, _ in plain.named_parameters()]
    assert_grads_close(grads[1], grads[0], names, f"{name} checkpointed")


def test_a_length_dependent_rope_in_a_form_the_trainer_does_not_know_is_refused() -> None:
    """The config asks for dynamic NTK RoPE but the RoPE module is not transformers' (no
    `rope_type`, as in a model's own code): refused in one line, never trained row-wide."""
    family = next(f for f in POSITION_FAMILIES if f.name == "llama-dynamic-rope")
    model = family.build()
    for module in model.modules():
        if hasattr(module, "rope_type"):
            del module.rope_type
    with pytest.raises(UserError) as refused:
        prepare(model, "sdpa")
    assert str(refused.value).startswith("LlamaForCausalLM cannot be trained on packed rows: its config asks for a 'dynamic' RoPE"), (
        refused.value
    )
