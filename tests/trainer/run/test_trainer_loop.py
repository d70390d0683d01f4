"""trainer.run.loop / trainer.run.checkpoint / trainer.model.precision: loss normalisation, exact resume, DDP on gloo,
checkpoints, --dtype bf16-weights."""

from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).parents[2]))
from gloo_ranks import fork_ranks, free_port  # noqa: E402
from packed_factory import default_labels, make_packed_folder, random_packed_folder  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from pipeline.shards import read_manifest  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data.stream import ShardReader  # noqa: E402
from trainer.model.load import build_model  # noqa: E402
from trainer.model.loss import LossModule  # noqa: E402
from trainer.model.precision import MasterAdamW, adamw_update  # noqa: E402
from trainer.run import checkpoint as ckpt  # noqa: E402
from trainer.run.loop import backward_window  # noqa: E402
from trainer.run.optim import (
    Schedule,  # noqa: E402
    param_groups,  # noqa: E402
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 18 rows of <= 64 tokens (token ids < 300) in 3 shards: ~4 steps per epoch."""
    return random_packed_folder(tmp_path_factory.mktemp("packed"), 64, count=50, low=4, high=40, rows_per_shard=7)


def _config(packed: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(packed),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        grad_accum=2,
        lr=2e-3,
        warmup=2,
        max_steps=6,
        log_every=1,
        num_workers=0,
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------- schedule


def test_schedule_warmup_then_decay() -> None:
    cos = Schedule("cosine", warmup=4, total=20, min_ratio=0.1)
    assert [cos(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(4) == pytest.approx(1.0) and cos(20) == pytest.approx(0.1)
    assert cos(12) == pytest.approx(0.55)  # halfway: midpoint of 1.0 and 0.1
    lin = Schedule("linear", warmup=0, total=10, min_ratio=0.0)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert Schedule("constant", 2, 10, 0.1)(9) == 1.0


# --------------------------------------------------------------------------- loss normalisation


def _grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


class _CheckpointFails(torch.autograd.Function):
    """The identity, whose backward raises what torch.utils.checkpoint raises when a recomputed
    layer saved other tensors than its forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise CheckpointError(
            "torch.utils.checkpoint: Recomputed values for the following tensors have "
            "different metadata than during the forward pass.\ntensor at position 17: ..."
        )


def test_a_checkpoint_error_in_the_backward_is_one_line(packed: Path) -> None:
    reader = ShardReader(packed, read_manifest(packed))
    module = LossModule(build_model("tiny", seed=1)[0])
    failing = lambda batch: _CheckpointFails.apply(module(batch))  # noqa: E731
    with pytest.raises(UserError, match="recomputed saved other tensors.*train with --no-compile or --grad-checkpointing 0") as err:
        backward_window(failing, [reader.microbatch(np.array([0, 1]))], device=torch.device("cpu"))
    assert "\n" not in str(err.value) and "Recomputed values" in str(err.value)
    backward_window(module, [reader.microbatch(np.array([0, 1]))], device=torch.device("cpu"))  # control
    assert all(p.grad is not None for p in module.parameters())


def test_accumulation_equals_one_big_batch(packed: Path) -> None:
    reader = ShardReader(packed, read_manifest(packed))
    groups = [np.array([0]), np.array([1, 2, 3]), np.array([4, 5])]  # unequal loss-token counts
    micro = [reader.microbatch(g) for g in groups]
    big = reader.microbatch(np.concatenate(groups))
    assert len({m.n_loss_tokens for m in micro}) == 3
    model, _ = build_model("tiny", seed=1)
    module = LossModule(model)

    loss_acc, counts, n = backward_window(module, micro, device=torch.device("cpu"))
    accumulated = _grads(module)
    assert int(counts[0]) == n == big.n_loss_tokens and int(counts[1]) == big.n_tokens
    module.zero_grad(set_to_none=True)
    big_loss, _, _ = backward_window(module, [big], device=torch.device("cpu"))
    one_batch = _grads(module)
    assert float(loss_acc) == pytest.approx(float(big_loss), rel=1e-5)
    torch.testing.assert_close(accumulated, one_batch, rtol=1e-4, atol=1e-7)

    # The tempting alternative, a mean of per-micro-batch means, is measurably different.
    module.zero_grad(set_to_none=True)
    for m in micro:
        (module(m) / m.n_loss_tokens / len(micro)).backward()
    assert not torch.allclose(_grads(module), one_batch, rtol=1e-3, atol=1e-6)


# ----------------------------------------------------------------------------------- resume


def test_resume_matches_uninterrupted_run_bitwise(packed: Path, tmp_path: Path) -> None:
    full = train(_config(packed, tmp_path / "full", max_steps=7))
    part = train(_config(packed, tmp_path / "part", max_steps=7, stop_at=3))
    assert part["steps"] == 3 and part["checkpoint"].endswith("step-00000003")
    with pytest.raises(UserError, match="already holds checkpoints"):
        train(_config(packed, tmp_path / "part", max_steps=7))
    rest = train(_config(packed, tmp_path / "part", max_steps=7, resume="newest"))
    assert rest["steps"] == full["steps"] == 7
    a, b = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    assert [m["step"] for m in b] == list(range(1, 8))
    assert {m["epoch"] for m in a} == {0, 1}  # the run crosses an epoch boundary
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key  # bitwise, not approx
    assert a[-1]["loss"] < a[0]["loss"]
    wa = ckpt.load_model_weights(tmp_path / "full" / "checkpoints" / "step-00000007")
    wb = ckpt.load_model_weights(tmp_path / "part" / "checkpoints" / "step-00000007")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert full["tokens"] == rest["tokens"]


def test_warmup_ratio_is_a_share_of_the_steps_rounded_up(packed: Path, tmp_path: Path) -> None:
    """--warmup-ratio 0.3 over 5 steps warms up for 2 (ceil 1.5), as the Hugging Face Trainer counts."""
    train(_config(packed, tmp_path / "run", max_steps=5, warmup=0, warmup_ratio=0.3, schedule="constant"))
    assert [m["lr"] for m in _metrics(tmp_path / "run")] == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3])
    with pytest.raises(UserError, match="warmup 2 and warmup_ratio 0.3 both set the warmup: give one"):
        train(_config(packed, tmp_path / "both", warmup=2, warmup_ratio=0.3))


