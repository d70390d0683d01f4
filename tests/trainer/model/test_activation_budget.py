"""--activation-memory-budget: a compiled LoRA layer keeps fewer activations for its backward and
computes the same gradients (the budget only moves work from memory to recomputation); pack-train
holds the budget while its layers compile, and refuses it where no layer is compiled."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).parents[2]))
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.batch import collate_flat  # noqa: E402
from trainer.model.load import compile_decoder_layers, prepare, preset_config  # noqa: E402
from trainer.model.loss import LossModule  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _saved_bytes_and_grads(budget: float) -> tuple[int, dict[str, torch.Tensor]]:
    """One compiled LoRA step of a small Llama on three packed examples: the bytes of the tensors
    autograd keeps for the backward (parameters left out) and every gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    config = preset_config("tiny", 300)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 128, 512, 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    prepare(model, "sdpa", "cpu")
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )  # B != 0: every adapter has gradients
    compile_decoder_layers(model)  # as pack-train --compile does
    lens = np.array([40, 30, 58])
    ids = np.random.default_rng(0).integers(3, 300, int(lens.sum()))
    batch = collate_flat(ids, ids.copy(), np.concatenate([np.arange(n) for n in lens]), lens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with functorch_config.patch(activation_memory_budget=budget):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = LossModule(model)(batch)
        loss.backward()
    return sum(kept.values()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_a_lower_budget_keeps_fewer_activations_and_computes_the_same_gradients():
    full, grads = _saved_bytes_and_grads(1.0)
    low, low_grads = _saved_bytes_and_grads(0.6)
    assert low < 0.85 * full, (low, full)  # measured: 0.77x here; 0.72x for an 8B-shaped layer at 0.7
    assert len(grads) == 14 and grads.keys() == low_grads.keys()  # 7 adapters x (A, B)
    for name, grad in grads.items():
        assert torch.equal(grad, low_grads[name]), name


def _packed(tmp_path: Path) -> Path:
    folder = tmp_path / "packed"
    make_packed_folder(folder, pack_lengths(np.random.default_rng(0).integers(4, 40, size=20).tolist(), 64, vocab=300), 64)
    return folder


def test_pack_train_holds_the_budget_while_its_layers_compile(tmp_path: Path, monkeypatch):
    import trainer.run.loop

    seen = []
    monkeypatch.setattr(trainer.run.loop, "_train", lambda config, opened: seen.append(functorch_config.activation_memory_budget) or {})
    train(
        TrainConfig(
            data=str(_packed(tmp_path)), model="tiny", out=str(tmp_path / "run"), compile=True, activation_memory_budget=0.7, progress=False
        )
    )
    assert seen == [0.7]
    assert functorch_config.activation_memory_budget == 1.0  # and only then


def test_a_budget_without_compiled_layers_is_refused_in_one_line(tmp_path: Path):
    config = TrainConfig(
        data=str(_packed(tmp_path)),
        model="tiny",
        out=str(tmp_path / "run"),
        max_steps=1,
        num_workers=0,
        progress=False,
        activation_memory_budget=0.7,
    )
    with pytest.raises(
        UserError,
        match=r"^activation_memory_budget 0\.7 applies to compiled layers, and this "
        r"run compiles none: add compile",
    ):
        train(config)  # on the CPU, layers compile only when asked
    train(TrainConfig(**{**config.__dict__, "activation_memory_budget": 1.0}))  # the control: the default runs
