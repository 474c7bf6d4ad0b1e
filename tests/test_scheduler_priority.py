"""Admission queue ordering on a deterministic clock: tiers first, EDF within a tier, FIFO on ties."""

from __future__ import annotations

import random

import pytest

from scheduler.priority import assign
from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()


def plain_queue() -> SloQueue:
    """The engine's queue with aging and fair share off: strict precedence, EDF, FIFO on ties."""
    return SloQueue(TIERS, aging_ns=0, fair_share=False)


def drain(queue: SloQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_assign_priority_and_deadline() -> None:
    assert assign(TIERS.get("critical"), 1_000) == (1, 1_000 + 120_000_000)
    assert assign(TIERS.get("batch"), 0) == (4, 5_000_000_000)


def test_order_across_tiers() -> None:
    queue: SloQueue[str] = plain_queue()
    now = 0
    for name in ("batch", "standard", "warmup", "critical"):
        now += 1_000_000  # later arrivals, but higher precedence
        queue.push(name, *assign(TIERS.get(name), now))
    assert drain(queue) == ["critical", "warmup", "standard", "batch"]


def test_precedence_beats_earlier_deadline() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("low-urgent", priority=4, deadline_ns=1)
    queue.push("high-relaxed", priority=1, deadline_ns=10**12)
    assert drain(queue) == ["high-relaxed", "low-urgent"]


def test_edf_within_tier() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("late", 3, 300)
    queue.push("early", 3, 100)
    queue.push("middle", 3, 200)
    assert queue.peek() == "early"
    assert drain(queue) == ["early", "middle", "late"]


def test_fifo_on_ties() -> None:
    queue: SloQueue[str] = plain_queue()
    for i in range(20):
        queue.push(f"r{i}", 2, 500)
    assert drain(queue) == [f"r{i}" for i in range(20)]


def test_remove_queued_item() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("a", 1, 1, key="req-a")
    key_b = queue.push("b", 1, 2)
    queue.push("c", 1, 3, key="req-c")
    assert "req-a" in queue and len(queue) == 3
    assert queue.remove("req-a") == "a"
    assert queue.remove("req-a") is None  # second cancel is a no-op
    assert queue.remove("unknown") is None
    assert len(queue) == 2 and "req-a" not in queue
    assert queue.peek() == "b"
    assert queue.remove(key_b) == "b"
    assert drain(queue) == ["c"]
    assert not queue


def test_key_reuse_after_removal() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("old", 1, 1, key="k")
    queue.remove("k")
    queue.push("new", 2, 2, key="k")
    assert drain(queue) == ["new"]


def test_duplicate_key_rejected() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("a", 1, 1, key="k")
    with pytest.raises(ValueError, match="already queued"):
        queue.push("b", 1, 1, key="k")


def test_empty_queue_raises() -> None:
    queue: SloQueue[str] = plain_queue()
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(IndexError):
        queue.peek()


def test_pop_expired() -> None:
    queue: SloQueue[str] = plain_queue()
    queue.push("a", 1, 10, expires_ns=100)
    queue.push("b", 4, 10, expires_ns=50)
    queue.push("c", 2, 10)
    expired = queue.pop_expired(now_ns=100)
    assert [e.item for e in expired] == ["a", "b"]
    assert drain(queue) == ["c"]


def test_matches_sorted_reference_under_random_removals() -> None:
    rng = random.Random(1234)
    queue: SloQueue[int] = plain_queue()
    reference: dict[int, tuple[int, int, int]] = {}
    for step in range(2000):
        action = rng.random()
        if action < 0.55:
            prio, deadline = rng.randint(1, 4), rng.randint(0, 50)
            key = queue.push(step, prio, deadline)
            reference[key] = (prio, deadline, step)  # type: ignore[index]
        elif action < 0.75 and reference:
            key = rng.choice(list(reference))
            assert queue.remove(key) == reference.pop(key)[2]
        elif reference:
            best = min(reference, key=lambda k: reference[k])
            assert queue.pop() == reference.pop(best)[2]
        assert len(queue) == len(reference)
    assert [e.item for e in queue.entries()] == [v[2] for v in sorted(reference.values())]
