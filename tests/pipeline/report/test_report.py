"""pack-report: figures of small hand-made packs, checked against numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from packed_factory import make_packed_folder

from pipeline.cli import pack_report
from pipeline.report.folder_report import compare, whatif_report
from pipeline.report.stats import pad_to_longest, pad_to_max
from pipeline.shards import IGNORE_INDEX, Counts

MAX_LEN = 10
# The model the FLOPs are counted for: layer weights 2 x 4 x 4 (q, o) + 2 x 4 x 4 (k, v: one head of 4)
# + 3 x 4 x 4 (MLP) = 112, so 6 x 112 = 672 FLOPs a token; the head (vocab 64, from the manifest)
# 6 x 64 x 4 = 1,536 a real token; attention 12 x 1 head x 4 = 48 a causal pair
MODEL = ["--hidden", "4", "--layers", "1", "--heads", "1", "--kv-heads", "1", "--intermediate", "4"]
PACKED_FLOPS = 672 * 30 + 1536 * 24 + 48 * 89  # 61,296: 30 slots, 24 tokens, 89 pairs
LONGEST_FLOPS = 672 * 32 + 1536 * 24 + 48 * 143  # 65,232
MAX_FLOPS = 672 * 50 + 1536 * 24 + 48 * 275  # 83,664
# Lengths in example-id order: 4, 5, 10, 3, 2 -> 24 tokens in 3 rows of 10.
ROWS = [
    [(0, [11, 12, 13, 14]), (1, [21, 22, 23, 24, 25])],
    [(2, list(range(31, 41)))],
    [(3, [41, 42, 43]), (4, [51, 52], [IGNORE_INDEX, IGNORE_INDEX])],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rep") / "packed"
    make_packed_folder(
        out,
        ROWS,
        MAX_LEN,
        rows_per_shard=2,
        counts=Counts(examples_read=7, examples_packed=5, truncated=1, dropped=1, empty_skipped=1),
        tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": 64},
    )
    return out


@pytest.fixture(scope="module")
def cli_run(folder: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    out = tmp_path_factory.mktemp("rep-out")
    result = CliRunner().invoke(
        pack_report,
        [
            str(folder),
            "--batch-size",
            "2",
            *MODEL,
            "--json",
            str(out / "r.json"),
            "--html",
            str(out / "r.html"),
        ],
    )
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "r.json").read_text()), (out / "r.html").read_text()


def test_layout_arithmetic() -> None:
    # Batches of 2 in id order: [4,5] [10,3] [2] -> slots 2*5 + 2*10 + 1*2 = 32.
    lay = pad_to_longest(np.array([4, 5, 10, 3, 2]), 2)
    assert (lay.rows, lay.token_slots, lay.tokens, lay.padding) == (5, 32, 24, 8)
    assert lay.attention_pairs == 2 * 15 + 2 * 55 + 1 * 3
    lay = pad_to_max(np.array([4, 5, 10, 3, 2]), 10)
    assert (lay.token_slots, lay.padding, lay.attention_pairs) == (50, 26, 5 * 55)


def test_folder_figures(cli_run) -> None:  # noqa: ANN001
    _, r, _ = cli_run
    assert (r["examples"], r["sequences"], r["tokens"], r["rows"]) == (5, 5, 24, 3)
    assert r["loss_tokens"] == 3 + 4 + 9 + 2 + 0
    assert r["efficiency"] == pytest.approx(24 / 30)
    assert (r["lower_bound_rows"], r["rows_over_lower_bound"]) == (3, 0)
    assert r["examples_per_row"] == {"mean": pytest.approx(5 / 3), "max": 2}
    assert r["counts"]["truncated"] == 1 and r["counts"]["dropped"] == 1
    assert r["lengths"]["max"] == 10 and r["lengths"]["min"] == 2
    # Packed: 3 rows x 10 slots, 6 padding; varlen attention pairs 10+15+55+6+3 = 89.
    assert r["packed"] == {"token_slots": 30, "padding_tokens": 6, "attention_pairs": 89}
    longest, pmax = r["savings"]["pad_to_longest"], r["savings"]["pad_to_max"]
    assert (longest["padding_tokens"], longest["padding_avoided"]) == (8, 2)
    assert (pmax["padding_tokens"], pmax["padding_avoided"]) == (26, 20)
    assert longest["attention_ratio"] == pytest.approx(143 / 89)
    assert pmax["attention_ratio"] == pytest.approx(275 / 89)
    assert longest["estimated_speedup"] == pytest.approx(LONGEST_FLOPS / PACKED_FLOPS)
    assert pmax["estimated_speedup"] == pytest.approx(MAX_FLOPS / PACKED_FLOPS)
    assert [s["rows"] for s in r["shards"]] == [2, 1]
    assert [s["tokens"] for s in r["shards"]] == [19, 5]
    assert all(s["sha256_ok"] for s in r["shards"])
    assert all(r["manifest_matches"].values())


def test_comparison_table(cli_run) -> None:  # noqa: ANN001
    _, r, _ = cli_run
    by = {row["layout"]: row for row in r["comparison"]}
    assert list(by) == ["pad-to-longest", "pad-to-max", "minibatch", "sequential", "shuffle", "ffd", "bfd"]
    assert by["pad-to-longest"]["token_slots"] == 32
    assert by["pad-to-max"]["token_slots"] == 50
    # Packing 4,5,10,3,2 into rows of 10 needs 3 rows; next fit in id order: [4,5] [10] [3,2].
    assert by["ffd"]["rows"] == by["bfd"]["rows"] == 3
    assert by["sequential"]["rows"] == 3
    assert by["ffd"]["speedup_vs_pad_to_longest"] == pytest.approx(LONGEST_FLOPS / PACKED_FLOPS)
    assert by["ffd"]["flops"] == PACKED_FLOPS and by["pad-to-max"]["flops"] == MAX_FLOPS
    assert by["pad-to-longest"]["speedup_vs_pad_to_longest"] == pytest.approx(1.0)


def test_terminal_summary(cli_run) -> None:  # noqa: ANN001
    result, _, _ = cli_run
    out = result.output
    assert all(len(line) <= 100 for line in out.splitlines())
    assert "efficiency              80.00%" in out
    assert "rows                         3   lower bound ceil(tokens/max_len) 3 (+0)" in out
    assert "examples/row    mean 1.67, max 2" in out
    assert "truncated 1, split 0, dropped 1" in out
    assert "vs pad-to-longest (B=2): 2 padding tokens avoided, 1.61x less attention, est. speedup 1.06x" in out
    assert "shards: 2, sha256 all ok" in out


def test_html_is_self_contained(cli_run) -> None:  # noqa: ANN001
    _, _, page = cli_run
    assert page.count("data:image/png;base64,") == 4  # 3 distributions + comparison chart
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for text in (
        "80.0%",
        "shard-00000.arrow",
        "shard-00001.arrow",
        "pad-to-longest",
        "bfd",
        "1.06x",
        "examples per row (max 2)",
        "Attention's share of the work",
    ):
        assert text in page, text


def test_split_example_counts_once(tmp_path: Path) -> None:
    rows = [[(0, list(range(3, 13)))], [(0, [20, 21, 22]), (1, [30, 31])]]
    make_packed_folder(tmp_path / "p", rows, 10)
    result = CliRunner().invoke(pack_report, [str(tmp_path / "p"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["examples"], r["sequences"], r["tokens"], r["rows"]) == (2, 3, 15, 2)
    assert r["counts"]["split"] == 1


def test_sha_mismatch_is_one_line_and_no_report(tmp_path: Path) -> None:
    make_packed_folder(tmp_path / "p", ROWS, MAX_LEN)
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "f" * 64
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    out = [str(tmp_path / "r.html"), str(tmp_path / "r.json")]
    result = CliRunner().invoke(pack_report, [str(tmp_path / "p"), "--html", out[0], "--json", out[1]])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "shard-00000.arrow does not match its sha256" in result.output and "no report written" in result.output
    assert not any(Path(f).exists() for f in out)
    result = CliRunner().invoke(pack_report, [str(tmp_path / "p"), "--no-hash"])
    assert result.exit_code == 0 and "sha256 not checked" in result.output


def test_errors_are_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(pack_report, [])
    assert result.exit_code == 1 and "nothing to report" in result.output
    result = runner.invoke(pack_report, [str(tmp_path)])
    assert result.exit_code == 1 and "no manifest" in result.output
    make_packed_folder(tmp_path / "p", ROWS, MAX_LEN)
    result = runner.invoke(pack_report, [str(tmp_path / "p"), "--strategy", "best"])
    assert result.exit_code == 1 and "--strategy 'best'" in result.output
    result = runner.invoke(pack_report, [str(tmp_path / "p"), "--json", str(tmp_path / "nodir" / "r.json")])
    assert result.exit_code == 1 and "does not exist" in result.output
    assert not (tmp_path / "nodir").exists()


def test_whatif_report_numbers() -> None:
    lengths = np.array([3, 5, 7, 20])
    r = whatif_report(lengths, [8, 16], strategies=("ffd", "sequential"), batch_size=4)
    assert r["examples"] == 4 and r["tokens_untruncated"] == 35
    run8, run16 = r["runs"]
    # max_len 8: 20 -> 8, tokens 3+5+7+8 = 23, lower bound 3 rows; ffd: [8] [7] [5,3] = 3 rows.
    assert (run8["over_max_len"], run8["tokens"], run8["lower_bound_rows"]) == (1, 23, 3)
    by8 = {row["layout"]: row for row in run8["comparison"]}
    assert by8["ffd"]["rows"] == 3 and by8["ffd"]["padding_tokens"] == 1
    assert by8["pad-to-longest"]["token_slots"] == 4 * 8
    assert by8["sequential"]["rows"] == 3  # next fit in order: [3,5] [7] [8]
    # max_len 16: 20 -> 16, tokens 31, ffd: [16] [7,5,3] = 2 rows.
    assert (run16["over_max_len"], run16["tokens"]) == (1, 31)
    by16 = {row["layout"]: row for row in run16["comparison"]}
    assert by16["ffd"]["rows"] == 2 and by16["pad-to-max"]["token_slots"] == 64


def test_compare_uses_planner() -> None:
    rows = compare(np.array([6, 6, 4, 4]), 10, strategies=("ffd",), batch_size=2)
    assert rows[-1]["layout"] == "ffd" and rows[-1]["rows"] == 2
    assert rows[-1]["efficiency"] == pytest.approx(1.0)


def test_whatif_cli_pretokenized(tmp_path: Path) -> None:
    pytest.importorskip("pipeline.read.sources")
    if not Path("data/tokenizer/tokenizer.json").is_file():
        pytest.skip("data/tokenizer not generated")
    data = tmp_path / "tok.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, n + 1))}) + "\n" for n in (3, 5, 7, 20)))
    result = CliRunner().invoke(
        pack_report,
        [
            "--input",
            str(data),
            "--format",
            "tokenized",
            "--tokenizer",
            "data/tokenizer",
            "--max-len",
            "8,16",
            "--strategy",
            "ffd",
            "--json",
            str(tmp_path / "w.json"),
            "--html",
            str(tmp_path / "w.html"),
        ],
    )
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "w.json").read_text())
    assert r["kind"] == "what-if" and r["examples"] == 4
    from pipeline.tokenize.tokenizer import load_tokenizer

    assert r["model"]["vocab"] == len(load_tokenizer("data/tokenizer"))  # the FLOPs' head: that tokenizer's
    assert [run["max_len"] for run in r["runs"]] == [8, 16]
    assert "max_len 8:" in result.output and "max_len 16:" in result.output
    page = (tmp_path / "w.html").read_text()
    assert page.count("data:image/png;base64,") == 2


def test_the_length_histogram_spans_the_lengths_there_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its x-axis starts at the shortest example (92 tokens here), not at 1, and reaches max_len."""
    from pipeline.report import report_render
    from pipeline.report.folder_report import load_folder

    rows = [[(0, list(range(1, 93))), (1, list(range(1, 151)))], [(2, list(range(1, 301)))]]
    make_packed_folder(tmp_path / "p", rows, 512)
    figures = []
    monkeypatch.setattr(report_render, "_png", lambda fig: figures.append(fig) or "data:,")
    report_render._plots_folder(load_folder(tmp_path / "p"))
    left, right = figures[0].axes[0].get_xlim()
    assert left == pytest.approx(92) and 512 < right < 600, (left, right)
    edges = report_render.length_bins(np.array([92, 150, 300]), 512)
    assert edges[0] == pytest.approx(92) and edges[-1] == pytest.approx(512 * 1.05)


