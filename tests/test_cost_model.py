"""Load-or-recompute decisions from synthetic measurements."""

from __future__ import annotations

import pytest

from cache.cost_model import LoadCostModel, ReuseLedger
from tests.test_redis_kv_store import FakeClock

# A 16-token block of a ~1B Llama in bf16: 16 layers * 2 * 8 heads * 16 tokens * 64 dims * 2 bytes.
BLOCK_BYTES = 16 * 2 * 8 * 16 * 64 * 2


def test_priors():
    m = LoadCostModel()
    est = m.estimates
    assert est.load_bytes_per_s == pytest.approx(500e6)
    assert est.prefill_tokens_per_s == pytest.approx(20_000.0)
    assert est.load_observations == est.prefill_observations == 0
    # 128 blocks (2k tokens): ~67 MB at 500 MB/s = 0.13 s vs 0.1 s prefill at 20k tok/s -> recompute
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    # ~8.4 MB for 2k tokens would load in ~18 ms -> load
    assert m.should_load(2048, 2048 * 4096)
    assert m.decisions == {"load": 1, "recompute": 1, "explore": 0}


def test_fast_redis_slow_prefill_loads():
    m = LoadCostModel()
    for _ in range(30):
        m.observe_load(BLOCK_BYTES * 64, BLOCK_BYTES * 64 / 2e9)  # 2 GB/s
        m.observe_prefill(1024, 1024 / 2_000)  # a CPU: 2k tokens/s
    assert m.estimates.load_bytes_per_s == pytest.approx(2e9, rel=0.01)
    assert m.estimates.prefill_tokens_per_s == pytest.approx(2_000, rel=0.01)
    assert m.should_load(2048, 128 * BLOCK_BYTES)
    assert m.decisions == {"load": 1, "recompute": 0, "explore": 0}


def test_slow_redis_fast_prefill_recomputes():
    m = LoadCostModel()
    for _ in range(30):
        m.observe_load(BLOCK_BYTES * 64, BLOCK_BYTES * 64 / 100e6)  # a congested link: 100 MB/s
        m.observe_prefill(2048, 2048 / 200_000)  # an H200: 200k tokens/s
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    assert m.decisions == {"load": 0, "recompute": 1, "explore": 0}


def test_estimates_follow_a_change():
    m = LoadCostModel()
    for _ in range(30):
        m.observe_load(1_000_000, 1_000_000 / 2e9)
    assert m.should_load(2048, 128 * BLOCK_BYTES)
    for _ in range(30):  # Redis becomes slow
        m.observe_load(1_000_000, 1_000_000 / 50e6)
    assert m.estimates.load_bytes_per_s == pytest.approx(50e6, rel=0.02)
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    assert m.decisions == {"load": 1, "recompute": 1, "explore": 0}


def test_margin_requires_a_clear_win():
    m = LoadCostModel(prior_load_bytes_per_s=1e9, prior_prefill_tokens_per_s=10_000, load_overhead_s=0.0)
    # prefill 1000 tokens = 0.1 s; load 90 MB = 0.09 s: faster, but not by 25%
    assert not m.should_load(1000, 90_000_000)
    assert m.should_load(1000, 70_000_000)


def test_first_sample_counts_against_the_prior_and_junk_is_ignored():
    m = LoadCostModel(prior_prefill_tokens_per_s=10_000)
    m.observe_prefill(100, 0.0)
    m.observe_prefill(0, 1.0)
    assert m.estimates.prefill_observations == 0
    m.observe_prefill(1000, 1000 / 5_000)  # prior 1e-4 s/token, sample 2e-4 -> mean 1.5e-4
    assert m.predict_prefill_s(1000) == pytest.approx(0.15)


def test_nothing_to_gain_is_recompute():
    m = LoadCostModel()
    assert not m.should_load(0, 0)
    assert m.decisions["recompute"] == 1


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LoadCostModel(prior_load_bytes_per_s=0)
    with pytest.raises(ValueError):
        LoadCostModel(margin=0.5)


def test_reuse_ledger_books_savings_and_slow_loads_apart():
    ledger = ReuseLedger()
    ledger.record("l3", 64, predicted_recompute_s=0.032, load_s=0.012)  # saved 20 ms
    ledger.record("l3", 32, predicted_recompute_s=0.016, load_s=0.041)  # slow: lost 25 ms
    ledger.record("l3", 0, predicted_recompute_s=1.0, load_s=0.0)  # nothing reused: not a load
    ledger.record("l1", 16, predicted_recompute_s=0.008, load_s=0.008)  # break-even is not slow
    l3 = ledger.totals("l3")
    assert (l3.loads, l3.tokens_loaded, l3.slow_loads) == (2, 96, 1)
    assert l3.seconds_saved == pytest.approx(0.020)
    assert l3.seconds_lost_slow_load == pytest.approx(0.025)
    assert l3.load_seconds == pytest.approx(0.053)
    l1 = ledger.totals("l1")
    assert (l1.loads, l1.slow_loads, l1.seconds_saved, l1.seconds_lost_slow_load) == (1, 0, 0.0, 0.0)
    assert ledger.totals("l2").loads == 0
    ledger.totals("l3").seconds_saved = 99.0  # a copy: the ledger is not changed through it
    assert ledger.totals("l3").seconds_saved == pytest.approx(0.020)


