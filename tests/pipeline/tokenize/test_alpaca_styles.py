"""Axolotl's alpaca prompt styles (`type: alpaca:phi`, `alpaca:chatml`, `alpaca:chat`) as pack-data's
--template presets: the text Axolotl's AlpacaPrompter builds (axolotl prompters.py: the style's
system_format around its system prompt, then turn_format, or turn_no_input_format for a row
without input, then the output), with the style's markers encoded as the tokenizer's tokens and the
same strings in a row's text encoded as text."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.read.formats import FormatOptions, detect_format
from pipeline.shards import IGNORE_INDEX
from pipeline.tokenize.batch import tokenize_batch
from pipeline.tokenize.render import rows_where
from pipeline.tokenize.tokenizer import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[3] / "data" / "tokenizer"
SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


# what axolotl's AlpacaPrompter._build_result returns for (instruction, input) of each style
def axolotl_prompt(style: str, instruction: str, input_text: str) -> str:
    system_format, turn, turn_no_input = {
        "chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
        "chatml": (
            "<|im_start|>system\n{system}<|im_end|>\n",
            "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
        ),
        "phi": (
            "<|system|>\n{system}<|end|>\n",
            "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
        ),
    }[style]
    if input_text:
        return system_format.format(system=SYSTEM) + turn.format(instruction=instruction, input=input_text)
    return system_format.format(system=SYSTEM_NO_INPUT) + turn_no_input.format(instruction=instruction)


@pytest.mark.parametrize("style", ["chat", "chatml", "phi"])
def test_each_style_packs_axolotls_prompt_with_its_markers_as_tokens(style: str):
    markers = {"chat": [], "chatml": ["<|im_start|>", "<|im_end|>"], "phi": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]}[style]
    tok = load_tokenizer(str(TOKENIZER), None, markers)
    rows = {"instruction": ["Add the numbers", "Say hi"], "input": ["2 and 3", ""], "output": ["5", "hi"]}
    table = pa.table(rows)
    fmt = detect_format(table.column_names, FormatOptions(format="instruction", template=f"alpaca:{style}"))
    batch = tokenize_batch(table, fmt, tok, rows_where("x.jsonl"))
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    at = 0
    for i, length in enumerate(batch.lengths.tolist()):
        row, row_labels = ids[at : at + length], labels[at : at + length]
        at += length
        prompt = tok(axolotl_prompt(style, rows["instruction"][i], rows["input"][i]), add_special_tokens=False)
        response = tok(rows["output"][i], add_special_tokens=False)["input_ids"]
        body = row[1:] if row[0] == tok.bos_token_id else row
        assert body == prompt["input_ids"] + response + [tok.eos_token_id]
        for m in markers:  # each marker the prompt writes is one token of the row
            assert body.count(tok.convert_tokens_to_ids(m)) == axolotl_prompt(style, rows["instruction"][i], rows["input"][i]).count(m)
        trained = [t for t, label in zip(row, row_labels) if label != IGNORE_INDEX]
        assert trained == response + [tok.eos_token_id]  # the prompt carries no loss
