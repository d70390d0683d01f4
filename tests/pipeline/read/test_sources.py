"""pipeline.read.sources: every input format, ordering and row positions, limits, and every error case."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from hf_cache import hf_home  # noqa: F401 - a fixture

from pipeline.errors import UserError
from pipeline.read import json_lines as read_json
from pipeline.read import sources
from pipeline.read import tables as read_tables
from pipeline.read.batches import SourceBatch, column_names, iter_batches
from pipeline.read.sources import input_fingerprints, resolve_inputs

ROWS = [{"instruction": f"task {i}", "input": "" if i % 2 else f"in {i}", "output": f"answer {i}"} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict], blank_every: int = 0) -> Path:
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_all(inputs: list[str], **kw) -> tuple[pa.Table, list[SourceBatch]]:
    batches = list(iter_batches(resolve_inputs(inputs), **kw))
    return pa.concat_tables([b.table for b in batches], promote_options="permissive"), batches


def expect_error(match: str, fn, *args, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


# ------------------------------------------------------------------------------------ formats


def _write_format(kind: str, tmp_path: Path) -> Path:
    table = pa.Table.from_pylist(ROWS)
    if kind == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", ROWS)
    if kind == "jsonl.gz":
        p = tmp_path / "d.jsonl.gz"
        p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode(), mtime=0))
        return p
    if kind == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(ROWS, indent=2))
        return p
    if kind == "json-lines-content":
        return write_jsonl(tmp_path / "d.json", ROWS)
    if kind == "parquet":
        pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
        return tmp_path / "d.parquet"
    if kind == "arrow-file":
        with pa.ipc.new_file(tmp_path / "d.arrow", table.schema) as w:
            w.write_table(table, max_chunksize=4)
        return tmp_path / "d.arrow"
    if kind == "arrow-stream":
        with pa.ipc.new_stream(tmp_path / "d.arrow", table.schema) as w:
            w.write_table(table, max_chunksize=4)
        return tmp_path / "d.arrow"
    if kind == "feather":
        feather.write_feather(table, tmp_path / "d.feather")
        return tmp_path / "d.feather"
    if kind == "hf_disk":
        import datasets

        datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
        return tmp_path / "ds"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["jsonl", "jsonl.gz", "json", "json-lines-content", "parquet", "arrow-file", "arrow-stream", "feather", "hf_disk"]
)
def test_each_format_reads_all_rows_in_order(tmp_path, kind):
    path = _write_format(kind, tmp_path)
    files = resolve_inputs([str(path)])
    expected_kind = {
        "jsonl.gz": "jsonl",
        "json-lines-content": "jsonl",
        "arrow-file": "arrow",
        "arrow-stream": "arrow",
        "feather": "arrow",
    }.get(kind, kind)
    assert [f.kind for f in files] == [expected_kind]
    assert files[0].size > 0
    table, batches = read_all([str(path)], batch_rows=4)
    assert table.to_pylist() == ROWS
    assert all(b.table.num_rows <= 4 for b in batches)
    assert [b.first_row for b in batches] == [b.first_index for b in batches]
    assert [b.first_row for b in batches] == list(np.cumsum([0] + [b.table.num_rows for b in batches[:-1]]))
    assert column_names(files) == ["instruction", "input", "output"]


def test_csv_and_tsv_read_as_strings_with_quoted_newlines(tmp_path):
    (tmp_path / "a.csv").write_text('instruction,input,output\n"multi\nline",,42\nb,"x, y",007\n')
    (tmp_path / "b.tsv").write_text("instruction\tinput\toutput\nc\t\t1\n")
    table, batches = read_all([str(tmp_path / "a.csv"), str(tmp_path / "b.tsv")])
    assert table.schema.types == [pa.string()] * 3
    assert table.to_pylist() == [
        {"instruction": "multi\nline", "input": "", "output": "42"},
        {"instruction": "b", "input": "x, y", "output": "007"},
        {"instruction": "c", "input": "", "output": "1"},
    ]
    assert [(b.first_row, b.first_index) for b in batches] == [(0, 0), (0, 2)]
    assert batches[0].where(1) == f"{tmp_path / 'a.csv'} row 2"


def test_datasets_dict_folder_uses_train_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    table, _ = read_all([str(tmp_path / "dd")])
    assert table.to_pylist() == ROWS[:3]
    table, _ = read_all([str(tmp_path / "dd" / "test")])
    assert table.to_pylist() == ROWS[3:]


def test_dataset_dict_without_train_names_the_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS[:2]), "b": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(
        str(tmp_path / "dd")
    )
    expect_error(r"splits \['a', 'b'\].*pass one split folder", read_all, [str(tmp_path / "dd")])


def test_a_hub_dataset_is_read_as_the_local_files_of_its_split(hf_home, tmp_path, monkeypatch):
    """`owner/name:config:split` names the split's files in the Hub's layout (here a cache the test
    builds, offline): read as the parquet files they are, each remembering the id and commit."""
    from hf_cache import add_snapshot

    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:6]), src / "a.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[6:]), src / "b.parquet")
    add_snapshot(
        hf_home,
        "dataset",
        "someone/some-data",
        {"main/test-0.parquet": src / "a.parquet", "main/test-1.parquet": src / "b.parquet", "main/train-0.parquet": src / "a.parquet"},
        "c" * 40,
    )
    monkeypatch.chdir(tmp_path)
    files = resolve_inputs(["someone/some-data:main:test"])
    assert [(Path(f.path).name, f.kind) for f in files] == [("test-0.parquet", "parquet"), ("test-1.parquet", "parquet")]
    table, batches = read_all(["someone/some-data:main:test"], batch_rows=4)
    assert table.to_pylist() == ROWS and len(batches) == 3
    assert column_names(files) == ["instruction", "input", "output"]
    hub = {
        "input": "someone/some-data:main:test",
        "id": "someone/some-data",
        "revision": None,
        "commit": "c" * 40,
        "config": "main",
        "split": "test",
    }
    assert [e["hub"] for e in input_fingerprints(files)] == [hub, hub]
    assert input_fingerprints(files)[0]["sha256"] == hashlib.sha256((src / "a.parquet").read_bytes()).hexdigest()


def test_a_hub_dataset_neither_cached_nor_reachable_is_one_clear_line(hf_home, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.chdir(tmp_path)
    msg = expect_error(
        "dataset owner/name is not in the local Hugging Face cache .* and the Hugging Face Hub cannot be reached",
        resolve_inputs,
        ["owner/name"],
    )
    assert "pass a local path" in msg


# ------------------------------------------------------------------------------------ order, globs


def test_globs_and_several_files_keep_order_and_global_index(tmp_path):
    for name, lo, hi in [("b.jsonl", 0, 3), ("a.jsonl", 3, 7), ("c.jsonl", 7, 10)]:
        write_jsonl(tmp_path / name, ROWS[lo:hi])
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), tmp_path / "z.parquet")
    inputs = [str(tmp_path / "z.parquet"), str(tmp_path / "*.jsonl")]
    files = resolve_inputs(inputs)
    assert [Path(f.path).name for f in files] == ["z.parquet", "a.jsonl", "b.jsonl", "c.jsonl"]
    _, batches = read_all(inputs, batch_rows=2)
    got = [(Path(b.file).name, b.first_row, b.first_index, b.table.num_rows) for b in batches]
    assert got == [
        ("z.parquet", 0, 0, 2),
        ("a.jsonl", 0, 2, 2),
        ("a.jsonl", 2, 4, 2),
        ("b.jsonl", 0, 6, 2),
        ("b.jsonl", 2, 8, 1),
        ("c.jsonl", 0, 9, 2),
        ("c.jsonl", 2, 11, 1),
    ]
    # the global index addresses the right example
    flat = [r for b in batches for r in b.table.to_pylist()]
    assert flat[4] == ROWS[5] and flat[9] == ROWS[7]


def test_plain_folder_expands_to_its_data_files(tmp_path):
    (tmp_path / "x").mkdir()
    write_jsonl(tmp_path / "x" / "2.jsonl", ROWS[5:])
    write_jsonl(tmp_path / "x" / "1.jsonl", ROWS[:5])
    (tmp_path / "x" / "notes.txt").write_text("ignored")
    table, _ = read_all([str(tmp_path / "x")])
    assert table.to_pylist() == ROWS


def test_files_skipped_in_a_folder_are_named(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    write_jsonl(tmp_path / "x" / "1.jsonl", ROWS)
    (tmp_path / "x" / "README.txt").write_text("about the data")
    (tmp_path / "x" / "more.jsnol").write_text("{}")  # a typo'd extension
    assert [Path(f.path).name for f in resolve_inputs([str(tmp_path / "x")])] == ["1.jsonl"]
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "skipping 2 file(s) that are not data (README.txt, more.jsnol)" in said[0]


def test_limit_stops_across_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "b.jsonl", ROWS[4:])
    table, batches = read_all([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], batch_rows=3, limit=6)
    assert table.to_pylist() == ROWS[:6]
    assert [(b.first_row, b.first_index, b.table.num_rows) for b in batches] == [(0, 0, 3), (3, 3, 1), (0, 4, 2)]
    assert list(iter_batches(resolve_inputs([str(tmp_path / "a.jsonl")]), limit=0)) == []


def test_jsonl_blank_lines_count_records_and_lines_are_exact(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS, blank_every=3)  # blanks after rows 0, 3, 6, 9
    _, batches = read_all([str(path)], batch_rows=4, chunk_bytes=150)
    rows = [r for b in batches for r in b.table.to_pylist()]
    assert rows == ROWS
    lines = np.concatenate([b.lines for b in batches])
    text_lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        assert json.loads(text_lines[line - 1]) == ROWS[i]
    starts = [b.first_row for b in batches]
    assert starts == list(np.cumsum([0] + [b.table.num_rows for b in batches[:-1]]))
    assert batches[0].where(1) == f"{path} line 3"


@pytest.mark.parametrize("chunk_bytes", [1, 5, 64, 1 << 20])
@pytest.mark.parametrize("last_newline", [True, False])
def test_jsonl_lines_longer_than_a_chunk_are_read_whole_with_their_line_numbers(tmp_path, chunk_bytes, last_newline):
    """A line spanning many read blocks is joined once and parsed whole; the lines around it (blank
    ones too, and a last line without a line end) keep their numbers."""
    rows = [{"text": "a"}, {"text": "b" * 300}, {"text": "c", "extra": 1}, {"text": "d" * 150}]
    body = json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n\n" + "\n".join(map(json.dumps, rows[2:]))
    path = tmp_path / "d.jsonl"
    path.write_text(body + ("\n" if last_newline else ""))
    table, batches = read_all([str(path)], batch_rows=2, chunk_bytes=chunk_bytes)
    assert table.to_pylist() == [{"text": r["text"], "extra": r.get("extra")} for r in rows]
    assert [int(line) for b in batches for line in b.lines] == [1, 2, 4, 5]
    chunks = list(read_json._jsonl_chunks(str(path), chunk_bytes))
    assert b"".join(c for c, _, _ in chunks) == path.read_bytes()
    assert [(line, offset) for _, line, offset in chunks] == [
        (1 + sum(c.count(b"\n") for c, _, _ in chunks[:k]), sum(len(c) for c, _, _ in chunks[:k])) for k in range(len(chunks))
    ]
    assert column_names(resolve_inputs([str(path)])) == ["text", "extra"]


# ------------------------------------------------------------------------------------ schema drift


@pytest.mark.parametrize("order", ["null-absent-string", "string-null-absent"])
def test_jsonl_schema_changes_between_chunks(tmp_path, order):
    """`input` null in whole chunks, missing in others, a new field late: all rows come through."""
    groups = {
        "null": [{"instruction": f"n{i}", "input": None, "output": "o"} for i in range(30)],
        "absent": [{"instruction": f"a{i}", "output": "o"} for i in range(30)],
        "string": [{"instruction": f"s{i}", "input": "text", "output": "o", "extra": [1, 2]} for i in range(30)],
    }
    rows = [r for g in order.split("-") for r in groups[g]]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    table, batches = read_all([str(path)], batch_rows=16, chunk_bytes=256)
    assert len(batches) > 6 and table.num_rows == 90
    got = table.to_pylist()
    assert [r["instruction"] for r in got] == [r["instruction"] for r in rows]
    assert [r["input"] for r in got] == [r.get("input") for r in rows]
    assert [r.get("extra") for r in got] == [r.get("extra") for r in rows]
    assert [b.first_row for b in batches] == [b.first_index for b in batches]
    if order.startswith("string"):
        # once `input` is known to be a string, chunks where it is null or absent still carry it
        assert all(b.table.schema.field("input").type == pa.string() for b in batches)
        assert all(b.table.column_names[:3] == ["instruction", "input", "output"] for b in batches)


def test_jsonl_type_conflict_within_chunk_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n\n{"a": "three"}\n')
    expect_error(r"d.jsonl line 4: field 'a' is a string here but a number on line 1", read_all, [str(path)])


# ------------------------------------------------------------------------------------ errors


def test_malformed_jsonl_line_is_named_even_in_a_later_chunk(tmp_path):
    good = "".join(json.dumps(r) + "\n" for r in ROWS * 5)  # 50 lines
    path = tmp_path / "d.jsonl"
    path.write_text(good + '{"instruction": "x", "output": }\n' + good)
    msg = expect_error(r"d.jsonl line 51: malformed JSON", read_all, [str(path)], chunk_bytes=500)
    assert "fix or remove that line" in msg


def test_jsonl_non_object_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\n')
    expect_error(r"d.jsonl line 2: expected a JSON object per line, found a list", read_all, [str(path)])


def test_non_utf8_jsonl_names_line_and_byte(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": "ok"}\n{"a": "caf\xe9"}\n')
    expect_error(r"d.jsonl line 2 \(byte offset 22\): not valid UTF-8; re-encode", read_all, [str(path)])


def test_non_utf8_csv_and_json_array(tmp_path):
    (tmp_path / "d.csv").write_bytes(b"a,b\nx,y\nz,caf\xe9\n")
    expect_error(r"d.csv line 3 \(byte offset 13\): not valid UTF-8", read_all, [str(tmp_path / "d.csv")])
    (tmp_path / "d.json").write_bytes(b'[\n{"a": "x"},\n{"a": "caf\xe9"}\n]')
    expect_error(r"d.json line 3 \(byte offset 24\): not valid UTF-8", read_all, [str(tmp_path / "d.json")])


def test_malformed_json_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"a": 1},\n  {"a": 2\n  {"a": 3}\n]')
    expect_error(r"d.json line \d+: (malformed JSON|expected ',' or '\]')", read_all, [str(path)])
    path.write_text('[\n  {"a": 1},\n  "text"\n]')
    expect_error(r"d.json line 3: array element is a string, not an object", read_all, [str(path)])
    path.write_text('[\n  {"a": 1},\n  {"a": 2}')
    expect_error(r"d.json line 3: expected ',' or '\]'.*truncated", read_all, [str(path)])
    path.write_text('"just a string"')
    expect_error(r"neither a JSON array of objects nor JSON Lines", resolve_inputs, [str(path)])


def test_json_array_lines_are_found_when_asked_for(tmp_path):
    path = tmp_path / "d.json"
    records = [{"text": f"t{i}", "n": i} for i in range(5)]
    path.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in records) + "\n]\n")  # 4 lines each
    _, batches = read_all([str(path)], batch_rows=2)
    assert [b.first_index for b in batches] == [0, 2, 4]
    assert [batches[1].where(i) for i in range(2)] == [f"{path} line 10", f"{path} line 14"]
    _, cut = read_all([str(path)], batch_rows=4, limit=3)
    assert len(cut[0].lines) == 3 and cut[0].where(2) == f"{path} line 10"
    path.write_text(path.read_text().replace('"t3"', "null"))  # the file changed: lines are found again
    assert read_all([str(path)], batch_rows=2)[1][1].where(1) == f"{path} line 14"


def test_a_json_array_keeps_fields_its_first_record_lacks(tmp_path):
    """Every field of every record arrives, as from the same records in JSON Lines (pyarrow's
    `Table.from_pylist` alone would keep only the first record's fields)."""
    records = [{"instruction": "say hi", "output": "hi"}] + [
        {"instruction": "repeat", "input": f"w{i}", "output": f"w{i}", "note": i} for i in range(5)
    ]
    array = tmp_path / "d.json"
    array.write_text(json.dumps(records))
    lines = write_jsonl(tmp_path / "d.jsonl", records)
    tables = {}
    for path in (array, lines):
        files = resolve_inputs([str(path)])
        assert column_names(files) == ["instruction", "output", "input", "note"]
        tables[path.suffix] = pa.concat_tables(b.table for b in iter_batches(files, batch_rows=4))
    assert tables[".json"].to_pylist() == tables[".jsonl"].to_pylist()
    assert tables[".json"].column("input").to_pylist() == [None, "w0", "w1", "w2", "w3", "w4"]


def test_a_json_array_of_text_and_nulls_keeps_its_types(tmp_path):
    """Text and all-null columns of a JSON array arrive as string and null columns; other values
    (numbers of mixed types) still work."""
    records = [{"text": "plain", "note": None, "n": None}, {"text": None, "note": "ünï 🙂"}, {"text": "", "note": None, "n": None}] * 50
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    tables = [b.table for b in iter_batches(resolve_inputs([str(path)]), batch_rows=64)]
    assert sorted({str(c.type) for x in tables for c in x.columns}) == ["null", "string"]
    assert sum((x.to_pylist() for x in tables), []) == [{"text": r["text"], "note": r["note"], "n": None} for r in records]
    mixed = tmp_path / "m.json"
    mixed.write_text(json.dumps([{"text": "a", "n": 1}, {"text": "b", "n": 2.5}]))
    table = pa.concat_tables(b.table for b in iter_batches(resolve_inputs([str(mixed)])))
    # numbers that pyarrow would hold as floats arrive as the text the file holds
    assert table.column("n").to_pylist() == ["1", "2.5"] and table.column("text").to_pylist() == ["a", "b"]


def test_the_columns_of_a_json_array_come_from_every_record(tmp_path):
    """A field of the 1,030th record only is found; a break further on is the same one-line error
    whether finding the fields or reading meets it first."""
    path = tmp_path / "d.json"
    records = [{"text": f"t{i}"} for i in range(1030)] + [{"text": "late", "source": "web"}]
    path.write_text(json.dumps(records))
    assert column_names(resolve_inputs([str(path)])) == ["text", "source"]
    good = ",\n".join(json.dumps({"text": f"t{i}"}) for i in range(1034))
    path.write_text("[\n" + good + ',\n{"text": "broken"\n]')
    expect_error(r"d.json line 1037: malformed JSON", column_names, resolve_inputs([str(path)]))
    expect_error(r"d.json line 1037: malformed JSON", read_all, [str(path)])


def test_a_jsonl_field_that_first_appears_late_is_found(tmp_path):
    """Silent data loss, fixed: an optional `input` that first appears after the first 20 MB is
    in the columns --format auto decides from, so the instruction format reads it."""
    from pipeline.read.formats import FormatOptions
    from pipeline.tokenize.tokenize_inputs import file_formats

    path = tmp_path / "late.jsonl"
    line = json.dumps({"instruction": "x" * 1000, "output": "y"}) + "\n"
    with open(path, "w") as f:
        f.write(line * (20 << 10))  # about 20 MB: past a whole scan chunk
        f.write(json.dumps({"instruction": "add", "input": "2 and 3", "output": "5"}) + "\n")
    files = resolve_inputs([str(path)])
    assert column_names(files) == ["instruction", "output", "input"]
    assert file_formats(files, FormatOptions())[0].fields["input"] == "input"


def test_json_array_type_conflict(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"a": 1},\n{"a": "x"}\n]')
    expect_error(r"d.json line 3: field 'a' is a string here but a number on line 2", read_all, [str(path)])


