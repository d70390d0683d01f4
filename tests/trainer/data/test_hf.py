"""trainer.data.hf: packed folders in Hugging Face's Trainer and TRL's SFTTrainer.

- the dataset is the folder's rows, memory-mapped from the shards (no copy), after verification;
- a collated batch gives every example the logits and loss it has alone (sdpa, eager, and
  pack-train's own backend), with a negative control;
- `transformers.Trainer` (and `trl.SFTTrainer` when installed) trains on the rows with the same
  step losses as pack-train on the same rows, weights and order (float32, CPU).
"""

from __future__ import annotations

import doctest
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from packed_factory import make_packed_folder  # noqa: E402

from pipeline.errors import ShardFormatError  # noqa: E402
from pipeline.shards import iter_rows, read_manifest  # noqa: E402
from pipeline.tokenize.tokenizer import load_tokenizer  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.data import hf  # noqa: E402
from trainer.data.stream import Planner, row_lengths  # noqa: E402
from trainer.model.load import load_model, prepare  # noqa: E402

MAX_LEN, VOCAB, ROWS = 64, 300, 8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROWS rows of exactly MAX_LEN tokens, 2-4 examples each, in 3 shards (so a micro-batch of
    MAX_LEN tokens is one row, on both sides)."""
    rng = np.random.default_rng(0)
    rows, eid = [], 0
    for _ in range(ROWS):
        cuts = np.sort(rng.choice(np.arange(5, MAX_LEN - 4), size=int(rng.integers(1, 4)), replace=False))
        row = []
        for n in np.diff([0, *cuts.tolist(), MAX_LEN]):
            row.append((eid, rng.integers(3, VOCAB, size=int(n))))
            eid += 1
        rows.append(row)
    folder = tmp_path_factory.mktemp("packed")
    make_packed_folder(folder, rows, MAX_LEN, rows_per_shard=3, tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB})
    return folder


def test_docstring_example():
    assert doctest.testmod(hf).failed == 0


def test_the_dataset_is_the_folders_rows_memory_mapped_in_place(packed: Path):
    data = hf.packed_dataset(packed)
    rows = list(iter_rows(packed))
    assert len(data) == len(rows) == ROWS
    for i in (0, 4, ROWS - 1):
        for name in ("input_ids", "labels", "position_ids", "seq_lens", "example_ids"):
            assert np.array_equal(data[i][name], rows[i][name])
    assert sorted(Path(f["filename"]).name for f in data.cache_files) == sorted(
        s.file for s in read_manifest(packed).shards
    )  # the shards themselves: nothing copied


def test_a_damaged_folder_is_refused(packed: Path, tmp_path: Path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / read_manifest(copy).shards[1].file
    data = bytearray(shard.read_bytes())
    data[-200] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError):
        hf.packed_dataset(copy)


def _model(attn: str | None = None, use_cache: bool = True):
    """The tiny preset, with a KV cache on by default as in most real model configs."""
    model = load_model("tiny", vocab_size=VOCAB, seed=0)
    model.config.use_cache = use_cache
    if attn is not None:
        if attn.startswith("packlm-"):
            prepare(model, attn.removeprefix("packlm-"))  # pack-train's own backend (reads cu_seq_lens_q)
        else:
            model.config._attn_implementation = attn
    return model.eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packlm-sdpa"])
def test_a_collated_batch_gives_every_example_its_own_logits_and_loss(packed: Path, attn: str):
    data = hf.packed_dataset(packed, check_hashes=False)
    rows = [data[i] for i in (0, 1, 2)]
    model = _model(attn)
    reference = _model("eager", use_cache=False)  # the same weights, one example at a time
    batch = hf.PackedCollator()(rows)
    with torch.no_grad():
        out = model(**batch)
        logits = out.logits[0]
        want_sum, want_count = 0.0, 0
        # each example alone, from the flat batch's own ids and labels
        flat_ids, flat_labels = batch["input_ids"][0], batch["labels"][0]
        cu = batch["cu_seq_lens_q"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            alone = reference(input_ids=flat_ids[a:b][None], labels=flat_labels[a:b][None])
            torch.testing.assert_close(logits[a:b], alone.logits[0], rtol=1e-5, atol=1e-5)
            n = int((flat_labels[a + 1 : b] != -100).sum())
            want_sum += float(alone.loss) * n
            want_count += n
    assert float(out.loss) == pytest.approx(want_sum / want_count, rel=1e-5)


def test_negative_control_with_a_kv_cache_transformers_ignores_the_packed_position_ids(packed: Path):
    """Why the batch carries use_cache=False: with the model's cache on, sdpa masks are plain causal
    over the whole batch, and the second example sees the first."""
    data = hf.PackedCollator()([hf.packed_dataset(packed, check_hashes=False)[0]])
    model = _model("sdpa", use_cache=True)
    a, b = data["cu_seq_lens_q"].tolist()[1:3]
    with torch.no_grad():
        fixed = model(**data).logits[0, a:b]
        leaky = model(**{**data, "use_cache": True}).logits[0, a:b]
        alone = model(input_ids=data["input_ids"][:, a:b], use_cache=False).logits[0]
    torch.testing.assert_close(fixed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky, alone, rtol=1e-3, atol=1e-3)


def test_negative_control_without_position_ids_examples_see_each_other(packed: Path):
    data = hf.packed_dataset(packed, check_hashes=False)
    batch = hf.PackedCollator(return_flash_attn_kwargs=False)([data[0], data[1]])
    model = _model("sdpa")
    cu = np.flatnonzero(batch["position_ids"][0].numpy() == 0).tolist()
    a, b = cu[1], cu[2] if len(cu) > 2 else len(batch["input_ids"][0])
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"]).logits[0]  # no boundaries: one long causal sequence
        alone = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
    assert not torch.allclose(leaky[a:b], alone, rtol=1e-3, atol=1e-3)


def test_the_collator_refuses_rows_it_cannot_cut():
    with pytest.raises(ValueError, match="position_ids"):
        hf.PackedCollator()([{"input_ids": [5, 6], "labels": [-100, 6], "position_ids": [1, 2]}])
    with pytest.raises(ValueError, match="equal"):
        hf.PackedCollator()([{"input_ids": [5, 6], "labels": [-100], "position_ids": [0, 1]}])


def test_the_collator_names_what_is_wrong_with_rows_of_another_shape():
    """One ValueError naming the row and column, not a raw KeyError or TypeError (or a wrong batch)."""
    row = {"input_ids": [5, 6], "labels": [-100, 6], "position_ids": [0, 1]}
    with pytest.raises(ValueError, match=r"PackedCollator: row 1 has no 'labels' \(it has input_ids, position_ids\)"):
        hf.PackedCollator()([row, {"input_ids": [5, 6], "position_ids": [0, 1]}])
    with pytest.raises(ValueError, match="PackedCollator takes a list of rows .*got dict"):
        hf.PackedCollator()(row)  # one row, not a list of rows
    with pytest.raises(ValueError, match="PackedCollator: row 0 is a str"):
        hf.PackedCollator()(["input_ids"])
    with pytest.raises(ValueError, match=r"row 0's 'input_ids' must be a flat list of integers, got .* shape \(1, 2\)"):
        hf.PackedCollator()([{**row, "input_ids": [[5, 6]]}])
    with pytest.raises(ValueError, match=r"return_flash_attn_kwargs=...\) must be True or False, got 'no'"):
        hf.PackedCollator(return_flash_attn_kwargs="no")
    assert hf.PackedCollator()((row, row))["input_ids"].tolist() == [[5, 6, 5, 6]]  # a tuple of rows is fine


# ------------------------------------------------------------------ Trainer against pack-train

STEPS, ACCUM, LR = 3, 2, 2e-3


def _pack_train_losses(packed: Path, out: Path) -> list[float]:
    train(
        TrainConfig(
            data=str(packed),
            model="tiny",
            out=str(out),
            tokens_per_step=MAX_LEN,
            grad_accum=ACCUM,
            lr=LR,
            warmup=0,
            schedule="constant",
            weight_decay=0.0,
            grad_clip=1.0,
            max_steps=STEPS,
            log_every=1,
            num_workers=0,
            progress=False,
            attn="sdpa",
            dtype="fp32",
            seed=0,
        )
    )
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _pack_train_order(packed: Path) -> list[int]:
    """The rows pack-train's planner feeds, in order (one row per micro-batch here)."""
    planner = Planner(row_lengths(packed, read_manifest(packed)), MAX_LEN, seed=0, grad_accum=ACCUM)
    plan = planner.plan(0)
    order = [int(r) for i in range(plan.n_microbatches) for r in plan.rows(i)]
    assert plan.n_microbatches == len(order) == ROWS
    return order


