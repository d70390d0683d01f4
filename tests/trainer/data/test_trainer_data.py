"""trainer.data.stream: seeded rank-split micro-batch plans, exact cursors, and shard gathering."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from packed_factory import make_packed_folder, pack_lengths, random_packed_folder  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from pipeline.shards import iter_rows, read_manifest  # noqa: E402
from trainer.data.batch import collate_rows  # noqa: E402
from trainer.data.stream import (  # noqa: E402
    Cursor,
    CursorSampler,
    MicroBatchDataset,
    Planner,
    ShardReader,
    make_loader,
    row_lengths,
    step_cursor,
)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~60 rows of up to 64 tokens over 4 shards."""
    return random_packed_folder(tmp_path_factory.mktemp("packed"), 64, count=150, low=3, high=50, seed=1, rows_per_shard=17)


def test_row_lengths_match_rows(packed: Path) -> None:
    lengths = row_lengths(packed, read_manifest(packed))
    assert lengths.tolist() == [len(r["input_ids"]) for r in iter_rows(packed)]


def test_plan_respects_budget_covers_rows_and_is_seeded() -> None:
    lengths = np.random.default_rng(0).integers(1, 100, size=500)
    planner = Planner(lengths, 256, seed=3, world_size=2, grad_accum=3)
    plan = planner.plan(0)
    assert plan.n_microbatches % 6 == 0 and plan.n_microbatches > 0
    sizes = [int(lengths[plan.rows(i)].sum()) for i in range(plan.n_microbatches)]
    assert max(sizes) <= 256
    used = np.concatenate([plan.rows(i) for i in range(plan.n_microbatches)])
    assert len(np.unique(used)) == len(used)  # no row twice
    # Only the dropped tail is missing, and it is less than one step's worth of micro-batches.
    assert plan.n_dropped_microbatches < 6
    assert len(used) + (len(plan.order) - plan.cuts[-1]) == len(lengths)
    # Greedy: adding the next row would have overflowed the budget.
    for i in range(plan.n_microbatches - 1):
        assert sizes[i] + lengths[plan.order[plan.cuts[i + 1]]] > 256
    again = Planner(lengths, 256, seed=3, world_size=2, grad_accum=3).plan(0)
    assert np.array_equal(plan.order, again.order) and np.array_equal(plan.cuts, again.cuts)
    assert not np.array_equal(planner.plan(1).order, plan.order)  # a new order every epoch
    assert not np.array_equal(Planner(lengths, 256, seed=4).plan(0).order, plan.order)


def test_long_rows_become_their_own_microbatch() -> None:
    lengths = np.array([10, 300, 20, 30, 500, 5])
    planner = Planner(lengths, 100, seed=0, shuffle=False)
    plan = planner.plan(0)
    groups = [plan.rows(i).tolist() for i in range(plan.n_microbatches)]
    assert groups == [[0], [1], [2, 3], [4], [5]]
    assert plan.n_long_rows == 2


def test_ranks_get_disjoint_data_and_equal_step_counts() -> None:
    lengths = np.random.default_rng(2).integers(1, 64, size=333)
    world, accum = 3, 2
    planner = Planner(lengths, 128, seed=0, world_size=world, grad_accum=accum)
    for epoch in range(2):
        steps = planner.steps_in_epoch(epoch)
        per_rank = [[planner.local_rows(epoch, k, r) for k in range(steps * accum)] for r in range(world)]
        flat = [np.concatenate(rows) for rows in per_rank]
        assert all(len(rows) == steps * accum for rows in per_rank)
        for a in range(world):
            for b in range(a + 1, world):
                assert not set(flat[a].tolist()) & set(flat[b].tolist())


def test_sampler_resumes_exactly_across_epochs() -> None:
    lengths = np.random.default_rng(5).integers(1, 64, size=60)
    planner = Planner(lengths, 128, seed=0, grad_accum=2)
    per_epoch = planner.steps_in_epoch(0)
    total = per_epoch * 2 + 3
    full = list(CursorSampler(planner, Cursor(), total))
    assert len(full) == total * 2
    assert full[-1][0] == 2  # ran into the third epoch
    for done in (1, per_epoch, per_epoch + 2, total - 1):
        cursor = step_cursor(planner, Cursor(), done)
        assert list(CursorSampler(planner, cursor, total - done)) == full[done * 2 :]
    assert step_cursor(planner, Cursor(), per_epoch) == Cursor(1, 0)


