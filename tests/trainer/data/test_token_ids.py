"""pack-train checks every micro-batch's token ids against the model's embedding: a row
with an id past it (a folder whose manifest does not say its vocabulary, or says too little) stops
the run in one line naming the shard file and row, with or without loader workers; in-range data
trains (the negative control)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from packed_factory import default_labels, make_packed_folder

from pipeline.errors import UserError
from trainer import TrainConfig, train

MAX_LEN = 32  # one row a step; the tiny preset embeds 4,096 tokens


def folder_with(tmp_path: Path, bad: dict | None = None) -> Path:
    """4 rows of one 32-token example each, in 2 shards of 2 rows; shard 1, row 1 gets `bad`
    (position -> id) written over its ids, and its labels follow (the folder's check holds each
    label to -100 or its token's id)."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        ids = rng.integers(3, 4096, MAX_LEN)
        if i == 3:
            for where, value in (bad or {}).items():
                ids[where] = value
        rows.append([(i, ids, default_labels(ids))])
    make_packed_folder(tmp_path / "data", rows, MAX_LEN, rows_per_shard=2)
    return tmp_path / "data"


def run(tmp_path: Path, data: Path, workers: int) -> dict:
    return train(
        TrainConfig(
            data=str(data),
            model="tiny",
            out=str(tmp_path / f"run-{workers}"),
            device="cpu",
            tokens_per_step=MAX_LEN,
            max_steps=4,
            num_workers=workers,
            progress=False,
            save_every=0,
            verify_hashes=False,
        )
    )


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("bad", "said"), [({5: 4096}, 4096), ({31: 4097}, 4097), ({7: 70000, 9: 5000}, 70000)])
def test_ids_outside_the_embedding_stop_in_one_line(tmp_path: Path, workers: int, bad: dict, said: int) -> None:
    data = folder_with(tmp_path, bad)
    with pytest.raises(UserError) as caught:
        run(tmp_path, data, workers)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(
        f"{data / 'shard-00001.arrow'}: row 1 holds token id {said}, outside the model's vocabulary of 4096 tokens"
    ), message


@pytest.mark.parametrize("workers", [0, 2])
def test_ids_at_the_edges_of_the_embedding_train(tmp_path: Path, workers: int) -> None:
    data = folder_with(tmp_path, {5: 4095, 6: 0})
    summary = run(tmp_path, data, workers)
    assert summary["steps"] == 4
