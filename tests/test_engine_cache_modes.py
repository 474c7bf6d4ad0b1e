"""Each `cache` mode and the warmup tier on a real engine (tiny model, real Redis): bypass touches no tier
or counter, refresh is never served and writes, warmup publishes the whole prompt to L3 and a template
pins what L1 already held, hits equal computed answers, sampled requests are never cached, tenants stay
apart (written in review, 2026-12-07; the last two findings failed before their fix)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import uuid

import pytest

from cache.circuit_breaker import CircuitBreaker
from cache.cost_model import LoadCostModel
from cache.kv_format import KVBlockMeta, dtype_name
from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactResponseCache
from engine.engine import Engine
from engine.kv_tiers import LAYOUT, L3Tier
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from engine.response_tier import ResponseTier
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

P = [1, *range(40, 88)]  # 49 tokens


def letters(ids, trim_bytes=0):
    data = bytes(97 + t % 26 for t in ids)
    return data[: len(data) - trim_bytes]


def make(model, redis_url, first_use=True, l3=False, slots=2):  # noqa: F811
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    engine.prefix_cache = cache = PrefixCache(runner, 32, 16, "fp")
    exact = ExactResponseCache(redis_url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, letters, first_use=first_use)
    if l3:
        shape = runner.shape
        block = (shape.layers, 2, shape.kv_heads, 16, shape.head_dim)
        meta = KVBlockMeta("fp", dtype_name(runner.dtype), block, 16, LAYOUT)
        cost = LoadCostModel()
        cost.decide = lambda *a, **k: "load"
        store = RedisKVStore(redis_url, f"rv:{uuid.uuid4().hex}", timeout_s=0.5, breaker=CircuitBreaker())
        cache.l3 = L3Tier(store, meta, cost)
    return engine


@contextmanager
def running(model, redis_url, **options) -> Iterator[Engine]:  # noqa: F811
    engine = make(model, redis_url, **options)
    try:
        yield engine
    finally:
        engine.shutdown(1.0)


def serve(engine, prompt, **params):
    sink = RecordingSink()
    params.setdefault("max_tokens", 6)
    engine.submit(request(prompt, sink, **params))
    run_until_idle(engine)
    assert not sink.errors
    return sink


def cache_state(engine) -> tuple:
    """What a bypassed request must leave as it was: the exact cache's counters, its sightings, L1's."""
    responses = engine.responses
    return (
        responses.cache.snapshot(),
        responses.first_sightings,
        len(getattr(responses._sightings, "_by_tenant", ())),
        engine.prefix_cache.hit_blocks,
        engine.prefix_cache.miss_blocks,
    )


def test_bypass_touches_no_counter(model, redis_server):  # noqa: F811
    with running(model, redis_server, first_use=False, l3=True) as engine:
        serve(engine, P + [5])
        before = cache_state(engine)
        serve(engine, P + [5], cache="bypass")
        serve(engine, P + [6], cache="bypass")
        engine.responses.drain_writes()
        after = cache_state(engine)
        assert before == after


def test_refresh_not_served_and_written(model, redis_server):  # noqa: F811
    with running(model, redis_server, first_use=True) as engine:
        a = serve(engine, P + [5], stream=False)
        assert engine.responses.drain_writes()
        b = serve(engine, P + [5], stream=False, cache="refresh")
        assert engine.stats.finished.get("cached", 0) == 0
        assert a.windows == b.windows


def test_warmup_publishes_l3(model, redis_server):  # noqa: F811
    with running(model, redis_server, l3=True) as engine:
        serve(engine, P + [5], tier="warmup")
        assert engine.prefix_cache.l3._writes.drain()
        keys = engine.prefix_cache.chain_keys(P + [5], "default")
        assert engine.prefix_cache.l3.store.exists_chain(keys) == 3


def test_warmup_after_standard_publishes_full_prompt(model, redis_server):  # noqa: F811
    with running(model, redis_server, l3=True) as engine:
        prompt = P[:48]  # 3 full blocks exactly
        serve(engine, prompt)  # standard: L1 only (first use)
        serve(engine, prompt, tier="warmup", cache="refresh")
        assert engine.prefix_cache.l3._writes.drain()
        keys = engine.prefix_cache.chain_keys(prompt + [9], "default")
        assert engine.prefix_cache.l3.store.exists_chain(keys) == 3


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("stop", [(), ("b",), ("bc",)])
@pytest.mark.parametrize("first_max,then_max", [(8, 8), (8, 3), (8, 5), (3, 3)])
def test_hits_equal_computed(model, redis_server, stream, stop, first_max, then_max):  # noqa: F811
    with running(model, redis_server, first_use=True) as engine:
        prompt = [1, 5, 9, 33, 7]
        serve(engine, prompt, max_tokens=first_max, stop=stop, stream=stream, ignore_eos=False)
        assert engine.responses.drain_writes()
        hit = serve(engine, prompt, max_tokens=then_max, stop=stop, stream=stream, ignore_eos=False)
        fresh = serve(
            engine, prompt, max_tokens=then_max, stop=stop, stream=stream, ignore_eos=False, cache="kv-only"
        )
        assert (hit.tokens, hit.trim) == (fresh.tokens, fresh.trim)


def test_seeded_hit_equals_recompute(model, redis_server):  # noqa: F811
    with running(model, redis_server, first_use=True) as engine:
        prompt = [1, 5, 9, 33, 7]
        kw = dict(temperature=0.9, seed=7, top_k=50, max_tokens=10)
        serve(engine, prompt, **kw)
        assert engine.responses.drain_writes()
        hit = serve(engine, prompt, **kw)
        assert engine.stats.finished.get("cached") == 1
        fresh = serve(engine, prompt, cache="kv-only", **kw)
        assert hit.tokens == fresh.tokens
        hit5 = serve(engine, prompt, **{**kw, "max_tokens": 5})
        fresh5 = serve(engine, prompt, cache="kv-only", **{**kw, "max_tokens": 5})
        assert hit5.tokens == fresh5.tokens


def test_sampled_never_cached(model, redis_server):  # noqa: F811
    with running(model, redis_server, first_use=True) as engine:
        prompt = [1, 5, 9, 33, 7]
        for _ in range(3):
            serve(engine, prompt, temperature=0.9, max_tokens=5)
        engine.responses.drain_writes()
        s = engine.responses.cache.snapshot()
        assert s["stores"] == 0 and s["hits"] == 0 and engine.stats.finished.get("cached", 0) == 0


def test_tenants_apart(model, redis_server):  # noqa: F811
    with running(model, redis_server, first_use=True) as engine:
        prompt = [1, 5, 9, 33, 7]
        serve(engine, prompt, tenant="a")
        engine.responses.drain_writes()
        serve(engine, prompt, tenant="b")
        assert engine.stats.finished.get("cached", 0) == 0


def test_warmup_publishes_a_block_l1_already_held_to_l3(model, redis_server):  # noqa: F811
    """A standard request keeps a 48-token prompt (3 full blocks) in L1 only (L3 writes on reuse); the
    warmup-tier request for the same prompt must publish all 3 blocks to L3 at once. Its lookup reaches
    only 2 of them (one token is left to compute), and _store returns early since L1 holds all three."""
    with running(model, redis_server, l3=True) as engine:
        prompt = P[:48]
        serve(engine, prompt)
        serve(engine, prompt, tier="warmup", cache="refresh")
        assert engine.prefix_cache.l3._writes.drain()
        keys = engine.prefix_cache.chain_keys(prompt + [9], "default")
        assert engine.prefix_cache.l3.store.exists_chain(keys) == 3


def test_a_template_whose_blocks_l1_already_holds_is_pinned(model, redis_server):  # noqa: F811
    with running(model, redis_server) as engine:
        serve(engine, P + [5])  # traffic stored P's 3 blocks before the (deferred) template ran
        engine.prefill_template(P, "default")
        keys = engine.prefix_cache.chain_keys(P + [5], "default")
        assert set(keys) <= engine.prefix_cache.pinned
