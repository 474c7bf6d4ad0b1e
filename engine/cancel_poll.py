"""How often to ask Triton whether a request was cancelled.

`request.is_cancelled()` is an IPC round trip from the Python backend's stub to the server: ~200 us
measured on the CPU VM. Asked for every active request on every decode step (the engine) and for every
streamed response (the detokenizer), it cost more per token than the tiny model's own step. Asking
each request at most once per `interval_s` bounds the cost and delays noticing a cancel by at most that
long; the first ask waits one interval too, so a request's first token never pays for one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

CANCEL_POLL_S = 0.05
# The engine's own ask: in the ensemble, Triton 24.10 never marks an in-flight step's request as
# cancelled (engine/cancel_mailbox.py), so a cancel reaches the engine through the detokenizer's
# mailbox within CANCEL_POLL_S; the engine's ask only serves clients that call llm_engine directly.
ENGINE_CANCEL_POLL_S = 0.25


class PollSchedule:
    """Per key: whether an ask is due now. Bounded: the least recently seen keys are dropped (a
    dropped key simply starts a new interval)."""

    def __init__(
        self,
        interval_s: float = CANCEL_POLL_S,
        limit: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_s, self.limit, self.clock = interval_s, limit, clock
        self._next: OrderedDict[Hashable, float] = OrderedDict()

    def due(self, key: Hashable) -> bool:
        now = self.clock()
        next_at = self._next.get(key)
        if next_at is None:
            self._next[key] = now + self.interval_s
            while len(self._next) > self.limit:
                self._next.popitem(last=False)
            return False
        self._next.move_to_end(key)
        if now < next_at:
            return False
        self._next[key] = now + self.interval_s
        return True

    def forget(self, key: Hashable) -> None:
        self._next.pop(key, None)


class ThrottledCancelCheck:
    """One request's `is_cancelled`, asked at most once per interval (its first interval included)."""

    def __init__(self, ask: Callable[[], bool], schedule: PollSchedule, key: Hashable):
        self.ask, self.schedule, self.key = ask, schedule, key
        self.schedule.due(key)  # starts the first interval

    def __call__(self) -> bool:
        return self.schedule.due(self.key) and self.ask()
