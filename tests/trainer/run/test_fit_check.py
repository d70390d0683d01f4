"""The memory check before the first step (`trainer.run.fit_check`): the largest micro-batch is found and
named, the measured line is read right, a row that cannot fit stops the run in one line naming it
and the longest that would, and the probes leave no trace in the run's losses.

The GPU's measurements are replaced by a line of the probe's tokens here (the CPU has no allocator
statistics); the probe steps themselves are the run's real forward and backward."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from packed_factory import make_packed_folder, pack_lengths
from run_metrics import logged_losses

from pipeline.errors import UserError
from trainer import TrainConfig, train
from trainer.data.stream import Largest, Planner, largest_microbatch
from trainer.model.long_rows import HostOffload
from trainer.run import fit_check
from trainer.run.fit_check import (
    MARGIN,
    Need,
    fit_line,
    host_state_bytes,
    longest_fitting,
    measure_need,
    optimizer_state_bytes,
    probe_tokens,
    synthetic_row,
    verdict,
)

GIB = 2**30


def test_probe_lengths_are_past_the_kept_logits_and_two_tiles() -> None:
    """P is past the logits the loss keeps whole (2**29 elements), two tiles, 8,192, a multiple of 4,096."""
    assert probe_tokens(32000, 0) == 20480  # 2**29 / 32000 = 16,777.2
    assert probe_tokens(128256, 0) == 8192
    assert probe_tokens(128256, 16384) == 32768
    assert probe_tokens(32000, 3000) == 20480
    assert probe_tokens(128256, 0, 262144) == 32768  # an eighth of the largest share
    assert probe_tokens(128256, 0, 100000) == 16384  # 12,500 rounded up to 4,096s
    for vocab in (1000, 50257, 151936, 262144):
        p = probe_tokens(vocab, 0)
        assert p % 4096 == 0 and p * vocab > 2**29 and p >= 8192


def test_the_chord_of_a_convex_peak_never_overstates_the_need() -> None:
    """The step's peak is the largest of its phases' lines (a constant loss chunk at short rows, the
    layers' activations at long ones): the chord through two probes, extended, stays at or below it,
    so a refusal is never wrong (the longest length named is an upper bound)."""

    def peak(t: float) -> float:
        return max(6e9 + 16e3 * t, 1e9 + 150e3 * t)

    for largest in (50_000, 196_608, 1_048_576):
        p = probe_tokens(128256, 8192, largest)
        probes = (p, 2 * p)
        line = fit_line([(t, peak(t)) for t in probes])
        assert line[0] + line[1] * largest <= peak(largest) * (1 + 1e-9)


def test_the_line_through_two_peaks_and_the_longest_it_allows() -> None:
    assert fit_line([(100, 5000)]) == (5000.0, 0.0)  # measured at the micro-batch itself
    intercept, slope = fit_line([(1000, 3000), (2000, 5000)])
    assert (intercept, slope) == (1000.0, 2.0)
    assert longest_fitting((intercept, slope), 10001) == 4500
    assert longest_fitting((5000.0, 0.0), 10) is None  # no token adds memory: nothing to name
    assert fit_line([(1000, 5000), (2000, 4000)])[1] == 0.0  # noise never makes a negative slope


def test_the_largest_micro_batch_is_the_longest_row_or_the_fullest_group() -> None:
    paths, starts = ["a/shard-00000.arrow", "a/shard-00001.arrow"], np.array([0, 3, 6])
    lengths = np.array([100, 90, 80, 70, 900, 60])
    largest = largest_microbatch(Planner(lengths, 256, seed=0), paths, starts)
    assert largest == Largest(900, "row 1 of shard-00001.arrow")  # global row 4 = shard 1, row 1
    short = largest_microbatch(Planner(lengths[[0, 1, 2, 3, 5]], 256, seed=0), paths, np.array([0, 5]))
    assert short.row is None and short.tokens <= 256
    assert short.tokens == max(
        np.add.reduceat(
            lengths[[0, 1, 2, 3, 5]][Planner(lengths[[0, 1, 2, 3, 5]], 256).plan(0).order],
            Planner(lengths[[0, 1, 2, 3, 5]], 256).plan(0).cuts[:-1],
        )
    )


def test_optimizer_states_the_first_step_will_allocate() -> None:
    """Counted where their parameters live: on the GPU for the GPU's need, in host memory (with the
    gradients not yet there) under --offload-states."""
    w = torch.nn.Parameter(torch.zeros(6, 4))
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    adamw = torch.optim.AdamW([w, b])
    assert optimizer_state_bytes(adamw, "cpu") == 2 * 24 * 4 + 2 * 4 * 2  # two moments, each in its parameter's dtype
    assert optimizer_state_bytes(adamw) == 0  # none of them on a GPU
    assert host_state_bytes(adamw) == 2 * 24 * 4 + 2 * 4 * 2 + 24 * 4 + 4 * 2  # and the gradients to come
    (w.sum() + b.float().sum()).backward()
    assert host_state_bytes(adamw) == 2 * 24 * 4 + 2 * 4 * 2  # the gradients are there now
    adamw.step()
    assert optimizer_state_bytes(adamw, "cpu") == 0  # they exist now (or came with a resumed checkpoint)
    adafactor = torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(6, 4))])
    assert optimizer_state_bytes(adafactor, "cpu") == 4 * (6 + 4)


def test_probes_are_this_ranks_share_of_a_synthetic_row() -> None:
    """Under --context-parallel 2 each probe is rank 1's share of a row twice the probe's tokens (its
    pieces and RowShard set, as the loader's micro-batches are); then the gradients are cleared."""
    seen, cleared = [], []

    def measure(step, batch, device):
        step(batch)
        return 1000 + 3 * batch.n_tokens, 0, 0

    need = measure_need(
        lambda b: seen.append(b),
        lambda: cleared.append(1),
        40000,
        vocab=128256,
        tile_mlp=0,
        cp_rank=1,
        cp_size=2,
        device=torch.device("cpu"),
        measure=measure,
    )
    assert need.probes == (8192, 16384)
    assert [b.n_tokens for b in seen] == [8192, 16384] and len(cleared) == 2
    assert all(b.context is not None for b in seen)
    assert need.gpu == 1000 + 3 * 40000 and need.gpu_line == (1000.0, 3.0)
    row = synthetic_row(40, 300)
    assert row.n_examples == 1 and row.n_loss_tokens == 39 and int(row.input_ids.max()) < 300


def _verdict(largest: Largest, **kw):
    need = Need(gpu=0, host=0, gpu_line=(10 * GIB, 0.25 * 2**20), host_line=(0.0, 0.0), probes=(20480, 40960))
    need = Need(
        gpu=int(need.gpu_line[0] + need.gpu_line[1] * largest.tokens),
        host=0,
        gpu_line=need.gpu_line,
        host_line=need.host_line,
        probes=need.probes,
    )
    args = dict(cp_size=1, tokens_per_step=16384, data="packed", tile_mlp=0, offload=False, checkpointing=1)
    args.update(kw)
    return verdict(largest, need, 2 * GIB, 80 * GIB, None, **args)


def test_a_row_that_cannot_fit_is_named_with_the_longest_that_would() -> None:
    line, info = _verdict(Largest(524288, "row 3 of shard-00002.arrow"))
    fits = math.floor((MARGIN * 80 * GIB - 12 * GIB) / (0.25 * 2**20)) // 1024 * 1024
    assert line.startswith("packed: row 3 of shard-00002.arrow holds 524,288 tokens, which need at least 140.0 GiB on each GPU")
    assert f"the longest row that could fit is at most about {fits:,} tokens" in line
    assert "--context-parallel N" in line and "--tile-mlp 8192" in line and "--offload-activations" in line
    assert "--grad-checkpointing" not in line  # in use already
    assert "\n" not in line and "steps of 20,480 and 40,960 tokens" in line
    ok, info = _verdict(Largest(131072, "row 3 of shard-00002.arrow"))
    assert ok is None and f"at most about {fits:,} tokens" in info
    # under --context-parallel 4 a rank holds a quarter of the row: four times as long a row fits
    line, _ = _verdict(Largest(524288 * 4, "row 0 of x"), cp_size=4, tile_mlp=8192)
    assert f"about {fits * 4 // 1024 * 1024:,} tokens" in line and "--tile-mlp" not in line
    # a full fine-tune is also offered FSDP2's CPU offload of its states; LoRA (None) and a run using it are not
    assert "--parallel fsdp --offload-states" in _verdict(Largest(524288, "r"), offload_states=False)[0]
    assert "--offload-states" not in _verdict(Largest(524288, "r"), offload_states=True)[0]
    assert "--offload-states" not in line


def test_a_micro_batch_of_short_rows_names_tokens_per_step() -> None:
    line, _ = _verdict(Largest(400000))
    assert line.startswith("--tokens-per-step 16384: a micro-batch of 400,000 tokens needs at least")
    assert "lower --tokens-per-step" in line


def _host_verdict(host_cap: int, host_per_token: int = 2**19, gpu_cap: int = 80 * GIB):
    """An 8B-like row of 409,600 tokens, 20 GiB on the GPU whatever its length, `host_per_token`
    bytes a token offloaded (0.5 MiB: 200 GiB for the row)."""
    need = Need(
        gpu=20 * GIB, host=409600 * host_per_token, gpu_line=(20 * GIB, 0.0), host_line=(0.0, host_per_token), probes=(20480, 40960)
    )
    return verdict(
        Largest(409600, "row 0 of shard-00000.arrow"),
        need,
        0,
        gpu_cap,
        host_cap,
        cp_size=1,
        tokens_per_step=8192,
        data="d",
        tile_mlp=8192,
        offload=True,
        checkpointing=1,
    )


def test_offloaded_activations_that_fit_the_host_are_said() -> None:
    line, info = _host_verdict(400 * GIB)
    assert line is None
    assert "what it offloads needs at least 200.0 GiB more of the 400.0 GiB of host memory each rank has" in info
    assert "blocks under 1 GiB take up to twice their size" in info


def test_a_row_whose_offloaded_activations_exceed_the_host_is_named() -> None:
    """The count of bytes moved is a lower bound (pinned blocks only round it up): a row past what the
    host has is refused in one line, naming the longest the host allows (0.95 x 100 GiB / 0.5 MiB =
    194,560 tokens, in steps of 1,024) and what would help; the GPU's room is not the reason."""
    line, info = _host_verdict(100 * GIB)
    assert line is not None and "\n" not in line
    assert line.startswith(
        "d: row 0 of shard-00000.arrow holds 409,600 tokens, which need at least 200.0 GiB of "
        "host memory for what each rank offloads, which has 100.0 GiB"
    )
    assert "the longest row that could fit is at most about 194,560 tokens" in line
    assert "give each rank more host memory" in line and "GPU" not in line.split("(measured")[0]
    assert "--offload-activations" not in line  # the lever in use is not offered again
    # negative control: the same row with a GPU too small is refused for the GPU as well
    both, _ = _host_verdict(100 * GIB, gpu_cap=10 * GIB)
    assert "on each GPU, which holds 10.0 GiB and 200.0 GiB of host memory" in both


def test_offloaded_states_count_against_the_host_not_the_gpu() -> None:
    """--offload-states: the states and gradients still to come in host memory (`host_fixed`) join
    the activations' count there; 150 + 200 GiB do not fit a 300 GiB host, 200 alone do."""
    line, _ = _host_verdict(300 * GIB)
    assert line is None
    need = Need(gpu=20 * GIB, host=200 * GIB, gpu_line=(20 * GIB, 0.0), host_line=(0.0, 2**19), probes=(20480, 40960))
    line, info = verdict(
        Largest(409600, "row 0 of s.arrow"),
        need,
        0,
        80 * GIB,
        300 * GIB,
        cp_size=1,
        tokens_per_step=8192,
        data="d",
        tile_mlp=8192,
        offload=True,
        checkpointing=1,
        host_fixed=150 * GIB,
        offload_states=True,
    )
    assert line is not None and "350.0 GiB of host memory for what each rank offloads, which has 300.0 GiB" in line
    # (0.95 x 300 - 150) GiB / 0.5 MiB a token
    assert f"at most about {int((0.95 * 300 - 150) * 2048) // 1024 * 1024:,} tokens" in line


def test_a_step_measured_as_it_is_says_so() -> None:
    """A largest micro-batch no longer than the second probe is measured itself: one step, no rate."""
    need = Need(gpu=26 * GIB, host=0, gpu_line=(26 * GIB, 0.0), host_line=(0.0, 0.0), probes=(16384,))
    _, info = verdict(
        Largest(65536), need, 0, 80 * GIB, None, cp_size=4, tokens_per_step=65536, data="d", tile_mlp=0, offload=False, checkpointing=1
    )
    assert info.endswith("measured from a step of 65,536 tokens")


@pytest.fixture()
def forced(monkeypatch):
    """The check on the CPU: probes of 64 and 128 tokens, peaks on a line of the probe's tokens
    (10,000 bytes + 100 a token, the step itself really run, `ahead[0]` bytes a token of them the
    offload's read-ahead), a GPU of `capacity[0]` bytes."""
    calls, capacity, ahead = [], [10**9], [0]

    def measure(step, batch, device):
        step(batch)
        calls.append(batch.n_tokens)
        return 10_000 + 100 * batch.n_tokens, 0, ahead[0] * batch.n_tokens

    monkeypatch.setattr(fit_check, "applies", lambda run: True)
    monkeypatch.setattr(fit_check, "probe_tokens", lambda vocab, tile, largest=0: 64)
    monkeypatch.setattr(fit_check, "measure_peaks", measure)
    monkeypatch.setattr(fit_check, "gpu_capacity", lambda device: capacity[0])
    monkeypatch.setattr(fit_check, "host_capacity", lambda: None)
    monkeypatch.setattr(HostOffload, "prefetch", True)  # the check sets it for its run
    return calls, capacity, ahead


def test_the_probes_leave_the_run_unchanged(tmp_path: Path, forced, monkeypatch) -> None:
    """A run whose largest row fits logs the losses of a run without the check (the probes' gradients
    cleared, the random generators restored: LoRA dropout on), after two probes of 64 and 128 tokens."""
    folder = tmp_path / "data"
    lengths = np.random.default_rng(3).integers(20, 300, size=16).tolist()
    make_packed_folder(folder, pack_lengths(lengths, 320, vocab=300), 320)
    base = dict(
        data=str(folder),
        model="tiny",
        tokens_per_step=256,
        lr=1e-3,
        max_steps=3,
        log_every=1,
        num_workers=0,
        progress=False,
        lora_r=4,
        lora_dropout=0.1,
    )
    train(TrainConfig(**base, out=str(tmp_path / "checked")))
    assert forced[0] == [64, 128]
    monkeypatch.setattr(fit_check, "applies", lambda run: False)
    train(TrainConfig(**base, out=str(tmp_path / "plain")))
    assert logged_losses(tmp_path / "checked") == logged_losses(tmp_path / "plain")


def test_a_row_too_long_stops_the_run_before_its_first_step(tmp_path: Path, forced) -> None:
    calls, capacity, _ = forced
    folder = tmp_path / "data"
    make_packed_folder(folder, pack_lengths([100, 120, 900, 80], 1000, vocab=300), 1000)  # rows of 300, 900
    capacity[0] = 60_000  # room for (0.95 x 60,000 - 10,000 - optimizer) / 100 tokens
    with pytest.raises(UserError) as err:
        train(
            TrainConfig(
                data=str(folder), model="tiny", tokens_per_step=256, max_steps=2, num_workers=0, progress=False, out=str(tmp_path / "run")
            )
        )
    line = str(err.value)
    assert "row 1 of " in line and "of shard-00000.arrow holds 900 tokens" in line
    assert "the longest row that could fit is none (the rest of the step alone needs about" in line
    assert "\n" not in line and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_row_past_the_host_memory_stops_the_run_before_its_first_step(tmp_path: Path, forced, monkeypatch) -> None:
    """With --offload-activations the probes' moved bytes (here 1,000 a token) are held against the
    host memory each rank has: a 900-token row that the GPU holds but the host (500,000 bytes) does
    not is refused in one line; without offloading the host is not asked (negative control)."""
    calls, capacity, _ = forced

    def measure(step, batch, device):
        step(batch)
        return 10_000 + 100 * batch.n_tokens, 1_000 * batch.n_tokens, 0

    monkeypatch.setattr(fit_check, "measure_peaks", measure)
    monkeypatch.setattr(fit_check, "host_capacity", lambda: 500_000)
    folder = tmp_path / "data"
    make_packed_folder(folder, pack_lengths([100, 120, 900, 80], 1000, vocab=300), 1000)
    base = dict(data=str(folder), model="tiny", tokens_per_step=256, max_steps=1, num_workers=0, progress=False, grad_checkpointing=1)
    with pytest.raises(UserError) as err:
        train(TrainConfig(**base, offload_activations=True, out=str(tmp_path / "run")))
    line = str(err.value)
    assert (
        "row 1 of shard-00000.arrow holds 900 tokens, which need at least 0.9 MiB of host memory for what "
        "each rank offloads, which has 0.5 MiB (measured from steps of 64 and 128 tokens)"
    ) in line
    assert "the longest row that could fit is at most about 475 tokens" in line and "\n" not in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    train(TrainConfig(**base, out=str(tmp_path / "plain")))
    assert (tmp_path / "plain" / "metrics.jsonl").exists()


def test_the_need_without_the_read_ahead_drops_what_it_held() -> None:
    """`Need.without_prefetch`: the GPU's line less the read-ahead's line (measured at the probes),
    the host's untouched: at 524,288 tokens 8 KiB a token less is 4 GiB less."""
    need = Need(
        gpu=70 * GIB,
        host=128 * GIB,
        gpu_line=(7 * GIB, 126 * 2**10),
        host_line=(0.0, 2**18),
        probes=(65536, 131072),
        ahead=4 * GIB,
        ahead_line=(0.0, 8 * 2**10),
    )
    lean = need.without_prefetch()
    assert lean.gpu == 66 * GIB and lean.gpu_line == (7 * GIB, 118 * 2**10)
    assert (lean.host, lean.host_line, lean.ahead, lean.ahead_line) == (128 * GIB, (0.0, 2**18), 0, (0.0, 0.0))


def test_a_row_that_fits_only_without_the_read_ahead_trains_without_it(tmp_path: Path, forced, monkeypatch, capsys) -> None:
    """A 900-token row needs 100,000 bytes with the offload's read-ahead (30 a token of them) and
    73,000 without, on a GPU of 90,000 (85,500 usable): the run turns the read-ahead off, says so on
    its memory line, and logs the losses of a run without the check. Negative control: a step whose
    backward reads nothing ahead is refused at the same capacity."""

    calls, capacity, ahead = forced
    monkeypatch.setattr(fit_check, "optimizer_state_bytes", lambda optimizer, where="cuda": 0)
    capacity[0], ahead[0] = 90_000, 30
    folder = tmp_path / "data"
    make_packed_folder(folder, pack_lengths([100, 120, 900, 80], 1000, vocab=300), 1000)
    base = dict(
        data=str(folder), model="tiny", tokens_per_step=256, max_steps=2, log_every=1, num_workers=0, progress=False,
        grad_checkpointing=1, offload_activations=True,
    )  # fmt: skip
    train(TrainConfig(**base, out=str(tmp_path / "lean")))
    assert HostOffload.prefetch is False
    err = capsys.readouterr().err
    assert "needs at least 71.3 KiB of the 87.9 KiB a GPU holds" in err
    assert "no room to copy 26.4 KiB of saved tensors back ahead of the backward: each comes back as it is needed" in err
    monkeypatch.setattr(HostOffload, "prefetch", True)
    monkeypatch.setattr(fit_check, "applies", lambda run: False)
    train(TrainConfig(**base, out=str(tmp_path / "plain")))
    assert logged_losses(tmp_path / "lean") == logged_losses(tmp_path / "plain")
    monkeypatch.setattr(fit_check, "applies", lambda run: True)
    ahead[0] = 0
    with pytest.raises(UserError, match="holds 900 tokens, which need at least 97.7 KiB on each GPU"):
        train(TrainConfig(**base, out=str(tmp_path / "refused")))
    assert HostOffload.prefetch is True


def test_the_host_figure_is_the_bytes_the_step_offloads(monkeypatch) -> None:
    """`measure_peaks` reads what the step's forward moved to host memory (HostOffload's count, from
    zero at each probe), not an allocator's statistics, and what its backward copied back ahead of
    need: as tanh's backward takes its [16, 8] output, as many bytes saved before it start back (the
    matmul's [16, 8] input). The CUDA calls are stubbed on the CPU."""
    from trainer.model.long_rows import offload_activations

    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 12345)
    monkeypatch.setattr(fit_check, "empty_caches", lambda: None)
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def step(_batch) -> None:
        with offload_activations(True, torch.device("cpu")):
            y = (x @ w).tanh().sum()
        y.backward()

    for _ in range(2):  # each probe counts its own bytes only
        assert fit_check.measure_peaks(step, None, torch.device("cpu")) == (12345, (16 * 8 + 8 * 8 + 16 * 8) * 4, 16 * 8 * 4)