def test_the_planners_first_compile_is_announced(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where numba has not compiled a strategy's kernels yet, pack-report says so (on stderr) before
    the silent seconds of compiling; where all are compiled, it says nothing."""
    from pipeline import cli

    monkeypatch.setattr(cli, "uncompiled", lambda strategies: [s for s in strategies if s in ("bfd", "shuffle")])
    result = CliRunner().invoke(pack_report, [str(folder)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "pack-report: compiling the planner's numba kernels for shuffle, bfd "
        "(their first use here; cached for later runs): up to half a minute"
    ]
    monkeypatch.setattr(cli, "uncompiled", lambda strategies: [])
    assert CliRunner().invoke(pack_report, [str(folder)]).stderr == ""


def test_uncompiled_tells_which_strategies_numba_would_compile(tmp_path: Path) -> None:
    """In an empty numba cache every strategy would compile; once a plan has run, its kernels are
    ready in that process and, from the on-disk cache, in the next one."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom pipeline.plan.binpack import STRATEGIES, assign_bins, uncompiled\n"
        "print(uncompiled(STRATEGIES))\nassign_bins([3, 5, 2], 8, strategy='sequential')\n"
        "print(uncompiled(['sequential', 'ffd']))"
    )
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    root = Path(__file__).resolve().parents[3]
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True, timeout=300
        ).stdout.splitlines()
        for _ in range(2)
    ]
    assert runs[0] == [str(["ffd", "bfd", "shuffle", "sequential", "minibatch", "pad"]), "['ffd']"]
    assert runs[1] == [str(["ffd", "bfd", "shuffle", "minibatch"]), "['ffd']"]  # pad needs only _scan


