"""Discrete-event simulation: the full scheduler against FIFO and other baselines on the same arrivals."""

from __future__ import annotations

import random

import pytest

from scheduler.simulation import NS, POLICIES, Arrival, EngineSpec, SimConfig, percentile, simulate
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()
ENGINE = EngineSpec(slots=8, prefill_tokens_per_s=20_000.0, decode_step_s=0.02)  # about 10 requests/s


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> list[Arrival]:
    """Open-loop Poisson arrivals: 20 % critical, 40 % standard, 40 % batch; two tenants."""
    rng = random.Random(seed)
    now, arrivals = 0, []
    for _ in range(count):
        now += int(rng.expovariate(rate_per_s) * NS)
        tier = rng.choices(["critical", "standard", "batch"], [0.2, 0.4, 0.4])[0]
        arrivals.append(Arrival(now, tier, rng.choice("ab"), rng.randint(50, 400), rng.randint(10, 60)))
    return arrivals


@pytest.mark.parametrize("seed", [1, 2])
def test_full_scheduler_beats_fifo_for_critical_under_overload(seed: int) -> None:
    arrivals = poisson_arrivals(14.0, 2000, seed)  # ~1.4x what the engine can serve
    results = {policy: simulate(arrivals, TIERS, policy, ENGINE) for policy in POLICIES}
    fifo = results["fifo"].attainment(TIERS, "critical")
    full = results["full"].attainment(TIERS, "critical")
    assert fifo < 0.2  # FIFO collapses under overload
    assert full >= fifo + 0.3
    assert full >= results["edf"].attainment(TIERS, "critical")
    assert results["full"].events  # the feedback loop acted
    assert not results["fifo"].events


def test_below_saturation_every_policy_serves_everything() -> None:
    arrivals = poisson_arrivals(4.0, 400, 5)
    for policy in POLICIES:
        result = simulate(arrivals, TIERS, policy, ENGINE)
        assert not [r for r in result.records if r.rejected], policy
        assert result.attainment(TIERS, "batch") == 1.0


def test_nothing_is_dropped_silently_and_no_tier_waits_past_its_maximum() -> None:
    arrivals = poisson_arrivals(20.0, 1500, 3)
    for policy in POLICIES:
        result = simulate(arrivals, TIERS, policy, ENGINE, SimConfig(max_queue_len=300))
        assert len(result.records) == len(arrivals)
        for record in result.records:
            served = record.first_token_ns is not None
            assert served != record.rejected, (policy, record)
            if record.rejected:
                assert record.reason in {"deadline", "queue-full", "expired"} and record.message
                assert repr(record.tier) in record.message
            else:
                assert record.wait_ns <= TIERS.get(record.tier).max_queue_ns
        reasons = {r.reason for r in result.records if r.rejected}
        if policy == "full":
            assert "deadline" in reasons  # batch shed at admission with a reason, not queued to expire


def test_simulation_is_deterministic_and_policy_is_checked() -> None:
    arrivals = poisson_arrivals(12.0, 500, 9)
    first = simulate(arrivals, TIERS, "full", ENGINE)
    second = simulate(arrivals, TIERS, "full", ENGINE)
    assert first.records == second.records and first.events == second.events
    with pytest.raises(ValueError, match="allowed: fifo, priority, edf, full"):
        simulate(arrivals, TIERS, "lifo", ENGINE)  # type: ignore[arg-type]


def test_quiet_tenant_keeps_its_latency_next_to_a_flooding_one() -> None:
    """Same tier, one tenant sends 10x the other's traffic and more than the engine can take."""
    rng = random.Random(11)
    arrivals = []
    for tenant, rate in (("flood", 12.0), ("quiet", 1.2)):
        now = 0
        for _ in range(int(rate * 60)):
            now += int(rng.expovariate(rate) * NS)
            arrivals.append(Arrival(now, "standard", tenant, 200, 30))
    config = SimConfig(feedback=False, admission=False)
    full = simulate(arrivals, TIERS, "full", ENGINE, config)
    edf = simulate(arrivals, TIERS, "edf", ENGINE, config)

    def p95_quiet_ms(result) -> float:  # type: ignore[no-untyped-def]
        ttfts = [r.ttft_ns / 1e6 for r in result.records if r.tenant == "quiet" and r.ttft_ns is not None]
        return percentile(ttfts, 95)

    assert p95_quiet_ms(full) < 0.25 * p95_quiet_ms(edf)
    assert p95_quiet_ms(full) <= TIERS.get("standard").ttft_target_ms


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([7.0], 99) == 7.0
