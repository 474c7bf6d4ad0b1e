"""A Redis whose chain GETs time out while its small commands answer (a congested link: the EXISTS probe
fits in the timeout, a multi-MB MGET does not). Each lookup's probe succeeds and resets the breaker's
consecutive-failure count, so the breaker never opens; and a failed GET was never shown to the cost model,
which kept deciding "load" on its old estimate: every request with an L3 chain paid a full socket
timeout before recomputing, for as long as the condition lasted. Found in review."""

from __future__ import annotations

import time

import redis

from cache.circuit_breaker import BreakerState, CircuitBreaker
from cache.cost_model import LoadCostModel
from cache.redis_kv_store import RedisKVStore
from engine.kv_tiers import L3Tier
from tests.test_redis_kv_store import META, FakeClock, _keys

TIMEOUT_S = 0.02


def _congested_store(breaker: CircuitBreaker) -> tuple[RedisKVStore, list[int]]:
    """A real store (its `_call`, breaker and counters) whose Redis answers EXISTS and times out MGETs."""
    store = RedisKVStore("redis://127.0.0.1:1/0", "kv-test:congested", timeout_s=TIMEOUT_S, breaker=breaker)
    mgets = [0]

    def exists_each(names, client=None):
        return [1] * len(names)

    def mget(names):
        mgets[0] += 1
        time.sleep(TIMEOUT_S)
        raise redis.TimeoutError("Timeout reading from socket")

    store._exists_each = exists_each
    store._mget = mget
    return store, mgets


def _model(clock: FakeClock) -> LoadCostModel:
    # loads win clearly on the estimates: 10 GB/s against 10k prefill tokens/s
    return LoadCostModel(prior_load_bytes_per_s=10e9, prior_prefill_tokens_per_s=10_000.0, clock=clock)


def _tier(failure_threshold: int):
    """An L3 tier over the congested store, with its breaker, MGET count and cost model."""
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=failure_threshold, reset_timeout_s=5.0, clock=clock)
    store, mgets = _congested_store(breaker)
    cost = _model(clock)
    return L3Tier(store, META, cost), breaker, mgets, cost


def test_chain_gets_that_time_out_teach_the_cost_model_to_recompute():
    l3, breaker, mgets, cost = _tier(failure_threshold=3)
    store = l3.store
    try:
        keys = _keys(4)  # 64 tokens: 6.4 ms to recompute; a GET costs its 20-ms timeout
        outcomes = [l3.fetch_with_outcome(keys)[1] for _ in range(10)]
        assert breaker.state is BreakerState.CLOSED, "each probe's success resets the consecutive count"
        assert store.stats.errors == mgets[0]
        assert mgets[0] <= 2, (mgets[0], outcomes, cost.decisions, cost.estimates)
        assert outcomes[-1] == "recompute"
    finally:
        l3.close()


def test_a_get_the_open_breaker_refused_is_not_a_measurement():
    """Refused at once, nothing was sent: the model must not read that as an instant load."""
    l3, breaker, mgets, cost = _tier(failure_threshold=1)
    try:
        keys = _keys(4)
        breaker.record_failure()  # open
        for _ in range(5):
            assert l3.fetch_with_outcome(keys, [True] * 4) == ([], "missing")
        assert mgets[0] == 0 and cost.estimates.load_observations == 0
        assert cost.decisions["load"] == 5, "still loads once Redis answers"
    finally:
        l3.close()


def test_a_failed_load_is_measured_only_when_slower_than_predicted():
    m = LoadCostModel(prior_load_bytes_per_s=1e9, load_overhead_s=0.001)
    assert not m.observe_failed_load(1_000_000, 0.0002)  # refused at once: says nothing of the bandwidth
    assert m.estimates.load_observations == 0
    assert m.observe_failed_load(1_000_000, 0.05)  # a 50-ms timeout for 1 MB
    assert m.estimates.load_observations == 1 and m.predict_load_s(1_000_000) > 0.02
