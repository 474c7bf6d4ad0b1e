"""Fuzz: a direct llm_engine request's request_params, parsed as model_repository/llm_engine/1/model.py
does (EngineRequestParams.from_bytes; whatever it raises is that request's INVALID_ARG there), then
Engine.submit (its RequestError is the client's error; any other exception is answered INTERNAL)."""

import json
import random
import uuid

import pytest

from cache.response_cache import ExactResponseCache, exact_namespace
from engine.requests import EngineRequest
from engine.response_tier import ResponseTier
from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams
from tests.test_engine_batching import RecordingSink, make_engine, model, run_until_idle

from tests.fuzz_inputs import ODD_NUMBERS, ODD_STRINGS, nested, rand_stop, rand_value

__all__ = ["model"]
FIELDS = {
    "max_tokens": 8,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": None,
    "stop": [],
    "ignore_eos": True,
    "stream": True,
    "exclude_input_in_output": False,
    "tier": "standard",
    "tenant": "default",
    "arrival_ns": 0,
    "cache": "use",
    "response_key": "",
    "tenant_token": "",
}


def rand_payload(rng, namespace):
    r = rng.random()
    if r < 0.08:
        return rng.choice(
            [
                b"",
                b"{",
                b"[]",
                b"null",
                b"\xff\xfe",
                b'{"stop": "\xed\xa0\x80"}',
                nested(100_000).encode(),
                ('{"stop": %s}' % nested(990)).encode(),
                b'{"max_tokens": ' + b"9" * 5000 + b"}",
                b'{"top_p": NaN}',
                b'{"a": 1, "a": 2}',
            ]
        )
    obj = dict(FIELDS)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(list(FIELDS) + ["unknown", "response_key", "response_key"])
        roll = rng.random()
        if key == "stop":
            obj[key] = rand_stop(rng)
        elif key == "response_key" and roll < 0.6:
            obj[key] = namespace + ":" + rng.choice(ODD_STRINGS[:8])
        elif roll < 0.4:
            obj[key] = rng.choice(ODD_NUMBERS)
        elif roll < 0.8:
            obj[key] = rng.choice(ODD_STRINGS)
        else:
            obj[key] = rand_value(rng)
    try:
        return json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        return b"{}"


def test_direct_request_params_are_refused_as_invalid_arg_or_served(model, redis_server):
    engine = make_engine(model)
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"", first_use=True)
    namespace = exact_namespace(exact.fingerprint)
    rng = random.Random("engine-params")
    counts = {"parse_refused": 0, "invalid": 0, "accepted": 0}
    try:
        for i in range(600):
            payload = rand_payload(rng, namespace)
            try:
                params = EngineRequestParams.from_bytes(payload)
            except (ValueError, RecursionError):  # model.py: "bad engine input", INVALID_ARG
                counts["parse_refused"] += 1
                continue
            sink = RecordingSink()
            req = EngineRequest(str(i), [1, 5, 9], params, rng.choice([0, 3, 2**31 - 1]), 0, sink)
            try:
                engine.submit(req)
            except RequestError as exc:
                assert exc.code == "INVALID_ARG", (exc, payload[:300])
                exc.message.encode("utf-8")
                counts["invalid"] += 1
                continue
            except Exception as exc:  # noqa: BLE001  model.py answers it INTERNAL
                pytest.fail(
                    f"case {i}: {type(exc).__name__}: {exc!s:.200} escaped submit for {payload[:300]!r}"
                )
            counts["accepted"] += 1
            if counts["accepted"] % 20 == 0:
                run_until_idle(engine)
        run_until_idle(engine)
    finally:
        engine.responses.drain_writes()
    print(counts)
    assert counts["accepted"] > 20 and counts["invalid"] > 10
