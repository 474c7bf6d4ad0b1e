"""Huge (but finite) budgets and sizes: refused naming the parameter, never a traceback later (found in
review, 2026-12-07: a memory size of 400 digits, a prefill budget or a flush period past what a thread
may wait)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.cache_sizing import parse_memory
from engine.config import EngineConfig
from engine.l3_prefetch import L3Prefetcher
from engine.warmup import WarmupReport, prefill_templates

BASE = {"model_dir": str(Path(__file__).resolve().parents[1] / "models" / "tiny-llama")}


def test_a_huge_memory_size_is_a_clear_error_naming_the_parameter():
    # 400 digits: float() overflows to inf and int(inf) raises OverflowError (no parameter named)
    with pytest.raises(ValueError, match="prefix_cache_memory"):
        EngineConfig.from_parameters({**BASE, "prefix_cache_memory": "9" * 400})


def test_parse_memory_never_raises_overflow():
    with pytest.raises(ValueError, match="l2_cache_memory"):
        parse_memory("l2_cache_memory", "9" * 400 + "TiB")


class _SlowL3:
    """A fake L3 tier whose fetch takes a moment (a slow Redis)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.store = SimpleNamespace(stats=SimpleNamespace(errors=0, breaker_rejections=0))
        self.block_bytes = 1

    def fetch_with_outcome(self, keys):
        time.sleep(self.delay_s)
        return [], "missing"


@pytest.mark.parametrize("name", ["prefill_budget_s", "traffic_flush_s", "feedback_interval_s"])
def test_a_time_past_what_a_thread_may_wait_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_parameters({**BASE, name: "1e12"})


def test_a_huge_prefill_budget_waits_for_the_prefetch_instead_of_crashing():
    """Waiting for a pending prefetch passed `deadline - now` (> threading.TIMEOUT_MAX) to
    Condition.wait_for: OverflowError out of prefill_templates, no template loaded, none deferred."""
    hot = [([1] + list(range(10, 60)), "default"), ([1] + list(range(60, 110)), "default")]
    prefetch = L3Prefetcher(_SlowL3(0.3), lambda prompt, tenant: [b"k"], hot)
    loaded_prompts: list = []
    engine = SimpleNamespace(
        template_prefetch=prefetch,
        deferred_templates=[],
        prefill_template=lambda prompt, tenant: loaded_prompts.append((prompt, tenant)) or 1,
    )
    prefetch.start()
    report = WarmupReport(enabled=True, device="cpu")
    try:
        loaded = prefill_templates(engine, hot, 1e12, report)
    finally:
        prefetch.close()
    assert loaded == 2 and loaded_prompts == hot and report.failures == []
