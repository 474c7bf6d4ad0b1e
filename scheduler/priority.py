"""Priority and deadline assignment, and the engine's admission queue.

A decoupled engine's `execute()` returns at once, so Triton's own priority queue stays empty; precedence
is enforced here instead: lowest priority number first (Triton's convention, 1 = highest), earliest
deadline first within a priority, and arrival order on ties.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from scheduler.tiers import Tier

T = TypeVar("T")


def assign(tier: Tier, arrival_ns: int) -> tuple[int, int]:
    """(priority, deadline_ns): the tier's precedence, and when its first token is due."""
    return tier.priority, int(arrival_ns) + tier.ttft_target_ns


@dataclass(frozen=True, order=True)
class QueueEntry(Generic[T]):
    """One queued item; entries order by (priority, deadline_ns, seq), i.e. by precedence."""

    priority: int
    deadline_ns: int
    seq: int
    key: Hashable = field(compare=False)
    item: T = field(compare=False)
    expires_ns: int | None = field(default=None, compare=False)


class AdmissionQueue(Generic[T]):
    """Precedence queue with O(log n) push/pop and O(1) cancellation of queued items.

    Not thread-safe on purpose: the engine owns one and guards it with its own lock, so this stays
    a plain, deterministic container that tests can drive with a fake clock.
    """

    def __init__(self) -> None:
        self._heap: list[QueueEntry[T]] = []
        self._live: dict[Hashable, QueueEntry[T]] = {}
        self._next_seq = 0

    def push(
        self,
        item: T,
        priority: int,
        deadline_ns: int,
        *,
        key: Hashable | None = None,
        expires_ns: int | None = None,
    ) -> Hashable:
        """Queue `item`; returns its key (the given one, else a fresh sequence number) for `remove`."""
        seq = self._next_seq
        self._next_seq += 1
        key = seq if key is None else key
        if key in self._live:
            raise ValueError(f"key {key!r} is already queued; keys must be unique among queued items")
        entry = QueueEntry(int(priority), int(deadline_ns), seq, key, item, expires_ns)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        return key

    def pop(self) -> T:
        """The item with the highest precedence; IndexError when empty."""
        return self.pop_entry().item

    def pop_entry(self) -> QueueEntry[T]:
        entry = self.peek_entry()
        heapq.heappop(self._heap)
        del self._live[entry.key]
        return entry

    def peek(self) -> T:
        """The item `pop` would return, without removing it; IndexError when empty."""
        return self.peek_entry().item

    def peek_entry(self) -> QueueEntry[T]:
        self._drop_dead_top()
        if not self._heap:
            raise IndexError("peek from an empty AdmissionQueue")
        return self._heap[0]

    def remove(self, key: Hashable) -> T | None:
        """Cancel a queued item; returns it, or None if it is not queued (already popped or unknown)."""
        entry = self._live.pop(key, None)
        if entry is None:
            return None
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)
        return entry.item

    def pop_expired(self, now_ns: int) -> list[QueueEntry[T]]:
        """Remove and return entries whose `expires_ns` has passed (queued too long to be worth running)."""
        expired = [e for e in self._live.values() if e.expires_ns is not None and e.expires_ns <= now_ns]
        for entry in expired:
            self.remove(entry.key)
        return sorted(expired)

    def entries(self) -> Iterator[QueueEntry[T]]:
        """Queued entries in pop order (a sorted snapshot; O(n log n))."""
        return iter(sorted(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0].key) is not heap[0]:
            heapq.heappop(heap)
