"""Shared test setup: the tests never write the user's own tokenizer cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _tokenizer_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """pack-data's disk cache of loaded tokenizers (`pipeline.tokenizer_cache`) lives in this
    session's temporary folder; command-line tests run in subprocesses inherit it."""
    os.environ["PACKLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("packlm-cache"))


@pytest.fixture
def fresh_tokenizer_cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """An empty tokenizer cache, in memory and on disk, for this test only; returns its folder."""
    import pipeline.tokenizer_cache

    folder = tmp_path / "tokenizer-cache"
    monkeypatch.setenv("PACKLM_CACHE_DIR", str(folder))
    monkeypatch.setattr(pipeline.tokenizer_cache, "_MEMORY", {})
    return folder
