"""pipeline.tokenizer_cache: a loaded tokenizer's facts and backend, kept per content and versions."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import pipeline.tokenizer_cache as cache

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"
INFO = {"name": "x", "fingerprint": "f", "vocab_size": 10, "eos_token_id": 2, "bos_token_id": 1}


def test_the_key_follows_the_files_content_not_their_place_nor_weights(tmp_path: Path, fresh_tokenizer_cache: Path):
    a = shutil.copytree(TOKENIZER, tmp_path / "a")
    b = shutil.copytree(TOKENIZER, tmp_path / "b")
    key = cache.cache_key(str(a))
    assert cache.cache_key(str(b)) == key
    (b / "model.safetensors").write_bytes(b"weights are not read to load a tokenizer")
    assert cache.cache_key(str(b)) == key
    (b / "config.json").write_text('{"model_type": "llama"}')  # AutoTokenizer may read it
    assert cache.cache_key(str(b)) != key
    (b / "config.json").unlink()
    (b / "tokenizer_config.json").write_text((b / "tokenizer_config.json").read_text() + " ")
    assert cache.cache_key(str(b)) != key
    assert cache.cache_key("owner/some-hub-name") is None  # Hub names are not cached


def test_a_large_or_unreadable_file_in_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A file above HASHED_BYTES counts by its size and mtime; one that cannot be read means no cache
    for that folder (no error: loading the tokenizer decides whether the file matters)."""
    folder = shutil.copytree(TOKENIZER, tmp_path / "tok")
    monkeypatch.setattr(cache, "HASHED_BYTES", 10)
    big = folder / "notes.txt"
    big.write_text("a" * 20)
    key = cache.cache_key(str(folder))
    before = big.stat()
    big.write_text("b" * 20)
    os.utime(big, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.cache_key(str(folder)) == key  # same size and mtime
    os.utime(big, ns=(1, 1))
    assert cache.cache_key(str(folder)) != key
    real = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path.name == "notes.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(cache, "HASHED_BYTES", 1 << 20)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert cache.cache_key(str(folder)) is None


def test_the_key_names_the_installed_libraries():
    import tokenizers
    import transformers

    assert f"tokenizers-{tokenizers.__version__}.dist-info" in cache._library_id("tokenizers")
    assert f"transformers-{transformers.__version__}.dist-info" in cache._library_id("transformers")
    assert cache._library_id("no_such_library_here") == "no_such_library_here: absent"


def test_an_entry_is_found_again_from_disk_under_its_key_only(fresh_tokenizer_cache: Path, monkeypatch):
    cache.store("k", (INFO, '{"backend": 1}'))
    monkeypatch.setattr(cache, "_MEMORY", {})  # from disk, as a new process would
    assert cache.lookup("k", "y") == ({**INFO, "name": "y"}, '{"backend": 1}')
    assert cache.lookup("other", "y") is None
    assert cache.lookup(None, "y") is None
    cache.store(None, (INFO, "{}"))  # Hub names: nothing kept
    assert sorted(p.name for p in fresh_tokenizer_cache.iterdir()) == ["k.json"]


def test_only_the_newest_entries_and_no_old_leftovers_stay_on_disk(fresh_tokenizer_cache: Path):
    for i in range(cache.KEEP + 3):
        cache.store(f"k{i:02d}", (INFO, "{}"))
        os.utime(fresh_tokenizer_cache / f"k{i:02d}.json", ns=(i * 10**9, i * 10**9))
    cut_short = fresh_tokenizer_cache / ".k00.123-abcd.tmp"  # a write that a kill cut short
    recent = fresh_tokenizer_cache / ".k01.124-abcd.tmp"  # perhaps still being written
    cut_short.write_text("{")
    recent.write_text("{")
    os.utime(cut_short, (1, 1))
    cache.store("last", (INFO, "{}"))
    assert not cut_short.exists() and recent.exists()
    kept = sorted(p.stem for p in fresh_tokenizer_cache.glob("*.json"))
    assert len(kept) == cache.KEEP
    assert kept == sorted(["last"] + [f"k{i:02d}" for i in range(cache.KEEP + 3)][-(cache.KEEP - 1):])


def test_the_default_folder_and_turning_it_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("PACKLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "packlm"
    monkeypatch.setenv("PACKLM_CACHE_DIR", "")
    assert cache.cache_dir() is None


def test_a_prefetched_loader_is_taken_over_by_the_job_or_stopped(tmp_path: Path, fresh_tokenizer_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """`prefetch` forks the loader for a tokenizer the cache lacks; the job's `TokenizerParts` takes
    that child over (no second fork) or, when the job loads the tokenizer itself (chat), stops it at
    once. Cached tokenizers, Hub names and bad paths fork nothing."""
    monkeypatch.setattr(cache, "_PREFETCHED", {})
    tok = str(shutil.copytree(TOKENIZER, tmp_path / "tok"))
    cache.prefetch(tok)
    child = cache._PREFETCHED[tok][1]
    parts = cache.TokenizerParts(tok, forked=True)
    assert not cache._PREFETCHED
    info, backend = parts.result()
    assert (info["name"], info["eos_token_id"]) == (tok, 2) and backend.startswith("{")
    assert not child._proc.is_alive()  # it answered and ended
    for name in (tok, "owner/hub-name", str(tmp_path / "missing")):  # cached now / no cache / the job's error
        cache.prefetch(name)
    assert not cache._PREFETCHED

    other = shutil.copytree(TOKENIZER, tmp_path / "other")
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text() + " ")
    cache.prefetch(str(other))
    child = cache._PREFETCHED[str(other)][1]
    cache.TokenizerParts(str(other), forked=False)  # chat: the job loads it itself
    assert not child._proc.is_alive() and not cache._PREFETCHED
