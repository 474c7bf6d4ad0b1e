"""The metric adapters against a fake pb_utils: a counter source that went back was reset (its increments
since are exported, not lost), and a relayed log line names who wrote it (found by a review)."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from adapters.stub_messages import serialized_log


class Recorder:
    def __init__(self, family, labels, counter):
        self.family, self.labels, self.counter, self.total = family, labels, counter, 0.0

    def increment(self, v):
        if self.counter and not v >= 0:  # Triton refuses negatives; NaN poisons a prometheus counter
            raise ValueError(f"counter increment {v}")
        self.total += v

    def set(self, v):
        self.total = v

    def observe(self, v):
        self.total += v


@pytest.fixture
def observer(monkeypatch):
    series = {}

    class FakeFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels, **_):  # noqa: N802
            m = series[(self.name, tuple(sorted(labels.items())))] = Recorder(
                self.name, labels, self.kind == "counter"
            )
            return m

    monkeypatch.setitem(
        sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=FakeFamily)
    )
    monkeypatch.delitem(sys.modules, "adapters.engine_metrics", raising=False)
    from adapters.engine_metrics import TritonEngineObserver

    return TritonEngineObserver("llm_engine", threading.Lock()), series


def total(series, name, **labels):
    labels = {"model": "llm_engine", **labels}
    return series[(name, tuple(sorted(labels.items())))].total


def test_cache_counter_increments_after_a_source_reset_are_not_lost(observer):
    obs, series = observer
    key = ("l3", "hits")
    obs.on_cache_counters({key: 100})
    obs.on_cache_counters({key: 0})  # the source was recreated (a store/directory rebuilt)
    obs.on_cache_counters({key: 40})  # 40 new hits since
    assert total(series, "llm_engine_cache_total", tier="l3", counter="hits") == 140


def test_a_log_event_line_names_its_real_caller():
    from unittest import mock

    sys.modules.setdefault("triton_python_backend_utils", types.SimpleNamespace())
    with mock.patch.dict(sys.modules, {"triton_python_backend_utils": types.SimpleNamespace(Logger=None)}):
        sys.modules.pop("adapters.triton_common", None)
        from adapters.triton_common import log_event

        lines = []
        log_event("engine_stopped", serialized_log(lines.append, threading.Lock()), stats={})
        sys.modules.pop("adapters.triton_common", None)
    assert lines[0].startswith("[test_metric_adapters.py:"), lines[0]


def test_new_shapes_after_ready_exists_at_zero_before_any_new_shape(observer):
    """A warm server never increments it; the series must still be there, reading 0 (README)."""
    obs, series = observer
    for kind in ("prefill", "decode"):
        assert total(series, "llm_engine_new_shapes_after_ready_total", kind=kind) == 0
    obs.on_new_shape("decode", 64)
    assert total(series, "llm_engine_new_shapes_after_ready_total", kind="decode") == 1
    assert total(series, "llm_engine_new_shapes_after_ready_total", kind="prefill") == 0
