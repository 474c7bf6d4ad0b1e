"""Closes the SLO loop: per-tier first-token latency goes to Redis, the fleet's figures come back,
and scheduler/feedback.py adapts each tier's weight, which the engine's queue (aging rate) and
admission control (threshold) then apply.

Every replica publishes its own window under its own field, and every replica reads all fresh
fields, so tiers drifting toward their SLO anywhere in the fleet gain share everywhere. Without
Redis the controller sees no observations and the last weights stay. What Redis hands back is not
trusted: malformed, non-finite or future-dated windows are ignored and deleted, a key of another type
is deleted, and no single tick's error stops the loop.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cache.wrong_type import is_wrong_type
from cache.traffic_stats import StoreUnavailable, _redis_module, in_range
from scheduler.feedback import Adaptation, FeedbackController, TierObservation
from scheduler.tiers import TierTable


CLOCK_SKEW_S = 5.0  # replicas' clocks may differ by this much; a window dated further ahead is bad
MAX_COUNT = 10**9  # requests in one replica's window: anything above is bit rot, not traffic
MAX_P_MS = 1e9  # about 11 days: a first-token latency above is bit rot, and would overflow the mean
# The most recent first-token latencies a window keeps per tier (~32 bytes each): a window nobody takes
# (no Redis, so no loop thread; a tick stuck on a slow Redis) grew by one per request for good.
MAX_WINDOW_SAMPLES = 16384

# Delete fields only if they still hold what this replica read: their owner may have rewritten them.
_HDEL_UNCHANGED = (
    "local n = 0 for i = 1, #ARGV, 2 do "
    "if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then "
    "n = n + redis.call('HDEL', KEYS[1], ARGV[i]) end end return n"
)


def percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


class TierLatencyWindow:
    """First-token latencies of the current window, per tier (engine thread writes, loop reads); the
    most recent MAX_WINDOW_SAMPLES per tier. `enabled` False: nothing is kept (no loop takes them)."""

    def __init__(self) -> None:
        self.enabled = True
        self._samples: dict[str, deque[float]] = defaultdict(_window)
        self._lock = threading.Lock()

    def observe(self, tier: str, ttft_ms: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._samples[tier].append(ttft_ms)

    def take(self) -> dict[str, deque[float]]:
        with self._lock:
            samples, self._samples = self._samples, defaultdict(_window)
        return samples


def _window() -> deque[float]:
    return deque(maxlen=MAX_WINDOW_SAMPLES)


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
        self.ttl_s = int(20 * self.interval_s) + 60
        self.client = None
        self.errors = ()
        if redis_url:
            try:
                redis = _redis_module()
                from cache.redis_url import redis_from_url

                self.client = redis_from_url(redis_url, socket_timeout=0.25, socket_connect_timeout=0.25)
                self.errors = redis.RedisError
                self._hdel_unchanged = self.client.register_script(_HDEL_UNCHANGED)
            except StoreUnavailable as exc:
                log(f"SLO feedback off: {exc}")
        self.window.enabled = self.client is not None  # no loop thread then: nothing takes the window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0  # ticks Redis failed (down, slow): the last weights stayed
        self.tick_errors = 0  # ticks that raised anything else: logged, and the loop goes on
        self.wrong_type = 0  # keys of another type deleted
        self.fields_deleted = 0  # bad or long-stale windows deleted
        self._acted: dict[bytes, bytes] = {}  # field -> the window last acted on (each counts once)

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
                self.client.expire(self.key, self.ttl_s)
            fleet = self.client.hgetall(self.key)
        except self.errors as exc:
            if is_wrong_type(exc):
                self._delete_wrong_type(exc)
            else:
                self.failures += 1
                self.log(f"SLO feedback: Redis unavailable ({exc}); keeping the last weights")
            return ()
        read = read_fleet(fleet, now, fresh_s=2 * self.interval_s, retain_s=self.ttl_s, acted=self._acted)
        self._acted = {_as_bytes(name): _as_bytes(raw) for name, raw in fleet.items()}
        self._delete_fields(read.discard)
        observations = read.observations
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

    def _delete_wrong_type(self, exc: Exception) -> None:
        """Another type under our key (Redis answered, so not an outage): deleted, as a corrupt value."""
        self.wrong_type += 1
        self.log(json.dumps({"event": "slo_feedback_wrong_type", "key": self.key, "error": str(exc)}))
        try:
            self.client.delete(self.key)
        except self.errors as delete_exc:
            self.failures += 1
            self.log(f"SLO feedback: deleting {self.key} failed ({delete_exc})")

    def _delete_fields(self, discard: dict[bytes, bytes]) -> None:
        """Bad windows, and stale ones a live replica's writes would otherwise keep alive with the key."""
        if not discard:
            return
        try:
            deleted = self._hdel_unchanged(
                keys=[self.key], args=[item for pair in discard.items() for item in pair]
            )
        except self.errors as exc:
            self.failures += 1
            self.log(f"SLO feedback: deleting bad windows failed ({exc})")
            return
        self.fields_deleted += int(deleted)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # one bad tick must not end the loop for the process's life
                self.tick_errors += 1
                self.log(json.dumps({"event": "slo_feedback_error", "error": f"{type(exc).__name__}: {exc}"}))


