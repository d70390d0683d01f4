"""Stepping by group: a `pack-data --strategy minibatch --group-size B` folder records the rows of each
group (manifest `groups`), pack-verify checks them, and pack-train takes one group per optimizer step,
which computes the gradient of a padded batch of the same B examples (TRL / Axolotl without packing)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[2]))

from pipeline.engines.job import PackConfig, run_pack_data  # noqa: E402
from pipeline.errors import ShardFormatError, UserError  # noqa: E402
from pipeline.shards import IGNORE_INDEX, iter_rows, read_manifest, write_manifest  # noqa: E402
from pipeline.shards.verify import verify_folder  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.stream import Planner, ShardReader  # noqa: E402
from trainer.model.load import build_model  # noqa: E402
from trainer.model.loss import LossModule  # noqa: E402
from trainer.run.loop import backward_window  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "data" / "sample" / "instructions.jsonl")
TOKENIZER = str(ROOT / "data" / "tokenizer")
GROUP = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 examples in groups of 4 (the last of 2), rows of <= 256 tokens."""
    out = tmp_path_factory.mktemp("grouped") / "packed"
    run_pack_data(
        PackConfig(
            inputs=[SAMPLE],
            tokenizer=TOKENIZER,
            max_len=256,
            out=str(out),
            limit=30,
            strategy="minibatch",
            group_size=GROUP,
            progress=False,
        )
    )
    return out


def _examples(folder: Path) -> list[list[tuple[int, np.ndarray, np.ndarray]]]:
    """Per row: its examples as (example id, input ids, labels)."""
    rows = []
    for row in iter_rows(folder):
        cuts = np.cumsum([0, *row["seq_lens"]])
        rows.append(
            [
                (int(e), np.array(row["input_ids"][a:b]), np.array(row["labels"][a:b]))
                for e, a, b in zip(row["example_ids"], cuts[:-1], cuts[1:])
            ]
        )
    return rows


