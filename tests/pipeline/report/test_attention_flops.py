"""pack-report's attention share of a packed folder's work, in all and per row, counted from each
row's EXAMPLE lengths by the one FLOP count (`pipeline.report.flops`), against hand counts; in the
terminal, JSON and HTML (escaped) outputs; model sizes that make no model are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from packed_factory import make_packed_folder

from pipeline.cli import pack_report
from pipeline.report.flops import Sizes

# rows [3, 5] and [8] in one shard; the second shard's row holds one example of 4 whose labels
# are all -100 (no loss token)
ROWS = [[(0, [11, 12, 13]), (1, [21, 22, 23, 24, 25])], [(2, list(range(31, 39)))], [(3, [41, 42, 43, 44], [-100] * 4)]]
# hidden 4, 1 layer, 1 head of 4, MLP 4, vocab 64: 6 x 112 = 672 FLOPs a token (layer weights
# 2x16 q/o + 2x16 k/v + 48 MLP), 6 x 64 x 4 = 1,536 a loss token (the head), 12 x 4 = 48 a pair
MODEL = ["--hidden", "4", "--layers", "1", "--heads", "1", "--kv-heads", "1", "--intermediate", "4"]
# row [3, 5]: 8 tokens, 2 + 4 loss tokens, 6 + 15 pairs; row [8]: 8 tokens, 7 loss, 36 pairs;
# row [4]: 4 tokens, no loss token, 10 pairs
ROW_ATTENTION = [48 * 21, 48 * 36, 48 * 10]
ROW_FLOPS = [672 * 8 + 1536 * 6 + 48 * 21, 672 * 8 + 1536 * 7 + 48 * 36, 672 * 4 + 48 * 10]  # 15,600; 17,856; 3,168


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, str]:
    tmp = tmp_path_factory.mktemp("attn")
    make_packed_folder(tmp / "p", ROWS, 8, rows_per_shard=2, tokenizer={"name": "<b>test</b>", "fingerprint": "0" * 64, "vocab_size": 64})
    result = CliRunner().invoke(pack_report, [str(tmp / "p"), *MODEL, "--json", str(tmp / "r.json"), "--html", str(tmp / "r.html")])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((tmp / "r.json").read_text()), (tmp / "r.html").read_text()


def test_the_share_in_all_and_per_row_is_the_hand_count(report: tuple[str, dict, str]) -> None:
    _, r, _ = report
    a = r["attention"]
    assert a["attention_flops"] == sum(ROW_ATTENTION) == 3216
    assert a["flops"] == sum(ROW_FLOPS) == 36624
    assert a["share"] == pytest.approx(3216 / 36624)
    # negative control: each row's length squared (36 + 36 + 10 pairs) would be another count
    assert a["attention_flops"] != 48 * (36 + 36 + 10)
    shares = [att / work for att, work in zip(ROW_ATTENTION, ROW_FLOPS)]  # 6.5%, 9.7%, 15.2%
    top = a["highest_share_rows"]
    assert [(t["shard"], t["row"]) for t in top] == [("shard-00001.arrow", 0), ("shard-00000.arrow", 1), ("shard-00000.arrow", 0)]
    assert [t["attention_share"] for t in top] == pytest.approx([shares[2], shares[1], shares[0]])
    assert [(t["tokens"], t["examples"], t["longest"]) for t in top] == [(4, 1, 4), (8, 1, 8), (8, 2, 5)]
    assert a["row_share"]["max"] == pytest.approx(shares[2]) and a["row_share"]["min"] == pytest.approx(shares[0])
    assert r["model"] == {"hidden": 4, "layers": 1, "heads": 1, "kv_heads": 1, "intermediate": 4, "vocab": 64}


def test_terminal_and_html_show_it(report: tuple[str, dict, str]) -> None:
    out, r, page = report
    assert all(len(line) <= 100 for line in out.splitlines())
    assert "all rows        8.8% of 36.62k FLOPs" in out
    assert "shard-00001.arrow row 0: 4 tokens, 1 example(s), longest 4: 15.2%" in out
    assert "hidden 4, 1 layers, 1 heads (1 K/V), MLP 4, vocab 64" in out
    assert "Attention's share of the work" in page and "15.2%" in page
    assert "<b>test</b>" not in page and "&lt;b&gt;test&lt;/b&gt;" in page  # the tokenizer's name, escaped


def test_one_long_example_costs_more_attention_than_short_ones_of_its_tokens() -> None:
    """llama-3.2-1B's shape (pack-report's default): one example of 8,192 tokens against 16 of 512."""
    from pipeline.report.flops import step_flops

    shape = Sizes().shape()
    one_long = step_flops(shape, [8192], loss_tokens=8000)
    many_short = step_flops(shape, [512] * 16, loss_tokens=8000)
    assert one_long.dense == many_short.dense  # same tokens and loss tokens
    # pairs 8192 x 8193 / 2 against 16 x 512 x 513 / 2: 31.9x the attention
    assert one_long.attention == pytest.approx(many_short.attention * (8192 * 8193) / (16 * 512 * 513))


def test_sizes_that_make_no_model_are_one_line(tmp_path: Path) -> None:
    make_packed_folder(tmp_path / "p", ROWS, 8)
    result = CliRunner().invoke(pack_report, [str(tmp_path / "p"), "--hidden", "100", "--heads", "32"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "--heads 32" in result.output and "must divide the width" in result.output
    for option, value in (("--layers", str(10**12)), ("--hidden", str(2**70))):  # absurd: refused at once
        result = CliRunner().invoke(pack_report, [str(tmp_path / "p"), option, value])
        assert result.exit_code != 0 and option in result.output and "Traceback" not in result.output, result.output
