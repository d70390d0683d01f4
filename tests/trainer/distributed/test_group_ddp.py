"""Stepping by group under torchrun (the padded batches of a TRL/Axolotl file without packing, on W
processes): one optimizer step takes W groups of pack-data, one a rank, each rank's group cut into
its own micro-batches (a different number per rank), the loss the mean over all W groups' loss tokens
(transformers' `average_tokens_across_devices`, TRL's default). On two gloo ranks, DDP and FSDP2, the
weights after an epoch equal one process's whose step is the union of the same groups (float32);
negative controls: the ranks' means averaged and both ranks taking the same group each fail that
comparison. `--loss-average ranks` (Axolotl's normalisation) equals the ranks' means averaged instead.
An odd number of groups ends the epoch in a step of one group (the other rank joins with a
zero-weight backward), and a run resumed mid-epoch ends as an uninterrupted one."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_ranks, train_on_two_ranks

from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.shards import read_manifest
from trainer import TrainConfig
from trainer.data import plan
from trainer.data.stream import Planner, ShardReader
from trainer.distributed.parallel import DistInfo, full_model_state, wrap_parallel
from trainer.model.load import build_model, decoder_layers
from trainer.model.loss import LossModule
from trainer.run.loop import backward_window

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "data" / "sample" / "instructions.jsonl")
TOKENIZER = str(ROOT / "data" / "tokenizer")
BUDGET = 120  # tokens per micro-batch: a group of 4 examples takes 1 to 4 micro-batches
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """26 examples in groups of 4: seven groups, the last of 2 (an odd number: two ranks end the
    epoch with a step of one group)."""
    out = tmp_path_factory.mktemp("grouped") / "packed"
    run_pack_data(
        PackConfig(
            inputs=[SAMPLE], tokenizer=TOKENIZER, max_len=256, out=str(out), limit=26, strategy="minibatch", group_size=4, progress=False
        )
    )
    return out


def _planner(folder: Path, rank: int, world: int = 2, even: bool = False) -> tuple[Planner, ShardReader]:
    manifest = read_manifest(folder)
    reader = ShardReader(folder, manifest)
    return Planner(reader.row_lengths(), BUDGET, seed=3, world_size=world, groups=manifest.groups, rank=rank, even=even), reader


def _model() -> LossModule:
    return LossModule(build_model("tiny", seed=1)[0])


def _rank_epoch(
    rank: int, world: int, folder: str, parallel: str, out: str, takes: int | None = None, by_rank: bool = False
) -> list[list[int]]:
    """One epoch on this rank as pack-train's loop takes it (DDP or FSDP2, SGD); rank 0 saves the
    weights to `out`. `takes`: the rank whose groups this one reads (the broken control's; None: its
    own); `by_rank`: --loss-average ranks. Returns each step's (micro-batches read, of them its own)."""
    fsdp = parallel == "fsdp"
    planner, reader = _planner(Path(folder), rank if takes is None else takes, world, even=fsdp)
    module = _model()
    info = DistInfo(rank=rank, world_size=world, enabled=True)
    wrapped = wrap_parallel(module, decoder_layers(module.model), info, fsdp=fsdp, bf16=False, bucket_mb=25)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    shares = []
    for step in range(planner.steps_in_epoch(0)):
        share = planner.step_share(0, step)
        micro = [reader.microbatch(planner.local_rows(0, i, rank)) for i in share.indices]
        backward_window(wrapped, micro, device=CPU, info=info, fsdp=fsdp, real=share.real, by_rank=by_rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=fsdp)
        shares.append([len(share.indices), share.real])
    state = full_model_state(wrapped) if fsdp else module.state_dict()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out)
    return shares