def test_resume_refuses_a_changed_data_stream(packed: Path, tmp_path: Path) -> None:
    train(_config(packed, tmp_path / "run", max_steps=2))
    with pytest.raises(UserError, match="grad_accum"):
        train(_config(packed, tmp_path / "run", max_steps=4, grad_accum=1, resume="newest"))
    with pytest.raises(UserError, match="holds no checkpoint"):
        train(_config(packed, tmp_path / "empty", resume="newest"))


def test_resume_with_more_steps_stretches_the_schedule(packed: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(_config(packed, run, max_steps=2, warmup=0, schedule="linear"))
    with pytest.raises(UserError, match="already at step 2 of 2"):
        train(_config(packed, run, max_steps=2, warmup=0, schedule="linear", resume="newest"))
    train(_config(packed, run, max_steps=4, warmup=0, schedule="linear", resume="newest"))
    lrs = [m["lr"] for m in _metrics(run)]
    # steps 3 and 4 follow a 4-step linear decay from 2e-3 towards 0.1 x 2e-3, not the old 2-step one
    assert lrs[2:] == pytest.approx([2e-3 * (1 - 0.9 * 2 / 4), 2e-3 * (1 - 0.9 * 3 / 4)])


# ------------------------------------------------------------------------------- checkpoints


def test_checkpoint_is_complete_and_loadable_by_transformers(packed: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    summary = train(_config(packed, run, max_steps=4, save_every=2, keep_last=1))
    names = [p.name for p in ckpt.list_checkpoints(run)]
    assert names == ["step-00000004"]  # keep_last=1 removed step 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    path = ckpt.list_checkpoints(run)[-1]
    assert ckpt.checkpoint_damage(path) is None
    for name in ("optimizer.pt", "scheduler.pt", "rng-rank0.pt", "trainer_state.json"):
        assert (path / name).is_file()
    state = ckpt.read_trainer_state(path)
    assert state["step"] == 4 and state["tokens_seen"] == summary["tokens"]
    loaded = AutoModelForCausalLM.from_pretrained(path / "model", local_files_only=True)
    saved = ckpt.load_model_weights(path)
    for name, tensor in loaded.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    summary_file = json.loads((run / "summary.json").read_text())
    assert summary_file["steps"] == 4 and summary_file["attention"] == summary["attention"]


def test_resume_steps_over_a_damaged_checkpoint(packed: Path, tmp_path: Path, capsys) -> None:
    train(_config(packed, tmp_path / "full", max_steps=4))
    run = tmp_path / "run"
    train(_config(packed, run, max_steps=4, save_every=2))
    newest = run / "checkpoints" / "step-00000004"
    weights = newest / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1  # one flipped bit inside a tensor: safetensors itself would load it silently
    weights.write_bytes(bytes(data))
    with pytest.raises(
        UserError,
        match=r"resume='strict': checkpoint .*step-00000004 is damaged "
        r"\(model/model.safetensors does not match its sha256\)",
    ):
        train(_config(packed, run, max_steps=4, resume="strict"))
    with pytest.raises(UserError, match="already at step 4"):  # the intact one is never skipped
        train(_config(packed, tmp_path / "full", max_steps=4, resume="strict"))
    rest = train(_config(packed, run, max_steps=4, resume="newest"))
    assert "step-00000004 is damaged" in capsys.readouterr().err
    assert rest["steps"] == 4 and ckpt.checkpoint_damage(newest) is None  # redone from step 2
    a = ckpt.load_model_weights(tmp_path / "full" / "checkpoints" / "step-00000004")
    b = ckpt.load_model_weights(newest)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_damage_names_what_is_wrong(packed: Path, tmp_path: Path) -> None:
    train(_config(packed, tmp_path, max_steps=1))
    path = ckpt.list_checkpoints(tmp_path)[-1]
    assert ckpt.checkpoint_damage(path) is None
    (path / "optimizer.pt").write_bytes((path / "optimizer.pt").read_bytes()[:100])
    assert ckpt.checkpoint_damage(path) == f"optimizer.pt has 100 bytes, not {_listed(path, 'optimizer.pt')}"
    (path / "optimizer.pt").unlink()
    assert ckpt.checkpoint_damage(path) == "optimizer.pt is missing"
    (path / ckpt.FILE_LIST).write_text("{")
    assert ckpt.checkpoint_damage(path) == "its checkpoint.json is unreadable (JSONDecodeError)"
    (path / ckpt.FILE_LIST).unlink()
    assert "no checkpoint.json" in ckpt.checkpoint_damage(path)
    with pytest.raises(UserError, match="no intact checkpoint"):
        ckpt.resume_point(tmp_path, strict=False)


def test_a_listed_file_that_does_not_load_is_one_line(packed: Path, tmp_path: Path) -> None:
    """A file that matches its listing but does not load (written damaged) is one line, too."""
    train(_config(packed, tmp_path, max_steps=1))
    path = ckpt.list_checkpoints(tmp_path)[-1]
    (path / "optimizer.pt").write_bytes(b"not a pickle")
    ckpt.write_file_list(path)
    with pytest.raises(UserError, match=r"optimizer.pt: cannot be loaded \(UnpicklingError"):
        train(_config(packed, tmp_path, max_steps=2, resume="newest"))


def _listed(path: Path, name: str) -> int:
    return json.loads((path / ckpt.FILE_LIST).read_text())["files"][name]["bytes"]


# ------------------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, world: int, port: int, config: TrainConfig, record: str) -> None:
    """One DDP rank: record which rows it reads, train, write its summary."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from trainer.data import stream as data

    seen: list[list[int]] = []
    original = data.ShardReader.microbatch

    def spy(self, rows):
        seen.append(rows.tolist())
        return original(self, rows)

    data.ShardReader.microbatch = spy
    summary = train(config)
    Path(record, f"rank{rank}.json").write_text(json.dumps({"rows": seen, "summary": summary}))
    assert not dist.is_initialized(), "train() left its process group open"


@pytest.mark.parametrize(
    ("parallel", "accum", "reduce"),
    [
        ("ddp", 1, "fp32"),
        ("fsdp", 1, "fp32"),
        ("fsdp", 2, "fp32"),
        ("ddp", 1, "bf16"),
        ("fsdp", 2, "bf16"),
        ("fsdp-keep", 2, "fp32"),
        ("fsdp-ckpt2", 1, "fp32"),
        ("ddp-b1", 2, "fp32"),
    ],
)
def test_two_ranks_gloo_disjoint_data_and_same_losses_as_accumulation(
    packed: Path, tmp_path: Path, parallel: str, accum: int, reduce: str
) -> None:
    steps = 4 // accum  # one epoch of this folder: rows are disjoint across ranks within an epoch
    # "-keep": FSDP2 keeps gathered parameters until the backward; "-ckpt2": layer 0 of the tiny
    # model's 2 recomputes its activations under FSDP2 (--grad-checkpointing 2), layer 1 keeps them;
    # "-b1": DDP buckets of 1 MiB (several for the tiny model), whose gradient views accumulate
    # over two micro-batches and are zeroed in place between steps
    config = _config(
        packed,
        tmp_path / "ddp",
        grad_accum=accum,
        max_steps=steps,
        parallel=parallel.split("-")[0],
        grad_reduce=reduce,
        reshard_after_forward=not parallel.endswith("-keep"),
        grad_checkpointing=2 if parallel.endswith("-ckpt2") else 0,
        ddp_bucket_mb=1 if parallel.endswith("-b1") else 250,
    )
    fork_ranks(_ddp_worker, (2, free_port(), config, str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    rows = [r["rows"] for r in ranks]
    assert len(rows[0]) == len(rows[1]) == steps * accum  # `accum` micro-batches per step per rank
    flat = [{i for mb in r for i in mb} for r in rows]
    assert not flat[0] & flat[1]
    assert ranks[0]["summary"]["steps"] == ranks[1]["summary"]["steps"] == steps
    own = [json.loads((tmp_path / "ddp" / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [o["steps"] for o in own] == [steps, steps]
    assert [o["micro_batches"] for o in own] == [len(rows[0]), len(rows[1])]

    # Same window (2 x accum micro-batches per step) on one process: same losses, since
    # the loss is normalised by the loss tokens of the whole window across ranks.
    single = train(replace(config, out=str(tmp_path / "single"), grad_accum=2 * accum))
    ddp_losses = [m["loss"] for m in _metrics(tmp_path / "ddp")]
    one_losses = [m["loss"] for m in _metrics(tmp_path / "single")]
    # bf16 gradient traffic: the same first loss (no update yet), then within bf16 rounding
    assert ddp_losses[0] == pytest.approx(one_losses[0], rel=1e-6)
    assert ddp_losses == pytest.approx(one_losses, rel=1e-5 if reduce == "fp32" else 2e-3)
    assert single["tokens"] == ranks[0]["summary"]["tokens"]
    wd = ckpt.load_model_weights(tmp_path / "ddp" / "checkpoints" / f"step-{steps:08d}")
    ws = ckpt.load_model_weights(tmp_path / "single" / "checkpoints" / f"step-{steps:08d}")
    if reduce == "fp32":
        for name in ws:
            torch.testing.assert_close(wd[name], ws[name], rtol=1e-4, atol=1e-5)
    else:  # Adam moves each weight by about lr per step, so a bf16-rounded tiny gradient can at
        # most flip a step: bounded by 2 x lr x steps, and rare (the mean stays tiny)
        diffs = [(wd[n] - ws[n]).abs() for n in ws]
        assert max(float(d.max()) for d in diffs) <= 2 * config.lr * steps
        assert float(torch.cat([d.flatten() for d in diffs]).mean()) < 1e-5
        assert any(float(d.max()) > 0 for d in diffs)  # and the bf16 reduction did happen


def _rows_with_and_without_loss(folder: Path) -> set[int]:
    """12 one-example rows of 60 tokens; the rows returned (half of them) have no loss token."""
    rng = np.random.default_rng(3)
    silent = {1, 2, 5, 7, 8, 11}
    rows = [
        [(i, tokens, np.full(60, -100) if i in silent else default_labels(tokens))]
        for i, tokens in enumerate(rng.integers(3, 300, size=(12, 60)))
    ]
    make_packed_folder(folder, rows, 64, rows_per_shard=4)
    return silent


def test_a_micro_batch_without_loss_tokens_gives_every_parameter_a_zero_gradient(tmp_path: Path) -> None:
    """DDP and FSDP2 reduce gradients parameter by parameter on every rank, so a rank whose
    micro-batch has no loss token must still produce a gradient for every parameter (zeros),
    the output layer's included; the control, a row with loss tokens, moves every one."""
    silent = _rows_with_and_without_loss(tmp_path / "packed")
    reader = ShardReader(tmp_path / "packed", read_manifest(tmp_path / "packed"))
    module = LossModule(build_model("tiny", seed=0)[0])
    for row, moves in ((min(silent), False), (0, True)):
        module.zero_grad(set_to_none=True)
        batch = reader.microbatch(np.array([row]))
        assert (batch.n_loss_tokens == 0) is not moves
        module(batch).backward()
        grads = dict(module.named_parameters())
        assert all(p.grad is not None for p in grads.values()), [n for n, p in grads.items() if p.grad is None]
        assert all(bool(p.grad.any()) is moves for p in grads.values())


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_when_one_rank_has_no_loss_token_in_a_step(tmp_path: Path, parallel: str) -> None:
    """A step where one rank's micro-batch has no loss token and the other's has: the ranks stay
    in step (they used to mismatch their gradient collectives and abort) and the losses and
    weights equal one process over the same window."""
    silent = _rows_with_and_without_loss(tmp_path / "packed")
    config = _config(tmp_path / "packed", tmp_path / "ranks", tokens_per_step=64, grad_accum=1, max_steps=6, parallel=parallel)
    fork_ranks(_ddp_worker, (2, free_port(), config, str(tmp_path)))
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text())["rows"] for r in range(2)]
    lonely = [(a[0] in silent) != (b[0] in silent) for a, b in zip(*rows)]
    assert any(lonely), rows  # the case under test occurs in this run
    single = train(replace(config, out=str(tmp_path / "single"), grad_accum=2, parallel="ddp"))
    assert single["steps"] == 6
    assert [m["loss"] for m in _metrics(tmp_path / "ranks")] == pytest.approx([m["loss"] for m in _metrics(tmp_path / "single")], rel=1e-5)
    wr = ckpt.load_model_weights(tmp_path / "ranks" / "checkpoints" / "step-00000006")
    ws = ckpt.load_model_weights(tmp_path / "single" / "checkpoints" / "step-00000006")
    for name in ws:
        torch.testing.assert_close(wr[name], ws[name], rtol=1e-4, atol=1e-5)


