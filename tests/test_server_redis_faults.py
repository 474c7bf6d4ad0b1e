"""Redis dies in the middle of a load test: every request still succeeds, computed instead of cached."""

from __future__ import annotations

import os
import signal
import threading

from client.load import run_load
from client.metrics import metric_total, scrape_metrics
from client.workload import PlannedRequest
from deploy.launch import StackOptions, start_stack
from tests.conftest import MODEL_DIR

PREFIX = "Shared context for the fault test. " * 12


def test_killing_redis_mid_load_fails_no_request(tmp_path):
    with start_stack(StackOptions(run_dir=tmp_path, model_dir=MODEL_DIR, warmup=True)) as stack:
        plan = [
            PlannedRequest(i * 0.08, "standard", f"t{i % 3}", f"{PREFIX} question {i % 7}", max_tokens=6)
            for i in range(60)
        ]
        killer = threading.Timer(1.5, os.kill, args=(stack.pids["redis"], signal.SIGKILL))
        killer.start()
        records = run_load(stack.grpc_url, plan, timeout_s=60)
        killer.join()
        assert [r.outcome for r in records].count("ok") == len(plan), [r.error for r in records if r.error]
        metrics = scrape_metrics(stack.metrics_url)
        served = metric_total(metrics, "llm_engine_requests_finished_total", tier="standard")
        assert served == len(plan)


def test_a_full_redis_fails_no_request_and_its_cached_answers_are_still_served(tmp_path):
    """Redis at maxmemory with nothing it may evict refuses writes but still answers reads: requests
    succeed, the refused writes are counted, and an answer cached before is still a hit."""
    import redis

    from client.generate import generate
    from tests.conftest import wait_for
    from tests.test_redis_full import _fill

    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    sampled = {"max_tokens": 2, "temperature": 0.8, "ignore_eos": True}  # never cached: publishes metrics
    with start_stack(StackOptions(run_dir=tmp_path, model_dir=MODEL_DIR, warmup=False)) as stack:

        def exact(counter: str) -> float:
            generate(stack.grpc_url, "metrics, please", sampling=sampled)  # counters go out with requests
            return metric_total(scrape_metrics(stack.metrics_url), "llm_engine_cache_total", tier="exact",
                                counter=counter)  # fmt: skip

        kept = "An answer cached before Redis filled up."
        answer = generate(stack.grpc_url, kept, sampling=greedy).text
        assert generate(stack.grpc_url, kept, sampling=greedy).text == answer  # written on this sighting
        assert wait_for(lambda: exact("stores") >= 1)
        client = redis.Redis.from_url(stack.redis_url)
        _fill(client)
        for i in range(3):
            for _ in range(2):
                assert generate(
                    stack.grpc_url, f"A new prompt {i} while Redis is full.", sampling=greedy
                ).text
        assert wait_for(lambda: exact("full_refusals") >= 1)
        hits = exact("hits")
        assert generate(stack.grpc_url, kept, sampling=greedy).text == answer
        assert wait_for(lambda: exact("hits") >= hits + 1)
        assert exact("errors") == 0  # the breaker was never told: reads went on
        client.close()