def _one_process(folder: Path, *, rank_means: bool = False) -> dict[str, torch.Tensor]:
    """The weights after one epoch in one process whose step is the union of the step's two groups
    (`rank_means`: each group's mean loss, the means averaged over the groups of the step: Axolotl's)."""
    planners = [_planner(folder, r) for r in range(2)]
    reader = planners[0][1]
    module = _model()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for step in range(planners[0][0].steps_in_epoch(0)):
        mine = []
        for planner, _ in planners:
            share = planner.step_share(0, step)
            mine.append([reader.microbatch(planner.local_rows(0, i, 0)) for i in share.indices[: share.real]])
        if rank_means:
            for micro in filter(None, mine):
                backward_window(module, micro, device=CPU)
            for p in module.parameters():
                p.grad /= len(list(filter(None, mine)))
        else:
            backward_window(module, [b for micro in mine for b in micro], device=CPU)
        optimizer.step()
        optimizer.zero_grad()
    return module.state_dict()


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_group_share_examples() -> None:
    """`group_share`'s docstring: a rank's micro-batches, fillers where it has none or fewer (even)."""
    assert doctest.testmod(plan).failed == 0


def test_the_plan_deals_one_group_a_rank(grouped: Path) -> None:
    """Seven groups on two ranks: four steps, the last of one group (the other rank reads a filler);
    every group once an epoch; the order a function of seed and epoch."""
    planners = [_planner(grouped, r)[0] for r in range(2)]
    assert [p.steps_in_epoch(0) for p in planners] == [4, 4]
    for epoch in (0, 1):
        seen = []
        for step in range(4):
            shares = [p.step_share(epoch, step) for p in planners]
            for share in shares:
                seen += share.indices[: share.real]
        plan = planners[0].plan(epoch)
        assert sorted(seen) == list(range(plan.n_microbatches))  # every micro-batch of every group, once
    last = [p.step_share(0, 3) for p in planners]
    assert last[0].real >= 1 and last[1].real == 0 and len(last[1].indices) == 1
    assert planners[0].plan(0).order.tolist() != planners[0].plan(1).order.tolist()  # another order each epoch
    one = _planner(grouped, 0, world=1)[0]  # one process: a step a group, no filler
    assert one.steps_in_epoch(0) == 7
    assert all(len(share.indices) == share.real for share in (one.step_share(0, k) for k in range(7)))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_as_one_process_on_the_union_of_their_groups(grouped: Path, tmp_path: Path, parallel: str) -> None:
    out = tmp_path / "w.pt"
    per_rank = run_on_ranks(_rank_epoch, 2, args=(str(grouped), parallel, str(out)), deadline_s=240)
    real = [[s[1] for s in rank] for rank in per_rank]
    assert any(a != b and b > 0 for a, b in zip(*real))  # the ranks cut their groups into unequal counts
    assert real[1][-1] == 0  # the last step: one group, the second rank only joins
    if parallel == "fsdp":  # FSDP2 gathers the weights in every forward: the ranks read equally many
        assert all(a[0] == b[0] for a, b in zip(*per_rank))
    got = torch.load(out)
    assert _close(got, _one_process(grouped))
    assert not _close(got, _one_process(grouped, rank_means=True))  # negative control: per-rank means


