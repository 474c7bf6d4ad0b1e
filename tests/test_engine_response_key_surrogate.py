"""A direct llm_engine request whose response_key is JSON's "\\ud800" escape under the exact cache's
namespace: EngineRequestParams.from_bytes accepts it (a str), ResponseTier trusts it for a miss, and the
Redis GET of it raised UnicodeEncodeError out of Engine.submit (model.py answers that INTERNAL, not
INVALID_ARG). It must be refused as INVALID_ARG, like every other bad parameter. Found in review."""

import json
import uuid

import pytest

from cache.response_cache import ExactResponseCache, exact_namespace
from engine.requests import EngineRequest
from engine.response_tier import ResponseTier
from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams
from tests.test_engine_batching import RecordingSink, make_engine, model, run_until_idle

__all__ = ["model"]


def test_a_response_key_utf8_cannot_write_is_invalid_arg(model, redis_server):
    engine = make_engine(model)
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"", first_use=True)
    payload = json.dumps({"max_tokens": 4, "response_key": exact_namespace(exact.fingerprint) + ":\ud800"})
    params = EngineRequestParams.from_bytes(payload.encode())  # what model.py parses: accepted
    with pytest.raises(RequestError) as caught:
        engine.submit(EngineRequest("r", [1, 5, 9], params, 3, 0, RecordingSink()))
    assert caught.value.code == "INVALID_ARG" and "response_key" in caught.value.message
    caught.value.message.encode("utf-8")
    # the next request is served as before
    sink = RecordingSink()
    engine.submit(
        EngineRequest(
            "s", [1, 5, 9], EngineRequestParams(max_tokens=4, ignore_eos=True, stream=True), 3, 0, sink
        )
    )
    run_until_idle(engine)
    assert not sink.errors and len(sink.tokens) == 4
