"""The lookup pool's `on_change` publishes the engine's load from two threads at once (the submitting one
and a lookup thread); the last load an idle engine reports must be its current one, or a drain watching
the queue gauge waits for a request that was answered long ago."""

from __future__ import annotations

import threading
import uuid

from cache.response_cache import ExactAnswer, ExactResponseCache
from engine.observer import EngineObserver
from engine.response_tier import ResponseTier
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401
from tests.test_lookup_pool import GatedSemantic


class StallingObserver(EngineObserver):
    """Records each load it is sent. The submitting thread's report of the lookup it queued is held up
    (as a preempted thread's is) until the lookup thread has sent the load after that lookup ended."""

    def __init__(self, semantic: GatedSemantic, submitter: int):
        self.semantic, self.submitter = semantic, submitter
        self.loads: list[tuple[int, int, int]] = []
        self.fresh = threading.Event()
        self._lock = threading.Lock()

    def on_load(self, queued, active, kv_tokens):
        if threading.get_ident() == self.submitter and queued == 1 and not self.fresh.is_set():
            self.semantic.gate.set()  # the lookup may now end (a hit)
            self.fresh.wait(3)  # the lookup thread reports the load after it (or, if serialized, cannot)
        with self._lock:
            self.loads.append((queued, active, kv_tokens))
        if threading.get_ident() != self.submitter and queued == 0:
            self.fresh.set()


def test_the_last_load_published_after_an_off_thread_hit_is_the_current_one(model, redis_server):  # noqa: F811
    semantic = GatedSemantic(answer=ExactAnswer((2, 0, 1), 0, True))
    engine = make_engine(model, slots=2)
    engine.responses = ResponseTier(
        ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5), lambda ids, trim: b"x"
    )
    engine.responses.semantic = semantic
    observer = StallingObserver(semantic, threading.get_ident())
    engine.observer = observer
    engine.use_lookup_threads(1)
    try:
        sink = RecordingSink()
        engine.submit(request([1, 5, 6], sink, temperature=0.0, max_tokens=4, stream=True))
        assert observer.fresh.wait(10) and sink.finished and sink.tokens == [2, 0, 1]
        engine.lookups.shutdown()  # every report of the pool's is in
        assert engine.load() == (0, 0)
        assert observer.loads[-1] == (0, 0, 0), f"an idle engine left its gauges at {observer.loads[-1]}"
    finally:
        semantic.gate.set()
        engine.shutdown(1.0)
