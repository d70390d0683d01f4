"""pack-train with a model and a tokenizer named by Hugging Face Hub id (`pipeline.read.hub`,
`trainer.model.presets.model_folder`), offline on a Hugging Face cache the tests build: the same step-1
loss as the same folder given by path; a tokenizer at another commit than the manifest's is named
in one line; a model id the Hub does not know, or not cached with --offline, is one line at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_cache import C1, C2, add_snapshot, fake_hub, folder_files, hf_home  # noqa: F401 - hf_home is a fixture

from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.errors import UserError
from trainer.cli import pack_train
from trainer.config import TrainConfig
from trainer.run.preflight import open_data

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "sample" / "instructions.jsonl"
TOKENIZER = ROOT / "data" / "tokenizer"

pytestmark = pytest.mark.skipif(
    not (SAMPLE.is_file() and (TOKENIZER / "tokenizer.json").is_file()), reason="embedded sample data not present"
)


def _pack(tmp_path: Path, tokenizer: str) -> Path:
    out = tmp_path / "packed"
    run_pack_data(PackConfig(inputs=[str(SAMPLE)], tokenizer=tokenizer, max_len=256, out=str(out), num_proc=1, limit=24, progress=False))
    return out


def _tiny_model(folder: Path) -> Path:
    """A 2-layer Llama with seeded random weights and data/tokenizer's files, as save_pretrained writes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def _step_one_loss(packed: Path, model: str, run: Path) -> float:
    args = [
        "--data",
        str(packed),
        "--model",
        model,
        "--out",
        str(run),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--max-steps",
        "1",
        "--tokens-per-step",
        "2048",
        "--log-every",
        "1",
        "--num-workers",
        "0",
        "--no-progress",
        "--no-verify-hashes",
    ]
    result = CliRunner().invoke(pack_train, args)
    assert result.exit_code == 0, result.output
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_a_model_by_id_trains_exactly_as_the_same_folder_by_path(hf_home: Path, tmp_path: Path) -> None:
    folder = _tiny_model(tmp_path / "model")
    add_snapshot(hf_home, "model", "someone/tiny-llama", folder_files(folder), C1)
    packed = _pack(tmp_path, str(TOKENIZER))
    by_path = _step_one_loss(packed, str(folder), tmp_path / "run-path")
    by_id = _step_one_loss(packed, "someone/tiny-llama", tmp_path / "run-id")  # its tokenizer: the id's files
    assert by_id == by_path
    # the run records which commit of the id it trained (a folder given by path records none)
    assert json.loads((tmp_path / "run-id" / "config.json").read_text())["model_hub"] == {
        "id": "someone/tiny-llama",
        "revision": None,
        "commit": C1,
    }
    assert json.loads((tmp_path / "run-path" / "config.json").read_text())["model_hub"] is None
    # the control: another model's loss differs (the id really was the model loaded)
    other = _tiny_model(tmp_path / "other")
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    save_file({k: v * 1.5 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    assert _step_one_loss(packed, str(other), tmp_path / "run-other") != by_path


def test_a_tokenizer_at_another_commit_is_named_in_one_line(hf_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pipeline.read import hub

    add_snapshot(hf_home, "model", "someone/tok", folder_files(TOKENIZER), C1)
    packed = _pack(tmp_path, "someone/tok")
    config = TrainConfig(data=str(packed), model="tiny", out=str(tmp_path / "run"), tokenizer="someone/tok")
    open_data(config)
    assert capsys.readouterr().err == ""  # the same commit: nothing to say
    # main moves to a commit with the same files: named in one line, training goes on
    add_snapshot(hf_home, "model", "someone/tok", folder_files(TOKENIZER), C2)
    hub._RESOLVED.clear()  # as in a new process
    open_data(config)
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and (
            f"tokenizer someone/tok is at commit {C2[:12]} now, but the data was packed "
            f"with commit {C1[:12]}: pass someone/tok@{C1} to use the same files"
        )
        in err
    )
    # pinned to the recorded commit: nothing to say
    hub._RESOLVED.clear()
    open_data(TrainConfig(data=str(packed), model="tiny", out=str(tmp_path / "run"), tokenizer=f"someone/tok@{C1}"))
    assert capsys.readouterr().err == ""
    # a commit whose tokenizer tokenizes differently: refused, the change of commit in the same line
    changed = tmp_path / "changed-tok"
    shutil.copytree(TOKENIZER, changed)
    cfg = json.loads((changed / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages }}"
    (changed / "tokenizer_config.json").write_text(json.dumps(cfg))
    add_snapshot(hf_home, "model", "someone/tok", folder_files(changed), "3" * 40)
    hub._RESOLVED.clear()
    with pytest.raises(
        UserError,
        match=r"has fingerprint \w+ \(tokenizer someone/tok is at commit 333333333333 "
        r"now, but the data was packed with commit 111111111111",
    ):
        open_data(config)


@pytest.mark.parametrize("offline", [False, True])
def test_a_model_id_the_hub_does_not_know_is_one_line_at_once(hf_home: Path, tmp_path: Path, offline: bool) -> None:
    packed = _pack(tmp_path, str(TOKENIZER))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    code = "import sys; from trainer.cli import main; sys.argv[0] = 'pack-train'; main()\n"
    with fake_hub(404, "RepoNotFound") as (url, asked):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                "--data",
                str(packed),
                "--model",
                "someone/no-such-model",
                "--out",
                str(tmp_path / "run"),
                *(["--offline"] if offline else []),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), "HF_ENDPOINT": url},
        )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    if offline:  # --offline: the Hub is never asked
        assert "model someone/no-such-model is not in the local Hugging Face cache" in proc.stderr
        assert [p for p in asked if "someone/" in p] == []
    else:
        assert "model someone/no-such-model is neither a local path nor a model repo on the Hugging Face Hub" in proc.stderr
        assert len([p for p in asked if "someone/" in p]) == 1
    assert not (tmp_path / "run").exists()  # (at once: the Hub asked once or never, above; not timed)
