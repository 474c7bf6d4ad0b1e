"""The metric adapters against a fake pb_utils: a counter source that went back was reset (its increments
since are exported, not lost), and a relayed log line names who wrote it (found by a review)."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from tests.fake_triton_backend import install_metrics

from adapters.stub_messages import serialized_log


@pytest.fixture
def observer(monkeypatch):
    series = install_metrics(monkeypatch)
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


def test_every_warmup_failure_stage_the_engine_reports_is_exported_at_zero() -> None:
    """Found in review: `l3_prefetch` failures were counted but their series was not made at 0 with the
    others, so rate() missed a first failure. Every stage named in the engine's failure records is
    in WARMUP_FAILURE_STAGES (the part before ':', as `record_warmup` labels it)."""
    import re
    from pathlib import Path

    from adapters.engine_metrics import WARMUP_FAILURE_STAGES

    engine_dir = Path(__file__).resolve().parents[1] / "engine"
    named = {
        stage.split(":")[0]
        for path in engine_dir.glob("*.py")
        for stage in re.findall(r'"stage": "([a-z_0-9:]+)"', path.read_text(encoding="utf-8"))
    }
    assert named and not named - set(WARMUP_FAILURE_STAGES), named - set(WARMUP_FAILURE_STAGES)
