"""Whether this replica is draining before a stop: new requests are refused, those in flight finish.

Stopping tritonserver with streams in flight cuts them off (during its shutdown wait a stream gets
nothing more; after the exit timeout the client sees "Stream removed"). So whoever stops a replica
first creates a marker file (the launcher's `Stack.stop`, or a Kubernetes preStop hook), waits until the
engine is idle, and only then sends SIGTERM. The scheduler step looks for the marker at most every
`interval_s`: a stat per request would be cheap too, but not free on a slow network filesystem.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.errors import RequestError


@dataclass
class DrainSwitch:
    path: str
    interval_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    exists: Callable[[str], bool] = os.path.exists
    _checked_at: float = field(default=-math.inf, init=False)
    _draining: bool = field(default=False, init=False)

    def draining(self) -> bool:
        now = self.clock()
        if now - self._checked_at >= self.interval_s:
            self._checked_at = now
            self._draining = self.exists(self.path)
        return self._draining

    def admit(self) -> None:
        """Raise UNAVAILABLE (retry elsewhere) while the marker exists."""
        if self.draining():
            raise RequestError.unavailable("this replica is draining before a stop; retry on another replica")
