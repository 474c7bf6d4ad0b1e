"""Cumulative values read from the engine, as increments of Prometheus counters (which never decrease)."""

from __future__ import annotations

from collections.abc import Callable, Hashable


class CounterDeltas:
    """The last value seen per counter. A value below it means its source was rebuilt, which counts from
    zero again: all of it is new, not held back under the old peak. NaN is neither exported nor kept."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, float] = {}

    def send(self, key: Hashable, value: float, increment: Callable[[float], object]) -> None:
        """Give counter `key`, which now reads `value`, what it was not given yet (`increment`, not called
        for nothing). The value counts as sent once `increment` returned: a metric message that failed
        (an IPC round trip to the stub) is sent again with the next value, not lost for good."""
        seen = self._seen.get(key, 0.0)
        delta = value if value < seen else value - seen
        if not delta >= 0:  # NaN
            return
        if delta > 0:
            increment(delta)
        self._seen[key] = value
