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