@dataclass
class FleetRead:
    """The fleet's fresh windows as observations, and the fields to delete (name -> the value read)."""

    observations: dict[str, TierObservation]
    discard: dict[bytes, bytes] = field(default_factory=dict)


def _finite(value: object, limit: float) -> float | None:
    """`value` as a finite float in [0, limit], or None: JSON gives bools, strings, NaN, 1e400 (inf), and
    integers of hundreds of digits, which no float holds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if in_range(number, limit) else None


@dataclass(frozen=True)
class Window:
    """One replica's published window of one tier."""

    tier: str
    count: int
    p_ms: float
    age_s: float


def read_window(name: bytes | str, raw: bytes | str, now: float) -> Window | None:
    """A field of the hash as a window, or None when it is malformed, out of range, or dated more
    than CLOCK_SKEW_S ahead of `now` (a gone replica's future date would otherwise never go stale)."""
    try:
        tier = (name.decode() if isinstance(name, bytes) else name).split(":", 1)[1]
        sample = json.loads(raw)
    except (IndexError, ValueError, RecursionError):
        return None
    if not tier or not isinstance(sample, dict):
        return None
    count = _finite(sample.get("count"), MAX_COUNT)
    p_ms = _finite(sample.get("p_ms"), MAX_P_MS)
    ts = _finite(sample.get("ts"), math.inf)
    if count is None or count < 1 or p_ms is None or ts is None or now - ts < -CLOCK_SKEW_S:
        return None
    return Window(tier, int(count), p_ms, now - ts)


def read_fleet(
    fleet: dict, now: float, fresh_s: float, retain_s: float = math.inf, acted: dict | None = None
) -> FleetRead:
    """Per-replica windows published within `fresh_s` -> one observation per tier (count-weighted mean
    of the replicas' percentiles); older windows were already acted on, or their replica is gone.
    `acted` (field -> value) names windows a previous read acted on already: they are not observed again.
    Bad fields are to be deleted, and stale ones once older than `retain_s` (the key's TTL: what would
    have expired had no live replica renewed the key)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    discard: dict[bytes, bytes] = {}
    for name, raw in fleet.items():
        window = read_window(name, raw, now)
        if window is None or window.age_s > retain_s:
            discard[_as_bytes(name)] = _as_bytes(raw)
        elif window.age_s <= fresh_s and (acted or {}).get(_as_bytes(name)) != _as_bytes(raw):
            sums[window.tier] += window.p_ms * window.count
            counts[window.tier] += window.count
    observations = {
        tier: TierObservation(count=counts[tier], p_target_ms=sums[tier] / counts[tier]) for tier in counts
    }
    return FleetRead(observations, discard)


def aggregate(fleet: dict, now: float, fresh_s: float) -> dict[str, TierObservation]:
    """The observations of `read_fleet`: malformed, non-finite and future-dated fields are not trusted."""
    return read_fleet(fleet, now, fresh_s).observations


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
