"""Closes the SLO loop: per-tier first-token latency goes to Redis, the fleet's figures come back,
and scheduler/feedback.py adapts each tier's weight, which the engine's queue (aging rate) and
admission control (threshold) then apply.

Every replica publishes its own window under its own field, and every replica reads all fresh
fields, so tiers drifting toward their SLO anywhere in the fleet gain share everywhere. Without
Redis the controller sees no observations and the last weights stay.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

from cache.traffic_stats import StoreUnavailable, _redis_module
from scheduler.feedback import Adaptation, FeedbackController, TierObservation
from scheduler.tiers import TierTable


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


class TierLatencyWindow:
    """First-token latencies of the current window, per tier (engine thread writes, loop reads)."""

    def __init__(self) -> None:
        self._samples: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def observe(self, tier: str, ttft_ms: float) -> None:
        with self._lock:
            self._samples[tier].append(ttft_ms)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            samples, self._samples = self._samples, defaultdict(list)
        return samples


class SloFeedbackLoop:
    def __init__(
        self,
        redis_url: str,
        model: str,
        tiers: TierTable,
        controller: FeedbackController,
        apply: Callable[[FeedbackController], None],
        interval_s: float = 5.0,
        log: Callable[[str], None] = print,
    ):
        self.tiers = tiers
        self.controller = controller
        self.apply = apply
        self.interval_s = interval_s
        self.log = log
        self.window = TierLatencyWindow()
        self.replica = uuid.uuid4().hex[:12]
        self.key = f"llm:slo:v1:{model}:tier_ttft"
        self.client = None
        self.errors = ()
        if redis_url:
            try:
                redis = _redis_module()
                self.client = redis.Redis.from_url(
                    redis_url, socket_timeout=0.25, socket_connect_timeout=0.25
                )
                self.errors = redis.RedisError
            except StoreUnavailable as exc:
                log(f"SLO feedback off: {exc}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def start(self) -> None:
        if self.client is None:
            return
        self._thread = threading.Thread(target=self._run, name="slo-feedback", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def tick(self, now: float | None = None) -> tuple[Adaptation, ...]:
        """Publish this replica's window, read the fleet's, adapt; returns what changed."""
        now = time.time() if now is None else now
        local = {
            tier: {"count": len(v), "p_ms": percentile(v, self._percentile(tier)), "ts": now}
            for tier, v in self.window.take().items()
            if v
        }
        try:
            if local:
                self.client.hset(
                    self.key, mapping={f"{self.replica}:{t}": json.dumps(s) for t, s in local.items()}
                )
                self.client.expire(self.key, int(20 * self.interval_s) + 60)
            fleet = self.client.hgetall(self.key)
        except self.errors as exc:
            self.failures += 1
            self.log(f"SLO feedback: Redis unavailable ({exc}); keeping the last weights")
            return ()
        observations = aggregate(fleet, now, fresh_s=2 * self.interval_s)
        self.controller.update(observations, time.time_ns())
        events = self.controller.last_events
        if events:
            self.apply(self.controller)
            for event in events:
                record = {"event": "slo_adaptation", "tier": event.tier, "kind": event.kind}
                record.update(old=round(event.old, 4), new=round(event.new, 4), reason=event.reason)
                self.log(json.dumps(record))
        return events

    def _percentile(self, tier: str) -> float:
        try:
            return self.tiers.get(tier).percentile
        except Exception:
            return 95.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()


def aggregate(fleet: dict, now: float, fresh_s: float) -> dict[str, TierObservation]:
    """Per-replica windows published within `fresh_s` -> one observation per tier (count-weighted mean
    of the replicas' percentiles); older windows were already acted on, or their replica is gone."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for field, raw in fleet.items():
        try:
            tier = (field.decode() if isinstance(field, bytes) else field).split(":", 1)[1]
            sample = json.loads(raw)
            if now - float(sample["ts"]) > fresh_s or int(sample["count"]) <= 0:
                continue
            sums[tier] += float(sample["p_ms"]) * int(sample["count"])
            counts[tier] += int(sample["count"])
        except (IndexError, ValueError, KeyError, TypeError):
            continue  # a malformed field is ignored, not trusted
    return {
        tier: TierObservation(count=counts[tier], p_target_ms=sums[tier] / counts[tier]) for tier in counts
    }
