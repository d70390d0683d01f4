"""CPU checks of the GPU benchmark scripts' logic (scripts/bench/bench_train.py, scripts/bench/bench_loss.py).

The GPU numbers themselves are measured by the lead; here we pin down that the paths compare like
with like: the padding and flattening collates hold the same examples, every path computes the same
loss on the same weights, the step/group bookkeeping is right and the FLOP accounting gives the
expected numbers. scripts/bench/bench_pack_data.py's pack-data runs (child and whole process) are run on a
small job, so that a moved pipeline entry point breaks a test, not the benchmark.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))  # the benchmarks, imported by name
sys.path.insert(0, str(REPO / "tests" / "gpu"))  # the GPU checks
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))  # scripts.benchlib

import bench_loss as bl  # noqa: E402
import bench_train as bt  # noqa: E402
from packed_factory import make_packed_folder  # noqa: E402

from pipeline.shards import read_manifest  # noqa: E402
from scripts.benchlib import (  # noqa: E402
    ffd_steps,
    pad_collate,
    to_device,
    train_steps,  # noqa: E402
)
from scripts.benchlib.train_results import finish_result, timed_result  # noqa: E402
from scripts.benchlib.train_runs import run_packed_pack_train, step_seq_lens_of_plan  # noqa: E402
from scripts.benchlib.train_steps import Batch, flatten_collate, real_tokens  # noqa: E402

CPU = torch.device("cpu")


def _examples(lengths, seed=0, vocab=500):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab, n).astype(np.int32)
        labels = ids.copy()
        labels[:2] = -100  # first token (contract) and one prompt token carry no loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def _rows(examples):
    return [
        {
            "input_ids": e["input_ids"],
            "labels": e["labels"],
            "position_ids": np.arange(len(e["input_ids"]), dtype=np.int32),
            "seq_lens": np.array([len(e["input_ids"])], dtype=np.int32),
            "example_ids": np.array([i], dtype=np.int64),
        }
        for i, e in enumerate(examples)
    ]


# ------------------------------------------------------------------------------------ accounting


def test_flop_shape_is_the_model_as_the_paths_train_it():
    """The tiny preset (hidden 64, 2 layers, 4 query heads of 16, 2 K/V heads, MLP 128, vocab 4096),
    as pipeline.report.flops counts it: full fine-tune, and LoRA rank 4 on every linear layer."""
    config = bt.model_config("tiny", 4096)
    full = bt.flop_shape(config)
    layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert [(x.params, x.heads, x.head_dim, x.adapter_params) for x in full.layers] == [(layer, 4, 16, 0)] * 2
    assert full.head_params == 4096 * 64 and not full.lora
    lora = bt.flop_shape(config, lora_r=4, grad_checkpointing=2)
    # rank 4: in x 4 + 4 x out per linear layer: q, o (64, 64), k, v (64, 32), gate, up (64, 128), down (128, 64)
    adapters = 4 * (2 * 128 + 2 * 96 + 3 * 192)
    assert [x.adapter_params for x in lora.layers] == [adapters] * 2 and lora.lora
    assert [x.recompute for x in lora.layers] == [True, False]


def test_finish_result_rates():
    """The rates come from the one count of the timed steps' examples (pipeline.report.flops)."""
    from pipeline.report.flops import LayerShape, ModelShape

    shape = ModelShape(layers=(LayerShape(params=1_000_000_000, heads=8, head_dim=128, recompute=True),), head_params=0)
    lens = np.array([3000, 5000])
    res = bt.PathResult(path="x", runner="r", steps=4, tokens=8000, loss_tokens=6000, seconds=2.0, data_wait_s=0.02)
    finish_result(res, shape=shape, lens=lens, peak_tflops=989.0)
    assert res.tokens_per_s == 4000
    assert res.step_ms == 500
    dense = 6e9 * 8000
    attention = 12 * 8 * 128 * (3000 * 3001 // 2 + 5000 * 5001 // 2)  # by example, not (3000 + 5000)^2
    assert res.mfu == pytest.approx((dense + attention) / 2.0 / 989e12)
    assert res.tflops == pytest.approx((dense + attention) / 2.0 / 1e12)
    assert res.hfu == pytest.approx((dense + attention + 2e9 * 8000 + attention / 3) / 2.0 / 989e12)
    assert res.attn_share == pytest.approx(attention / (dense + attention))
    assert res.attn_tflops_per_s == pytest.approx(attention / 2.0 / 1e12)
    assert res.data_wait_pct == pytest.approx(1.0)


def test_markdown_table_ratios_against_best_hf_packed_and_padding():
    rs = [
        bt.PathResult(path="hf-pad", runner="hf/sdpa", tokens_per_s=100, peak_gib=1.0),
        bt.PathResult(path="hf-flat-sdpa", runner="hf/sdpa", tokens_per_s=200),
        bt.PathResult(path="hf-flat-flex", runner="hf/flex", tokens_per_s=400),
        bt.PathResult(path="hf-flat-fa2", runner="hf", ok=False, note="no flash-attn"),
        bt.PathResult(path="packlm-minibatch", runner="pack-train/torch", tokens_per_s=500),
    ]
    table = bt.markdown_table(rs).splitlines()
    assert len(table) == 2 + len(rs)
    mini = next(line for line in table if line.startswith("| packlm-minibatch"))
    cells = [c.strip() for c in mini.strip("|").split("|")]
    assert cells[-2:] == ["1.25", "5.00"]  # vs best HF packed (flex, 400) and vs padding (100)
    assert "skipped: no flash-attn" in next(line for line in table if "hf-flat-fa2" in line)


# -------------------------------------------------------------------------------------- batching


def test_pad_collate_right_pads_with_mask_and_ignored_labels():
    exs = _examples([5, 3, 4])
    b = pad_collate(exs, pad_id=2)
    assert b["input_ids"].shape == (3, 5)
    assert b["attention_mask"].sum(1).tolist() == [5, 3, 4]
    assert b["input_ids"][1, 3:].tolist() == [2, 2]
    assert b["labels"][1, 3:].tolist() == [-100, -100]
    assert b["labels"][2, :4].tolist() == exs[2]["labels"].tolist()
    assert real_tokens(b) == 12


def test_flatten_collate_is_hf_flattening_of_the_same_examples():
    exs = _examples([5, 3, 4])
    b = flatten_collate(exs)
    assert b["input_ids"].shape == (1, 12)
    assert b["input_ids"][0].tolist() == np.concatenate([e["input_ids"] for e in exs]).tolist()
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    labels = b["labels"][0].tolist()
    assert [labels[i] for i in (0, 5, 8)] == [-100, -100, -100]  # no loss across a boundary
    assert real_tokens(b) == 12
    # packlm's own collate sees the same tokens and boundaries
    from trainer.data.batch import collate_rows

    mb = collate_rows(_rows(exs))
    assert torch.equal(mb.input_ids, b["input_ids"])
    assert torch.equal(mb.position_ids, b["position_ids"])
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 12]


