"""Per-model traffic statistics in Redis: histograms of prompt lengths and of reserved sequence
lengths (prompt + max_tokens), and recent concurrency peaks.

Warmup plans from them at the next start (scheduler/warmup_planner.py). Every call has a short
socket timeout and raises StoreUnavailable instead of hanging: a slow or dead Redis must never
delay the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

_MAX_PEAK = (
    "local v = redis.call('HGET', KEYS[1], ARGV[1]) "
    "if (not v) or tonumber(v) < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end "
    "redis.call('EXPIRE', KEYS[1], ARGV[3]) return 1"
)
PROMPT = "prompt_lengths"
RESERVED = "reserved_lengths"  # prompt + max_tokens: the KV positions a request may reach
HISTOGRAMS = (PROMPT, RESERVED)
PEAK_WINDOW_S = 3600
PEAK_TTL_S = 14 * 24 * 3600


class StoreUnavailable(RuntimeError):
    """Redis could not be reached or answered with something unusable."""


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
        self.client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.prefix = f"llm:traffic:v1:{model}:{fingerprint}"
        self._max_peak = self.client.register_script(_MAX_PEAK)

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

    def add_lengths(self, counts: Mapping[int, int], histogram: str = PROMPT) -> None:
        if not counts:
            return
        key = self.histogram_key(histogram)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for length, count in counts.items():
                    pipe.hincrby(key, str(int(length)), int(count))
                pipe.execute()
        except self.errors as exc:
            raise StoreUnavailable(f"recording prompt lengths failed: {exc}") from exc

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
                continue
            if length > 0 and count > 0:
                out[length] = count
        return out

    def add_peak(self, timestamp: float, active: int) -> None:
        window = int(timestamp // PEAK_WINDOW_S) * PEAK_WINDOW_S
        try:
            self._max_peak(keys=[self.peaks_key], args=[window, int(active), PEAK_TTL_S])
        except self.errors as exc:
            raise StoreUnavailable(f"recording the concurrency peak failed: {exc}") from exc

    def load_peaks(self) -> list[tuple[float, float]]:
        try:
            raw = self.client.hgetall(self.peaks_key)
        except self.errors as exc:
            raise StoreUnavailable(f"reading concurrency peaks failed: {exc}") from exc
        peaks = []
        for key, value in raw.items():
            try:
                peaks.append((float(key), float(value)))
            except ValueError:
                continue
        return sorted(peaks)
