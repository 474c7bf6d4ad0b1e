"""A semantic lookup whose embedding raises (a failed MiniLM pass: every caller coalesced into it gets
EmbeddingFailed) is a miss, counted, never the request's failure: inline, and on the lookup threads."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from cache.embed_coalescer import CoalescingEmbedder
from cache.response_cache import ExactResponseCache
from cache.semantic_cache import SemanticResponseCache
from engine.response_tier import ResponseTier
from scheduler.messages import EngineRequestParams
from tests.conftest import answer, wait_for
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401


class FailingEmbedder:
    dim = 384

    def embed(self, texts: list[str]) -> np.ndarray:
        raise RuntimeError("MiniLM forward pass failed (out of memory)")

    def fits(self, texts: list[str]) -> list[bool]:
        return [True for _ in texts]


@pytest.mark.parametrize("threads", [0, 1], ids=["inline", "lookup-thread"])
def test_an_embedding_that_raises_is_a_miss_and_the_request_is_computed(model, redis_server, threads):  # noqa: F811
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    semantic = SemanticResponseCache(
        redis_server, fingerprint, CoalescingEmbedder(FailingEmbedder()), verifier=None
    )
    params = EngineRequestParams(max_tokens=4, tenant="t1")
    assert semantic.store("seed question", "t1", params, answer("x"), embedding=np.ones(384, np.float32))
    exact = ExactResponseCache(redis_server, fingerprint, timeout_s=0.5)
    engine = make_engine(model, slots=2)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"x", semantic=semantic)
    if threads:
        engine.use_lookup_threads(threads)
    engine.start()
    sink = RecordingSink()
    try:
        engine.submit(request([1, 5, 6], sink, "r", temperature=0.0, max_tokens=4, tenant="t1"))
        assert wait_for(lambda: sink.finished, 20)
    finally:
        engine.shutdown(1.0)
    assert not sink.errors and len(sink.tokens) == 4
    # the lookup's failure, and the computed answer's store when its write ran: counted, never raised
    assert semantic.stats.embed_errors in (1, 2) and "out of memory" in semantic.last_embed_error
    assert semantic.stats.stores == 1  # the seed's only
