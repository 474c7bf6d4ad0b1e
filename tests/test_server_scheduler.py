"""SLO-aware ordering and admission on a real server: one slot, so every request queues."""

from __future__ import annotations

import queue
import time

import pytest

from client.generate import StreamingSession
from client.metrics import metric_total, scrape_metrics
from deploy.launch import StackOptions, start_stack
from tests.conftest import MODEL_DIR, wait_for

TIERS_YAML = """
default_tier: standard
cpu_scale: 1.0
tiers:
  critical: {priority: 1, ttft_target_ms: 20000, sheddable: false, max_queue_ms: 60000}
  warmup:   {priority: 2, ttft_target_ms: 20000, sheddable: false, max_queue_ms: 60000}
  standard: {priority: 3, ttft_target_ms: 20000, sheddable: false, max_queue_ms: 60000}
  batch:    {priority: 4, ttft_target_ms: 60000, sheddable: true, max_queue_ms: 120000}
  bulk:     {priority: 5, ttft_target_ms: 100, sheddable: true, max_queue_ms: 1000}
  urgent:   {priority: 1, ttft_target_ms: 100, sheddable: false, max_queue_ms: 60000}
"""


@pytest.fixture(scope="module")
def one_slot_stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-slot")
    tiers = run_dir / "tiers.yaml"
    tiers.write_text(TIERS_YAML)
    options = StackOptions(
        run_dir=run_dir,
        model_dir=MODEL_DIR,
        warmup=True,
        overrides={"llm_engine": {"max_batch_size": "1", "plan_kv_from_traffic": "false"}},
        extra_env={"LLM_TIERS_FILE": str(tiers)},
    )
    with start_stack(options) as stack:
        yield stack


def test_critical_overtakes_queued_batch_requests(one_slot_stack):
    """The blocker holds the only slot until all three are queued in the engine, then is cancelled.

    Letting the blocker run out instead raced: on a loaded machine it could finish before the
    critical request reached the engine, and batch-1 then took the free slot (seen in CI).
    """
    blocker_session = StreamingSession(one_slot_stack.grpc_url)
    started: queue.Queue = queue.Queue()
    long_sampling = {"max_tokens": 512, "ignore_eos": True}
    blocker = blocker_session.submit(
        "The slot is busy with this", sampling=long_sampling, tier="batch", on_piece=started.put
    )
    started.get(timeout=60)
    session = StreamingSession(one_slot_stack.grpc_url)
    sent: dict[str, float] = {}
    for name, tier in (("batch-1", "batch"), ("batch-2", "batch"), ("critical", "critical")):
        sent[name] = time.perf_counter()
        session.submit(f"Queued {name}", sampling={"max_tokens": 4}, tier=tier, request_id=name)
    queued = lambda: metric_total(scrape_metrics(one_slot_stack.metrics_url), "llm_engine_queue_depth")  # noqa: E731
    assert wait_for(lambda: queued() >= 3, timeout_s=60), f"queue depth {queued()}"
    assert blocker in blocker_session.unfinished(), "the blocker finished before the queue filled"
    blocker_session.cancel()
    assert session.wait(timeout_s=180)
    first_token_at = {name: sent[name] + session.result(name).ttft_s for name in sent}
    assert all(session.result(name).error is None for name in sent)
    assert first_token_at["critical"] < first_token_at["batch-1"] < first_token_at["batch-2"]
    session.close()


def test_a_sheddable_request_that_cannot_make_its_deadline_gets_a_clear_error(one_slot_stack):
    """Shed on arrival (predicted late), or if admitted anyway, refused at its max_queue_ms (1 s): either
    way a clear error. The busy request is long enough for both: with 150 tokens a fast idle machine once
    predicted the wait under the 100 ms target and ran the bulk request (CI)."""
    session = StreamingSession(one_slot_stack.grpc_url)
    started: queue.Queue = queue.Queue()
    session.submit("Busy again", sampling={"max_tokens": 512, "ignore_eos": True}, on_piece=started.put)
    started.get(timeout=60)
    shed = session.submit("Too late anyway", sampling={"max_tokens": 4}, tier="bulk")
    kept = session.submit("Not sheddable", sampling={"max_tokens": 4}, tier="critical")
    assert session.wait(timeout_s=180)
    error = session.result(shed).error or ""
    assert "bulk" in error and "retry" in error.lower(), error
    assert session.result(kept).error is None and session.result(kept).text
    session.close()


def test_an_urgent_request_preempts_a_running_batch_request_which_still_completes(one_slot_stack):
    preempted_before = metric_total(
        scrape_metrics(one_slot_stack.metrics_url), "llm_engine_preemptions_total"
    )
    session = StreamingSession(one_slot_stack.grpc_url)
    started: queue.Queue = queue.Queue()
    blocker_sent = time.perf_counter()
    blocker = session.submit(
        "A long batch answer", sampling={"max_tokens": 150, "ignore_eos": True}, tier="batch",
        on_piece=started.put,
    )  # fmt: skip
    started.get(timeout=60)
    sent = time.perf_counter()
    urgent = session.submit("Answer me first", sampling={"max_tokens": 4}, tier="urgent")
    assert session.wait(timeout_s=180)
    blocker_result, urgent_result = session.result(blocker), session.result(urgent)
    assert urgent_result.error is None and blocker_result.error is None
    assert sent + urgent_result.total_s < blocker_sent + blocker_result.total_s
    assert (
        len(blocker_result.pieces) >= 140
    )  # resumed and ran to max_tokens (a piece per token, a few held back)
    metrics = scrape_metrics(one_slot_stack.metrics_url)
    assert metric_total(metrics, "llm_engine_preemptions_total", tier="batch") - preempted_before >= 1
    session.close()