def test_flatten_collate_hands_flash_attention_the_boundaries_as_a_skilled_user_asks():
    """The flash_attention_2 peer gets `cu_seq_lens_q/k` and `max_length_q/k` (Python ints) from
    HF's collator, so transformers need not derive them from position_ids (a host sync and a graph
    break in every layer); `to_device` moves the tensors and keeps the ints."""
    exs = _examples([5, 3, 4])
    b = flatten_collate(exs, flash_kwargs=True)
    assert b["cu_seq_lens_q"].tolist() == b["cu_seq_lens_k"].tolist() == [0, 5, 8, 12]
    assert b["max_length_q"] == b["max_length_k"] == 5 and type(b["max_length_q"]) is int
    assert "cu_seq_lens_q" not in flatten_collate(exs)  # the default: what TRL's padding_free hands over
    moved = to_device(b, CPU)
    assert moved["max_length_q"] == 5 and torch.equal(moved["input_ids"], b["input_ids"])


def test_all_paths_compute_the_same_loss_on_the_same_weights():
    """HF padding, HF flattening (sdpa) and packlm's packed_loss agree on a tiny model; the HF
    baseline model starts from exactly build_model's weights."""
    from trainer.data.batch import collate_rows
    from trainer.model.load import build_model
    from trainer.model.loss import packed_loss

    exs = _examples([6, 9, 3, 7])
    hf = bt.build_hf_model("tiny", "sdpa", CPU, 512, seed=0)
    packed, _ = build_model("tiny", attn="sdpa", device=CPU, vocab_size=512, seed=0)
    for a, b in zip(hf.state_dict().values(), packed.state_dict().values()):
        assert torch.equal(a, b)
    with torch.no_grad():
        pad_loss = float(hf(**pad_collate(exs, 2)).loss)
        flat_loss = float(hf(**flatten_collate(exs)).loss)
        s, n = packed_loss(packed, collate_rows(_rows(exs)))
    assert n == sum(int((e["labels"][1:] != -100).sum()) for e in exs)
    assert flat_loss == pytest.approx(pad_loss, rel=1e-5)
    assert float(s) / n == pytest.approx(pad_loss, rel=1e-5)


# ------------------------------------------------------------------------------- groups and steps


def _minibatch_folder(tmp_path, group=4, n=10):
    """Rows as pack-data --strategy minibatch writes them: groups of `group` examples, each packed
    into one or two rows, never mixed."""
    rng = np.random.default_rng(1)
    perm = rng.permutation(n)
    rows = []
    for g in range(0, n, group):
        ids = perm[g : g + group].tolist()
        ex = [(int(i), rng.integers(3, 100, 3 + int(i))) for i in ids]
        rows.extend([ex[:2], ex[2:]] if len(ex) > 2 else [ex])
    make_packed_folder(tmp_path / "mb", rows, max_len=64, strategy="minibatch")
    return tmp_path / "mb", perm


def test_minibatch_groups_are_recovered_from_rows(tmp_path):
    folder, perm = _minibatch_folder(tmp_path, group=4, n=10)
    groups = bt.minibatch_groups(folder, 4)
    assert [len(g) for g in groups] == [2, 2, 1]
    ids = [bt.group_example_ids(g) for g in groups]
    assert [sorted(x) for x in ids] == [sorted(perm[:4]), sorted(perm[4:8]), sorted(perm[8:])]
    with pytest.raises(ValueError, match="group holds"):
        bt.minibatch_groups(folder, 3)


def test_examples_by_id_needs_one_example_per_row(tmp_path):
    exs = _examples([4, 6])
    make_packed_folder(
        tmp_path / "pad", [[(7, exs[0]["input_ids"], exs[0]["labels"])], [(3, exs[1]["input_ids"], exs[1]["labels"])]], 16, strategy="pad"
    )
    got = bt.examples_by_id(tmp_path / "pad")
    assert sorted(got) == [3, 7]
    assert got[3]["labels"].tolist() == exs[1]["labels"].tolist()
    make_packed_folder(tmp_path / "pad2", [[(0, exs[0]["input_ids"]), (1, exs[1]["input_ids"])]], 16)
    with pytest.raises(ValueError, match="one example per row"):
        bt.examples_by_id(tmp_path / "pad2")


def test_ffd_steps_cut_rows_at_the_token_budget(tmp_path):
    lens = [8, 8, 5, 8, 3]
    rows = [[(i, np.arange(3, 3 + n))] for i, n in enumerate(lens)]
    make_packed_folder(tmp_path / "ffd", rows, max_len=8)
    steps = ffd_steps(tmp_path / "ffd", 16)
    assert [[len(r["input_ids"]) for r in s] for s in steps] == [[8, 8], [5, 8, 3]]
    assert [len(s) for s in ffd_steps(tmp_path / "ffd", 4)] == [1, 1, 1, 1, 1]  # long rows alone


def test_timed_loop_counts_only_timed_steps_and_host_wait():
    import time

    def thunks():
        for i in range(5):

            def thunk(i=i):
                time.sleep(0.01)
                return Batch(payload=i, tokens=10 * (i + 1), seq_lens=np.array([i + 1]), examples=1)

            yield thunk

    res, lens = bt.timed_loop(thunks(), lambda p: torch.tensor(float(p)), warmup=2, steps=3, device=CPU)
    assert res.steps == 3 and res.examples == 3
    assert res.tokens == 30 + 40 + 50
    assert lens.tolist() == [3, 4, 5]
    assert res.final_loss == 4.0
    assert 0.03 <= res.data_wait_s <= res.seconds
    with pytest.raises(SystemExit, match="ran out of data"):
        bt.timed_loop(thunks(), lambda p: torch.tensor(0.0), warmup=3, steps=3, device=CPU)


def test_planned_steps_match_pack_train_data_plan(tmp_path):
    """The attention FLOPs of the pack-train path come from the same Planner the loop uses."""
    from trainer.data.stream import Planner, row_lengths

    lens = [5, 9, 3, 7, 8, 2, 6]
    rows = [[(i, np.arange(3, 3 + n))] for i, n in enumerate(lens)]
    make_packed_folder(tmp_path / "p", rows, max_len=16)
    got, tokens = step_seq_lens_of_plan(tmp_path / "p", 12, seed=3, first=1, count=2)
    manifest = read_manifest(tmp_path / "p")
    planner = Planner(row_lengths(tmp_path / "p", manifest), 12, seed=3)
    want = np.concatenate([np.array(lens)[planner.plan(0).rows(k)] for k in (1, 2)])
    assert got.tolist() == want.tolist() and tokens == int(want.sum())


