"""Collects prompt and reserved lengths and concurrency peaks on the request path; a background thread ships
them to the TrafficStatsStore, so Redis latency or outages never touch a request."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

from cache.traffic_stats import HISTOGRAMS, PROMPT, RESERVED, StoreUnavailable, TrafficStatsStore


def _empty_histograms() -> dict[str, Counter[int]]:
    return {name: Counter() for name in HISTOGRAMS}


class TrafficRecorder:
    def __init__(
        self,
        store: TrafficStatsStore | None,
        flush_interval_s: float = 5.0,
        on_error: Callable[[str], None] = lambda message: None,
    ):
        self.store = store
        self.flush_interval_s = flush_interval_s
        self.on_error = on_error
        self._lengths = _empty_histograms()
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flush_failures = 0

    def observe_request(self, prompt_len: int, reserved_len: int) -> None:
        with self._lock:
            self._lengths[PROMPT][prompt_len] += 1
            self._lengths[RESERVED][reserved_len] += 1

    def observe_active(self, active: int) -> None:
        if active > self._peak:
            with self._lock:
                self._peak = max(self._peak, active)

    def start(self) -> None:
        if self.store is None:
            return
        self._thread = threading.Thread(target=self._run, name="traffic-recorder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()

    def flush(self) -> bool:
        """Ship what was collected; keep for the next try only what Redis did not take (bounded by
        distinct lengths): a count it refused is sent again, one it took is not (unless the connection
        failed mid-flush: then which took is unknown, and all are kept)."""
        if self.store is None:
            return False
        with self._lock:
            lengths, peak = self._lengths, self._peak
            self._lengths, self._peak = _empty_histograms(), 0
        unsent: dict[str, Mapping[int, int]] = dict(lengths)
        problems: list[str] = []
        try:
            for histogram, counts in lengths.items():
                write = self.store.add_lengths(counts, histogram)
                unsent[histogram] = write.unsent
                problems.extend(write.errors)
            if peak:
                self.store.add_peak(time.time(), peak)
                peak = 0
        except StoreUnavailable as exc:
            problems.append(str(exc))
        if not problems:
            return True
        self.flush_failures += 1
        with self._lock:
            for histogram, counts in unsent.items():
                self._lengths[histogram].update(counts)
            self._peak = max(self._peak, peak)
        self.on_error("; ".join(problems))
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()
