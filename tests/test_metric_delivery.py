"""Metrics and logs, found in review (2026-12-07): a counter increment whose metric message failed is sent
again, the semantic cache's embed_errors is its own and not the coalescer's failed passes, and the
engine's own JSON events are found in the server log."""

from __future__ import annotations

import json
import threading

import pytest

from tests.conftest import wait_for
from tests.fake_triton_backend import install_metrics


@pytest.fixture
def fake_pb(monkeypatch):
    return install_metrics(monkeypatch)


def _series(series, name, **labels):
    return series[(name, tuple(sorted(labels.items())))]


def test_cache_counter_delta_is_not_lost_when_the_metric_message_fails(fake_pb):
    """A metric message that fails (the reason GuardedObserver exists) must not lose the increment for
    good: the next publish of the same cumulative value should export it."""
    from adapters.engine_metrics import TritonEngineObserver
    from engine.observer import GuardedObserver

    logged = []
    obs = GuardedObserver(TritonEngineObserver("llm_engine", threading.Lock()), logged.append)
    obs.on_cache_counters({("l3", "hits"): 1})  # creates the series
    hits = _series(fake_pb, "llm_engine_cache_total", model="llm_engine", tier="l3", counter="hits")
    hits.fail_next = 1
    obs.on_cache_counters({("l3", "hits"): 10})  # the message fails: counted by the guard
    assert obs.failures == 1
    obs.on_cache_counters({("l3", "hits"): 10})  # next second: the engine still reads 10
    assert hits.total == 10, f"exported {hits.total} of 10 cumulative L3 hits"
    assert logged and json.loads(logged[0])["event"] == "observer_error"


def test_prefix_tokenizer_delta_is_not_lost_when_the_metric_message_fails(fake_pb):
    from adapters.scheduler_metrics import PrefixTokenizerMetrics
    from scheduler.tokenize import PrefixTokenStats

    now = [0.0]
    metrics = PrefixTokenizerMetrics("slo_scheduler", clock=lambda: now[0])
    hits = _series(fake_pb, "llm_scheduler_prefix_tokenizer_total", model="slo_scheduler", result="hits")
    hits.fail_next = 1
    with pytest.raises(RuntimeError):
        metrics.publish(PrefixTokenStats(hits=5))
    now[0] = 2.0
    metrics.publish(PrefixTokenStats(hits=5))
    assert hits.total == 5, f"exported {hits.total} of 5 prefix-tokenizer hits"


# ---------------------------------------------------------------- semantic counters collide
class _BlockingFailingEmbedder:
    """The first pass waits until released; every pass raises (a failed MiniLM pass)."""

    dim = 384

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def embed(self, texts):
        self.entered.set()
        self.release.wait(10)
        raise RuntimeError("MiniLM forward pass failed (out of memory)")

    def fits(self, texts):
        return [True for _ in texts]


def test_semantic_embed_errors_counts_failed_lookups_not_coalescer_passes():
    """SemanticCacheStats.embed_errors ("lookups whose embedding raised") and the coalescer's `errors`
    ("passes that raised") are both exported as semantic/embed_errors: one overwrites the other."""
    from cache.embed_coalescer import CoalescingEmbedder
    from cache.semantic_cache import SemanticResponseCache

    inner = _BlockingFailingEmbedder()
    coalescer = CoalescingEmbedder(inner)
    # no Redis is contacted: the client connects lazily and nothing here reads or writes
    cache = SemanticResponseCache("redis://127.0.0.1:9/0", "fp", coalescer, verifier=None)

    def lookup_embedding(text):
        cache._guard_embedder(lambda: coalescer.embed([text]))

    first = threading.Thread(target=lookup_embedding, args=("a",))
    first.start()
    assert inner.entered.wait(10)  # pass 1 runs (blocked): the next two lookups queue behind it
    others = [threading.Thread(target=lookup_embedding, args=(t,)) for t in ("b", "c")]
    for t in others:
        t.start()
    assert wait_for(lambda: coalescer.stats.calls >= 3, 10)
    inner.release.set()
    for t in [first, *others]:
        t.join(10)
    assert cache.stats.embed_errors == 3  # three lookups missed for a failed embedding
    assert coalescer.stats.errors == 2  # in two passes
    snap = cache.snapshot()
    assert snap["embed_errors"] == cache.stats.embed_errors, (
        f"semantic/embed_errors exported as {snap['embed_errors']} (the coalescer's failed passes), "
        f"the cache counted {cache.stats.embed_errors} failed lookups"
    )


# ---------------------------------------------------------------- deploy/logs.py
def test_log_events_reads_an_event_the_engine_logged(tmp_path):
    """Engine events (cache_tier_error, engine_step_failed, observer_error, slo_adaptation) go through
    the engine's serialized_log, which prefixes "[file:line] ", and are json.dumps'd with the default
    separators. Triton quotes the message as in .run/*/tritonserver.log."""
    from adapters.stub_messages import serialized_log
    from deploy.logs import log_events
    from engine.observer import EngineObserver, GuardedObserver

    messages = []
    log = serialized_log(messages.append, threading.Lock())  # as model.py passes it to load_engine

    class Broken(EngineObserver):
        def on_load(self, queued, active, kv_tokens):
            raise RuntimeError("metric message failed")

    GuardedObserver(Broken(), log).on_load(1, 1, 1)
    assert messages, "nothing logged"
    line = f"I1207 15:52:18.593245 14704 stub_messages.py:67] {json.dumps(messages[0])}\n"
    path = tmp_path / "tritonserver.log"
    path.write_text(line)
    events = log_events(path, "observer_error")
    assert [e["hook"] for e in events] == ["on_load"], (line, events)