def test_a_pack_train_run_that_stopped_early_is_no_result():
    """SIGTERM (a `timeout` around the benchmark) makes pack-train save and end after its step: the
    one timed step it logged must not stand in for the steps asked for."""
    recs = [{"step": s, "tokens": 100 * s, "step_time_s": 0.5, "data_wait_s": 0.01, "loss": 9.0 - s} for s in (3, 6, 9)]
    full, ms = timed_result("packlm-ffd", "pack-train", recs, warmup=3, steps=6)
    assert full.ok and full.steps == 6 and full.tokens == 600 and ms == [500.0, 500.0] and not full.note
    short, _ = timed_result("packlm-ffd", "pack-train", recs[:2], warmup=3, steps=6, stopped_by_sigterm=True)
    assert not short.ok and short.steps == 3
    assert short.note == "pack-train stopped after 3 of 6 timed steps (SIGTERM)"


# -------------------------------------------------------------------------------- bench_loss


def test_lr_schedule_is_a_function_of_examples_seen():
    peak = 1e-3
    assert bl.lr_at(0, 1000, peak, 0.1, 0.1) == pytest.approx(peak / 100)
    assert bl.lr_at(100, 1000, peak, 0.1, 0.1) == pytest.approx(peak)
    assert bl.lr_at(1000, 1000, peak, 0.1, 0.1) == pytest.approx(0.1 * peak)
    mid = bl.lr_at(550, 1000, peak, 0.1, 0.1)
    assert mid == pytest.approx(peak * (0.1 + 0.9 * 0.5))


def test_split_records_is_deterministic_and_disjoint():
    recs = [{"instruction": str(i), "input": "", "output": "x"} for i in range(100)]
    train, held = bl.split_records(recs, 0.02)
    assert len(held) == 2 and len(train) == 98
    assert held == recs[98:]
    assert bl.split_records(recs, 0.0)[1] == []


def test_smooth_is_an_unbiased_ema():
    out = bl.smooth([2.0, 2.0, 2.0], span=5)
    assert out.tolist() == pytest.approx([2.0, 2.0, 2.0])
    assert bl.smooth([0.0, 10.0], span=1).tolist() == pytest.approx([0.0, 10.0])


def test_pad_and_minibatch_steps_hold_the_same_examples(tmp_path):
    folder, _ = _minibatch_folder(tmp_path, group=4, n=10)
    folders = {"minibatch": folder}
    pad = bl.method_steps("pad", folders, 4, 0, None)
    mini = bl.method_steps("minibatch", folders, 4, 0, None)
    assert [s.example_ids for s in pad] == [bt.group_example_ids(s.rows) for s in mini]
    assert [s.examples for s in pad] == [4, 4, 2]
    assert [s.tokens for s in pad] == [s.tokens for s in mini]


# --------------------------------------------------------------------------- gpu_suite.sh


