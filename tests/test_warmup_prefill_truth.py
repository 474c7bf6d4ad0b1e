"""The start-up warmup's prefix templates: one that caches nothing (shorter than a block, a failed store)
is not counted loaded, and the L3 prefetch holds no more fetched blocks than the prefix cache can take
(found in review, 2026-12-07)."""

from __future__ import annotations

import time

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from engine.warmup import run_warmup
from tests.test_engine_batching import BUCKETS, EOS, model  # noqa: F401
from tests.test_kv_tiers import replica
from tests.test_l3_prefetch import seeded


def test_a_template_that_caches_nothing_is_not_counted_loaded(model):  # noqa: F811
    """`prefill_loaded` counts templates that went into the prefix cache (test_warmup_templates_count.py).
    A template shorter than one 16-token block (or of one token) computes, stores no block, and was
    counted loaded all the same."""
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    engine.prefix_cache = PrefixCache(runner, 32, 16, "fp")
    short = ([1] + list(range(10, 20)), "default")  # 11 tokens: no full block
    single = ([1], "default")
    report = run_warmup(engine, enabled=True, hot_prefixes=[short, single], prefill_budget_s=30.0)
    assert len(engine.prefix_cache.index) == 0, "nothing could be cached"
    assert report.prefill_loaded == 0
    assert next(s for s in report.stages if s.name == "prefix_templates").items == 0


def test_the_prefetch_holds_no_more_blocks_than_the_cache_can_take(model, redis_server, request):  # noqa: F811
    """The prefetch fetched every hot prefix's blocks into host memory at once, whatever the prefix cache can
    hold: with the templates deferred (an engine that stays busy after READY takes none), a long hot list's
    whole KV sat in pageable host memory beside L2's checked budget."""
    namespace = f"pf-review:{request.node.name}"
    hot = [
        ([1] + [10 + (i * 53 + j) % 280 for j in range(48)], "default") for i in range(30)
    ]  # 3 blocks each
    seeded(model, redis_server, namespace, hot)
    engine = replica(model, redis_server, namespace)
    capacity = engine.prefix_cache.capacity  # 32 blocks
    report = run_warmup(engine, enabled=True, hot_prefixes=hot, prefill_budget_s=0.0)
    assert report.prefill_loaded == 0 and report.prefill_deferred == 30
    prefetch = engine.template_prefetch

    def held() -> int:
        return sum(len(r.blocks) for r in list(prefetch._results.values()) if r is not None)

    deadline = time.monotonic() + 10
    while prefetch.running and held() < capacity and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a prefetch that does not stop there goes on meanwhile
    try:
        assert held() <= capacity + 3, f"{held()} blocks held in host memory for an L1 of {capacity}"
        # and the deferred templates still all load, in order, from the prefetch once the engine is idle
        deadline = time.monotonic() + 30
        while engine.deferred_templates and time.monotonic() < deadline:
            engine._background_step()
        assert not engine.deferred_templates
        deadline = time.monotonic() + 10
        while prefetch.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefetch.summary(0)["outcomes"] == {"loaded": 30} and prefetch.blocks_used == 90
    finally:
        prefetch.close()
        engine.prefix_cache.l3.close()