# ------------------------------------------------------- what the figures were counted with, and other max_len

ROOT = Path(__file__).resolve().parents[3]


def test_a_folder_what_if_plans_the_stored_example_lengths_at_other_max_len(folder: Path, tmp_path: Path) -> None:
    """Lengths 4, 5, 10, 3, 2 (24 tokens): at 20, ffd fits them in 2 rows; at 5, the 10 is longer and
    counts as 5 (19 tokens, 4 rows at least). One example was truncated and one dropped at 10, so
    the figures above 10 are lower bounds, and the report says so."""
    result = CliRunner().invoke(
        pack_report,
        [str(folder), "--max-len", "5,20", "--strategy", "ffd", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")],
    )
    assert result.exit_code == 0, result.output
    whatif = json.loads((tmp_path / "r.json").read_text())["whatif"]
    assert [(r["max_len"], r["over_max_len"], r["tokens"], r["lower_bound_rows"]) for r in whatif["runs"]] == [
        (5, 1, 19, 4),
        (20, 0, 24, 2),
    ]
    ffd = {r["max_len"]: next(c for c in r["comparison"] if c["layout"] == "ffd") for r in whatif["runs"]}
    assert (ffd[5]["rows"], ffd[20]["rows"]) == (4, 2)
    assert whatif["limits"] == {"folder_max_len": 10, "truncated": 1, "dropped": 1, "exact_up_to": 10}
    assert "1 truncated, 1 dropped at 10: rows above it are lower bounds" in result.output
    assert all(len(line) <= 100 for line in result.output.splitlines())
    page = (tmp_path / "r.html").read_text()
    assert "<h2>What-if: other max_len values</h2>" in page and "<td>20</td><td>0</td><td>2</td><td>ffd</td>" in page
    CliRunner().invoke(pack_report, [str(folder), "--json", str(tmp_path / "p.json")])
    assert "whatif" not in json.loads((tmp_path / "p.json").read_text())  # only when --max-len is given


def test_the_reports_name_the_tokenizer_and_the_inputs(tmp_path: Path) -> None:
    data, tok = ROOT / "data/sample/instructions.jsonl", ROOT / "data/tokenizer"
    from pipeline.cli import pack_data

    assert (
        CliRunner()
        .invoke(
            pack_data,
            [
                str(data),
                "--tokenizer",
                str(tok),
                "--max-len",
                "512",
                "--limit",
                "40",
                "--out",
                str(tmp_path / "p"),
                "--no-progress",
                "--num-proc",
                "1",
            ],
        )
        .exit_code
        == 0
    )
    folder = CliRunner().invoke(pack_report, [str(tmp_path / "p"), "--json", str(tmp_path / "f.json"), "--html", str(tmp_path / "f.html")])
    assert folder.exit_code == 0, folder.output
    assert folder.output.startswith(f"tokenizer: {tok} (recorded by the folder)\ninputs: {data}\n")
    report = json.loads((tmp_path / "f.json").read_text())
    assert (report["tokenizer"], report["inputs"]) == (str(tok), [str(data)])
    assert f"Tokenizer <code>{tok}</code>" in (tmp_path / "f.html").read_text()
    # a what-if takes the tokenizer a packed folder records, and says so
    whatif = CliRunner().invoke(
        pack_report,
        [
            "--input",
            str(data),
            "--tokenizer",
            str(tmp_path / "p"),
            "--limit",
            "40",
            "--max-len",
            "256,512",
            "--json",
            str(tmp_path / "w.json"),
        ],
    )
    assert whatif.exit_code == 0, whatif.output
    assert f"tokenizer: {tok} (recorded by the packed folder {tmp_path / 'p'})" in whatif.output
    assert "across max_len (the best packing strategy of each)" in whatif.output
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["tokenizer"] == str(tok) and report["inputs"] == [str(data)]


def test_a_what_if_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(pack_report, ["--input", str(ROOT / "data/sample/text.jsonl"), "--html", str(tmp_path / "w.html")])
    assert result.exit_code == 1 and not (tmp_path / "w.html").exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--input needs --tokenizer" in lines[0], result.stderr


def test_every_value_on_the_what_if_page_is_escaped(tmp_path: Path) -> None:
    hostile = tmp_path / "<img src=x onerror=alert(1)>.jsonl"
    hostile.write_text("".join(json.dumps({"text": f"document {i} " * (i + 1)}) + "\n" for i in range(20)))
    result = CliRunner().invoke(
        pack_report,
        ["--input", str(hostile), "--tokenizer", str(ROOT / "data/tokenizer"), "--max-len", "16,64", "--html", str(tmp_path / "w.html")],
    )
    assert result.exit_code == 0, result.output
    page = (tmp_path / "w.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;.jsonl" in page
    assert "<h2>Across max_len</h2>" in page and page.count("<td>64</td>") >= 1
