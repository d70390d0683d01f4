"""ArcticTraining's data source for packlm's rows: loaded through the recipe's `code:` key (its
supported way to register a custom DataSource), it hands the SFT data factory each row's token ids
and labels exactly as pack-data wrote them, one example a row, with no chat template, tokenizer or
truncation in between (`process: false` in the YAML skips the factory's tokenization).

The rows come from `bench_alst.py run` as an .npz file (`ids_<i>` and `labels_<i>` per row, int64),
written from the packed folder with pack-train's own reader; this module imports neither `pipeline`
nor `trainer`, since it runs under ArcticTraining's transformers 4.x. Labels follow the Hugging Face
convention pack-train uses (aligned with the ids, -100 where no loss; the model shifts them).

No `from __future__ import annotations` here: ArcticTraining resolves the `config` annotation of a
class with `typing.get_type_hints`, which needs it evaluated.
"""

from pathlib import Path

import numpy as np

SOURCE_NAME = "packlm_rows"


def read_rows(path: str | Path) -> dict[str, list[list[int]]]:
    """The rows of a `rows.npz` file, in order, as lists of ints (input_ids, labels)."""
    with np.load(path) as npz:
        count = sum(1 for key in npz.files if key.startswith("ids_"))
        rows = {"input_ids": [], "labels": []}
        for i in range(count):
            ids, labels = npz[f"ids_{i}"], npz[f"labels_{i}"]
            if ids.shape != labels.shape:
                raise ValueError(f"{path}: row {i} has {ids.size} ids but {labels.size} labels")
            rows["input_ids"].append(ids.tolist())
            rows["labels"].append(labels.tolist())
    return rows


def registered() -> type | None:
    """The source class ArcticTraining has under SOURCE_NAME (this module loaded before in the
    process, e.g. by a second `get_config`), else None."""
    from arctic_training.exceptions import RegistryError
    from arctic_training.registry import get_registered_data_source

    try:
        return get_registered_data_source(SOURCE_NAME)
    except RegistryError:
        return None


try:  # the classes at module level: the datasets library pickles them (by name) to fingerprint its steps
    from arctic_training import DataSource
    from arctic_training.config.data import DataSourceConfig
    from datasets import Dataset
except ImportError:  # imported by a test without ArcticTraining: only read_rows is used
    DataSource = None

if DataSource is not None and registered() is not None:  # registering twice is an error: reuse it
    PackedRowsSource = registered()
    PackedRowsConfig = PackedRowsSource.__annotations__["config"]
elif DataSource is not None:

    class PackedRowsConfig(DataSourceConfig):
        path: Path
        """ The rows.npz file `bench_alst.py run` wrote. """

    class PackedRowsSource(DataSource):
        name = SOURCE_NAME
        config: PackedRowsConfig

        def load(self, config: PackedRowsConfig, split: str) -> Dataset:
            return Dataset.from_dict(read_rows(config.path))
