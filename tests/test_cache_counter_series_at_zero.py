"""Every cache counter the spec names (item 9: hits and misses per tier, tokens and bytes loaded, time saved
and lost, evictions, checksum failures) is exported from the engine's first report on, at 0 until it
moves. `llm_engine_cache_total` made a series only on its first increment, so a counter still at 0 had no
series: an L3 that never hit had no `hits` series (its hit rate in PromQL was no value, not 0), and a
counter that appeared at 1 hid that first increment from rate() and increase(), so the first checksum
failure, usually the only one, never raised an alert (found in review). The engine's other counters that must
read 0 (`new_shapes_after_ready_total`) are created at load for the same reason."""

from __future__ import annotations

import threading

import pytest

from client.metrics import scrape_metrics
from tests.conftest import wait_for
from tests.fake_triton_backend import install_metrics
from tests.test_engine_batching import model  # noqa: F401
from tests.test_kv_tiers import replica, serve

CACHE = "llm_engine_cache_total"


@pytest.fixture
def observer(monkeypatch):
    series = install_metrics(monkeypatch)
    from adapters.engine_metrics import TritonEngineObserver

    return TritonEngineObserver("llm_engine", threading.Lock()), series


def exported(series, tier, counter):
    key = (CACHE, tuple(sorted({"model": "llm_engine", "tier": tier, "counter": counter}.items())))
    return None if key not in series else series[key].total


def test_a_counter_reported_at_zero_is_exported_at_zero(observer):
    obs, series = observer
    obs.on_cache_counters({("l3", "hits"): 0, ("l3", "misses"): 3, ("l3", "checksum_failures"): 0})
    assert exported(series, "l3", "misses") == 3
    assert exported(series, "l3", "hits") == 0, "no series for an L3 that has not hit yet"
    assert exported(series, "l3", "checksum_failures") == 0, "no series before the first checksum failure"
    obs.on_cache_counters({("l3", "hits"): 2, ("l3", "misses"): 3, ("l3", "checksum_failures"): 1})
    assert (exported(series, "l3", "hits"), exported(series, "l3", "checksum_failures")) == (2, 1)


def test_an_engine_whose_l3_only_missed_exports_its_hits_and_failures_at_zero(
    observer,
    model,  # noqa: F811
    redis_server,
    request,
):
    """Ground truth: 3 prompts no replica computed; L3 is asked for each chain and holds none of them."""
    obs, series = observer
    engine = replica(model, redis_server, f"zero:{request.node.name}")
    engine.observer = obs
    try:
        for i in range(3):
            serve(engine, [1] + list(range(110 + 40 * i, 150 + 40 * i)))
        engine._cache_stats_at = 0.0  # the last publish, whenever it was, is due now
        engine._publish_cache_counters()
        assert exported(series, "l3", "misses") == 3
        missing = [
            (tier, counter)
            for tier, counters in {
                "l1": (
                    "hit_blocks",
                    "miss_blocks",
                    "tokens_loaded",
                    "bytes_loaded",
                    "seconds_saved",
                    "seconds_lost_slow_load",
                    "evictions",
                ),
                "l3": (
                    "hits",
                    "misses",
                    "checksum_failures",
                    "tokens_loaded",
                    "bytes_loaded",
                    "seconds_saved",
                    "seconds_lost_slow_load",
                    "quota_evictions",
                    "chains_loaded",
                    "chains_partial",
                ),
            }.items()  # fmt: skip
            for counter in counters
            if exported(series, tier, counter) is None
        ]
        assert not missing, f"spec counters with no series while at 0: {missing}"
    finally:
        engine.prefix_cache.l3.close()


SPEC_COUNTERS = {  # what README's cache counters list and item 9 ask for, per tier the server runs
    "l1": ("hit_blocks", "miss_blocks", "tokens_loaded", "bytes_loaded", "seconds_saved",
           "seconds_lost_slow_load", "evictions"),
    "l2": ("hit_blocks", "miss_blocks", "tokens_loaded", "bytes_loaded", "seconds_saved",
           "seconds_lost_slow_load", "evictions"),
    "l3": ("hits", "misses", "checksum_failures", "tokens_loaded", "bytes_loaded", "seconds_saved",
           "seconds_lost_slow_load"),
    "exact": ("hits", "misses", "corrupt", "errors"),
    "semantic": ("hits", "misses", "corrupt", "errors", "evictions"),
}  # fmt: skip


def test_the_server_exports_every_spec_counter_of_its_tiers_once_it_reported(metrics_url):
    """A real tritonserver (the session stack): once the engine reported its cache state (within a second
    or two of the launcher's priming requests), every counter of every tier it runs has a series, 0 or
    not."""

    def names() -> list[str]:
        metrics = scrape_metrics(metrics_url)
        return [
            key for key in metrics if key.startswith(("llm_engine_cache_total{", "llm_engine_cache_state{"))
        ]

    assert wait_for(lambda: any('gauge="blocks"' in key for key in names()), timeout_s=30), "no report"
    reported = names()
    tiers = [tier for tier in SPEC_COUNTERS if any(f'tier="{tier}"' in key for key in reported)]
    assert "l1" in tiers and "l3" in tiers, reported
    missing = [
        f"{tier}/{counter}"
        for tier in tiers
        for counter in SPEC_COUNTERS[tier]
        if not any(f'counter="{counter}"' in key and f'tier="{tier}"' in key for key in reported)
    ]
    assert not missing, f"no series (still 0, or never exported) for: {missing}"
