"""trainer.run.profiling: `pack-train --profile-steps FIRST-LAST` and the summary of where a step's time
went (GPU kernels by kind, idle gaps, host waits); the GPU side's numbers come from CUDA runs only
(BENCHMARKS.md), so here: the kinds of kernel names seen on an H100, the gap arithmetic, which steps
are profiled, what the run folder gets on one and on two ranks, and the one-line refusals."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from gloo_ranks import train_on_two_ranks  # noqa: E402
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.config import parse_step_range  # noqa: E402
from trainer.run import profiling  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("packed")
    lengths = np.random.default_rng(0).integers(4, 40, size=50).tolist()
    make_packed_folder(folder, pack_lengths(lengths, 64, vocab=300), 64)
    return folder


def _config(packed: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(packed),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        max_steps=5,
        log_every=1,
        num_workers=0,
        progress=False,
        attn="sdpa",
    )
    return TrainConfig(**{**base, **kw})


def test_profile_kernel_kinds_from_names_seen_on_an_h100():
    """Names from the H100 profiles in docs/results (NCCL, flash-attn, cuBLAS's nvjet, torch's fused AdamW,
    Inductor's fused kernels): the compiled AdamW update of bf16-weights is the optimizer although
    its name holds _to_copy."""
    kind = profiling.kernel_kind
    assert kind("triton_poi_fused__to_copy_add_copy_copy__div_lerp_mul_pow_rsub_sqrt_sub_unbind_2") == "optimizer"
    assert kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(a") == "optimizer"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "matmul"
    assert kind("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits") == "attention"
    assert kind("triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_3") == "copy/cast"
    assert kind("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0") == "other"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "communication"


def test_gap_summary_buckets_idle_time_between_kernels():
    """Overlapping kernels leave no gap; each gap lands in one bucket, per step; the longest gaps
    name the kernels around them."""
    kernels = [(0, 10, "a"), (5, 30, "b"), (31, 40, "c"), (70, 80, "d"), (2080, 2090, "e")]
    g = profiling.gap_summary(kernels, steps=2, top=2)
    assert g["gaps_per_step"] == {"<5us": 0.5, "5-20us": 0.0, "20-100us": 0.5, "100-1000us": 0.0, ">=1000us": 0.5}
    assert g["idle_ms_per_step_by_gap"]["<5us"] == pytest.approx(0.001 / 2)
    assert g["idle_ms_per_step_by_gap"][">=1000us"] == pytest.approx(2.0 / 2)
    assert g["longest_gaps"] == [{"us": 2000.0, "after": "d", "before": "e"}, {"us": 30.0, "after": "c", "before": "d"}]


def test_the_profiler_runs_exactly_over_the_asked_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    events: list[tuple[str, int]] = []
    profiler = profiling.StepProfiler((3, 4), profiling.torch.device("cpu"), tmp_path, rank=0)
    monkeypatch.setattr(profiler.prof, "start", lambda: events.append(("start", step)))
    monkeypatch.setattr(profiler.prof, "stop", lambda: events.append(("stop", step)))
    monkeypatch.setattr(profiler, "_write", lambda: events.append(("write", step)))
    for step in range(0, 7):  # step 0: before the first step (the loop calls it there too)
        profiler.after_step(step)
    assert events == [("start", 2), ("stop", 4), ("write", 4)]  # started once step 2 is done


def test_pack_train_profile_steps_writes_a_summary_and_a_trace(packed: Path, tmp_path: Path):
    train(_config(packed, tmp_path / "run", profile_steps="2-3"))
    summary = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    assert summary["steps"] == [2, 3] and summary["rank"] == 0
    assert summary["note"] == "kernel times are measured on CUDA only"  # a CPU run: the host side only
    assert any(op.startswith("aten::") for op in summary["top_host_ops_self_ms_per_step"])
    with gzip.open(tmp_path / "run" / "profile" / "rank0.trace.json.gz") as f:
        assert json.load(f)["traceEvents"]


def test_profile_steps_from_the_first_step_and_on_every_rank(packed: Path, tmp_path: Path):
    train_on_two_ranks(_config(packed, tmp_path / "ddp", profile_steps="1", max_steps=2), tmp_path)
    for rank in (0, 1):
        summary = json.loads((tmp_path / "ddp" / "profile" / f"rank{rank}.json").read_text())
        assert summary["steps"] == [1, 1] and summary["rank"] == rank


@pytest.mark.parametrize("text", ["3-2", "0-2", "a", "2-", "1-2-3"])
def test_a_malformed_step_range_is_one_line(text: str):
    with pytest.raises(UserError, match=f"--profile-steps {text}: expected FIRST-LAST"):
        parse_step_range(text)


def test_steps_the_run_does_not_train_are_refused_before_anything_is_written(packed: Path, tmp_path: Path):
    with pytest.raises(UserError, match=r"profile.steps 4-9: this run trains steps 1 to 5; .* 3-5\)"):
        train(_config(packed, tmp_path / "run", profile_steps="4-9"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
