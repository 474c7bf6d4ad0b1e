"""Triton's model_warmup request for llm_engine (model_repository/llm_engine/warmup/request_params) named
no `cache`, so it was `use`: at tier `warmup` its answer was written at once into tenant `default`'s exact
cache, and from the second start on it was an exact hit that ran none of the engine's code, what
engine/warmup.py's own requests were switched to `kv-only` for (found in review, 2026-12-07)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import redis

from cache.response_cache import ExactResponseCache
from engine.requests import EngineRequest
from engine.response_tier import ResponseTier
from scheduler.messages import EngineRequestParams
from tests.test_engine_batching import RecordingSink, make_engine, model, run_until_idle

__all__ = ["model"]

ROOT = Path(__file__).resolve().parents[1]


def _warmup_params() -> tuple[bytes, EngineRequestParams]:
    raw = (ROOT / "model_repository/llm_engine/warmup/request_params").read_bytes()
    return raw, EngineRequestParams.from_bytes(raw)


def test_the_warmup_file_is_the_size_the_config_declares():
    raw, _ = _warmup_params()
    config = (ROOT / "model_repository/llm_engine/config.pbtxt").read_text()
    dims = re.search(r'key: "request_params".*?dims: \[ (\d+) \] input_data_file: "request_params"', config)
    assert dims is not None and int(dims.group(1)) == len(raw)


def test_tritons_engine_warmup_request_neither_reads_nor_writes_tenant_defaults_response_cache(
    model, redis_server
):
    _, params = _warmup_params()
    engine = make_engine(model)
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"", first_use=False)
    try:
        for n in range(4):  # count: 2 per start, two starts
            sink = RecordingSink()
            engine.submit(EngineRequest(f"w{n}", [0, 0, 0, 0], params, 0, 0, sink), own=True)
            run_until_idle(engine)
            assert sink.finished and not sink.errors
            assert engine.responses.drain_writes()
        written = list(redis.Redis.from_url(redis_server).scan_iter(exact.namespace + ":*"))
        assert written == [], f"warmup wrote {len(written)} answer(s) under tenant {params.tenant!r}"
        assert engine.stats.finished.get("cached", 0) == 0, "warmup requests were answered from the cache"
    finally:
        engine.responses.close()
