"""The engine's metric families: README's metrics section names every cache and warmup metric the engine
exports, and no family's series collide with a histogram's own `_sum`, `_count` or `_bucket` series (the
exposition then held each twice under two TYPE lines, which scrapers reject or drop)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from tests.fake_triton_backend import install_metrics

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.fixture
def families(monkeypatch) -> dict[str, object]:
    """Every family the engine's observer registers: name -> kind."""
    install_metrics(monkeypatch)
    from adapters import engine_metrics

    found: dict[str, object] = {}

    class Recording(engine_metrics.pb_utils.MetricFamily):
        def __init__(self, name, description, kind):
            found[name] = kind
            super().__init__(name, description, kind)

    monkeypatch.setattr(engine_metrics.pb_utils, "MetricFamily", Recording)
    engine_metrics.TritonEngineObserver("llm_engine", threading.Lock())
    return found


def test_every_cache_and_warmup_metric_family_is_named_in_the_readme(families):
    ours = [n for n in families if re.search(r"warmup|cache|prefix", n)]
    assert "llm_engine_warmup_prefill_items" in ours
    missing = [n for n in ours if n not in README and n.removeprefix("llm_engine_") not in README]
    assert not missing, f"README.md does not name these exported metrics: {missing}"


def test_no_family_repeats_a_histograms_own_series(families, monkeypatch):
    from adapters import engine_metrics

    histogram = engine_metrics.pb_utils.MetricFamily.HISTOGRAM
    histograms = [name for name, kind in families.items() if kind == histogram]
    assert histograms, "the engine exports TTFT histograms"
    taken = {f"{name}{suffix}" for name in histograms for suffix in ("_sum", "_count", "_bucket")}
    assert not taken & set(families), "a family named like a histogram's series"