def test_sampler_refuses_data_smaller_than_one_step() -> None:
    planner = Planner(np.array([10, 10]), 10, world_size=2, grad_accum=2)
    with pytest.raises(UserError, match="no complete step"):
        list(CursorSampler(planner, Cursor(), 1))


def test_reader_gathers_rows_across_shards(packed: Path) -> None:
    manifest = read_manifest(packed)
    rows = list(iter_rows(packed))
    reader = ShardReader(packed, manifest)
    pick = np.array([40, 3, 16, 17, len(rows) - 1])  # spans shard boundaries, any order
    got = reader.microbatch(pick)
    want = collate_rows([rows[i] for i in pick])
    for name in ("input_ids", "targets", "position_ids", "cu_seqlens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.cu_seqlens.dtype == torch.int32
    assert isinstance(got.max_seqlen, int) and got.max_seqlen == want.max_seqlen
    assert (got.n_tokens, got.n_loss_tokens) == (want.n_tokens, want.n_loss_tokens)


def _count_in_a_fresh_thread() -> int:
    """The intra-op thread count a thread started now begins with (autograd's GPU thread starts at
    the first backward and recomputes checkpointed layers there)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_loader_leaves_the_thread_count_of_later_threads(packed: Path) -> None:
    before = _count_in_a_fresh_thread()
    manifest = read_manifest(packed)
    planner = Planner(row_lengths(packed, manifest), 100, seed=7, grad_accum=1)
    loader = make_loader(
        MicroBatchDataset(ShardReader(packed, manifest), planner), CursorSampler(planner, Cursor(), 4), num_workers=2, prefetch_factor=2
    )
    assert not loader.pin_memory  # a pinning DataLoader's thread would set the count to 1 (below)
    assert len(list(loader)) == 4
    assert _count_in_a_fresh_thread() == before


def test_a_thread_setting_the_count_recompiles_compiled_code_in_later_threads() -> None:
    """Why the loader pins nothing (negative control of the test above): one thread's
    `set_num_threads(1)`, as in a pinning DataLoader's thread, is the count later threads start
    with, and torch.compile's guards then reject the graph compiled in the main thread."""
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(1)
        return gm.forward

    main = torch.get_num_threads()
    if main == 1:
        pytest.skip("one intra-op thread: set_num_threads(1) changes nothing here")
    torch._dynamo.reset()
    step = torch.compile(lambda x: torch.sin(x) * 2, backend=backend, dynamic=True)
    x = torch.randn(8)
    step(x)
    setter = threading.Thread(target=torch.set_num_threads, args=(1,))
    setter.start()
    setter.join()
    try:
        assert _count_in_a_fresh_thread() == 1
        later = threading.Thread(target=step, args=(x,))
        later.start()
        later.join()
        assert len(graphs) == 2  # compiled again: the guard on the thread count failed
    finally:
        torch.set_num_threads(main)  # the process-wide count again, for the tests after this one
        torch._dynamo.reset()
    assert _count_in_a_fresh_thread() == main


def test_loader_with_workers_yields_the_planned_order(packed: Path) -> None:
    manifest = read_manifest(packed)
    planner = Planner(row_lengths(packed, manifest), 100, seed=7, grad_accum=1)
    dataset = MicroBatchDataset(ShardReader(packed, manifest), planner)
    sampler = CursorSampler(planner, Cursor(0, 2), 6)
    serial = [b.input_ids for b in make_loader(dataset, sampler, num_workers=0)]
    parallel = [b.input_ids for b in make_loader(dataset, sampler, num_workers=2, prefetch_factor=2)]
    assert len(serial) == len(parallel) == 6
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel))
    first = dataset[(0, 2)].input_ids
    assert torch.equal(serial[0], first)


def test_open_data_refuses_a_damaged_folder(packed: Path, tmp_path: Path) -> None:
    from trainer import TrainConfig
    from trainer.run.preflight import open_data

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in packed.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["total_tokens"] += 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError):
        open_data(TrainConfig(data=str(bad), model="tiny", out=str(tmp_path / "run")))


