"""The engine process's metric, log and cancellation messages to the server go one at a time (the Python
backend crashed the server under concurrent metric messages from one stub; adapters/stub_messages.py).
The Triton API is replaced by a recorder that notices two messages in flight at once."""

from __future__ import annotations

import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from adapters.stub_messages import SerializedMetric, serialized, serialized_log


class InFlight:
    """Counts messages and how often one began while another was in flight (an IPC round trip's
    duration is stood in for by a short pause, which widens the window for an overlap)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._inside = 0
        self.messages = 0
        self.overlaps = 0

    def send(self, *_args) -> bool:
        with self._guard:
            self._inside += 1
            self.overlaps += self._inside > 1
        time.sleep(0.0002)
        with self._guard:
            self._inside -= 1
            self.messages += 1
        return False


class FakeMetric:
    def __init__(self, wire: InFlight, **_create) -> None:
        self.increment = self.set = self.observe = wire.send


def hammer(calls, threads: int = 4, rounds: int = 40) -> None:
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(lambda c=c: [c() for _ in range(rounds)]) for c in calls]:
            future.result()


def test_the_recorder_sees_unserialized_messages_overlap() -> None:
    """The check below can fail: without the lock, the same calls overlap."""
    wire = InFlight()
    hammer([lambda: wire.send(1.0)] * 4)
    assert wire.overlaps > 0


def test_serialized_metrics_logs_and_cancel_checks_never_overlap() -> None:
    wire, lock = InFlight(), threading.Lock()
    metric = SerializedMetric(FakeMetric(wire), lock)
    log = serialized_log(wire.send, lock)
    is_cancelled = serialized(lambda: wire.send() or False, lock)
    hammer([lambda: metric.increment(1.0), lambda: metric.set(2.0), lambda: metric.observe(0.1),
            lambda: log("line"), is_cancelled])  # fmt: skip
    assert wire.messages == 5 * 40 and wire.overlaps == 0
    assert serialized(lambda x: x + 1, lock)(1) == 2  # the wrapped call's result comes back


def test_a_serialized_log_line_names_its_caller() -> None:
    lines: list[str] = []
    serialized_log(lines.append, threading.Lock())("L3 KV cache off")
    assert lines == [f"[test_stub_messages.py:{sys._getframe().f_lineno - 1}] L3 KV cache off"]


@pytest.fixture
def observer_with_fake_backend(monkeypatch):
    """TritonEngineObserver on a stand-in `triton_python_backend_utils` whose metrics report overlaps."""
    wire = InFlight()
    created: list[dict] = []

    class FakeFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind) -> None:
            self.name = name

        def Metric(self, **create):  # noqa: N802 (the backend's name)
            created.append({"family": self.name, **create})
            return FakeMetric(wire)

    monkeypatch.setitem(
        sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=FakeFamily)
    )
    monkeypatch.delitem(sys.modules, "adapters.engine_metrics", raising=False)
    from adapters.engine_metrics import TritonEngineObserver

    return TritonEngineObserver("llm_engine", threading.Lock()), wire, created


def test_engine_observer_sends_one_metric_message_at_a_time(observer_with_fake_backend) -> None:
    observer, wire, created = observer_with_fake_backend
    before = wire.messages
    hammer([
        lambda: observer.on_step("decode", 3, 0.01),        # the engine loop
        lambda: observer.on_first_token("critical", 0.02),  # Triton's execute thread (cache hits)
        lambda: observer.on_finish("standard", "cached", 4),
        lambda: observer.on_adaptation("batch", "weight", 0.5),  # the feedback thread
        lambda: observer.on_cache_counters({("exact", "hits"): time.monotonic()}),
    ])  # fmt: skip
    assert wire.messages - before > 5 * 40 and wire.overlaps == 0
    series = [(c["family"], tuple(sorted(c["labels"].items()))) for c in created]
    assert len(series) == len(set(series))  # a label set is created once, even when threads race to it