def test_the_probes_hand_the_offloads_pooled_blocks_back(monkeypatch) -> None:
    """The offload keeps its page-locked blocks for the next step; after a probe they go back to the
    host, so that the host memory the check reads next is not short by a probe's blocks. Negative
    control: before, the pool holds them."""
    from fake_cudart import FakeCudart

    from trainer.model import long_rows

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(long_rows, "PINNED", long_rows.PinnedBlocks())
    monkeypatch.setattr(fit_check, "PINNED", long_rows.PINNED)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: None, raising=False)  # no CUDA here
    view = long_rows.PINNED.take(torch.Size([4, 4]), torch.float32)
    del view
    assert len(long_rows.PINNED.free) == 1 and fake.unregistered == []
    fit_check.empty_caches()
    import gc

    gc.collect()
    assert long_rows.PINNED.free == [] and len(fake.unregistered) == 1


def test_gpu_capacity_stops_at_a_per_process_memory_cap(monkeypatch) -> None:
    """What the check may plan for is the free memory plus the allocator's own, and no more than
    `set_per_process_memory_fraction` lets the allocator reserve; without a cap, all of it."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 20 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0, raising=False)
    assert fit_check.gpu_capacity(torch.device("cuda", 0)) == 120 * gib
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.5, raising=False)
    assert fit_check.gpu_capacity(torch.device("cuda", 0)) == 70 * gib
