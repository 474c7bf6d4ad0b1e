"""Scheduler edges found in review (2026-12-07): warm-up buckets past an unaligned max_len, a generated
queue key taken by a caller's."""

from __future__ import annotations


from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable
from scheduler.warmup_planner import plan_buckets


def test_plan_buckets_never_exceed_max_len_with_a_finer_ratio() -> None:
    # max_len is "always a bucket" and the limit; no warmed shape may be longer than it
    plan = plan_buckets({1: 60}, 31, [], max_ratio=1.9)
    assert plan.source == "traffic"
    assert max(plan.buckets) <= 31, plan.buckets


def test_plan_buckets_unaligned_max_len_realistic_size() -> None:
    plan = plan_buckets({153: 10, 65: 29, 72: 9, 143: 26, 168: 38}, 175, [], min_samples=1, max_ratio=1.1)
    assert max(plan.buckets) == 175, plan.buckets


def test_push_without_key_is_not_refused_by_an_explicit_key_of_another_item() -> None:
    queue: SloQueue[str] = SloQueue(TierTable.defaults(), clock=lambda: 0)
    queue.push("a", 3, 0, key=1)  # the caller's key
    queue.push("b", 3, 0)  # no key: "a fresh sequence number"; the queue has room
    assert len(queue) == 2
