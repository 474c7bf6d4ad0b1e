"""L1 prefix cache: stable keys, tenant isolation, eviction order, and exact reuse in the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache, block_keys
from engine.warmup import run_warmup
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

PREFIX = [1] + list(range(40, 88))  # 49 tokens: three full blocks of 16


def make_engine(model, capacity=16) -> Engine:  # noqa: F811
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    engine.prefix_cache = PrefixCache(runner, capacity, 16, "fingerprint")
    return engine


def run(engine, prompt, tenant="default", **params) -> list[int]:
    sink = RecordingSink()
    engine.submit(request(prompt, sink, max_tokens=6, tenant=tenant, **params))
    run_until_idle(engine)
    return sink.tokens


def test_block_keys_are_identical_in_another_process():
    code = "from engine.prefix_cache import block_keys;print(block_keys(list(range(50)), 16, b's')[-1].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == block_keys(list(range(50)), 16, b"s")[-1].hex()
    assert len(block_keys(list(range(50)), 16, b"s")) == 3
    assert block_keys(list(range(16)), 16, b"a") != block_keys(list(range(16)), 16, b"b")


def test_reused_prefix_gives_the_same_tokens_as_a_full_prefill(model):  # noqa: F811
    plain = make_engine(model)
    plain.prefix_cache = None
    expected = run(plain, PREFIX + [5, 6, 7])
    engine = make_engine(model)
    run(engine, PREFIX + [9, 9])  # fills the cache with PREFIX's full blocks
    assert engine.stats.prefix_reused_tokens == 0
    assert run(engine, PREFIX + [5, 6, 7]) == expected
    assert engine.stats.prefix_reused_tokens == 48


def test_tenants_never_share_cached_prefixes(model):  # noqa: F811
    engine = make_engine(model)
    run(engine, PREFIX + [9], tenant="acme")
    run(engine, PREFIX + [9], tenant="globex")
    assert engine.stats.prefix_reused_tokens == 0
    run(engine, PREFIX + [9], tenant="acme")
    assert engine.stats.prefix_reused_tokens == 48


def test_eviction_takes_unpinned_tails_first(model):  # noqa: F811
    engine = make_engine(model, capacity=6)
    cache = engine.prefix_cache
    engine.prefill_template(PREFIX[:33], "default")  # two pinned blocks
    first = [1] + list(range(100, 148))  # three blocks
    run(engine, first)
    assert len(cache.lookup(first, "default")) == 3  # touched tail-first: the head is now the newest
    run(engine, [1] + list(range(200, 248)))  # three more blocks, one free slot: two evictions
    assert cache.evictions == 2
    assert len(cache.lookup(first, "default")) == 1, "the shared head survives, the tails went first"
    assert len(cache.lookup(PREFIX, "default")) == 2, "pinned template blocks are never evicted"


def test_templates_load_within_budget_and_the_rest_in_the_background(model):  # noqa: F811
    engine = make_engine(model)
    templates = [(PREFIX, "default"), ([1] + list(range(90, 130)), "default")]
    report = run_warmup(engine, enabled=True, hot_prefixes=templates, prefill_budget_s=1e-9)
    assert report.prefill_loaded == 0 and report.prefill_deferred == 2
    engine.ready = True
    engine.start()
    import time

    deadline = time.monotonic() + 30
    while engine.has_background_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.prefix_cache.lookup(PREFIX + [3], "default")) == 3
    engine.shutdown(drain_timeout_s=10)


@pytest.mark.parametrize("start", [16, 32])
def test_prefill_from_an_offset_matches_transformers(model, start):  # noqa: F811
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    prompt = PREFIX[:45]
    runner.prefill(0, prompt, 64)
    reference = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(runner.prefill(0, prompt, 32, start=start), reference, atol=1e-4, rtol=1e-4)
