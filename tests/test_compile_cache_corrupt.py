"""Found in review (2026-12-07): a compiled kernel left truncated in the compile cache (the linker writes
the .so in place, so a start killed mid-compile, e.g. by a model-load timeout, or a full disk leaves a
partial file that inductor then finds and never rebuilds: it only checks that the file exists) made every
later start fail its compile stage and serve eager, for good. Now the stage sets a cache that fails a
compile aside and compiles that bucket anew."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.loader import load_engine
from tests.test_compile_cache import _config


def _start(cache_dir: Path):
    torch.compiler.reset()
    return load_engine(_config(cache_dir), log=lambda m: None, model_name="llm_engine", model_version="1")


def test_a_truncated_kernel_in_the_cache_is_rebuilt(tmp_path):
    first = _start(tmp_path / "a")
    first.engine.shutdown(1.0)
    assert first.report.compile["compiled_buckets"] == [32], first.report.failures
    # the same cache as another volume (a new path: this process has the old .so files mapped)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    kernels = list((tmp_path / "b").rglob("*.so"))
    assert kernels
    for so in kernels:
        so.write_bytes(so.read_bytes()[:100])  # what a killed link leaves
    starts = []
    try:
        for _ in range(2):  # a restart, and the one after it
            starts.append(_start(tmp_path / "b"))
            starts[-1].engine.shutdown(1.0)
        reports = [s.report for s in starts]
        assert any(r.compile["compiled_buckets"] == [32] for r in reports), (
            "every start after the bad entry served eager: "
            + repr([(r.compile["eager_buckets"], r.failures) for r in reports])[:1500]
        )
    finally:
        for s in starts:
            s.engine.shutdown(1.0)
