"""Engine events and counters; the Triton adapter turns the events into Prometheus metrics."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


class EngineObserver:
    """No-op hooks; subclasses export them (see model_repository/llm_engine/metrics.py)."""

    def on_step(self, kind: str, batch: int, seconds: float) -> None: ...

    def on_first_token(self, tier: str, ttft_s: float) -> None: ...

    def on_finish(self, tier: str, status: str, tokens: int) -> None: ...

    def on_new_shape(self, kind: str, size: int) -> None: ...

    def on_load(self, queued: int, active: int, kv_tokens: int) -> None: ...

    def on_prefix(self, reused_tokens: int, prompt_tokens: int) -> None: ...

    def on_adaptation(self, tier: str, kind: str, value: float) -> None: ...

    def on_preemption(self, tier: str) -> None:
        """A running request of `tier` gave its slot to a more urgent one."""

    def on_scheduling(self, tier: str, seconds: float) -> None:
        """Scheduler overhead for one request (admission, queue, dispatch), reported when it starts."""

    def on_cache_counters(self, counters: dict[tuple[str, str], float]) -> None:
        """Cumulative per-tier cache counters ((tier, counter) -> value), about once a second."""

    def on_cache_gauges(self, gauges: dict[tuple[str, str], float]) -> None:
        """Per-tier cache state now ((tier, gauge) -> value), with the counters."""


class GuardedObserver(EngineObserver):
    """Forwards every hook to `inner`, and keeps what it raises from the engine: a metric that fails to
    update (a message to the server that failed) had failed every running request as a broken step, an
    exact-cache answer already sent, and, raised again while the loop failed those requests, ended the
    engine thread, so that every later request waited forever. Each failure is counted, and logged once
    per hook."""

    def __init__(self, inner: EngineObserver, log: Callable[[str], None]):
        self.inner = inner
        self.log = log
        self.failures = 0
        self._logged: set[str] = set()
        self._guards: dict[
            str, Callable[..., None]
        ] = {}  # one wrapper per hook: the engine calls them per step

    def __getattribute__(self, name: str):
        if not name.startswith("on_"):
            return object.__getattribute__(self, name)
        guards = object.__getattribute__(self, "_guards")
        if (guarded := guards.get(name)) is None:
            hook = getattr(object.__getattribute__(self, "inner"), name)

            def guarded(*args: object) -> None:
                try:
                    hook(*args)
                except Exception as exc:
                    self._failed(name, exc)

            guards[name] = guarded
        return guarded

    def __getattr__(self, name: str):  # what the inner observer keeps besides hooks (tests read it)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def report(self, source: str, exc: Exception) -> None:
        """A failure met while gathering what the hooks get (a tier's counters): counted and logged alike."""
        self._failed(source, exc)

    def _failed(self, hook: str, exc: Exception) -> None:
        self.failures += 1
        if hook not in self._logged:
            self._logged.add(hook)
            self.log(
                json.dumps({"event": "observer_error", "hook": hook, "error": f"{type(exc).__name__}: {exc}"})
            )


@dataclass
class EngineStats:
    """Counters the engine keeps itself, so tests and the warmup report need no metrics server."""

    prefill_steps: int = 0
    decode_steps: int = 0
    multi_request_decode_steps: int = 0
    max_decode_batch: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    new_shapes_after_ready: int = 0
    prompt_tokens: int = 0
    prefix_reused_tokens: int = 0
    preemptions: int = 0
    resumes: int = 0
    step_failures: int = 0  # steps that raised: their running requests failed, the loop went on
    shapes_seen: set[tuple[str, int]] = field(default_factory=set)
    # the engine loop, the execute thread (exact hits) and lookup threads (semantic hits) all finish requests
    _finish_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_finish(self, status: str) -> None:
        with self._finish_lock:
            self.finished[status] = self.finished.get(status, 0) + 1
