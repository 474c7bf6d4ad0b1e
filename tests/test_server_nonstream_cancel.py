"""A non-streaming request (stream=False) whose client cancels, or is killed, kept its KV slot until it
had generated every token: the engine sends nothing before the final window, so the detokenizer (the
only step that ever sees an ensemble cancel in Triton 24.10) never gets a request to ask about, and the
engine's own is_cancelled stays False for an in-flight ensemble step. Streaming requests are freed
within a step (tests/test_server_cancel_leak.py); this one was counted `length`, never `cancelled`. Now
the engine sends it empty windows while it runs (NON_STREAM_KEEPALIVE_S), which the detokenizer asks
Triton about (found in review, 2026-12-07)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from client.generate import StreamingSession, generate
from client.metrics import holds_requests, metric_total, scrape_metrics
from tests.conftest import REPO_ROOT, wait_for


def finished(metrics_url: str, status: str) -> float:
    return metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", status=status)


LONG = {"max_tokens": 512, "ignore_eos": True}


def test_a_cancelled_non_streaming_request_frees_its_slot(stack):
    cancelled, lengths = finished(stack.metrics_url, "cancelled"), finished(stack.metrics_url, "length")
    session = StreamingSession(stack.grpc_url)
    session.submit("A long answer nobody will read " * 3, sampling=LONG, stream=False)
    assert wait_for(
        lambda: metric_total(scrape_metrics(stack.metrics_url), "llm_engine_active_requests") == 1
    )
    session.cancel()
    assert wait_for(lambda: not holds_requests(scrape_metrics(stack.metrics_url)), timeout_s=60)
    assert wait_for(lambda: finished(stack.metrics_url, "cancelled") == cancelled + 1, timeout_s=5), (
        "the cancelled non-streaming request ran to max_tokens "
        f"(length {lengths} -> {finished(stack.metrics_url, 'length')})"
    )
    assert finished(stack.metrics_url, "length") == lengths


def test_a_killed_non_streaming_client_frees_its_slot(stack):
    cancelled = finished(stack.metrics_url, "cancelled")
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from client.generate import StreamingSession
        from client.metrics import metric_total, scrape_metrics
        s = StreamingSession({stack.grpc_url!r})
        s.submit("A killed client's long answer " * 3, sampling={LONG!r}, stream=False)
        while metric_total(scrape_metrics({stack.metrics_url!r}), "llm_engine_active_requests") < 1:
            time.sleep(0.02)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], timeout=120, check=True, env=dict(os.environ))
    assert wait_for(lambda: not holds_requests(scrape_metrics(stack.metrics_url)), timeout_s=60)
    assert wait_for(lambda: finished(stack.metrics_url, "cancelled") == cancelled + 1, timeout_s=5), (
        "the killed client's non-streaming request ran to max_tokens"
    )
    # the server still answers, non-streaming too
    assert generate(stack.grpc_url, "after the kill", sampling={"max_tokens": 3}, stream=False).text
