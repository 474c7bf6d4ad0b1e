"""Found in review (2026-12-07): the compile cache directory holds code the engine runs (inductor's
pickled FX-graph entries, compiled .so kernels, artifacts.bin hot-loaded into them). Its default lives in
/tmp (`/tmp/llm-compile-cache`), where any local user can create it first. A cache directory that another
user owns, or that anyone may write, must not be activated: no hot-load of its artifacts.bin, and
TORCHINDUCTOR_CACHE_DIR must not point into it (the compile stage then compiles without the cache,
with the reason in the report's failures)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import compile_cache as cc
from tests.conftest import MODEL_DIR

OTHER_UID = 65534  # nobody


def _planted(tmp_path: Path, mode: int, uid: int | None):
    root = tmp_path / "llm-compile-cache"
    cache = cc.compile_cache_for(root, "llm_engine", "1", "fp", MODEL_DIR, 2, torch.device("cpu"))
    cache.inductor_dir.mkdir(parents=True)  # another user got there first: empty inductor/, their file
    cache.artifacts_path.write_bytes(b"planted by another user")
    for path in (root, cache.path, cache.inductor_dir, cache.artifacts_path):
        path.chmod(mode if path.is_dir() else 0o666)
        if uid is not None:
            os.chown(path, uid, uid)
    return cache


@pytest.mark.parametrize(
    ("mode", "uid"),
    [(0o755, OTHER_UID), (0o777, None)],
    ids=["owned-by-another-user", "world-writable"],
)
def test_a_cache_directory_others_control_is_not_loaded(tmp_path, monkeypatch, mode, uid):
    if uid is not None and os.geteuid() != 0:
        pytest.skip("needs root to chown")
    cache = _planted(tmp_path, mode, uid)
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or object())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "private"))
    try:
        cc.activate(cache)
    except Exception as exc:  # refusing is fine (compile_decode_buckets records it as compile:cache)
        assert "compile_cache_dir" in str(exc) or str(cache.path) in str(exc) or "trust" in str(exc), exc
    assert loaded == [], "artifacts.bin from a directory another user controls was hot-loaded"
    assert not os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(cache.path)), (
        "inductor now loads pickled entries and .so kernels from a directory another user controls"
    )


def test_a_private_cache_directory_is_still_used(tmp_path, monkeypatch):
    """The check must not refuse the normal case: a directory this user created."""
    root = tmp_path / "llm-compile-cache"
    cache = cc.compile_cache_for(root, "llm_engine", "1", "fp", MODEL_DIR, 2, torch.device("cpu"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "private"))
    assert cc.activate(cache) is False
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.inductor_dir.resolve())