def _padded_loss(model: torch.nn.Module, examples: list[tuple[int, np.ndarray, np.ndarray]]) -> torch.Tensor:
    """The padded-batch loss transformers computes: right-padded, masked, the sum of the token losses
    over their count (num_items_in_batch)."""
    width = max(len(ids) for _, ids, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, (_, x, y) in enumerate(examples):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.from_numpy(x), torch.from_numpy(y), 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    target = labels[:, 1:]
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return losses / (target != IGNORE_INDEX).sum()


def _grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def test_the_manifest_records_each_group_and_pack_verify_checks_it(grouped: Path, tmp_path: Path) -> None:
    manifest = verify_folder(grouped)
    assert manifest.group_size == GROUP and sum(manifest.groups) == manifest.rows
    rows = _examples(grouped)
    first = np.cumsum([0, *manifest.groups])
    sizes = [sum(len(r) for r in rows[a:b]) for a, b in zip(first[:-1], first[1:])]
    assert sizes == [GROUP] * (len(sizes) - 1) + [30 % GROUP]  # the last group holds what is left
    assert any(n > 1 for n in manifest.groups)  # a group is packed into fewer rows than examples

    def tampered(groups: list[int]) -> Path:
        import shutil

        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(grouped, copy)
        m = read_manifest(copy)
        m.groups = groups
        write_manifest(copy, m)
        return copy

    moved = [manifest.groups[0] + 1, manifest.groups[1] - 1, *manifest.groups[2:]]  # same rows in all
    with pytest.raises(ShardFormatError, match=r"group 0 holds \d+ examples, not group_size 4"):
        verify_folder(tampered(moved))
    with pytest.raises(ShardFormatError, match="the groups hold .* rows but the folder has"):
        verify_folder(tampered(manifest.groups[:-1]))
    with pytest.raises(ShardFormatError, match="groups.* must be a list of positive row counts"):
        read_manifest(tampered([0, *manifest.groups]))
    verify_folder(tampered(list(manifest.groups)))  # control: the same groups rewritten pass
    from click.testing import CliRunner

    from pipeline.cli import pack_verify

    result = CliRunner().invoke(pack_verify, [str(tampered(moved))])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "group 0 holds" in result.output and len(result.output.strip().splitlines()) == 1


def test_a_group_step_computes_the_padded_batch_gradient(grouped: Path) -> None:
    manifest = read_manifest(grouped)
    reader = ShardReader(grouped, manifest)
    rows = _examples(grouped)
    planner = Planner(reader.row_lengths(), 200, seed=3, groups=manifest.groups)  # groups cut into micro-batches
    module = LossModule(build_model("tiny", seed=1)[0])
    stock = copy.deepcopy(module.model)  # the same weights, with the model's own padded attention
    stock.set_attn_implementation("eager")
    cut = 0
    for step in range(2):
        indices = planner.step_share(0, step).indices
        micro = [reader.microbatch(planner.local_rows(0, i, 0)) for i in indices]
        cut += len(micro) > 1
        loss_sum, _, n = backward_window(module, micro, device=torch.device("cpu"))
        packed = _grads(module)
        module.zero_grad(set_to_none=True)
        examples = [e for i in indices for r in planner.local_rows(0, i, 0) for e in rows[r]]
        assert len(examples) in (GROUP, 30 % GROUP)  # a whole group (the last holds 2)
        reference = _padded_loss(stock, examples)
        reference.backward()
        assert float(loss_sum) / n == pytest.approx(reference.item(), rel=1e-5)
        torch.testing.assert_close(packed, _grads(stock), rtol=1e-4, atol=1e-6)
        stock.zero_grad(set_to_none=True)
    assert cut  # at least one step took its group in several micro-batches

    # negative control: stepping by token budget mixes examples of several groups into a step
    budget = Planner(reader.row_lengths(), 200, seed=3)
    micro = [reader.microbatch(budget.local_rows(0, 0, 0))]
    backward_window(module, micro, device=torch.device("cpu"))
    by_budget = _grads(module)
    first = planner.step_share(0, 0).indices
    _padded_loss(stock, [e for i in first for r in planner.local_rows(0, i, 0) for e in rows[r]]).backward()
    assert not torch.allclose(by_budget, _grads(stock), rtol=1e-3, atol=1e-5)


def _config(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(data),
        model="tiny",
        out=str(out),
        tokens_per_step=300,
        lr=1e-3,
        warmup=0,
        log_every=1,
        num_workers=0,
        progress=False,
        schedule="constant",
    )
    return TrainConfig(**{**base, **kw})


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_epoch_is_one_step_per_group_and_resume_lands_on_the_group(grouped: Path, tmp_path: Path, capsys) -> None:
    groups = len(read_manifest(grouped).groups)
    full = train(_config(grouped, tmp_path / "full", epochs=2))
    assert full["steps"] == 2 * groups
    err = capsys.readouterr().err
    assert f"one group of {GROUP} examples each" in err and "stepping by group" in err
    assert json.loads((tmp_path / "full" / "config.json").read_text())["step_by_group"] is True
    mid = groups + 3  # inside the second epoch
    train(_config(grouped, tmp_path / "part", epochs=2, stop_at=mid))
    train(_config(grouped, tmp_path / "part", epochs=2, resume="newest"))
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    assert [m["step"] for m in b] == list(range(1, 2 * groups + 1))
    for key in ("loss", "grad_norm", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    with pytest.raises(UserError, match="step_by_group"):  # another stream than the checkpoint's
        train(_config(grouped, tmp_path / "part", epochs=3, resume="newest", step_by_group=False))


def test_group_stepping_refuses_what_would_change_the_group(grouped: Path, tmp_path: Path) -> None:
    manifest = read_manifest(grouped)
    lengths = ShardReader(grouped, manifest).row_lengths()
    with pytest.raises(UserError, match="--grad-accum 2 with stepping by group: .* --group-size B x N"):
        Planner(lengths, 300, grad_accum=2, groups=manifest.groups)
    assert Planner(lengths, 300, grad_accum=2).steps_in_epoch(0) > 0  # control: by token budget
    with pytest.raises(UserError, match="grad_accum 2 with stepping by group"):  # the Python API spells options so
        train(_config(grouped, tmp_path / "accum", max_steps=1, grad_accum=2))
    train(_config(grouped, tmp_path / "budget", max_steps=1, grad_accum=2, step_by_group=False))  # control
    plain = tmp_path / "plain"
    run_pack_data(PackConfig(inputs=[SAMPLE], tokenizer=TOKENIZER, max_len=256, out=str(plain), limit=12, progress=False))
    assert read_manifest(plain).groups == [] and read_manifest(plain).group_size is None
    with pytest.raises(UserError, match="step_by_group=True: .* has no groups .*--strategy minibatch"):
        train(_config(plain, tmp_path / "nogroups", max_steps=1, step_by_group=True))