def test_open_data_checks_the_tokenizer_fingerprint(packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenize = pytest.importorskip("pipeline.tokenize.tokenizer")
    from trainer import TrainConfig
    from trainer.run.preflight import open_data

    fingerprint = read_manifest(packed).tokenizer["fingerprint"]
    monkeypatch.setattr(tokenize, "load_tokenizer", lambda path: object())
    monkeypatch.setattr(tokenize, "tokenizer_fingerprint", lambda tok: fingerprint)
    config = TrainConfig(data=str(packed), model="tiny", out=str(tmp_path), tokenizer=str(tmp_path))
    assert open_data(config)[1] is not None
    monkeypatch.setattr(tokenize, "tokenizer_fingerprint", lambda tok: "f" * 64)
    with pytest.raises(UserError, match="fingerprint"):
        open_data(config)
    # tokenizer files inside a local model folder count as the model's tokenizer
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="fingerprint"):
        open_data(TrainConfig(data=str(packed), model=str(model_dir), out=str(tmp_path)))


def test_open_data_takes_the_fingerprints_of_what_the_tokenizer_does_and_of_its_files(tmp_path: Path) -> None:
    """A manifest records what the tokenizer does (`tokenizer_fingerprint`); one written before that
    recorded the sha256 of its files, which still matches the same folder. Anything else is refused."""
    from pipeline.tokenize.tokenizer import file_fingerprint, load_tokenizer, tokenizer_fingerprint
    from trainer import TrainConfig
    from trainer.run.preflight import open_data

    folder = Path(__file__).resolve().parents[3] / "data" / "tokenizer"
    tok = load_tokenizer(str(folder))
    rows = pack_lengths([5, 7, 9], 32, vocab=300)
    for name, fingerprint, ok in (
        ("now", tokenizer_fingerprint(tok), True),
        ("files", file_fingerprint(tok), True),
        ("other", "0" * 64, False),
    ):
        make_packed_folder(tmp_path / name, rows, 32, tokenizer={"name": "t", "fingerprint": fingerprint})
        config = TrainConfig(data=str(tmp_path / name), model="tiny", out=str(tmp_path / "r"), tokenizer=str(folder))
        if ok:
            assert open_data(config)[1] is not None
        else:
            with pytest.raises(UserError, match="fingerprint"):
                open_data(config)


def test_an_older_manifest_takes_a_checkpoints_copy_of_the_tokenizer_it_names(tmp_path: Path) -> None:
    """An older manifest's file fingerprint of data/tokenizer, and a checkpoint's re-saved copy of that
    tokenizer (other files): the folder the manifest names still holds those files and does what
    the copy does, so the copy is taken. Negative controls: a copy with another EOS token, and a
    manifest naming a folder that is gone."""
    import json as _json

    from pipeline.tokenize.tokenizer import file_fingerprint, load_tokenizer
    from trainer import TrainConfig
    from trainer.run.preflight import open_data

    folder = Path(__file__).resolve().parents[3] / "data" / "tokenizer"
    original = load_tokenizer(str(folder))
    copy = tmp_path / "ckpt" / "model"
    original.save_pretrained(copy)
    rows = pack_lengths([5, 7, 9], 32, vocab=300)
    for name, data in ((str(folder), "named"), (str(tmp_path / "gone"), "gone")):
        make_packed_folder(tmp_path / data, rows, 32, tokenizer={"name": name, "fingerprint": file_fingerprint(original)})
    config = TrainConfig(data=str(tmp_path / "named"), model="tiny", out=str(tmp_path / "r"), tokenizer=str(copy))
    assert open_data(config)[1] is not None
    with pytest.raises(UserError, match="fingerprint"):
        open_data(TrainConfig(data=str(tmp_path / "gone"), model="tiny", out=str(tmp_path / "r"), tokenizer=str(copy)))
    settings = _json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(_json.dumps({**settings, "eos_token": "<pad>"}))
    with pytest.raises(UserError, match="fingerprint"):
        open_data(config)


def test_open_data_refuses_data_with_no_loss_token(tmp_path: Path) -> None:
    """A folder whose every label is -100 would train nothing (final loss 0.0000): refused."""
    from trainer import TrainConfig
    from trainer.run.preflight import open_data

    rows = [[(0, [5, 6, 7], [-100, -100, -100]), (1, [8, 9], [-100, -100])]]
    make_packed_folder(tmp_path / "silent", rows, 8)
    with pytest.raises(UserError, match="has no token that carries a loss"):
        open_data(TrainConfig(data=str(tmp_path / "silent"), model="tiny", out=str(tmp_path / "run")))