def test_gpu_suite_is_strict_bash_with_parts():
    text = (REPO / "scripts" / "bench" / "gpu_suite.sh").read_text()
    assert "set -o pipefail" in text and "PYTHONUNBUFFERED=1" in text
    for part in ("attn", "train", "loss"):
        assert part in text
    import subprocess

    assert subprocess.run(check=False, args=["bash", "-n", str(REPO / "scripts" / "bench" / "gpu_suite.sh")]).returncode == 0
    bad = subprocess.run(
        check=False,
        args=["bash", str(REPO / "scripts" / "bench" / "gpu_suite.sh"), "nonsense"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": "/tmp"},
    )
    assert bad.returncode != 0 and "usage" in (bad.stderr + bad.stdout).lower()


def test_benchmark_modules_do_not_import_polars_or_datasets():
    """The GPU box has neither: importing the scripts (and the trainer they use) must not need them."""
    import subprocess

    code = (
        "import sys; sys.modules['polars'] = None; sys.modules['datasets'] = None\n"
        f"sys.path.insert(0, {str(REPO / 'scripts' / 'bench')!r})\n"
        "import bench_train, bench_loss, trainer.run.loop, trainer.model.load, trainer.model.loss, trainer.data.stream\n"
        "import pipeline.cli, pipeline.engines.job, pipeline.write.shard_writer, pipeline.read.sources, pipeline.tokenize.tokenize_inputs, pipeline.shards\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- end to end (CPU)


def _fake_shared(root: Path, n: int = 40) -> Path:
    """A tiny stand-in for ../shared: GSM8K- and CodeAlpaca-shaped files (tests never need the
    real data); the tokenizer is the project's own data/tokenizer."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sum", "code", "print", "list", "two", "ten"]

    def text(k):
        return " ".join(rng.choice(words, size=k))

    (root / "datasets" / "gsm8k").mkdir(parents=True)
    (root / "datasets" / "codealpaca").mkdir(parents=True)
    with (root / "datasets" / "gsm8k" / "train.jsonl").open("w") as handle:
        for _ in range(n):
            handle.write(json.dumps({"question": text(8), "answer": text(int(rng.integers(3, 20)))}) + "\n")
    alpaca = [{"instruction": text(6), "input": text(3) if i % 2 else "", "output": text(int(rng.integers(3, 20)))} for i in range(n)]
    (root / "datasets" / "codealpaca" / "code_alpaca.json").write_text(json.dumps(alpaca))
    return root


@pytest.mark.slow
def test_bench_train_end_to_end_on_cpu(tmp_path):
    """All CPU-capable paths run on a tiny model; the HF padding, HF flattening and packlm (inline)
    steps see the same 32 examples from the same weights, so their losses agree; the pack-train
    runner's token count matches the data plan."""
    tokenizer = REPO / "data" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("data/tokenizer is not there")
    shared = _fake_shared(tmp_path / "shared")
    common = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--dtype",
        "fp32",
        "--shared",
        str(shared),
        "--tokenizer",
        str(tokenizer),
        "--workdir",
        str(tmp_path / "w"),
        "--max-len",
        "512",
        "--ffd-tokens",
        "512",
        "--num-workers",
        "0",
        "--pack-procs",
        "1",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenMP threads on a shared 2-core box only slow a tiny model down
    try:
        _run_end_to_end(common, tmp_path)
    finally:
        torch.set_num_threads(threads)


def test_bench_train_paths_and_tunings_are_checked():
    """HF paths take +layers/+model/+liger tunings, packlm paths +bf16-weights; +liger must come
    last (it patches transformers)."""
    args = bt.parse_args(
        [
            "--paths",
            "hf-pad+layers,hf-flat-fa2+model,packlm-ffd,packlm-ffd+bf16-weights,"
            "hf-ffd-fa2+model+bf16,hf-ffd-flex+fp8,packlm-ffd+fp8,hf-flat-fa2+layers+liger",
        ]
    )
    assert args.paths[-1] == "hf-flat-fa2+layers+liger"
    for bad in (
        "hf-flat-fa2+turbo",
        "packlm-ffd+layers",
        "hf-pad+bf16-weights",
        "hf-flat-fa2+liger,hf-pad",
        "packlm-ffd+bf16",
        "hf-ffd-fa2+bf16-weights",
    ):
        with pytest.raises(SystemExit):
            bt.parse_args(["--paths", bad])
    assert bt.split_path("hf-flat-fa2+layers+liger") == ("hf-flat-fa2", ["layers", "liger"])


def _run_end_to_end(common, tmp_path):
    out = tmp_path / "bench.json"
    results = bt.main(
        [
            *common,
            "--paths",
            "hf-pad,hf-flat-sdpa,hf-flat-sdpa+layers,packlm-minibatch,packlm-ffd,packlm-ffd+bf16-weights,hf-ffd-sdpa",
            "--json",
            str(out),
        ]
    )
    by = {r.path: r for r in results}
    assert all(r.ok for r in results), [r.note for r in results]
    # the compiled HF path: the same examples, the same loss up to the compiler's rounding
    assert by["hf-flat-sdpa+layers"].runner == "hf/sdpa+layers"
    assert by["hf-flat-sdpa+layers"].tokens == by["hf-flat-sdpa"].tokens
    assert by["hf-flat-sdpa+layers"].final_loss == pytest.approx(by["hf-flat-sdpa"].final_loss, rel=1e-3)
    assert by["hf-pad"].runner == "hf/sdpa" and by["packlm-ffd"].runner.startswith("pack-train/")
    assert by["hf-pad"].tokens == by["hf-flat-sdpa"].tokens > 0
    assert by["hf-pad"].examples == by["hf-flat-sdpa"].examples == 32
    assert by["hf-flat-sdpa"].final_loss == pytest.approx(by["hf-pad"].final_loss, rel=1e-4)
    assert by["packlm-ffd"].note == "" and 0 < by["packlm-ffd"].tokens <= 512
    # the same-row peer: HF fed exactly pack-train's rows, the same model and seed, fp32: the same
    # tokens, examples and loss as pack-train's own loop
    assert by["hf-ffd-sdpa"].tokens == by["packlm-ffd"].tokens
    assert by["hf-ffd-sdpa"].examples == by["packlm-ffd"].examples
    assert by["hf-ffd-sdpa"].final_loss == pytest.approx(by["packlm-ffd"].final_loss, rel=1e-4)
    # each timed step's host time (HF and inline loops) or each timed metrics window's (pack-train)
    assert len(by["hf-pad"].extra["host_ms_per_step"]) == by["hf-pad"].steps == 1
    assert all(ms > 0 for ms in by["hf-pad"].extra["host_ms_per_step"])
    assert len(by["packlm-ffd"].extra["step_ms_per_metrics_window"]) == 1
    # pack-train --dtype bf16-weights on the same rows: the same tokens, the loss within bf16 rounding
    assert by["packlm-ffd+bf16-weights"].tokens == by["packlm-ffd"].tokens
    assert by["packlm-ffd+bf16-weights"].final_loss == pytest.approx(by["packlm-ffd"].final_loss, rel=2e-2)
    assert by["packlm-ffd+bf16-weights"].final_loss != by["packlm-ffd"].final_loss  # it did run in bf16
    payload = json.loads(out.read_text())
    assert [r["path"] for r in payload["results"]] == list(by)
    assert "| hf-pad |" in payload["table"]
    # the inline packlm loop on the same groups (the data folders are reused, not re-packed)
    inline = bt.main([*common, "--paths", "packlm-minibatch", "--packed-runner", "inline"])[0]
    assert inline.ok and inline.runner.startswith("inline/")
    assert inline.tokens == by["hf-pad"].tokens
    assert inline.final_loss == pytest.approx(by["hf-pad"].final_loss, rel=1e-4)
    # --profile-steps on a pack-train path profiles steps after the timed ones, which stay as they were
    profiled = bt.main([*common, "--paths", "packlm-ffd", "--profile-steps", "1", "--profile-trace", str(tmp_path / "traces")])[0]
    assert profiled.ok and profiled.tokens == by["packlm-ffd"].tokens and profiled.steps == 1
    assert profiled.extra["profile"]["note"] == "kernel times are measured on CUDA only"
    assert profiled.extra["profile"]["top_host_ops_self_ms_per_step"]  # the host side is profiled on CPU too
    import gzip

    trace = json.loads(gzip.decompress((tmp_path / "traces" / "packlm-ffd.json.gz").read_bytes()))
    assert trace["traceEvents"]
    # --optimizer adafactor reaches both kinds of path (its state: tests/trainer/run/test_trainer_loop.py)
    ada = {r.path: r for r in bt.main([*common, "--paths", "hf-flat-sdpa,packlm-minibatch", "--optimizer", "adafactor", "--warmup", "0"])}
    assert all(r.ok for r in ada.values()), [r.note for r in ada.values()]


@pytest.mark.slow
def test_bench_loss_end_to_end_on_cpu(tmp_path):
    """One epoch per method on a tiny model: padding and minibatch packing train on the same groups
    with the same objective, so their loss curves and held-out losses coincide."""
    tokenizer = REPO / "data" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("data/tokenizer is not there")
    shared = _fake_shared(tmp_path / "shared", n=40)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = bl.main(
            [
                "--device",
                "cpu",
                "--model",
                "tiny",
                "--shared",
                str(shared),
                "--tokenizer",
                str(tokenizer),
                "--workdir",
                str(tmp_path / "w"),
                "--max-len",
                "256",
                "--holdout",
                "0.1",
                "--pack-procs",
                "1",
                "--json",
                str(tmp_path / "loss.json"),
                "--plot",
                str(tmp_path / "c.png"),
                "--full-len",
                "4096",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    by = {r.method: r for r in results}
    assert list(by) == list(bl.METHODS)
    assert by["pad"].examples == by["minibatch"].examples == by["ffd"].examples == 72  # 80 - 8 held out
    assert by["ffd-full"].examples == 72 and by["ffd-full"].tokens == by["ffd"].tokens
    assert by["ffd-full"].steps < by["ffd"].steps  # one full 4096-token row per step
    pad = [loss for _, loss in by["pad"].curve]
    mini = [loss for _, loss in by["minibatch"].curve]
    assert [x for x, _ in by["pad"].curve] == [x for x, _ in by["minibatch"].curve] == [32, 64, 72]
    assert mini == pytest.approx(pad, rel=1e-4)
    assert by["minibatch"].heldout_loss == pytest.approx(by["pad"].heldout_loss, rel=1e-4)
    assert all(r.heldout_loss is not None and np.isfinite(r.heldout_loss) for r in results)
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert json.loads((tmp_path / "loss.json").read_text())["token_budget"] > 0


@pytest.mark.slow
def test_bench_loss_bf16_weights_tuning_trains_the_same_steps_with_master_weights(tmp_path):
    """`ffd+bf16-weights` takes ffd's steps with bf16 weights and fp32 masters: the same examples and
    tokens, a loss close to ffd's but not equal (control: the weights really were bf16), and fp32
    weights for the held-out loss. A tuning of `pad` is refused."""
    tokenizer = REPO / "data" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("data/tokenizer is not there")
    shared = _fake_shared(tmp_path / "shared", n=40)
    common = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--shared",
        str(shared),
        "--tokenizer",
        str(tokenizer),
        "--workdir",
        str(tmp_path / "w"),
        "--max-len",
        "256",
        "--holdout",
        "0.1",
        "--pack-procs",
        "1",
        "--plot",
        str(tmp_path / "c.png"),
    ]
    with pytest.raises(SystemExit):
        bl.parse_args([*common, "--methods", "pad+bf16-weights"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, tuned = bl.main([*common, "--methods", "ffd,ffd+bf16-weights"])
    finally:
        torch.set_num_threads(threads)
    assert tuned.method == "ffd+bf16-weights" and tuned.attention == plain.attention
    assert (tuned.steps, tuned.examples, tuned.tokens) == (plain.steps, plain.examples, plain.tokens)
    first_plain, first_tuned = plain.curve[0][1], tuned.curve[0][1]
    assert first_tuned == pytest.approx(first_plain, rel=2e-2) and first_tuned != first_plain
    assert tuned.heldout_loss == pytest.approx(plain.heldout_loss, rel=5e-2)


@pytest.mark.slow
def test_bench_pack_data_runs_pack_data_in_a_child_and_as_a_whole_process(tmp_path, monkeypatch):
    """bench_pack_data's two ways of running pack-data use the pipeline's current entry points: its
    child's code (run_pack_data, cold then warm, peak RSS of the tokenizer workers) and the whole
    `pack-data` process (the click command), each on a small text job."""
    import bench_pack_data as bpd

    tokenizer = REPO / "data" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("data/tokenizer is not there")
    source = REPO / "data" / "sample" / "chat.jsonl"
    stats = bpd.pack_in_child(
        repeat=2, inputs=[str(source)], tokenizer=str(tokenizer), max_len=1024, out=str(tmp_path / "child"), num_proc=2, limit=60
    )
    assert set(stats["times"]) == {"setup", "read_tokenize", "plan", "write", "verify", "total"}
    assert stats["tokens"] > 0 and 0 < stats["efficiency"] <= 1 and stats["process_s"] > 0
    assert [w["tokens"] for w in stats["warm_runs"]] == [stats["tokens"]]
    assert stats["maxrss_children_mb"] > 0  # the worker processes, joined before it is read
    monkeypatch.setattr(bpd, "TOKENIZER", tokenizer)
    assert bpd.pack_data_process(source, tmp_path / "process", 1024, 1) > 0
    manifest = json.loads((tmp_path / "process" / "manifest.json").read_text())
    assert manifest["config"]["max_len"] == 1024 and manifest["config"]["num_proc"] == 1


def test_bench_startup_runs_a_checkouts_own_console_script(tmp_path):
    """bench_startup runs the pack-data entry point a checkout's pyproject.toml names, in a fresh
    interpreter with that checkout first on the path, and digests the shards it wrote."""
    import bench_startup as bs

    assert "from pipeline.cli import pack_data" in bs.entry_point(REPO)
    data, tokenizer = bs.jobs()["sample"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        assert bs.run_once(REPO, data, tokenizer, out, tmp_path / "cache") > 0
    assert json.loads((runs[0] / "manifest.json").read_text())["config"]["max_len"] == 8192
    assert bs.shard_digest(runs[0]) == bs.shard_digest(runs[1]) != bs.shard_digest(tmp_path)
    assert "from trainer.cli import main" in bs.entry_point(REPO, "pack-train")
    assert bs.refusal_once(REPO, runs[0], tmp_path / "run") > 0  # refused, and no run folder written


def test_targets_are_checked_against_the_same_run():
    """Every packlm-ffd path is compared with the HF peer fed the same rows (fastest of all, and of
    its own precision class); fp8 against bf16-weights of the same run; the bf16 MFU target."""
    rs = [
        bt.PathResult(path="hf-flat-flex+model", runner="hf", tokens_per_s=900),  # other rows: not a peer
        bt.PathResult(path="hf-ffd-fa2+model", runner="hf", tokens_per_s=400),
        bt.PathResult(path="hf-ffd-fa2+model+bf16", runner="hf", tokens_per_s=500),  # the best same-row peer
        bt.PathResult(path="hf-ffd-fa2+model+fp8", runner="hf", tokens_per_s=550),
        bt.PathResult(path="packlm-ffd", runner="p", tokens_per_s=440, mfu=0.52, data_wait_pct=0.3),
        bt.PathResult(path="packlm-ffd+bf16-weights", runner="p", tokens_per_s=520, mfu=0.61, data_wait_pct=1.5),
        bt.PathResult(path="packlm-ffd+fp8", runner="p", tokens_per_s=715, mfu=0.83),
    ]
    lines = bt.target_lines(rs)
    assert lines[0] == ("packlm-ffd vs best HF same rows (hf-ffd-fa2+model+fp8): 0.80x; vs same precision (hf-ffd-fa2+model): 1.10x")
    assert lines[1].endswith("vs same precision (hf-ffd-fa2+model+bf16): 1.04x")
    assert lines[2].endswith("vs same precision (hf-ffd-fa2+model+fp8): 1.30x")
    assert lines[3].startswith("packlm-ffd+fp8 vs packlm-ffd+bf16-weights: 1.38x") and lines[3].endswith(": MET")
    assert lines[4].startswith("packlm-ffd+fp8 vs best HF same rows: 1.30x") and lines[4].endswith(": MET")
    assert lines[5].startswith("packlm-ffd+bf16-weights MFU 61.0%") and lines[5].endswith(": MET")  # fp8 not counted
    assert "1.50%" in lines[6] and lines[6].endswith("NOT MET")
    table = bt.markdown_table(rs).splitlines()
    row = next(line for line in table if line.startswith("| packlm-ffd+fp8 |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[2] == "fp8" and cells[12:16] == ["1.30", "1.30", "0.79", "n/a"]


def test_precision_classes_of_paths():
    assert bt.precision_class("hf-ffd-fa2+model") == bt.precision_class("packlm-ffd") == "autocast"
    assert bt.precision_class("hf-ffd-fa2+model+bf16") == bt.precision_class("packlm-ffd+bf16-weights") == "bf16 weights"
    assert bt.precision_class("hf-ffd-flex+fp8") == bt.precision_class("packlm-ffd+fp8") == "fp8"
    assert bt.packed_dtype(["fp8"], "bf16") == "fp8" and bt.packed_dtype([], "bf16") == "bf16"


def test_check_gpu_hf_builds_valid_packed_rows_and_needs_cuda(monkeypatch):
    """tests/gpu/check_gpu_hf.py: its rows are full packed rows (examples restart positions, first
    label -100) that the collator accepts; without CUDA it stops with one line."""
    import check_gpu_hf as cg

    from trainer.data.hf import PackedCollator

    rows = cg.rows(3, 256, np.random.default_rng(0))
    assert all(len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"]) == 256 for r in rows)
    batch = PackedCollator()(rows)
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == 768 and all(batch["labels"][0, a] == -100 for a in cu[:-1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["check_gpu_hf.py"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        cg.main()


def test_bench_pack_data_long_replicates_without_repeats_and_measures_the_ceiling(tmp_path):
    import bench_pack_data_long as bl

    from pipeline.tokenize.tokenizer import load_tokenizer

    path = bl.replicate(3, tmp_path)  # the sample is 2.6 MB: two copies
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.stat().st_size >= 3 << 20 and len(rows) == 6000
    copies = [{r["instruction"] for r in rows[:3000]}, {r["instruction"] for r in rows[3000:]}]
    assert not copies[0] & copies[1]  # no text of one copy repeats in another
    tokenizer = load_tokenizer(str(REPO / "data" / "tokenizer"))
    assert bl.ceiling([r["output"] for r in rows[:50]], tokenizer) > 0


@pytest.mark.slow
def test_bench_long_on_cpu(tmp_path):
    """scripts/bench/bench_long.py end to end on a tiny model: every backend that runs on the CPU trains
    the same rows from the same seed (same loss); one that needs CUDA is reported, not fatal."""
    import subprocess

    out = tmp_path / "long.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench" / "bench_long.py"),
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--examples",
            "30",
            "--min-len",
            "64",
            "--max-example-len",
            "128",
            "--max-len",
            "256",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--dtype",
            "fp32",
            "--backends",
            "sdpa,sdpa,torch",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        env={"SHARED": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["ok"] for r in results] == [True, True, False] and "CUDA" in results[2]["note"]
    assert results[0]["tokens"] == results[1]["tokens"] > 0
    assert results[0]["final_loss"] == pytest.approx(results[1]["final_loss"], rel=1e-6)


@pytest.mark.slow
def test_bench_ray_on_cpu(tmp_path):
    """scripts/bench/bench_ray.py on a small job: both engines run and their shards are identical."""
    pytest.importorskip("ray")
    import subprocess

    out = tmp_path / "ray.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench" / "bench_ray.py"),
            "--parts",
            "pretok,plan",
            "--workers",
            "2",
            "--tokens",
            "300000",
            "--plan-tokens",
            "1e6",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["pretok"]["arrow"]["identical"] and result["pretok"]["parquet"]["identical"]
    assert result["pretok"]["parquet"]["ray"]["ray_memory"]["worker_processes"] >= 1
    assert {p["examples"] for p in result["plan"].values()} == {4000, 486}


def test_bench_precision_entries_and_ratios_against_the_first():
    """An entry is a pack-train --dtype with an fp8 recipe after a colon and a model seed after an
    at sign (default: --seed); the table divides each entry's speed by the first's and gives its
    held-out loss's relative difference."""
    import bench_precision as bp

    assert bp.parse_entry("fp8:tensorwise") == ("fp8", "tensorwise", 0)
    assert bp.parse_entry("bf16-weights", seed=3) == ("bf16-weights", None, 3)
    assert bp.parse_entry("bf16-weights@1", seed=3) == ("bf16-weights", None, 1)
    assert bp.parse_entry("fp8:rowwise@2") == ("fp8", "rowwise", 2)
    # windows that start inside the warm-up (compile) are left out whole
    lines = [dict(step=25, step_time_s=9.0, tokens=2500), dict(step=50, step_time_s=1.0, tokens=5000)]
    assert bp.timed_rate(lines, warmup=20) == 100.0
    assert bp.timed_rate(lines, warmup=0) == 5000 / 250
    # the median window: warm-up windows and windows holding a profiled step are left out
    lines = [dict(step=s, step_time_s=t, tokens=100 * s) for s, t in ((5, 9.0), (10, 1.0), (15, 2.0), (20, 0.5), (25, 4.0))]
    assert bp.parse_steps("16-17") == range(16, 18) and bp.parse_steps("7") == range(7, 8) and not bp.parse_steps(None)
    assert bp.window_rates(lines, warmup=5) == [100.0, 50.0, 200.0, 25.0]
    assert bp.window_rates(lines, warmup=5, profiled=bp.parse_steps("16-17")) == [100.0, 50.0, 25.0]
    row = dict(final_loss=2.0, mfu_last=0.5, peak_mem_gib=10.0)
    rows = bp.table(
        [
            {**row, "entry": "bf16-weights", "tokens_per_s": 100.0, "eval_loss": 4.0, "median_window_tokens_per_s": 110.0},
            {**row, "entry": "fp8", "tokens_per_s": 125.0, "eval_loss": 3.96, "median_window_tokens_per_s": 143.0},
        ]
    ).splitlines()
    cells = [c.strip() for c in rows[-1].split("|")]
    assert cells[1:9] == ["fp8", "125", "1.25", "143", "1.30", "50.0%", "3.9600", "-1.00%"]


def test_bench_precision_passes_the_fsdp_options_to_pack_train(tmp_path, monkeypatch):
    """--no-reshard-after-forward and --grad-reduce reach every entry's TrainConfig (pack-train's own
    options of the same names); left out, they are pack-train's defaults. Each entry's peak memory
    is counted from its own start."""
    import bench_precision as bp

    import trainer

    seen = []

    def stop(config):
        seen.append(config)
        raise RuntimeError("stop")

    monkeypatch.setattr(trainer, "train", stop)
    monkeypatch.setattr(bp, "reset_cuda_peak", lambda device: seen.append(("reset", device.type)))
    for argv, reshard, reduce in ((["--no-reshard-after-forward", "--grad-reduce", "bf16"], False, "bf16"), ([], True, "fp32")):
        args = bp.parse_args([*argv, "--workdir", str(tmp_path), "--shared", str(tmp_path)])
        with pytest.raises(RuntimeError, match="stop"):
            bp.run_entry("fp8:tensorwise", tmp_path, args)
        assert seen[-2] == ("reset", "cpu")  # each entry's peak memory starts afresh
        assert (seen[-1].reshard_after_forward, seen[-1].grad_reduce) == (reshard, reduce)
        assert (seen[-1].dtype, seen[-1].fp8_recipe) == ("fp8", "tensorwise")


def _peer_worker(rank: int, world: int, port: int, folder: str, workdir: str) -> None:
    """One rank of bench_precision: pack-train's FSDP2 entry, then the Hugging Face peer's; writes
    the input_ids of every micro-batch each one trained on, and the peer's result."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import bench_precision as bp
    import torch.distributed as dist

    import trainer
    from trainer.data import stream

    seen: dict[str, list] = {"pack-train": [], "hf": []}
    read = stream.ShardReader.microbatch

    def spy_read(self, rows):
        mb = read(self, rows)
        seen["pack-train"].append(mb.input_ids.flatten().tolist())
        return mb

    stream.ShardReader.microbatch = spy_read
    config = trainer.TrainConfig
    trainer.TrainConfig = lambda **kw: config(**{**kw, "num_workers": 0})  # reads in this process
    make_step = train_steps.hf_step_fn

    def spy_step(*a, **kw):
        step = make_step(*a, **kw)

        def run(batch):
            seen["hf"].append(batch["input_ids"].flatten().tolist())
            return step(batch)

        return run

    train_steps.hf_step_fn = spy_step  # where bench_precision's HF peer takes it from
    args = bp.parse_args(
        [
            "--model",
            "tiny",
            "--parallel",
            "fsdp",
            "--tokens-per-step",
            "128",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--log-every",
            "1",
            "--lr",
            "1e-3",
            "--workdir",
            workdir,
            "--shared",
            workdir,
        ]
    )
    with bp.process_group():  # main's one group for every entry (gloo here), open across both
        bp.run_entry("bf16", Path(folder), args)
        assert dist.is_initialized()
        result = bp.run_hf_entry("hf/bf16", Path(folder), args)
        assert dist.is_initialized()
    assert not dist.is_initialized()
    Path(workdir, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "result": result}))


def test_bench_precision_hf_peer_trains_on_each_ranks_pack_train_rows(tmp_path):
    """`hf/bf16` under FSDP2 on two ranks: each rank's HF model trains, step by step, on exactly the
    tokens pack-train's same rank read from the shards in its own run (disjoint across ranks);
    the peer's metrics lines count both ranks' tokens, as pack-train's summary does."""
    from gloo_ranks import fork_ranks, free_port
    from packed_factory import pack_lengths

    lengths = np.random.default_rng(0).integers(4, 40, size=50).tolist()
    make_packed_folder(tmp_path / "p", pack_lengths(lengths, 64, vocab=300), 64, rows_per_shard=7)
    fork_ranks(_peer_worker, (2, free_port(), str(tmp_path / "p"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert len(r["seen"]["pack-train"]) == 3 and r["seen"]["hf"] == r["seen"]["pack-train"]
    assert ranks[0]["seen"]["hf"] != ranks[1]["seen"]["hf"]
    res = ranks[0]["result"]
    assert res["world_size"] == 2 and res["attention"] == "sdpa" and res["eval_loss"] is None
    assert [step for step, _ in res["loss_curve"]] == [1, 2, 3]
    both = sum(len(ids) for r in ranks for ids in r["seen"]["hf"])
    assert res["tokens_per_s"] > 0 and len(res["window_tokens_per_s"]) == 2  # steps 2 and 3, after warm-up
    summary = json.loads((tmp_path / "run-bf16" / "summary.json").read_text())
    assert summary["tokens"] == res["tokens_seen"] == both


def test_bench_precision_hf_peer_refuses_a_precision_it_does_not_run(tmp_path):
    """The peer runs bf16 and fp8; `hf/bf16-weights` (pack-train's own master-weight precision)
    stops in one line before any model is built."""
    import bench_precision as bp

    args = bp.parse_args(["--workdir", str(tmp_path), "--shared", str(tmp_path)])
    with pytest.raises(SystemExit, match="hf/bf16-weights: the Hugging Face peer runs hf/bf16 or hf/fp8"):
        bp.run_hf_entry("hf/bf16-weights", tmp_path, args)


@pytest.mark.slow
def test_bench_unsloth_feeds_unsloth_the_same_rows_with_their_lengths(tmp_path, monkeypatch):
    """scripts/bench/bench_unsloth.py with a stand-in for `unsloth` (HF + peft under Unsloth's API): it
    writes the checkpoint Unsloth loads, asks for LoRA with the gradient checkpointing named, and
    times exactly pack-train's planned steps, each flattened with its examples' lengths."""
    import shutil
    import types

    tokenizer = REPO / "data" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip("data/tokenizer is not there")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shared = _fake_shared(tmp_path / "shared")
    shutil.copytree(tokenizer, shared / "tokenizers" / "llama2")
    seen: dict = {"lengths": [], "tokens": []}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(model_name, **_):
            seen["checkpoint"] = sorted(p.name for p in Path(model_name).iterdir())
            return AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32), None

        @staticmethod
        def get_peft_model(model, *, r, use_gradient_checkpointing, target_modules, **_):
            seen["gc"], seen["r"] = use_gradient_checkpointing, r
            model = get_peft_model(model, LoraConfig(r=r, target_modules=target_modules))

            def take_lengths(_module, args, kwargs):
                seen["lengths"].append(kwargs.pop("packed_seq_lengths").tolist())
                seen["tokens"].append(kwargs["input_ids"].shape[1])
                return args, kwargs

            model.register_forward_pre_hook(take_lengths, with_kwargs=True)
            return model

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel, __version__="stand-in"))
    import bench_unsloth

    report = bench_unsloth.main(
        [
            "--workdir",
            str(tmp_path / "w"),
            "--shared",
            str(shared),
            "--model",
            "tiny",
            "--lora-r",
            "4",
            "--gc",
            "true",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--max-len",
            "512",
            "--ffd-tokens",
            "512",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "u.json"),
        ]
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(seen["checkpoint"])
    assert seen["gc"] is True and seen["r"] == 4
    assert [sum(x) for x in seen["lengths"]] == seen["tokens"]  # every token is in one example
    (res,) = report["results"]
    lens, tokens = step_seq_lens_of_plan(tmp_path / "w" / "ffd", 512, 0, 1, 2)
    assert res["path"] == "unsloth-ffd+gc-true" and res["ok"] and res["steps"] == 2
    assert res["tokens"] == tokens == sum(seen["tokens"][1:3])
    assert sum(seen["lengths"][1:3], []) == lens.tolist()  # the timed steps' examples, in order
    assert json.loads((tmp_path / "u.json").read_text())["results"][0]["tokens"] == tokens


@pytest.mark.slow
def test_bench_activation_memory_counts_one_layer_of_activations(capsys):
    """scripts/bench/bench_activation_memory.py on the tiny preset: a layer keeps a positive number of
    bytes per token for its backward, fewer compiled than eager (the compiled backward recomputes
    what is cheap), and the breakdown lists what they are."""
    import re

    import bench_activation_memory as bam

    bam.main(["--model", "tiny", "--lora-r", "4", "--tokens", "64", "--budgets", "eager,1"])
    out = capsys.readouterr().out
    eager, compiled = (float(x.replace(",", "")) for x in re.findall(r": ([\d,]+) bytes per token per layer", out))
    assert 0 < compiled < eager, out
    assert "B/token  bfloat16" in out


def test_bench_activation_memory_with_tiles_counts_less_than_the_whole_mlp(capsys):
    """--tile-mlp: the layer's count leaves the MLP's intermediates out (its tiles recompute them),
    so an eager layer keeps fewer bytes per token than with the whole MLP."""
    import re

    import bench_activation_memory as bam

    def per_token(*extra: str) -> float:
        bam.main(["--model", "tiny", "--lora-r", "4", "--tokens", "64", "--budgets", "eager", *extra])
        out = capsys.readouterr().out
        return float(re.findall(r": ([\d,]+) bytes per token per layer", out)[0].replace(",", ""))

    assert 0 < per_token("--tile-mlp", "8") < per_token()


def test_the_activation_memory_budget_reaches_every_compiled_path(tmp_path, monkeypatch):
    """--activation-memory-budget goes to pack-train's config on packlm paths and is in force while
    an HF path's compiled layers run (and partition) their steps; the default leaves torch's own."""
    import torch._functorch.config as functorch_config

    import trainer

    class Stop(Exception):
        pass

    seen = {}

    def fake_train(config):
        seen["packlm"] = config.activation_memory_budget
        raise Stop

    def fake_loop(*_args, **_kwargs):
        seen["hf"] = functorch_config.activation_memory_budget
        raise Stop

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(bt, "timed_loop", fake_loop)
    make_packed_folder(tmp_path / "p", [[(i, np.arange(3, 3 + n))] for i, n in enumerate([5, 9, 3, 7])], max_len=16)
    for budget, want in ((["--activation-memory-budget", "0.7"], 0.7), ([], 1.0)):
        args = bt.parse_args(
            [
                "--device",
                "cpu",
                "--model",
                "tiny",
                "--workdir",
                str(tmp_path),
                "--ffd-tokens",
                "16",
                "--steps",
                "1",
                "--warmup",
                "1",
                *budget,
            ]
        )
        s = bt.Setup(args, CPU, {"ffd": tmp_path / "p"}, [], [], {}, 0, 300)
        with pytest.raises(Stop):
            run_packed_pack_train("packlm-ffd", s)
        with pytest.raises(Stop):
            bt.run_hf_path("hf-ffd-sdpa+layers", s)
        assert seen == {"packlm": want, "hf": want}
        assert functorch_config.activation_memory_budget == 1.0


# ------------------------------------------------------------------------- bench_fp8_layers (CPU)


def test_bench_fp8_layers_row_fills_the_tokens_with_restarting_positions():
    import bench_fp8_layers as bf

    row = bf.packed_row(8192, seed=0, device=CPU)
    cu = row["cu_seq_lens_q"].tolist()
    lengths = np.diff(cu)
    assert cu[0] == 0 and cu[-1] == 8192 and len(cu) > 4 and (lengths > 0).all()
    assert row["max_length_q"] == row["max_length_k"] == lengths.max() <= 2048
    starts = torch.zeros(8192, dtype=torch.bool)
    starts[cu[:-1]] = True
    assert (row["position_ids"][0][starts] == 0).all() and (row["position_ids"][0][~starts] > 0).all()


def test_bench_fp8_layers_weight_scaled_variant_keeps_every_example_exact(monkeypatch):
    """The benchmark's `rowwise_tw_weight` (per-token activation scales, one scale per weight) is
    packing-exact like rowwise_with_gw_hp: each example's loss and gradients equal its own alone
    (torchao's CPU emulation; tests/trainer/model/test_fp8.py's comparison, whose negative control is
    tensorwise)."""
    pytest.importorskip("torchao.float8")
    import dataclasses

    import bench_fp8_layers as bf

    from trainer.model import fp8

    sys.path.insert(0, str(REPO / "tests" / "trainer" / "model"))
    import test_fp8

    real = fp8.fp8_config
    monkeypatch.setattr(
        fp8,
        "fp8_config",
        lambda recipe, emulate=False, fsdp=False: (
            dataclasses.replace(bf.variant_config(recipe), emulate=emulate)
            if recipe in bf.VARIANTS
            else real(recipe, emulate=emulate, fsdp=fsdp)
        ),
    )
    loss_gap, grad_gap = test_fp8._packed_vs_alone("rowwise_tw_weight")
    assert loss_gap < 1e-5 and grad_gap < 1e-4
    with pytest.raises(SystemExit, match="unknown recipe"):
        bf.variant_config("rowwise_tw_everything")


def test_context_parallel_report_and_ring_peer_count_flops_by_the_one_count(tmp_path):
    """bench_context_parallel report: medians of pack-train's own FLOP rates over the timed steps;
    ring_peer: the FLOPs of its rows by pipeline.report.flops (every layer recomputed)."""
    import bench_context_parallel as bcp

    from pipeline.report.flops import step_flops
    from scripts.benchlib import ring_peer as rp

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"world_size": 2, "context_parallel": 2}))
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": k, "tokens_per_s": 10.0 * k, "tflops": k, "mfu": k / 989, "hfu": k / 900, "attn_flop_share": 0.5}) + "\n"
            for k in (1, 2, 3, 4)
        )
    )
    bcp.report([str(run)], str(tmp_path / "r.json"), warmup=1)
    (got,) = json.loads((tmp_path / "r.json").read_text())
    assert got["tflops"] == 3 and got["mfu"] == pytest.approx(3 / 989) and got["attn_flop_share"] == 0.5
    config = bt.model_config("tiny", 4096)
    rows = [
        {"seq_lens": np.array([8]), "labels": np.array([-100] + [5] * 7)},
        {"seq_lens": np.array([3, 5]), "labels": np.array([-100, 5, 5, -100, 5, 5, 5, 5])},
    ]
    shape = bt.flop_shape(config, 4, 1)
    want = step_flops(shape, [8], loss_tokens=7) + step_flops(shape, [3, 5], loss_tokens=6)
    assert rp.timed_flops(rows, config, 4) == want and want.recompute > 0


def test_packed_run_defaults_are_bench_trains_own():
    """bench_long runs packlm paths from `train_runs.PACKED_RUN_DEFAULTS` where bench_train runs them
    from its command line: the two agree, so both scripts train with the same settings."""
    from scripts.benchlib.train_runs import PACKED_RUN_DEFAULTS

    args = vars(bt.parse_args(["--device", "cpu"]))
    assert {k: args[k] for k in PACKED_RUN_DEFAULTS} == PACKED_RUN_DEFAULTS
