"""Cumulative values read from the engine, as increments of Prometheus counters (which never decrease)."""

from __future__ import annotations

from collections.abc import Hashable


class CounterDeltas:
    """The last value seen per counter. A value below it means its source was rebuilt, which counts from
    zero again: all of it is new, not held back under the old peak. NaN is neither exported nor kept."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, float] = {}

    def increment(self, key: Hashable, value: float) -> float:
        """What to add to counter `key`, which now reads `value` (0: nothing)."""
        seen = self._seen.get(key, 0.0)
        delta = value if value < seen else value - seen
        if delta >= 0:
            self._seen[key] = value
        return delta if delta > 0 else 0.0
