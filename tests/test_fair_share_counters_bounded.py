"""SloQueue keeps a fair-share counter per (tier, tenant); one-off tenants must not grow it for good.

The bound is scheduler.slo_queue.IDLE_COUNTERS (set small here; absent before the fix: then no bound).
(found in review, 2026-12-07)"""

from __future__ import annotations

import pytest

import scheduler.slo_queue as slo_queue
from scheduler.slo_queue import SloQueue
from scheduler.tenant_auth import TenantAuth
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401

LIMIT = 32


@pytest.fixture(autouse=True)
def small_bound(monkeypatch):
    monkeypatch.setattr(slo_queue, "IDLE_COUNTERS", LIMIT, raising=False)


def test_one_off_tenants_served_one_at_a_time_leave_a_bounded_table():
    queue: SloQueue[str] = SloQueue()
    for i in range(500):
        queue.push(f"r{i}", 3, i, key=f"r{i}", tenant=f"tenant-{i}", cost=10)
        assert queue.pop() == f"r{i}"
    assert len(queue._counters) <= LIMIT, len(queue._counters)


def test_a_recent_idle_tenants_debt_is_still_kept():
    """What the counters are for stays: a tenant that was served and went idle comes back behind one
    that was not (within the bound)."""
    queue: SloQueue[str] = SloQueue()
    for i in range(5):
        queue.push(f"heavy{i}", 3, i, key=f"heavy{i}", tenant="heavy", cost=100)
        queue.pop()
    queue.push("l", 3, 10, key="l", tenant="light", cost=1)
    queue.push("h", 3, 11, key="h", tenant="heavy", cost=1)
    assert queue.counter(3, "heavy") > queue.counter(3, "light")
    assert queue.pop() == "l"


def test_engine_unique_tenants_do_not_grow_the_queue_tables(model):  # noqa: F811
    engine = make_engine(model, slots=2)
    engine.tenant_auth = TenantAuth(trust_client=True)  # tenants as named (LLM_TENANT_TRUST_CLIENT)
    for i in range(200):
        sink = RecordingSink()
        engine.submit(request([1, 5, 7], sink, rid=f"id-{i}", max_tokens=1, tenant=f"user-{i}"))
        while engine.step():
            pass
        assert sink.windows and sink.windows[-1][2]
    queue = engine.policy_queue.queue
    assert len(queue) == 0
    assert len(queue._counters) <= LIMIT, f"{len(queue._counters)} counters for 200 one-off tenants"
