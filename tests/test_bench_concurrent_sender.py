"""bench.prefix_cache.ConcurrentSender against fake clients: the closed loop that (b) under load relies on
(every prompt sent once, its own tenant, exactly C in flight, one request at a time per client)."""

from __future__ import annotations

import threading
import time

from bench.prefix_cache import THROUGHPUT_MAX_TOKENS, ConcurrentSender

REQUEST_S = 0.01


class Gauge:
    """Requests in flight across the fake clients, and the most seen at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0


class FakeProbe:
    """Stands in for TtftProbe: records what it was sent and whether two of its requests overlapped."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.sent: list[tuple[str, str | None, str | None]] = []
        self.busy = False
        self.overlapped = False
        self.closed = False

    def request(self, prompt: str, max_tokens: int, tenant: str | None = None, cache: str | None = None):
        assert max_tokens == THROUGHPUT_MAX_TOKENS
        with self.gauge.lock:
            self.overlapped |= self.busy
            self.busy = True
            self.gauge.now += 1
            self.gauge.peak = max(self.gauge.peak, self.gauge.now)
        time.sleep(REQUEST_S)
        with self.gauge.lock:
            self.gauge.now -= 1
            self.busy = False
            self.sent.append((prompt, tenant, cache))

    def close(self) -> None:
        self.closed = True


def test_closed_loop_sends_each_prompt_once_with_c_in_flight() -> None:
    gauge = Gauge()
    probes = [FakeProbe(gauge) for _ in range(4)]
    sender = ConcurrentSender(probes)  # type: ignore[arg-type]
    texts = [f"prompt {i}" for i in range(16)]
    rates = [sender.requests_per_s(texts, "kv-only"), sender.requests_per_s(texts, "bypass")]
    sender.close()
    sent = [s for p in probes for s in p.sent]
    for cache in ("kv-only", "bypass"):
        assert sorted(t for t, _, c in sent if c == cache) == sorted(texts)
    assert len({tenant for _, tenant, _ in sent}) == 2 * len(texts)  # every request its own tenant: 0% hits
    assert gauge.peak == len(probes)
    assert not any(p.overlapped for p in probes)  # one request at a time per client (one stream each)
    assert all(p.closed for p in probes)
    assert all(0 < rate <= len(probes) / REQUEST_S for rate in rates)