def _sigterm_worker(rank: int, world: int, port: int, config: TrainConfig, record: str) -> None:
    """One DDP rank; rank 1 alone gets SIGTERM while it reads its first micro-batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import signal

    import torch.distributed as dist

    from trainer.data import stream as data

    original = data.ShardReader.microbatch

    def signalled(self, rows):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            data.ShardReader.microbatch = original
        return original(self, rows)

    data.ShardReader.microbatch = signalled
    summary = train(config)
    Path(record, f"rank{rank}.json").write_text(json.dumps(summary))
    assert not dist.is_initialized(), "train() left its process group open"


def test_ranks_agree_to_stop_on_sigterm_at_the_next_log_step(packed: Path, tmp_path: Path) -> None:
    """SIGTERM that reached one rank at step 1 stops both after step 2 (the first log step), with
    one checkpoint of that step."""
    config = _config(packed, tmp_path / "ddp", grad_accum=1, max_steps=4, log_every=2)
    fork_ranks(_sigterm_worker, (2, free_port(), config, str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["steps"] for r in ranks] == [2, 2]
    assert [r["stopped_by_sigterm"] for r in ranks] == [True, True]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ddp")] == ["step-00000002"]
    assert ckpt.checkpoint_damage(ckpt.list_checkpoints(tmp_path / "ddp")[0]) is None


def test_grad_checkpointing_changes_memory_not_results(packed: Path, tmp_path: Path) -> None:
    train(_config(packed, tmp_path / "plain", max_steps=3))
    train(_config(packed, tmp_path / "ckpt", max_steps=3, grad_checkpointing=1))
    plain, recomputed = _metrics(tmp_path / "plain"), _metrics(tmp_path / "ckpt")
    assert [m["loss"] for m in recomputed] == pytest.approx([m["loss"] for m in plain], rel=1e-6)


def _layer_forwards_in_one_step(every: int | None) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A 4-layer tiny model, one packed micro-batch forward + backward: how many times each decoder
    layer's MLP ran, and the gradients; `every` as enable_grad_checkpointing's (None: off)."""
    from trainer.data.batch import collate_rows
    from trainer.model.load import PRESETS, decoder_layers, enable_grad_checkpointing
    from trainer.model.loss import packed_loss

    preset = dict(PRESETS["tiny"])
    PRESETS["tiny4"] = {**preset, "num_hidden_layers": 4}
    try:
        model, _ = build_model("tiny4", attn="sdpa", seed=0)
    finally:
        del PRESETS["tiny4"]
    if every is not None:
        enable_grad_checkpointing(model, every=every)
    calls = [0] * 4
    for i, layer in enumerate(decoder_layers(model)):
        # a pre-hook: the recompute stops as soon as the backward has what it needs (torch's early
        # stop), before the MLP returns, so a forward hook would miss it
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    lengths = [5, 9, 3]
    ids = np.arange(1, sum(lengths) + 1, dtype=np.int32)
    row = dict(
        input_ids=ids,
        labels=ids.copy(),
        position_ids=np.concatenate([np.arange(n) for n in lengths]).astype(np.int32),
        seq_lens=np.array(lengths, np.int32),
    )
    total, _ = packed_loss(model, collate_rows([row]))
    total.backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grad_checkpointing_every_nth_layer_recomputes_only_those_layers() -> None:
    """--grad-checkpointing 2: layers 0 and 2 run their forward again in the backward, 1 and 3 do
    not, and the gradients are those without checkpointing. Control: every layer recomputes with 1."""
    calls_off, grads_off = _layer_forwards_in_one_step(None)
    calls_half, grads_half = _layer_forwards_in_one_step(2)
    calls_all, grads_all = _layer_forwards_in_one_step(1)
    assert calls_off == [1, 1, 1, 1]
    assert calls_half == [2, 1, 2, 1]
    assert calls_all == [2, 2, 2, 2]  # control: all recompute
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_half[name], grad, rtol=0, atol=0)
        torch.testing.assert_close(grads_all[name], grad, rtol=0, atol=0)


