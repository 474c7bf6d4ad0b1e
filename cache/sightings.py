"""A doorkeeper: tells a key's second sighting from its first, in bounded memory.

Caches that admit an entry only when it comes back (L1 blocks written to Redis on reuse, exact
responses written on a prompt's second sighting) keep one-off traffic, most traffic at a low hit
rate, from costing a copy and a Redis write. Forgetting the oldest sightings only delays an
admission by one more sighting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Sightings(Generic[K]):
    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        self.limit = limit
        self._keys: OrderedDict[K, None] = OrderedDict()

    def seen_before(self, key: K) -> bool:
        """Whether `key` was sighted before (and not forgotten since); notes this sighting either way."""
        seen = key in self._keys
        self.note(key)
        return seen

    def seen_many(self, keys: Sequence[K]) -> list[bool]:
        """`seen_before` of distinct keys at once (a store's new blocks: one call instead of one per
        block, on the engine thread)."""
        known = self._keys
        seen = [key in known for key in keys]
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        while len(known) > self.limit:
            known.popitem(last=False)
        return seen

    def note(self, key: K) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
