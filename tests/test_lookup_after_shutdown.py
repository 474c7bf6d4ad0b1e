"""A request submitted after a shutdown began is refused (UNAVAILABLE: retry on another replica); only
requests accepted before it, those in a semantic lookup among them, drain. A greedy miss whose semantic
lookup runs on the submitting thread because the pool is already shut down must be refused as well."""

from __future__ import annotations

import threading
import uuid

from cache.response_cache import ExactResponseCache
from engine.response_tier import ResponseTier
from scheduler.errors import RequestError
from tests.conftest import wait_for
from tests.test_lookup_pool import GatedSemantic
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class FirstGated(GatedSemantic):
    """A semantic cache that always misses; only its first lookup waits for `gate`."""

    def lookup(self, question, tenant, params, variant=""):
        if self.looked_up:
            self.looked_up += 1
            return None
        return super().lookup(question, tenant, params, variant)


def test_a_greedy_miss_submitted_after_shutdown_began_is_refused(model, redis_server):  # noqa: F811
    semantic = FirstGated()
    engine = make_engine(model, slots=2)
    engine.responses = ResponseTier(
        ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5), lambda ids, trim: b"x"
    )
    engine.responses.semantic = semantic
    engine.use_lookup_threads(1)
    engine.start()
    first, late = RecordingSink(), RecordingSink()
    engine.submit(request([1, 5, 6], first, temperature=0.0))  # accepted: drains
    assert semantic.entered.wait(10)
    stopping = threading.Thread(target=engine.shutdown, args=(10.0,))
    stopping.start()
    try:
        assert wait_for(lambda: engine.lookups._closed, 10), "the shutdown has closed the lookup pool"
        refused = False
        try:
            engine.submit(request([1, 9, 9], late, "late", temperature=0.0))  # after the shutdown began
        except RequestError as exc:
            refused = exc.code == "UNAVAILABLE"
    finally:
        semantic.gate.set()
        stopping.join(30)
    assert not stopping.is_alive()
    assert first.finished and not first.errors and len(first.tokens) == 8
    refused = refused or [code for code, _ in late.errors] == ["UNAVAILABLE"]
    assert refused and not late.tokens, f"served {late.tokens} after the shutdown began"