def test_reused_tokens_are_priced_at_the_marginal_cost_not_with_the_fixed_overhead():
    """H200 after prefill graphs: ~3 ms whatever the length, plus ~5 us per token."""
    m = LoadCostModel(prior_load_bytes_per_s=300e6, load_overhead_s=0.001)
    for tokens in (12, 128, 512, 2048, 3500) * 6:
        m.observe_prefill(tokens, 0.003 + 5e-6 * tokens)
    assert m.predict_prefill_s(448) == pytest.approx(448 * 5e-6, rel=0.05)
    assert not m.should_load(448, 448 * 32 * 1024)  # 14 MB from Redis: ~49 ms against ~2 ms


def test_one_prompt_length_alone_falls_back_to_the_mean_cost_per_token():
    m = LoadCostModel(prior_prefill_tokens_per_s=10_000, alpha=0.5)
    for _ in range(20):
        m.observe_prefill(500, 0.003 + 5e-6 * 500)
    assert m.predict_prefill_s(500) == pytest.approx(0.0055, rel=0.01)


def test_a_model_that_recomputes_explores_one_load_a_period_and_recovers():
    """After a slow spell the model recomputes, so it would never measure Redis again: once no load was
    measured for explore_every_s, one request loads anyway, and a fast Redis wins the decision back."""
    clock = FakeClock()
    m = LoadCostModel(explore_every_s=60.0, clock=clock)
    for _ in range(30):
        m.observe_prefill(2048, 2048 / 20_000)
        m.observe_load(BLOCK_BYTES * 64, BLOCK_BYTES * 64 / 100e6)  # a slow spell: 100 MB/s
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    clock.now = 59.0
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    clock.now = 60.0
    assert m.should_load(2048, 128 * BLOCK_BYTES)  # the exploration
    assert not m.should_load(2048, 128 * BLOCK_BYTES)  # one a period, however many ask
    assert not m.should_load(0, 0)  # nothing to load is never explored
    assert m.decisions == {"load": 0, "recompute": 4, "explore": 1}
    m.observe_load(BLOCK_BYTES * 128, BLOCK_BYTES * 128 / 2e9)  # Redis is fast again: 2 GB/s
    assert m.should_load(2048, 128 * BLOCK_BYTES)  # at once: the exploration's sample replaced the mean
    assert m.decisions == {"load": 1, "recompute": 4, "explore": 1}
    for _ in range(3):  # a load chosen on one lucky sample is measured too: a slow Redis is seen again
        m.observe_load(BLOCK_BYTES * 128, BLOCK_BYTES * 128 / 100e6)
    assert not m.should_load(2048, 128 * BLOCK_BYTES)
    never = LoadCostModel(explore_every_s=0, clock=clock)
    clock.now += 3600.0
    assert not never.should_load(2048, 128 * BLOCK_BYTES) and never.decisions["explore"] == 0


def test_an_exploration_that_loaded_nothing_leaves_the_next_load_an_ordinary_sample():
    clock = FakeClock()
    m = LoadCostModel(explore_every_s=60.0, clock=clock, alpha=0.25)
    for _ in range(30):
        m.observe_prefill(2048, 2048 / 20_000)
        m.observe_load(BLOCK_BYTES * 64, BLOCK_BYTES * 64 / 100e6)
    clock.now = 60.0
    assert m.decide(2048, 128 * BLOCK_BYTES) == "explore"
    m.explored_nothing()  # the blocks were gone by the GET
    before = m.predict_load_s(BLOCK_BYTES)
    m.observe_load(BLOCK_BYTES * 128, BLOCK_BYTES * 128 / 2e9)  # a later ordinary load
    assert m.predict_load_s(BLOCK_BYTES) > 0.5 * before, "weighed into the mean, not replacing it"


def test_the_engine_takes_its_exploration_period_from_the_config(redis_server):
    from engine.config import EngineConfig
    from engine.loader import load_engine
    from tests.conftest import MODEL_DIR

    config = EngineConfig(
        model_dir=str(MODEL_DIR), response_cache=False, prefill_templates="", warmup=False,
        redis_url=redis_server, l3_explore_s=7.0, l3_tenant_max_blocks=300,
    )  # fmt: skip
    engine = load_engine(config, log=lambda message: None).engine
    try:
        assert engine.prefix_cache.l3.cost.explore_every_s == 7.0
        assert engine.prefix_cache.l3.store.tenant_max_blocks == 300, "and the tenants' L3 quota"
    finally:
        engine.shutdown(1.0)
