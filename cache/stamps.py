"""A bounded table of when each key was last seen or acted on.

Caches keep such marks per key ("Redis held this block at t", "this entry's renewal was queued at t") to
skip a round trip. The key space is unbounded, so the table is not: past `limit` the stalest marks go,
and a key without a mark is only acted on again (one more write or renewal), never wrongly skipped.
Not locked: its owners already hold a lock around it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Stamps(Generic[K]):
    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"limit must be >= 0 (0: remember nothing), got {limit}")
        self.limit = limit
        self._when: OrderedDict[K, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._when)

    def keys(self) -> list[K]:
        """The marked keys, stalest first (a copy)."""
        return list(self._when)

    def get(self, key: K, default: float) -> float:
        return self._when.get(key, default)

    def stale(self, keys: Sequence[K], before: float) -> list[int]:
        """Positions of the keys not marked after `before` (never marked, forgotten, or marked then)."""
        when = self._when.get
        return [i for i, key in enumerate(keys) if when(key, before) <= before]

    def stamp(self, keys: Iterable[K], now: float) -> None:
        """`keys` marked `now`, most recent last; past `limit` the oldest marks go."""
        for key in keys:
            self._when[key] = now
            self._when.move_to_end(key)
        while len(self._when) > self.limit:
            self._when.popitem(last=False)

    def pop(self, key: K) -> None:
        self._when.pop(key, None)

    def due(self, keys: Sequence[K], now: float, every_s: float) -> list[K]:
        """The keys not marked within the last `every_s`, now marked: what a throttle lets through."""
        out = [keys[i] for i in self.stale(keys, now - every_s)]
        self.stamp(out, now)
        return out