def test_grad_checkpointing_every_nth_layer_is_refused_where_layers_do_not_checkpoint_themselves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decoder that checkpoints its layers from its own loop leaves the layers' flags unset: only
    "every layer" can be honoured there, so N > 1 is one line, not a silent all-layers run."""
    from trainer.model.load import enable_grad_checkpointing

    model, _ = build_model("tiny", attn="sdpa", seed=0)
    monkeypatch.setattr(model, "activation_checkpointing_enable", lambda **_: None, raising=False)
    monkeypatch.setattr(model, "gradient_checkpointing_enable", lambda **_: None)
    with pytest.raises(UserError, match="--grad-checkpointing 2: this model's decoder layers do not checkpoint"):
        enable_grad_checkpointing(model, every=2)
    enable_grad_checkpointing(model, every=1)  # every layer: the model's own switch, no per-layer flags needed


def test_grad_checkpointing_option_takes_an_optional_layer_interval(packed: Path, tmp_path: Path) -> None:
    """`--grad-checkpointing` alone is every layer (1), `--grad-checkpointing 3` every third, absent 0."""
    from click.testing import CliRunner

    from trainer import cli

    seen: list[int] = []

    def fake(**options: object) -> None:
        seen.append(options["grad_checkpointing"])  # type: ignore[arg-type]

    command = cli.pack_train
    for args in (["--grad-checkpointing"], ["--grad-checkpointing", "3"], []):
        original = command.callback
        command.callback = fake
        try:
            result = CliRunner().invoke(command, ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "run"), *args])
        finally:
            command.callback = original
        assert result.exit_code == 0, result.output
    assert seen == [1, 3, 0]


def test_tokens_per_step_defaults_to_the_devices_budget(packed: Path, tmp_path: Path) -> None:
    """No --tokens-per-step: 8192 on the CPU (one row of the README's 8192-token packing per step),
    16384 on a GPU; the run records the number it used, so --resume compares numbers."""
    from trainer.config import TOKENS_PER_STEP, resolved

    assert TOKENS_PER_STEP == {"cuda": 16384, "cpu": 8192}
    config = _config(packed, tmp_path / "d", tokens_per_step=None, grad_accum=1, max_steps=1)
    assert resolved(config, "cuda").tokens_per_step == 16384
    assert resolved(replace(config, tokens_per_step=300), "cpu").tokens_per_step == 300
    train(config)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["tokens_per_step"] == 8192
    assert ckpt.read_trainer_state(tmp_path / "d" / "checkpoints" / "step-00000001")["config"]["tokens_per_step"] == 8192


def test_epochs_and_max_steps_set_the_schedule_length(packed: Path, tmp_path: Path) -> None:
    from trainer.data.stream import Planner, row_lengths

    planner = Planner(row_lengths(packed, read_manifest(packed)), 128, seed=0, grad_accum=2)
    two_epochs = planner.steps_in_epoch(0) + planner.steps_in_epoch(1)
    summary = train(_config(packed, tmp_path / "e", max_steps=None, epochs=2))
    assert summary["steps"] == summary["total_steps"] == two_epochs
    metrics = _metrics(tmp_path / "e")
    assert [m["epoch"] for m in metrics] == [0] * planner.steps_in_epoch(0) + [1] * planner.steps_in_epoch(1)
    assert metrics[-1]["lr"] < metrics[2]["lr"]  # cosine decays over the two epochs
    capped = train(_config(packed, tmp_path / "c", max_steps=2, epochs=2))
    assert capped["total_steps"] == 2


def test_the_heap_is_frozen_after_the_first_step_and_handed_back_when_the_run_ends(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the first step has run (and compiled), the objects alive are set aside from Python's full
    garbage collections (`trainer.run.loop.freeze_heap`); when the run ends, or fails, they are the
    collector's again, so a process that trains twice frees the first run's model."""
    import gc

    import trainer.run.loop as loop

    steps, frozen = [], []
    real_step, real_freeze = loop.Meter.step, loop.freeze_heap
    monkeypatch.setattr(loop.Meter, "step", lambda self, *a: (steps.append(1), real_step(self, *a))[1])

    def freeze() -> None:
        real_freeze()
        frozen.append((len(steps), gc.get_freeze_count()))

    monkeypatch.setattr(loop, "freeze_heap", freeze)
    train(_config(packed, tmp_path / "a", max_steps=3))
    assert len(frozen) == 1 and frozen[0][0] == 1 and frozen[0][1] > 1000  # after step 1 only
    assert gc.get_freeze_count() == 0

    def freeze_then_fail() -> None:
        real_freeze()
        raise RuntimeError("boom")

    monkeypatch.setattr(loop, "freeze_heap", freeze_then_fail)
    with pytest.raises(RuntimeError, match="boom"):
        train(_config(packed, tmp_path / "b", max_steps=3))
    assert gc.get_freeze_count() == 0


def test_a_shard_changed_after_packing_stops_training_before_any_checkpoint(packed: Path, tmp_path: Path) -> None:
    """A flipped, in-vocabulary token id passes the structural checks; the sha256 check beside
    training catches it (by default): one line, and no checkpoint holds what it trained on."""
    from packed_factory import rewrite_shard, shard_arrays

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in packed.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    arrays = shard_arrays(bad / "shard-00001.arrow")
    arrays["input_ids"][3] = (arrays["input_ids"][3] + 1) % 300
    if arrays["labels"][3] != -100:  # labels are unshifted copies: keep the row consistent
        arrays["labels"][3] = arrays["input_ids"][3]
    rewrite_shard(bad, 1, arrays, update_hash=False)
    with pytest.raises(UserError, match="shard-00001.arrow: sha256 .* does not match the manifest"):
        train(_config(bad, tmp_path / "run", max_steps=4, save_every=1))
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    summary = train(_config(bad, tmp_path / "run2", max_steps=2, verify_hashes=False))
    assert summary["steps"] == 2  # --no-verify-hashes: the user's call


# ------------------------------------------------------------------- --dtype bf16-weights

BF16W = "bf16-weights"  # trainer.model.precision: bf16 weights for compute, fp32 masters in the optimizer


def _loss_curve(run: Path) -> list[float]:
    return [m["loss"] for m in _metrics(run)]


def test_masters_hold_fp32_and_gradients_accumulate_in_fp32(packed: Path) -> None:
    model, _ = build_model("tiny", seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = MasterAdamW([{"params": list(model.parameters()), "weight_decay": 0.0}])
    buffers = {b.dtype for b in model.buffers()}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert buffers == {torch.float32}  # RoPE's inverse frequencies keep their precision
    assert all(m.dtype == torch.float32 for m in masters.weight_of)
    assert all(torch.equal(m, before[n]) for m, (n, _) in zip(masters.weight_of, model.named_parameters()))

    reader = ShardReader(packed, read_manifest(packed))
    micro = [reader.microbatch(np.array([i])) for i in range(3)]
    module = LossModule(model)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    backward_window(module, micro, device=torch.device("cpu"), autocast=bf16, masters=masters)
    assert all(p.grad is None for p in model.parameters())  # moved into the masters
    fp32_sum = torch.cat([m.grad.flatten() for m in masters.weight_of])
    assert fp32_sum.dtype == torch.float32

    # each micro-batch's bf16 gradient of its loss over the window's loss tokens, added in fp32
    n = sum(mb.n_loss_tokens for mb in micro)
    expected = torch.zeros_like(fp32_sum)
    for mb in micro:
        with bf16:
            loss = module(mb)
        (loss * (1.0 / n)).backward()
        expected += torch.cat([p.grad.flatten().float() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert torch.equal(fp32_sum, expected)
    # negative control: the same window accumulated in the bf16 .grad is rounded differently
    backward_window(module, micro, device=torch.device("cpu"), autocast=bf16)
    bf16_sum = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    assert not torch.equal(bf16_sum, fp32_sum)
    # one micro-batch: its bf16 gradients stay on the model, and the step reads them as they are
    masters.zero_grad()
    backward_window(module, micro[:1], device=torch.device("cpu"), autocast=bf16, masters=masters)
    assert all(m.grad is None for m in masters.weight_of)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def _in_groups(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _reference_and_masters(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, MasterAdamW, torch.optim.AdamW]:
    """Two copies of one fp32 model: one under torch.optim.AdamW, one under MasterAdamW (so bf16)."""
    reference, _ = build_model("tiny", seed=seed)
    model, _ = build_model("tiny", seed=seed)
    kw = dict(lr=1e-2, betas=(0.9, 0.95))
    torch_adamw = torch.optim.AdamW(param_groups(reference.parameters(), 0.1), foreach=False, **kw)
    return reference, model, MasterAdamW(param_groups(model.parameters(), 0.1), **kw), torch_adamw


@pytest.mark.parametrize("max_norm", [1e-3, float("inf")])  # clipping every step, and never
def test_master_adamw_steps_like_torch_adamw_with_clipping(max_norm: float) -> None:
    """The fused update (clip, AdamW, write the bf16 weight) equals clip_grad_norm_ + torch AdamW
    on fp32 weights given the same gradients, and the model's weights are the masters in bf16."""
    reference, model, masters, torch_adamw = _reference_and_masters(seed=3)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        for group in (*masters.param_groups, *torch_adamw.param_groups):
            group["lr"] = 1e-2 * (step + 1) / 4  # a schedule: the rate changes every step
        for ref, param in zip(reference.parameters(), model.parameters()):
            grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
            param.grad, ref.grad = grad, grad.float()  # a bf16 gradient is exactly an fp32 one
        norm = masters.clip_grad_norm_(max_norm)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
        masters.step()
        torch_adamw.step()
        masters.zero_grad()
        torch_adamw.zero_grad()
    for master, ref in zip(_in_groups(masters), _in_groups(torch_adamw)):
        torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(masters.weight_of[master], master.to(torch.bfloat16))


def test_master_adamw_without_clipping_control() -> None:
    """Negative control for the test above: with clipping skipped (coefficient 1) on one side only,
    the masters leave torch AdamW's tolerance."""
    reference, model, masters, torch_adamw = _reference_and_masters(seed=3)
    for ref, param in zip(reference.parameters(), model.parameters()):
        grad = torch.ones(param.shape, dtype=torch.bfloat16)
        param.grad, ref.grad = grad, grad.float()
    masters.clip_grad_norm_(float("inf"))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    masters.step()
    torch_adamw.step()
    master, ref = _in_groups(masters)[0], _in_groups(torch_adamw)[0]
    assert not torch.allclose(master, ref, rtol=1e-6, atol=1e-7)


def _compiled_master_steps(layers: int, steps: int = 3) -> tuple[Any, MasterAdamW]:
    """MasterAdamW over `layers` blocks of two biased linear layers (four parameter shapes), its
    update compiled (what CUDA does) with a counting backend, after `steps` steps with a new learning
    rate each: (the counter, the optimizer)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)) for _ in range(layers)])
    masters = MasterAdamW(param_groups(model.parameters(), 0.1), lr=1e-3)
    masters._update = torch.compile(adamw_update, backend=counter, dynamic=False, fullgraph=True)
    for step in range(steps):
        for group in masters.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        for param in model.parameters():
            param.grad = torch.randn(param.shape).to(torch.bfloat16)
        masters.clip_grad_norm_(1.0)
        masters.step()
        masters.zero_grad()
    return counter, masters


def test_master_adamw_compiles_one_graph_per_parameter_shape_whatever_the_depth() -> None:
    """The compiled update takes the learning rate, step and clip coefficient as tensors, and runs on
    chunks of at most CHUNK_TENSORS parameters of one shape: one graph of CHUNK_TENSORS parameters
    per shape for a whole run, the same graphs at 8 layers as at 40 (the compile time of one graph
    grows with its parameters: one graph over 448 LoRA matrices took minutes)."""
    shallow, _ = _compiled_master_steps(layers=8)
    deep, masters = _compiled_master_steps(layers=40)
    assert deep.frame_count == shallow.frame_count == 4  # (16, 8), (16,), (8, 16), (8,)
    assert deep.op_count == shallow.op_count
    assert all(int(s["step"]) == 3 for s in masters.state.values()) and len(masters.state) == 160


def test_master_adamw_in_one_chunk_per_shape_grows_with_depth_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: with each shape's parameters in one chunk, the graphs
    are as many, but at 40 layers each holds five times the per-parameter work (and the same few
    shared operations, so a little under five times the operations)."""
    from trainer.model import precision

    whole = precision.signature_chunks
    monkeypatch.setattr(precision, "signature_chunks", lambda pairs: whole(pairs, size=10**6))
    shallow, _ = _compiled_master_steps(layers=8)
    deep, _ = _compiled_master_steps(layers=40)
    assert deep.frame_count == shallow.frame_count == 4
    assert 4 * shallow.op_count < deep.op_count < 5 * shallow.op_count


def test_signature_chunks_keep_one_shape_per_chunk_in_order() -> None:
    """The docstring's example, and on a mixed list: every pair once, in its shape's order, at most
    `size` to a chunk, one master shape and gradient dtype to a chunk."""
    from trainer.model.precision import signature_chunks

    masters = [torch.zeros(s) for s in [(4, 8), (8, 4), (4, 8), (8, 4), (4, 8)]]
    chunks = signature_chunks([(m, m) for m in masters], size=2)
    assert [[next(i for i, m in enumerate(masters) if m is x) for x, _ in c] for c in chunks] == [[0, 2], [4], [1, 3]]
    rng = np.random.default_rng(0)
    pairs = [
        (torch.zeros(int(a), int(b)), torch.zeros(int(a), int(b), dtype=dt))
        for a, b, dt in zip(rng.integers(1, 4, 60), rng.integers(1, 4, 60), rng.choice([torch.float32, torch.bfloat16], 60))
    ]
    chunks = signature_chunks(pairs, size=3)
    assert sorted(id(m) for c in chunks for m, _ in c) == sorted(id(m) for m, _ in pairs)
    for chunk in chunks:
        assert 1 <= len(chunk) <= 3
        assert len({(m.shape, g.dtype) for m, g in chunk}) == 1
        positions = [next(i for i, (m, _) in enumerate(pairs) if m is x) for x, _ in chunk]
        assert positions == sorted(positions)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_run_says_its_first_step_compiles(packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture, compiled: bool) -> None:
    """The first step of a compiled run is silent for minutes on a large model: the start-up lines say
    why (and how to skip it); an uncompiled run says nothing of it."""
    from trainer.run.start import start

    start(_config(packed, tmp_path / "run", compile=compiled))
    said = "the first step compiles the decoder layers (torch.compile)" in capsys.readouterr().err
    assert said == compiled


def test_compiled_layers_keep_one_graph_for_every_row_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--compile` compiles each decoder layer once for a whole run: rows of other lengths, longer
    or shorter than the first, run the same graph, forward and backward. The inductor setting that
    keeps the RMSNorm backward's kernel choice off the first row's length is on (it acts only in
    Triton kernels, which a CPU run does not build: the GPU check is in BENCHMARKS.md), and
    dynamo's recompile limit has room for every layer."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from trainer.attention import kernels
    from trainer.data.batch import collate_flat
    from trainer.model.load import compile_decoder_layers, decoder_layers

    # the CPU's reference attention splits a row into its examples in Python: run it uncompiled,
    # as a GPU kernel is one opaque call, so that the layers' own graphs are what is counted
    monkeypatch.setattr(kernels, "sdpa_varlen", torch.compiler.disable(kernels.sdpa_varlen))
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with torch._dynamo.config.patch(recompile_limit=8), inductor_config.patch({"triton.mix_order_reduction_non_strict_mode": False}):
        model, _ = build_model("tiny", attn="sdpa", vocab_size=300)
        compile_decoder_layers(model)
        assert inductor_config.triton.mix_order_reduction_non_strict_mode is True
        assert torch._dynamo.config.recompile_limit >= 2 * len(decoder_layers(model)) + 8  # room for 64-bit indexing
        rng = np.random.default_rng(0)
        # the first step's rows, then longer, then shorter ones, in other numbers of examples (none
        # of them one more than a head count: dynamo would take the equal sizes for one)
        for lens in ([40, 30, 58, 11, 23], [200, 7, 30, 90, 5, 66], [5, 9]):
            lens = np.array(lens)
            ids = rng.integers(3, 300, int(lens.sum()))
            batch = collate_flat(ids, ids.copy(), np.concatenate([np.arange(n) for n in lens]), lens)
            LossModule(model)(batch).backward()
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3  # nothing compiled again after the first step


def test_checkpoints_hold_the_fp32_masters_and_resume_bitwise(packed: Path, tmp_path: Path) -> None:
    full = train(_config(packed, tmp_path / "full", dtype=BF16W))
    train(_config(packed, tmp_path / "part", dtype=BF16W, stop_at=2))
    rest = train(_config(packed, tmp_path / "part", dtype=BF16W, resume="newest"))
    assert full["steps"] == rest["steps"] == 6
    assert _loss_curve(tmp_path / "full") == _loss_curve(tmp_path / "part")  # bitwise, not approx
    saved = ckpt.load_model_weights(tmp_path / "full" / "checkpoints" / "step-00000006")
    again = ckpt.load_model_weights(tmp_path / "part" / "checkpoints" / "step-00000006")
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    weights = saved["model.layers.0.mlp.up_proj.weight"]
    # the fp32 masters, not their bf16 copies (which a bf16 round trip would leave unchanged)
    assert weights.dtype == torch.float32
    assert not torch.equal(weights, weights.to(torch.bfloat16).float())


def test_bf16_weights_train_like_bf16_autocast(packed: Path, tmp_path: Path) -> None:
    train(_config(packed, tmp_path / "weights", dtype=BF16W))
    train(_config(packed, tmp_path / "autocast", dtype="bf16"))
    weights, autocast = _loss_curve(tmp_path / "weights"), _loss_curve(tmp_path / "autocast")
    assert weights[0] == pytest.approx(autocast[0], rel=1e-2)  # the same model, before any update
    assert weights == pytest.approx(autocast, rel=3e-2)
    assert weights[-1] < weights[0]


@pytest.fixture
def as_rank_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """train() believes it runs under torchrun as rank 0 of 2 (it refuses before any collective)."""
    from trainer.distributed.parallel import DistInfo
    from trainer.run import start

    monkeypatch.setattr(start, "setup_distributed", lambda device, **_: DistInfo(enabled=True, rank=0, world_size=2))


@pytest.mark.parametrize("device, expected", [(torch.device("cuda", 3), {"device_ids": [3]}), (torch.device("cpu"), {}), (None, {})])
def test_barrier_names_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch, device: torch.device | None, expected: dict[str, Any]) -> None:
    """A CUDA rank's barrier names its own GPU (else PyTorch warns that it guesses the current
    one, on every multi-GPU run); a CPU (gloo) rank's names none, and a run of one rank waits for
    no one."""
    import torch.distributed as dist

    from trainer.distributed.parallel import DistInfo

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: calls.append(kwargs))
    DistInfo(enabled=True, rank=0, world_size=2, device=device).barrier()
    DistInfo(device=device).barrier()  # not under torchrun
    assert calls == [expected]


@pytest.mark.usefixtures("as_rank_of_two")
def test_bf16_weights_refuses_ddp(packed: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="needs parallel fsdp"):
        train(_config(packed, tmp_path / "run", dtype=BF16W))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------- --optimizer adafactor


def test_adafactor_keeps_factored_state_and_resumes_bitwise(packed: Path, tmp_path: Path) -> None:
    """A matrix's optimizer state is one row and one column of statistics, not two full moments
    (what lets a full fine-tune of a large model fit); a resumed run is the uninterrupted one."""
    full = train(_config(packed, tmp_path / "full", optimizer="adafactor"))
    train(_config(packed, tmp_path / "part", optimizer="adafactor", stop_at=3))
    train(_config(packed, tmp_path / "part", optimizer="adafactor", resume="newest"))
    assert _loss_curve(tmp_path / "full") == _loss_curve(tmp_path / "part")  # bitwise
    losses = _loss_curve(tmp_path / "full")
    assert losses[-1] < losses[0]
    state = torch.load(Path(full["checkpoint"]) / "optimizer.pt", weights_only=True)["state"]
    weights = ckpt.load_model_weights(Path(full["checkpoint"]))
    up = weights["model.layers.0.mlp.up_proj.weight"]
    shapes = [{k: tuple(v.shape) for k, v in s.items() if k != "step"} for s in state.values()]
    assert {"row_var": (up.shape[0], 1), "col_var": (1, up.shape[1])} in shapes
    assert not any("exp_avg" in s for s in shapes)  # AdamW's full-size moments
    stored = sum(v.numel() for s in state.values() for k, v in s.items() if k != "step")
    assert stored < sum(w.numel() for w in weights.values()) / 4


@pytest.mark.usefixtures("as_rank_of_two")
def test_adafactor_refuses_fsdp(packed: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="adafactor is not supported with parallel fsdp"):
        train(_config(packed, tmp_path / "run", optimizer="adafactor", parallel="fsdp"))
    with pytest.raises(UserError, match="unknown optimizer"):
        train(_config(packed, tmp_path / "run", optimizer="sgd"))


def test_adafactor_refuses_bf16_weights(packed: Path, tmp_path: Path) -> None:
    """bf16-weights' masters are updated by its fused AdamW: with Adafactor it says so, before any
    file is written (and --dtype bf16 with Adafactor trains)."""
    with pytest.raises(UserError, match="bf16-weights needs optimizer adamw"):
        train(_config(packed, tmp_path / "run", optimizer="adafactor", dtype=BF16W))
    assert not (tmp_path / "run").exists()
    assert train(_config(packed, tmp_path / "ok", optimizer="adafactor", dtype="bf16", max_steps=1))["steps"] == 1


def test_ddp_gradients_are_views_of_its_buckets_of_the_asked_size(tmp_path: Path) -> None:
    """--ddp-bucket-mb sets DDP's bucket size, and each gradient is a view into a bucket: zeroed in
    place, as the step does, it keeps its storage from one backward to the next, so autograd adds
    into the bucket itself (set to None, it would be allocated anew and copied into the bucket)."""
    import torch.distributed as dist

    from trainer.distributed.parallel import DistInfo, wrap_parallel

    # a time limit on the group's waits: this test hung once (not reproduced), and would then stall CI
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
    )
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        ddp = wrap_parallel(model, [], DistInfo(enabled=True), fsdp=False, bf16=False, bucket_mb=3)
        assert ddp.bucket_bytes_cap == 3 * 1024 * 1024
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        storages = []
        for _ in range(3):  # DDP rebuilds its buckets after the first backward, in gradient order
            ddp(torch.randn(8, 64)).square().sum().backward()
            storages.append([p.grad.untyped_storage().data_ptr() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
        assert storages[1] == storages[2]
        assert len(set(storages[2])) < len(storages[2])  # the 4 gradients share bucket storage
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- a loss that diverges


def test_a_loss_that_turns_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights poisoned by the 3rd optimizer step: step 4's loss is NaN; the run stops at the
    next logged step (one line naming step 4 and the step-2 checkpoint) and saves nothing more."""
    real = torch.optim.AdamW.step
    calls = []

    def step(self, *a, **kw):  # noqa: ANN001, ANN202
        out = real(self, *a, **kw)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                next(p for g in self.param_groups for p in g["params"]).fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(UserError) as err:
        train(_config(packed, tmp_path / "run", save_every=2, log_every=2, max_steps=6))
    line = str(err.value)
    assert "\n" not in line and line.startswith(
        "the loss of step 4 is not finite (NaN or inf): training stopped at step 4 without saving"
    ), line
    assert "step-00000002, is intact" in line, line
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-00000002"]


def test_weights_made_inf_by_an_update_are_never_saved(packed: Path, tmp_path: Path) -> None:
    """--lr 1e308: step 1's loss is finite, the weights after it are not; nothing is saved."""
    with pytest.raises(
        UserError,
        match=r"^after step 1 a weight is not finite \(NaN or inf\): training stopped "
        r"at step 1 without saving; no checkpoint was saved; lower lr",
    ):  # the API spells options so
        train(_config(packed, tmp_path / "run", lr=1e308, save_every=1, log_every=5, max_steps=3))
    assert ckpt.list_checkpoints(tmp_path / "run") == []