def _hf_args(out: Path, cls):
    return cls(
        output_dir=str(out),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )


def _logged_losses(trainer) -> list[float]:
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


@pytest.mark.parametrize("attn", ["sdpa", "packlm-sdpa"])
def test_transformers_trainer_matches_pack_train_step_losses(packed: Path, tmp_path: Path, attn: str):
    """With transformers' sdpa and with pack-train's own backend installed in the model."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    want = _pack_train_losses(packed, tmp_path / "pack")
    data = hf.packed_dataset(packed).select(_pack_train_order(packed))
    model = _model(attn).train()
    trainer = Trainer(model=model, args=_hf_args(tmp_path / "hf", TrainingArguments), train_dataset=data, data_collator=hf.PackedCollator())
    trainer.train()
    got = _logged_losses(trainer)
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-4)
    # the updates matched too: step 2's loss is not what its rows give with the first weights
    with torch.no_grad():
        untrained = float(_model("sdpa", use_cache=False)(**hf.PackedCollator()([data[i] for i in (ACCUM, ACCUM + 1)])).loss)
    assert abs(untrained - want[1]) > 20 * 1e-4 * want[1], (untrained, want[1])


def test_trl_sft_trainer_matches_pack_train_step_losses(packed: Path, tmp_path: Path):
    trl = pytest.importorskip("trl")
    pytest.importorskip("accelerate")

    want = _pack_train_losses(packed, tmp_path / "pack")
    data = hf.packed_dataset(packed).select(_pack_train_order(packed))
    args = _hf_args(tmp_path / "sft", trl.SFTConfig)
    args.dataset_kwargs = {"skip_prepare_dataset": True}  # the rows are tokenized and packed already
    args.remove_unused_columns = False  # SFTTrainer would keep only the columns it knows
    tokenizer = load_tokenizer(str(Path(__file__).parents[3] / "data" / "tokenizer"))  # unused: rows are tokens
    trainer = trl.SFTTrainer(
        model=_model("sdpa").train(), args=args, train_dataset=data, data_collator=hf.PackedCollator(), processing_class=tokenizer
    )
    trainer.train()
    assert _logged_losses(trainer) == pytest.approx(want, rel=1e-4)


def test_trainer_under_ddp_gives_every_rank_the_same_steps_and_all_rows(tmp_path: Path):
    """Two ranks (torchrun, gloo on CPU) over 7 rows: Trainer's sampler evens the ranks out (one row
    is used twice), both take the same optimizer steps, together they see every row, and their
    weights stay identical."""
    pytest.importorskip("accelerate")
    import os

    from gloo_ranks import run_killable

    rng = np.random.default_rng(1)
    rows = [[(i, rng.integers(3, VOCAB, size=MAX_LEN))] for i in range(7)]
    make_packed_folder(tmp_path / "odd", rows, MAX_LEN, tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB})
    worker = Path(__file__).with_name("hf_ddp_worker.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), "OMP_NUM_THREADS": "1"}
    proc = run_killable(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--standalone",
            str(worker),
            str(tmp_path / "odd"),
            str(tmp_path / "run"),
        ],
        300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2  # 4 batches each, 2 per step
    seen = [i for r in ranks for batch in r["seen"] for i in batch]
    assert len(seen) == 8 and set(seen) == set(range(7))
    assert ranks[0]["checksum"] == ranks[1]["checksum"] and ranks[0]["first"] == ranks[1]["first"]