def test_negative_control_a_rank_taking_the_other_ranks_group_fails(grouped: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.pt"
    run_on_ranks(_rank_epoch, 2, args=(str(grouped), "ddp", str(out), 0), deadline_s=240)  # both read rank 0's
    assert not _close(torch.load(out), _one_process(grouped))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_train_under_torchrun_steps_by_group_and_resumes_mid_epoch_exactly(grouped: Path, tmp_path: Path, parallel: str, capfd) -> None:
    config = TrainConfig(
        data=str(grouped),
        model="tiny",
        out=str(tmp_path / "full"),
        tokens_per_step=BUDGET,
        epochs=2,
        lr=1e-3,
        warmup=0,
        schedule="constant",
        log_every=1,
        num_workers=0,
        progress=False,
        device="cpu",
        eval_data="none",
        parallel=parallel,
    )
    for name in ("full-ranks", "part-ranks", "resume-ranks"):
        (tmp_path / name).mkdir()
    full = train_on_two_ranks(config, tmp_path / "full-ranks")
    assert [s["steps"] for s in full] == [8, 8]  # two epochs of four steps (seven groups, two a step)
    err = capfd.readouterr().err
    assert "8 steps of 2 groups, one a rank, of 4 examples each" in err and "each optimizer step is 2 (one a rank" in err
    saved = json.loads((tmp_path / "full" / "config.json").read_text())
    assert saved["step_by_group"] is True
    part = replace(config, out=str(tmp_path / "part"))
    assert train_on_two_ranks(replace(part, stop_at=5), tmp_path / "part-ranks")[0]["steps"] == 5  # inside epoch 2
    train_on_two_ranks(replace(part, resume="newest"), tmp_path / "resume-ranks")
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    assert [m["step"] for m in b] == list(range(1, 9))
    assert [m["epoch"] for m in a] == [0] * 4 + [1] * 4
    for key in ("loss", "grad_norm", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key


def test_loss_average_ranks_trains_the_mean_of_the_ranks_means(grouped: Path, tmp_path: Path) -> None:
    """--loss-average ranks (Axolotl's normalisation): each rank's mean over its own group, the means
    averaged (over the one group of the epoch's last step there); the token mean is its control."""
    out = tmp_path / "w.pt"
    run_on_ranks(_rank_epoch, 2, args=(str(grouped), "ddp", str(out), None, True), deadline_s=240)
    got = torch.load(out)
    assert _close(got, _one_process(grouped, rank_means=True))
    assert not _close(got, _one_process(grouped))


def _first_step(grouped: Path, tmp_path: Path, name: str, **kw) -> dict:
    config = TrainConfig(
        data=str(grouped),
        model="tiny",
        out=str(tmp_path / name),
        tokens_per_step=BUDGET,
        max_steps=1,
        lr=1e-3,
        warmup=0,
        log_every=1,
        num_workers=0,
        progress=False,
        device="cpu",
        eval_data="none",
        **kw,
    )
    (tmp_path / f"{name}-ranks").mkdir()
    train_on_two_ranks(config, tmp_path / f"{name}-ranks")
    return _metrics(tmp_path / name)[0]


def test_train_takes_loss_average_ranks_under_torchrun(grouped: Path, tmp_path: Path) -> None:
    """pack-train's loop passes --loss-average on: the first step's logged loss (the token mean of the
    same weights) is the same, its gradient another (the control: tokens). Two ranks sharing each row
    (--context-parallel 2) are one data-parallel group: there the two averages are one."""
    tokens, ranks = (_first_step(grouped, tmp_path, average, loss_average=average) for average in ("tokens", "ranks"))
    assert tokens["loss"] == pytest.approx(ranks["loss"], rel=1e-6)
    assert tokens["grad_norm"] != pytest.approx(ranks["grad_norm"], rel=1e-4)
    shared = [_first_step(grouped, tmp_path, f"cp-{average}", loss_average=average, context_parallel=2) for average in ("tokens", "ranks")]
    assert shared[0]["grad_norm"] == pytest.approx(shared[1]["grad_norm"], rel=1e-6)


@pytest.mark.parametrize(("value", "want"), [("false", "ranks"), ("true", "tokens"), (None, "tokens")])
def test_trls_average_tokens_across_devices_is_loss_average(tmp_path: Path, value: str | None, want: str) -> None:
    """TRL's key maps to --loss-average (absent: TRL's default, the token mean); Axolotl files default
    to ranks (tests/e2e/test_config_files.py); a value that is no boolean is one line."""
    from pipeline.config_file import read_config_file
    from pipeline.errors import UserError
    from trainer.cli import pack_train
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model_name_or_path: tiny\nlearning_rate: 1.0e-4\n" + (f"average_tokens_across_devices: {value}\n" if value else ""))
    settings = read_config_file(cfg, pack_train, TRAIN_CHECKS, foreign="pack-train", mapping=[])
    assert settings.get("loss_average", "tokens") == want
    cfg.write_text("model_name_or_path: tiny\naverage_tokens_across_devices: sometimes\n")
    with pytest.raises(UserError, match="'sometimes' has no equivalent here: use true or false"):
        read_config_file(cfg, pack_train, TRAIN_CHECKS, foreign="pack-train", mapping=[])
