"""The warmup's `requests` stage must run its requests through the engine's own code on every start.

Its two requests (tenant "default", greedy and seeded, tier "warmup", cache mode "use") are cacheable, and
warmup-tier answers are written to the exact response cache at once. So the first start leaves their
answers in Redis, and every later start answers them from the exact cache in `submit`: no admission, no
prefill, no decode, no streaming; the stage still reports 2 items. They also show up as exact-cache
traffic (misses and stores on the first start, hits after) in a real tenant's namespace."""

from __future__ import annotations

import redis

import engine.engine as engine_module
from engine.cache_stats import cache_counters
from engine.config import EngineConfig
from engine.loader import load_engine
from tests.conftest import MODEL_DIR


def _config(url: str) -> EngineConfig:
    return EngineConfig(
        model_dir=str(MODEL_DIR), device="cpu", prefill_templates="", redis_url=url, prompt_buckets=(16,),
        max_seq_len=64, max_batch_size=2, l3_kv_cache=False, l2_cache_blocks=0, prefix_cache_blocks=8,
    )  # fmt: skip


def _load(config: EngineConfig, monkeypatch):
    started: list[str] = []
    real_start = engine_module.Engine._start

    def spy(self, request, slot):
        started.append(request.request_id)
        return real_start(self, request, slot)

    monkeypatch.setattr(engine_module.Engine, "_start", spy)
    loaded = load_engine(config, log=lambda message: None)
    monkeypatch.setattr(engine_module.Engine, "_start", real_start)
    counters = cache_counters(None, loaded.engine.responses).items()
    exact = {k[1]: v for k, v in counters if k[0] == "exact" and v}
    loaded.engine.shutdown(5.0)  # drains the response writer
    return loaded, started, exact


def test_warmup_requests_run_through_the_engine_on_every_start(redis_server, monkeypatch):
    url = redis_server.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        config = _config(url)
        first, started_first, _ = _load(config, monkeypatch)
        assert first.report.failures == []
        assert started_first == ["warmup-0", "warmup-1"]
        second, started_second, exact = _load(config, monkeypatch)
        assert second.report.failures == []
        requests = next(s for s in second.report.stages if s.name == "requests")
        assert requests.items == 2
        # the stage's requests were prefilled and decoded by the engine, not answered from Redis
        assert started_second == ["warmup-0", "warmup-1"]
        assert exact.get("hits", 0) == 0
    finally:
        client.flushdb()
        client.close()


def test_warmup_requests_leave_no_answer_in_a_tenants_response_cache(redis_server, monkeypatch):
    url = redis_server.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        _, _, exact = _load(_config(url), monkeypatch)
        assert exact.get("stores", 0) == 0 and exact.get("misses", 0) == 0
        assert [k for k in client.scan_iter("llm:resp:*")] == []
    finally:
        client.flushdb()
        client.close()
