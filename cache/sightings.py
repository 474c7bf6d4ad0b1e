"""A doorkeeper: tells a key's second sighting from its first, in bounded memory, fairly between owners.

Caches that admit an entry only when it comes back (L1 blocks written to Redis on reuse, exact
responses written on a prompt's second sighting) keep one-off traffic, most traffic at a low hit
rate, from costing a copy and a Redis write. Forgetting a sighting only delays an admission by one
more sighting.

Sightings belong to an owner (a tenant). When the table is full, the owner holding the most forgets
its least recent one; among owners holding equally many, the one whose sightings changed least
recently (a sighting or a forgetting), so the largest holders take turns. A tenant that
floods the table with one-off prompts then forgets its own sightings once it holds the largest
share, and never pushes out another tenant's below that share: with one shared LRU it pushed out
everyone's, and their second sightings stopped being admitted. With one owner it is a plain LRU.
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
        self._owned: dict[str, OrderedDict[K, None]] = {}  # owner -> its sightings, least recent first
        # how many sightings -> the owners holding that many, least recently active first
        self._holding: dict[int, OrderedDict[str, None]] = {}
        self._most = 0  # the largest count any owner holds
        self._size = 0

    def seen_before(self, key: K, owner: str = "") -> bool:
        """Whether `owner` sighted `key` before (and did not forget it since); notes this sighting."""
        return self.seen_many([key], owner)[0]

    def seen_many(self, keys: Sequence[K], owner: str = "") -> list[bool]:
        """`seen_before` of distinct keys at once (a store's new blocks: one call instead of one per
        block, on the engine thread); a key sighted before the batch counts even if the batch's own
        keys would push it out one at a time."""
        known = self._owned.get(owner)
        seen = [False] * len(keys) if known is None else [key in known for key in keys]
        self._note(keys, owner)
        return seen

    def note(self, key: K, owner: str = "") -> None:
        self._note([key], owner)

    def owners(self) -> dict[str, int]:
        """How many sightings each owner holds (for tests and a status page)."""
        return {owner: len(keys) for owner, keys in self._owned.items()}

    def clear(self) -> None:
        self._owned.clear()
        self._holding.clear()
        self._most = self._size = 0

    def contains(self, key: K, owner: str = "") -> bool:
        known = self._owned.get(owner)
        return known is not None and key in known

    def __contains__(self, key: object) -> bool:
        """`key` among the default owner's sightings (a cache with one owner)."""
        return self.contains(key)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._size

    def _note(self, keys: Sequence[K], owner: str) -> None:
        known = self._owned.get(owner)
        if known is None:
            known = self._owned[owner] = OrderedDict()
        before = len(known)
        for key in keys:
            known[key] = None
            known.move_to_end(key)
        self._size += len(known) - before
        self._regroup(owner, before, len(known))
        while self._size > self.limit:
            self._forget_one()

    def _regroup(self, owner: str, before: int, after: int) -> None:
        """Moves `owner` from the group of owners holding `before` to the end of that holding `after`;
        an owner holding none is dropped."""
        if before:
            group = self._holding[before]
            del group[owner]
            if not group:
                del self._holding[before]
        if after:
            self._holding.setdefault(after, OrderedDict())[owner] = None
            self._most = max(self._most, after)
        else:
            del self._owned[owner]
        while self._most and self._most not in self._holding:
            self._most -= 1

    def _forget_one(self) -> None:
        owner = next(iter(self._holding[self._most]))
        known = self._owned[owner]
        known.popitem(last=False)
        self._size -= 1
        self._regroup(owner, len(known) + 1, len(known))
