"""A load that fails midway (a documented ValueError of the loader, or any later failure) must not
leave the threads and Redis connections it started running in the process. Found in review."""

from __future__ import annotations

import threading
import time

import pytest

import engine.loader as loader
from engine.config import EngineConfig
from tests.conftest import MODEL_DIR


def _new_threads(before: set[threading.Thread], settle_s: float = 6.0) -> list[str]:
    deadline = time.monotonic() + settle_s
    while True:
        left = [
            t.name
            for t in threading.enumerate()
            if t not in before and t.is_alive() and t.name != "tqdm_monitor"
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _config(redis_url: str, tmp_path, **overrides) -> EngineConfig:
    templates = tmp_path / "templates.yaml"
    templates.write_text("templates:\n  - text: 'You are a helpful assistant. ' \n", encoding="utf-8")
    return EngineConfig(
        model_dir=str(MODEL_DIR), redis_url=redis_url, prefill_templates=str(templates),
        semantic_cache=False, **overrides,
    )  # fmt: skip


def test_a_tier_that_does_not_fit_leaves_no_thread_behind(redis_server, tmp_path):
    before = set(threading.enumerate())
    config = _config(redis_server, tmp_path, l2_cache_memory="1000TiB")
    with pytest.raises(ValueError, match="l2_cache_memory"):
        loader.load_engine(config, log=lambda message: None)
    assert (left := _new_threads(before)) == [], f"threads of the failed load still running: {left}"


def test_a_failure_after_warmup_leaves_no_prefetch_or_redis_thread(redis_server, tmp_path, monkeypatch):
    def boom() -> None:
        raise RuntimeError("simulated failure after the warmup")

    monkeypatch.setattr(loader, "settle_garbage_collector", boom)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="simulated"):
        loader.load_engine(_config(redis_server, tmp_path), log=lambda message: None)
    assert (left := _new_threads(before)) == [], f"threads of the failed load still running: {left}"
