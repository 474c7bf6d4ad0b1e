"""SloQueue on a deterministic clock: drop-in semantics, precedence, EDF, aging and its bound, fair share."""

from __future__ import annotations

import random

import pytest

from scheduler.errors import RequestError
from scheduler.priority import assign
from scheduler.slo_queue import QueueFull, SloQueue, default_aging_floor, default_aging_ns, tenant_weight
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()
MS = 1_000_000
S = 1_000_000_000


class FakeClock:
    def __init__(self, now: int = 0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def drain(queue: SloQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_order_across_tiers_and_edf_within() -> None:
    clock = FakeClock()
    queue: SloQueue[str] = SloQueue(TIERS, clock=clock)
    for name in ("batch", "standard", "warmup", "critical"):
        clock.now += MS
        queue.push(name, *assign(TIERS.get(name), clock.now))
    queue.push("critical-late", 1, deadline_ns=10 * S)
    queue.push("critical-early", 1, deadline_ns=1)
    assert drain(queue) == ["critical-early", "critical", "critical-late", "warmup", "standard", "batch"]


def test_duplicate_key_and_cost_are_checked() -> None:
    queue: SloQueue[str] = SloQueue(TIERS, clock=FakeClock())
    queue.push("a", 1, 0, key="x")
    with pytest.raises(ValueError, match="already queued"):
        queue.push("b", 1, 0, key="x")
    with pytest.raises(ValueError, match="cost"):
        queue.push("c", 1, 0, cost=0)


def test_aged_batch_overtakes_newer_standard_but_not_critical() -> None:
    clock = FakeClock()
    queue: SloQueue[str] = SloQueue(TIERS, aging_ns=1 * S, clock=clock)
    assert queue.aging_floor == 2  # one below critical: aging never overtakes the top tier
    queue.push("batch-old", *assign(TIERS.get("batch"), 0))
    clock.now = 500 * MS  # half a step: still level 4
    queue.push("standard-1", *assign(TIERS.get("standard"), clock.now))
    assert queue.peek() == "standard-1"
    clock.now = 2 * S  # two steps: batch is at level 2, standard-1 (1.5 s) at level 2 but younger
    queue.push("standard-2", *assign(TIERS.get("standard"), clock.now))
    queue.push("critical", *assign(TIERS.get("critical"), clock.now))
    assert drain(queue) == ["critical", "batch-old", "standard-1", "standard-2"]


def test_aging_can_reach_the_top_tier_when_configured() -> None:
    clock = FakeClock()
    queue: SloQueue[str] = SloQueue(TIERS, aging_ns=1 * S, aging_floor=1, clock=clock)
    queue.push("batch-old", *assign(TIERS.get("batch"), 0))
    clock.now = 3 * S
    queue.push("critical", *assign(TIERS.get("critical"), clock.now))
    assert drain(queue) == ["batch-old", "critical"]


def test_tier_weight_scales_aging_and_the_bound() -> None:
    queue: SloQueue[str] = SloQueue(TIERS, aging_ns=1 * S, clock=FakeClock())
    assert queue.max_wait_bound_ns("batch") == 2 * S
    assert queue.max_wait_bound_ns("critical") == 0
    queue.set_tier_weight("batch", 2.0)
    assert queue.tier_aging_ns("batch") == 500 * MS
    assert queue.max_wait_bound_ns("batch") == 1 * S
    assert queue.max_wait_bound_ns("batch", service_ns=10 * MS) is None  # unbounded queue: no bound
    assert SloQueue(TIERS, aging_ns=0, clock=FakeClock()).max_wait_bound_ns("batch") is None


def test_default_aging_reaches_the_floor_within_half_the_max_queue_time() -> None:
    floor = default_aging_floor(TIERS)
    aging = default_aging_ns(TIERS)
    for tier in TIERS:
        if tier.priority > floor:
            assert (tier.priority - floor) * aging <= tier.max_queue_ns // 2


@pytest.mark.parametrize("floor", [None, 1])
def test_lowest_tier_wait_bound_holds_under_a_flood(floor: int | None) -> None:
    """Higher tiers arrive faster than the queue is served; every batch request still meets the bound.

    With the default floor the critical tier is protected, so it is kept out of the flood (the bound
    counts pops that go to requests at or below the floor); with floor 1 critical floods too.
    """
    rng = random.Random(3)
    clock = FakeClock()
    service = 10 * MS
    queue: SloQueue[tuple[str, int]] = SloQueue(
        TIERS, aging_ns=200 * MS, aging_floor=floor, max_len=400, clock=clock
    )
    names = ["warmup", "standard"] + (["critical"] if floor == 1 else [])
    bound = queue.max_wait_bound_ns("batch", service_ns=service)
    assert bound is not None
    waits = []
    for _ in range(5000):
        clock.now += service
        for _ in range(2):  # two arrivals per pop: overload
            name = "batch" if rng.random() < 0.2 else rng.choice(names)
            try:
                queue.push((name, clock.now), *assign(TIERS.get(name), clock.now), tenant=rng.choice("ab"))
            except QueueFull:
                pass
        name, arrived = queue.pop()
        if name == "batch":
            waits.append(clock.now - arrived)
    assert len(waits) > 100
    assert max(waits) <= bound
    assert max(waits) > queue.max_wait_bound_ns("batch")  # the flood really made batch wait


def test_fair_share_quiet_tenant_gets_half_despite_a_flood() -> None:
    clock = FakeClock()
    queue: SloQueue[str] = SloQueue(TIERS, clock=clock)
    for i in range(500):  # the flooding tenant queued everything first, with earlier deadlines
        queue.push("flood", 3, deadline_ns=i, tenant="flood", cost=100)
    served = []
    for step in range(200):
        clock.now += MS
        if step % 1 == 0:
            queue.push("quiet", 3, deadline_ns=10**12 + step, tenant="quiet", cost=100)
        served.append(queue.pop())
    share = served.count("quiet") / len(served)
    assert 0.45 <= share <= 0.55


def test_fair_share_is_weighted_and_off_means_edf() -> None:
    queue: SloQueue[str] = SloQueue(TIERS, clock=FakeClock())
    queue.set_tenant_weight("gold", 3.0)
    for i in range(400):
        queue.push("gold", 3, i, tenant="gold")
        queue.push("free", 3, i, tenant="free")
    served = [queue.pop() for _ in range(200)]
    assert served.count("gold") == pytest.approx(150, abs=2)

    edf: SloQueue[str] = SloQueue(TIERS, fair_share=False, clock=FakeClock())
    for i in range(10):
        edf.push("flood", 3, i, tenant="flood")
    edf.push("quiet", 3, 100, tenant="quiet")
    assert drain(edf)[-1] == "quiet"


def test_idle_tenant_cannot_bank_credit() -> None:
    queue: SloQueue[str] = SloQueue(TIERS, clock=FakeClock())
    for i in range(100):
        queue.push("busy", 3, i, tenant="busy")
    for _ in range(80):
        queue.pop()  # busy's counter is now 80; a newcomer is lifted to the active minimum
    for i in range(40):
        queue.push("newcomer", 3, i, tenant="newcomer")
    assert queue.counter("standard", "newcomer") == queue.counter("standard", "busy") == 80
    served = [queue.pop() for _ in range(20)]
    assert served.count("newcomer") == 10  # alternates instead of 20 in a row


def test_queue_full_carries_the_tier() -> None:
    queue: SloQueue[str] = SloQueue(TIERS, max_len=3, tier_max_len={"batch": 1}, clock=FakeClock())
    queue.push("b", 4, 0)
    with pytest.raises(QueueFull) as per_tier:
        queue.push("b2", 4, 0)
    assert per_tier.value.tier == "batch" and per_tier.value.code == "UNAVAILABLE"
    assert "'batch'" in str(per_tier.value) and "1/1" in str(per_tier.value)
    queue.push("c", 1, 0)
    queue.push("s", 3, 0)
    with pytest.raises(QueueFull) as full:
        queue.push("c2", 1, 0)
    assert full.value.tier == "critical" and isinstance(full.value, RequestError)
    assert len(queue) == 3  # nothing dropped to make room


def test_oldest_wait_remove_and_expiry() -> None:
    clock = FakeClock(1 * S)
    queue: SloQueue[str] = SloQueue(TIERS, clock=clock)
    queue.push("s1", 3, 0, key="s1", expires_ns=2 * S)
    clock.now = 1_500 * MS
    queue.push("b1", 4, 0, key="b1")
    queue.push("c1", 1, 0, key="c1", expires_ns=3 * S)
    assert queue.earliest_expiry_ns() == 2 * S
    clock.now = 2 * S
    assert queue.oldest_wait_ns() == {"critical": 500 * MS, "warmup": 0, "standard": 1 * S, "batch": 500 * MS}
    assert [e.key for e in queue.pop_expired(clock.now)] == ["s1"]
    assert queue.earliest_expiry_ns() == 3 * S and queue.remove("c1") == "c1"
    assert queue.earliest_expiry_ns() is None  # b1 never expires
    assert queue.remove("b1") == "b1" and queue.remove("b1") is None
    assert not queue and len(queue) == 0
    assert queue.queued_by_tier() == {"critical": 0, "warmup": 0, "standard": 0, "batch": 0}


def test_tenant_weight_from_load_figures() -> None:
    neutral = tenant_weight(10.0, 100.0, 0.0, target_ms=100.0)
    assert neutral == 1.0
    assert tenant_weight(10.0, 400.0, 0.0, target_ms=100.0) == pytest.approx(2.0)  # suffering: more share
    assert tenant_weight(10.0, 100.0, 0.5, target_ms=100.0) == pytest.approx(0.5)  # failing: less share
    assert tenant_weight(0.01, 400.0, 0.0, target_ms=100.0) == 1.0  # too few samples to trust the P99
    assert tenant_weight(10.0, 1e9, 0.0, target_ms=100.0) == 4.0  # clamped
    assert tenant_weight(10.0, 100.0, 1.0, target_ms=100.0) == 0.25
    with pytest.raises(ValueError):
        tenant_weight(1.0, 1.0, 2.0, target_ms=1.0)
    with pytest.raises(ValueError):
        SloQueue(TIERS).set_tenant_weight("t", 0.0)


def test_random_churn_with_tenants_and_aging_loses_nothing() -> None:
    """Pushes, pops, cancels and expiries across tiers and tenants: every item leaves exactly once."""
    rng = random.Random(11)
    clock = FakeClock()
    queue: SloQueue[int] = SloQueue(TIERS, aging_ns=50 * MS, max_len=500, clock=clock)
    pushed, left = set(), []
    for step in range(20_000):
        clock.now += rng.randint(0, 3) * MS
        op = rng.random()
        if op < 0.5:
            try:
                queue.push(
                    step,
                    rng.randint(1, 4),
                    clock.now + rng.randint(0, 500) * MS,
                    key=step,
                    tenant=f"t{rng.randint(0, 30)}",
                    cost=rng.uniform(1, 500),
                    expires_ns=clock.now + 400 * MS if rng.random() < 0.3 else None,
                )
                pushed.add(step)
            except QueueFull:
                pass
        elif op < 0.85 and queue:
            assert queue.peek() == (item := queue.pop())
            left.append(item)
        elif op < 0.95:
            key = rng.randint(0, step)
            if queue.remove(key) is not None:
                left.append(key)
        else:
            left.extend(e.key for e in queue.pop_expired(clock.now))
    left.extend(drain(queue))  # type: ignore[arg-type]
    assert sorted(left) == sorted(pushed)
