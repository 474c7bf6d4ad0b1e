"""Cancelled streams leave nothing in flight: in Triton 2.51 an error response from a step of a cancelled
ensemble request leaked that request (counted in flight until the server's exit timeout), so the engine
and detokenizer end a cancelled request with a plain final response. Its own stack: the leak shows only
when the server stops."""

from __future__ import annotations

import queue
import re

from client.generate import StreamingSession, generate
from deploy.launch import StackOptions, start_stack
from client.metrics import holds_requests, scrape_metrics
from tests.conftest import MODEL_DIR, wait_for

IN_FLIGHT_AT_STOP = re.compile(r"Model 'llm' \(version \d+\) has (\d+) in-flight inferences")


def test_cancelled_streams_leave_nothing_in_flight(tmp_path):
    stack = start_stack(StackOptions(run_dir=tmp_path / "stack", model_dir=MODEL_DIR, warmup=True))
    try:
        for i in range(6):
            session = StreamingSession(stack.grpc_url)
            started: queue.Queue = queue.Queue()
            sampling = {"max_tokens": 200, "ignore_eos": True}
            session.submit(f"cancel me {i} " * 10, sampling=sampling, on_piece=started.put)
            if i % 2 == 0:  # after its first piece (running in the engine), else at once (queued or running)
                started.get(timeout=60)
            session.cancel()
        assert generate(stack.grpc_url, "still serving", sampling={"max_tokens": 3}).text
        assert wait_for(
            lambda: not holds_requests(scrape_metrics(stack.metrics_url)), timeout_s=30.0
        )  # every cancel noticed
    finally:
        stack.stop()
    leaked = [int(n) for n in IN_FLIGHT_AT_STOP.findall(stack.triton_log.read_text(errors="replace"))]
    assert leaked == [], f"the ensemble still counted {max(leaked)} requests in flight at shutdown"