def test_missing_file_and_glob_without_match(tmp_path):
    expect_error(r"input not found: .*nope.jsonl", resolve_inputs, [str(tmp_path / "nope.jsonl")])
    expect_error(r"no files match .*\*.parquet", resolve_inputs, [str(tmp_path / "*.parquet")])


def test_unreadable_file(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    monkeypatch.setattr(sources.os, "access", lambda p, mode: False)
    expect_error(r"cannot read .*d.jsonl: permission denied", resolve_inputs, [str(path)])


def test_unknown_format_lists_supported(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    msg = expect_error(r"unknown input format '.txt' for .*d.txt: supported are", resolve_inputs, [str(tmp_path / "d.txt")])
    assert ".jsonl" in msg and ".parquet" in msg and "save_to_disk" in msg
    (tmp_path / "empty_dir").mkdir()
    expect_error(r"holds no supported data files", resolve_inputs, [str(tmp_path / "empty_dir")])


def test_empty_inputs(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    expect_error(r"e.jsonl is empty \(0 bytes\)", resolve_inputs, [str(tmp_path / "e.jsonl")])
    (tmp_path / "w.jsonl").write_text("\n  \n\n")
    expect_error(r"w.jsonl has no records", resolve_inputs, [str(tmp_path / "w.jsonl")])
    (tmp_path / "e.json").write_text("[]")
    expect_error(r"e.json contains no records", read_all, [str(tmp_path / "e.json")])
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    expect_error(r"e.parquet contains no records", read_all, [str(tmp_path / "e.parquet")])
    (tmp_path / "h.csv").write_text("text\n")
    expect_error(r"h.csv contains no records", read_all, [str(tmp_path / "h.csv")])
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "eds"))
    expect_error(r"eds contains no records", read_all, [str(tmp_path / "eds")])


def test_corrupt_parquet_and_arrow(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    data = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "t.parquet").write_bytes(data[: len(data) // 2])
    expect_error(r"t.parquet: not a readable Parquet file.*corrupt", read_all, [str(tmp_path / "t.parquet")])
    (tmp_path / "g.arrow").write_bytes(b"this is not arrow at all" * 10)
    expect_error(r"g.arrow: not a readable Arrow IPC file or stream", read_all, [str(tmp_path / "g.arrow")])
    with pa.ipc.new_file(tmp_path / "d.arrow", pa.Table.from_pylist(ROWS).schema) as w:
        w.write_table(pa.Table.from_pylist(ROWS))
    data = (tmp_path / "d.arrow").read_bytes()
    (tmp_path / "t.arrow").write_bytes(data[: len(data) - 40])
    expect_error(r"t.arrow: not a readable Arrow IPC file or stream", read_all, [str(tmp_path / "t.arrow")])


def test_malformed_csv(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n1,2\n3,4,5\n")
    expect_error(r"d.csv: cannot read as CSV: .*same number of fields", read_all, [str(tmp_path / "d.csv")])


# ------------------------------------------------------------------------------------ fingerprints


def test_fingerprints(tmp_path):
    import datasets

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    files = resolve_inputs([str(path), str(tmp_path / "ds")])
    fp = input_fingerprints(files)
    assert fp[0] == {
        "path": str(path),
        "kind": "jsonl",
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    assert fp[1]["kind"] == "hf_disk" and fp[1]["bytes"] == files[1].size > 0
    # the folder's hash follows its data, not its metadata
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds2"))
    assert input_fingerprints(resolve_inputs([str(tmp_path / "ds2")]))[0]["sha256"] == fp[1]["sha256"]
    datasets.Dataset.from_list(ROWS[:-1]).save_to_disk(str(tmp_path / "ds3"))
    assert input_fingerprints(resolve_inputs([str(tmp_path / "ds3")]))[0]["sha256"] != fp[1]["sha256"]


def test_sample_data_reads(tmp_path):
    root = Path(__file__).resolve().parents[3]
    files = resolve_inputs([str(root / "data" / "sample" / "instructions.jsonl")])
    assert column_names(files) == ["instruction", "input", "output"]
    total = sum(b.table.num_rows for b in iter_batches(files, batch_rows=1000))
    assert total == 3000


SHARED = Path(__file__).resolve().parents[4] / "shared" / "datasets"


@pytest.mark.skipif(
    not (SHARED / "gsm8k" / "train.jsonl").is_file() or not (SHARED / "codealpaca" / "code_alpaca.json").is_file(),
    reason="../shared/datasets not present",
)
def test_real_datasets_read_in_order():
    gsm = SHARED / "gsm8k" / "train.jsonl"
    alpaca = SHARED / "codealpaca" / "code_alpaca.json"
    files = resolve_inputs([str(gsm), str(alpaca)])
    assert [f.kind for f in files] == ["jsonl", "json"]
    assert column_names(files) == ["question", "answer"]
    n_gsm = sum(1 for line in gsm.open(encoding="utf-8") if line.strip())
    n_alpaca = len(json.loads(alpaca.read_text(encoding="utf-8")))
    batches = list(iter_batches(files))
    assert sum(b.table.num_rows for b in batches if b.file == str(gsm)) == n_gsm
    assert sum(b.table.num_rows for b in batches if b.file == str(alpaca)) == n_alpaca
    first_alpaca = next(b for b in batches if b.file == str(alpaca))
    assert first_alpaca.first_row == 0 and first_alpaca.first_index == n_gsm
    assert first_alpaca.where(0) == f"{alpaca} line 2"


def test_parquet_row_groups_decoded_ahead_come_in_order(tmp_path, monkeypatch):
    """Row groups are decoded by threads, within a byte budget; a group too large for the budget
    is streamed; either way rows arrive in file order and batches respect batch_rows."""
    n = 5000
    texts = [f"row {i} " + "x" * (i % 300 if 2000 <= i < 3000 else i % 7) for i in range(n)]
    table = pa.table({"text": texts, "i": list(range(n))})
    path = tmp_path / "groups.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        for start, size in ((0, 700), (700, 1300), (2000, 1000), (3000, 1), (3001, 1999)):
            writer.write_table(table.slice(start, size))
    sizes = [pq.ParquetFile(path).metadata.row_group(g).total_byte_size for g in range(5)]
    monkeypatch.setattr(read_tables, "PARQUET_THREADS", 2)
    monkeypatch.setattr(read_tables, "PARQUET_AHEAD_BYTES", 4 * sorted(sizes)[-2])  # the largest is streamed
    decoded = []
    real = read_tables._parquet_group
    monkeypatch.setattr(read_tables, "_parquet_group", lambda p, g: decoded.append(g) or real(p, g))
    got, batches = read_all([str(path)], batch_rows=256)
    assert sorted(decoded) == [g for g in range(5) if g != int(np.argmax(sizes))]
    assert got.column("i").to_pylist() == list(range(n))
    assert all(b.table.num_rows <= 256 for b in batches)
    assert [b.first_index for b in batches] == list(np.cumsum([0] + [b.table.num_rows for b in batches[:-1]]))


NUMBER_TEXTS = ["12345678901234567890", "1.10", "1E2", "-0.000", "7", "9223372036854775808"]


def _records_with_numbers() -> str:
    """Instruction records whose `output` is a JSON number (one of NUMBER_TEXTS each), one per line."""
    return "\n".join(f'{{"instruction": "say {i}", "output": {n}}}' for i, n in enumerate(NUMBER_TEXTS)) + "\n"


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_numbers_in_text_fields_stay_the_text_the_file_holds(tmp_path, kind):
    body = _records_with_numbers()
    path = tmp_path / f"nums.{kind}"
    path.write_text(body if kind == "jsonl" else "[\n" + ",\n".join(body.splitlines()) + "\n]\n", encoding="utf-8")
    table, batches = read_all([str(path)])
    assert table.column("output").to_pylist() == NUMBER_TEXTS  # never 1.2345678901234567e+19 or 1.1
    from pipeline.read.formats import FormatOptions, detect_format
    from pipeline.tokenize.render import render

    fmt = detect_format(table.column_names, FormatOptions())
    texts = render(batches[0].table, fmt, batches[0].where).texts
    assert texts[1::2] == NUMBER_TEXTS  # the responses, as tokenized


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_integer_and_list_columns_keep_their_types(tmp_path, kind):
    """Negative control: only numbers a float would change become text; int64 fields and lists of
    numbers (pre-tokenized ids) stay numbers."""
    rows = [{"input_ids": [1, 2, 3], "n": 5, "w": [0.5, 1.5]}, {"input_ids": [4], "n": 6, "w": [2.0]}]
    path = tmp_path / f"ids.{kind}"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n" if kind == "jsonl" else json.dumps(rows), encoding="utf-8")
    table, _ = read_all([str(path)])
    assert table.schema.field("n").type == pa.int64()
    assert pa.types.is_integer(table.schema.field("input_ids").type.value_type)
    assert table.column("w").to_pylist() == [[0.5, 1.5], [2.0]]


def test_a_broken_link_to_data_in_a_folder_is_one_line_naming_it(tmp_path):
    (tmp_path / "x").mkdir()
    write_jsonl(tmp_path / "x" / "1.jsonl", ROWS)
    (tmp_path / "x" / "2.jsonl").symlink_to(tmp_path / "gone.jsonl")
    msg = expect_error("broken symbolic link", resolve_inputs, [str(tmp_path / "x")])
    assert str(tmp_path / "x" / "2.jsonl") in msg and "gone.jsonl" in msg and "\n" not in msg
    # given directly or through a glob, the same line (not "permission denied" or "not found")
    for spec in (tmp_path / "x" / "2.jsonl", tmp_path / "x" / "*.jsonl"):
        assert "broken symbolic link" in expect_error("2.jsonl", resolve_inputs, [str(spec)])


def test_a_broken_link_that_is_not_data_is_named_among_the_skipped_files(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    write_jsonl(tmp_path / "x" / "1.jsonl", ROWS)
    (tmp_path / "x" / "NOTES").symlink_to(tmp_path / "nowhere")
    assert [Path(f.path).name for f in resolve_inputs([str(tmp_path / "x")])] == ["1.jsonl"]
    assert "skipping 1 file(s) that are not data (NOTES)" in capsys.readouterr().err


def test_only_the_text_columns_asked_for_are_decoded_again(tmp_path):
    """pack-data asks for its format's text fields only (a float metadata column costs no second
    decode); asking for none of them leaves pyarrow's numbers."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "output": 1.10, "score": 0.50}\n', encoding="utf-8")
    table = next(read_json.read_jsonl(str(path), 10, 1 << 20, exact=["instruction", "output"]))[0]
    assert table.column("output").to_pylist() == ["1.10"] and table.column("score").to_pylist() == [0.5]
    batch = next(iter_batches(resolve_inputs([str(path)]), exact={str(path): ["output"]}))
    assert batch.table.column("output").to_pylist() == ["1.10"]
