"""A circuit breaker for optional remote tiers (Redis): fail fast instead of paying a timeout per request.

A cache that is down must cost nothing: after `failure_threshold` consecutive failures the breaker
opens and `allow()` answers False without touching the network, so the engine recomputes at once.
After `reset_timeout_s` it half-opens and lets one probe through; the probe's success closes it
(recovery without a restart), its failure opens it for another period.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        reset_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if reset_timeout_s < 0:
            raise ValueError(f"reset_timeout_s must be >= 0, got {reset_timeout_s}")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None  # half-open: when the one probe went out
        self.opens = 0  # times the breaker opened (closed -> open and failed probes)
        self.rejections = 0  # calls refused while open or while a probe is out
        self.failures = 0  # all failures recorded
        self.successes = 0  # all successes recorded

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._refresh()
            return self._state

    @property
    def consecutive_failures(self) -> int:
        with self._lock:
            return self._consecutive_failures

    def allow(self) -> bool:
        """Whether a call may go out now; a caller that gets True must report success or failure."""
        with self._lock:
            self._refresh()
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if self._state is BreakerState.HALF_OPEN and (
                self._probe_started is None
                # a probe whose caller never reported must not wedge the breaker half-open forever
                or now - self._probe_started >= self.reset_timeout_s
            ):
                self._probe_started = now
                return True
            self.rejections += 1
            return False

    def record_success(self) -> None:
        with self._lock:
            self.successes += 1
            if self._state is BreakerState.OPEN:
                return  # a call that started before the breaker opened says nothing about now
            self._state = BreakerState.CLOSED
            self._consecutive_failures = 0
            self._probe_started = None

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self._state is BreakerState.OPEN:
                return  # late failures of calls already in flight do not extend the open period
            self._consecutive_failures += 1
            if self._state is BreakerState.HALF_OPEN or self._consecutive_failures >= self.failure_threshold:
                self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._probe_started = None
        self.opens += 1

    def _refresh(self) -> None:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.reset_timeout_s:
            self._state = BreakerState.HALF_OPEN
            self._probe_started = None
