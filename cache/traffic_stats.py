"""Per-model traffic statistics in Redis: histograms of prompt lengths and of reserved sequence
lengths (prompt + max_tokens), and recent concurrency peaks.

Warmup plans from them at the next start (scheduler/warmup_planner.py). Every call has a short
socket timeout and raises StoreUnavailable instead of hanging: a slow or dead Redis must never
delay the engine. What Redis hands back is not trusted: a value read that is no finite number in
range is skipped and counted, a key of another type is deleted, and a field HINCRBY refuses is reset.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cache.wrong_type import holds_another_type

# A stored peak that is not a number (or NaN, inf) is replaced, not compared with: Lua would raise.
_MAX_PEAK = (
    "local v = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) "
    "if (not v) or v ~= v or v == math.huge or v < tonumber(ARGV[2]) then "
    "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end "
    "redis.call('EXPIRE', KEYS[1], ARGV[3]) return 1"
)
PROMPT = "prompt_lengths"
RESERVED = "reserved_lengths"  # prompt + max_tokens: the KV positions a request may reach
HISTOGRAMS = (PROMPT, RESERVED)
PEAK_WINDOW_S = 3600
PEAK_TTL_S = 14 * 24 * 3600
MAX_LENGTH = 10**9  # tokens: beyond any model's context; a larger length field is bit rot
MAX_COUNT = 10**15  # requests of one length: 3 million a second for ten years; larger would overflow plans
MAX_PEAK_ACTIVE = 10**6  # concurrent requests on one replica


class StoreUnavailable(RuntimeError):
    """Redis could not be reached or answered with something unusable."""


@dataclass
class LengthsWrite:
    """What one histogram write left undone: counts Redis refused (to send again) and why."""

    unsent: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _bad_field(exc: BaseException) -> bool:
    """HINCRBY refused the field's value: not an integer, or one that the increment would overflow."""
    text = str(exc)
    return "not an integer" in text or "overflow" in text


def in_range(value: float, limit: float) -> bool:
    """A finite number in [0, limit]: what a count, length or time read back from Redis must be."""
    return math.isfinite(value) and 0 <= value <= limit


def model_fingerprint(model_dir: str | Path, max_len: int) -> str:
    """Stable across processes and machines: the checkpoint's config plus the sequence limit."""
    config = (Path(model_dir) / "config.json").read_bytes()
    return hashlib.sha256(config + f"|max_len={max_len}".encode()).hexdigest()[:16]


def _redis_module():
    """redis-py, imported on use: an engine without it still serves, it only loses traffic plans."""
    try:
        import redis
    except ImportError as exc:
        raise StoreUnavailable(
            "redis-py is not installed in this Python environment (pip install redis)"
        ) from exc
    return redis


class TrafficStatsStore:
    def __init__(self, redis_url: str, model: str, fingerprint: str, timeout_s: float = 0.25):
        redis = _redis_module()
        self.errors = redis.RedisError
        from cache.redis_url import redis_from_url

        self.client = redis_from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = f"llm:traffic:v1:{model}:{fingerprint}"
        self._max_peak = self.client.register_script(_MAX_PEAK)
        self.malformed = 0  # values read and skipped: not numbers, not finite, negative or absurdly large
        self.repairs = 0  # keys of another type deleted, and fields HINCRBY refused reset

    @property
    def lengths_key(self) -> str:
        return self.histogram_key(PROMPT)

    def histogram_key(self, histogram: str) -> str:
        if histogram not in HISTOGRAMS:
            raise ValueError(f"unknown length histogram {histogram!r}; known: {', '.join(HISTOGRAMS)}")
        return f"{self.prefix}:{histogram}"

    @property
    def peaks_key(self) -> str:
        return f"{self.prefix}:peak_active"

    def add_lengths(self, counts: Mapping[int, int], histogram: str = PROMPT) -> LengthsWrite:
        """Add `counts`; the pipeline is no transaction, so each HINCRBY's reply says whether its count
        took. Those refused come back to be sent again, after the cause is repaired: a key of another
        type is deleted, a field that is no integer is reset. Raises StoreUnavailable when Redis failed
        as a whole (then which counts took is unknown)."""
        write = LengthsWrite()
        if not counts:
            return write
        key = self.histogram_key(histogram)
        items = [(int(length), int(count)) for length, count in counts.items()]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for length, count in items:
                    pipe.hincrby(key, str(length), count)
                replies = pipe.execute(raise_on_error=False)
        except self.errors as exc:
            raise StoreUnavailable(f"recording prompt lengths failed: {exc}") from exc
        refused = {
            length: reply for (length, _), reply in zip(items, replies) if isinstance(reply, Exception)
        }
        if not refused:
            return write
        write.unsent = {length: count for length, count in items if length in refused}
        first = next(iter(refused.values()))
        write.errors.append(f"{key}: Redis refused {len(refused)} of {len(items)} counts ({first})")
        if any(holds_another_type(reply) for reply in refused.values()):
            write.errors.append(self._repair(key, "deleted the key of another type", self.client.delete))
        else:
            bad = [str(length) for length, reply in refused.items() if _bad_field(reply)]
            if bad:
                write.errors.append(self._repair(key, f"reset {len(bad)} bad fields", self.client.hdel, *bad))
        return write

    def _repair(self, key: str, what: str, command: Callable[..., object], *args: str) -> str:
        """Run `command(key, *args)` to remove a bad value; counted when it took. Returns what happened."""
        try:
            command(key, *args)
        except self.errors as exc:
            return f"{key}: repair failed ({exc})"
        self.repairs += 1
        return f"{key}: {what}"

    def load_lengths(self, histogram: str = PROMPT) -> dict[int, int]:
        """The histogram {length: count}; malformed fields are skipped, not trusted."""
        try:
            raw = self.client.hgetall(self.histogram_key(histogram))
        except self.errors as exc:
            raise StoreUnavailable(f"reading prompt lengths failed: {exc}") from exc
        out: dict[int, int] = {}
        for key, value in raw.items():
            try:
                length, count = int(key), int(value)
            except ValueError:
                self.malformed += 1
                continue
            if not (0 < length <= MAX_LENGTH and 0 <= count <= MAX_COUNT):
                self.malformed += 1
            elif count:
                out[length] = count
        return out

    def add_peak(self, timestamp: float, active: int) -> None:
        window = int(timestamp // PEAK_WINDOW_S) * PEAK_WINDOW_S
        try:
            self._max_peak(keys=[self.peaks_key], args=[window, int(active), PEAK_TTL_S])
        except self.errors as exc:
            message = f"recording the concurrency peak failed: {exc}"
            if holds_another_type(exc):  # another type under the key: deleted, the next flush writes a hash
                message += "; " + self._repair(
                    self.peaks_key, "deleted the key of another type", self.client.delete
                )
            raise StoreUnavailable(message) from exc

    def load_peaks(self) -> list[tuple[float, float]]:
        """(window start, peak) pairs; malformed, non-finite, negative or absurd ones are skipped."""
        try:
            raw = self.client.hgetall(self.peaks_key)
        except self.errors as exc:
            raise StoreUnavailable(f"reading concurrency peaks failed: {exc}") from exc
        peaks = []
        for key, value in raw.items():
            try:
                stamp, peak = float(key), float(value)
            except ValueError:
                stamp = peak = math.nan
            if in_range(stamp, math.inf) and in_range(peak, MAX_PEAK_ACTIVE):
                peaks.append((stamp, peak))
            else:
                self.malformed += 1
        return sorted(peaks)
