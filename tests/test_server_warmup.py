"""The warmup stage on a real server: plans from recorded traffic, READY after warmup, failures."""

from __future__ import annotations

import io
import time

import pytest
import yaml

from bench.common import PromptFactory
from cache.traffic_stats import RESERVED, TrafficStatsStore, model_fingerprint
from client.generate import StreamingSession, generate
from client.metrics import metric_total, scrape_metrics
from deploy.launch import StackOptions, find_free_port, start_stack
from deploy.logs import log_events, warmup_report
from tests.conftest import MODEL_DIR, REPO_ROOT, wait_for

RECORDED = {20: 300, 45: 200, 90: 120, 180: 60, 400: 20}  # prompt length -> count
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def planned_stack(redis_server, tmp_path_factory):
    store = TrafficStatsStore(redis_server, "llm_engine", model_fingerprint(MODEL_DIR, 2048))
    store.client.delete(store.lengths_key, store.histogram_key(RESERVED))
    store.add_lengths(RECORDED)
    store.add_lengths({length + MAX_TOKENS: count for length, count in RECORDED.items()}, RESERVED)
    options = StackOptions(
        run_dir=tmp_path_factory.mktemp("planned"),
        model_dir=MODEL_DIR,
        warmup=True,
        start_redis=False,
        redis_url=redis_server,
    )
    with start_stack(options) as stack:
        yield stack


def test_warmup_buckets_come_from_the_recorded_histogram(planned_stack):
    report = warmup_report(planned_stack.triton_log)
    assert report["plan"]["source"] == "traffic"
    assert report["plan"]["samples"] == sum(RECORDED.values())
    assert report["plan"]["cuts"]["p50"] == 45 and report["plan"]["cuts"]["p100"] == 400
    assert 48 in report["prompt_buckets"] and 400 in report["prompt_buckets"]
    assert report["failures"] == [] and report["deferred"] == []
    shapes = len(report["prompt_buckets"]) + len(report["kv_buckets"])  # a prefill and a decode per bucket
    metrics = scrape_metrics(planned_stack.metrics_url)
    assert metric_total(metrics, "llm_engine_warmup_shapes", outcome="warmed") == shapes


def test_recorded_lengths_meet_no_cold_shape(planned_stack):
    prompts = PromptFactory(MODEL_DIR)
    for length in RECORDED:
        result = generate(planned_stack.grpc_url, prompts.make(length), sampling={"max_tokens": MAX_TOKENS})
        assert result.text

    def finished() -> float:  # counted once the final response is on its way: a scrape may come first
        metrics = scrape_metrics(planned_stack.metrics_url)
        return metric_total(metrics, "llm_engine_requests_finished_total", tier="standard")

    assert wait_for(lambda: finished() == len(RECORDED), 10), finished()
    metrics = scrape_metrics(planned_stack.metrics_url)
    assert metric_total(metrics, "llm_engine_new_shapes_after_ready_total") == 0


def test_kv_pools_are_sized_per_length_class(planned_stack):
    kv = warmup_report(planned_stack.triton_log)["plan"]["kv"]
    assert kv["source"] == "traffic" and len(kv["pools"]) > 1
    assert kv["pools"][-1]["capacity"] == 2048 and kv["slot_tokens"] < kv["single_pool_tokens"]
    metrics = scrape_metrics(planned_stack.metrics_url)
    for pool in kv["pools"]:
        assert (
            metric_total(metrics, "llm_engine_kv_pool_slots", capacity=str(pool["capacity"])) == pool["slots"]
        )
    reserved = metric_total(metrics, "llm_engine_kv_cache_bytes")
    assert 0 < reserved < metric_total(metrics, "llm_engine_kv_single_pool_bytes")


def test_ready_is_reported_only_after_warmup(planned_stack):
    lines = planned_stack.triton_log.read_text().splitlines()
    report_at = next(i for i, line in enumerate(lines) if "warmup_report" in line)
    loaded_at = next(i for i, line in enumerate(lines) if "successfully loaded 'llm_engine'" in line)
    assert report_at < loaded_at


def test_served_prompt_lengths_are_recorded_for_the_next_start(planned_stack, redis_server):
    store = TrafficStatsStore(redis_server, "llm_engine", model_fingerprint(MODEL_DIR, 2048))
    prompts = PromptFactory(MODEL_DIR)
    warm_prompt, user_prompt = "word " * 31, "word " * 57
    warm_len, user_len = prompts.count(warm_prompt), prompts.count(user_prompt)
    before = store.load_lengths()
    generate(planned_stack.grpc_url, warm_prompt, sampling={"max_tokens": 2}, tier="warmup")
    generate(planned_stack.grpc_url, user_prompt, sampling={"max_tokens": 2})
    deadline = time.monotonic() + 20  # the recorder flushes every traffic_flush_s (5 s)
    while store.load_lengths().get(user_len, 0) == before.get(user_len, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = store.load_lengths()
    assert after.get(user_len, 0) == before.get(user_len, 0) + 1, "user traffic is recorded"
    assert after.get(warm_len, 0) == before.get(warm_len, 0), "warmup-tier traffic is not"


def test_warmup_failure_never_fails_the_load(tmp_path):
    dead_redis = f"redis://localhost:{find_free_port()}/0"
    options = StackOptions(
        run_dir=tmp_path, model_dir=MODEL_DIR, warmup=True, start_redis=False, redis_url=dead_redis
    )
    with start_stack(options) as stack:
        report = warmup_report(stack.triton_log)
        assert [f["stage"] for f in report["failures"]] == ["plan"]
        assert report["plan"]["source"] == "default"
        metrics = scrape_metrics(stack.metrics_url)
        assert metric_total(metrics, "llm_engine_warmup_failure_total", stage="plan") == 1
        assert generate(stack.grpc_url, "still serving", sampling={"max_tokens": 3}).text


def test_prompts_that_start_with_a_template_reuse_its_prefilled_blocks(planned_stack):
    report = warmup_report(planned_stack.triton_log)
    # the hottest template always loads before READY; the second may be deferred on a busy machine
    assert report["prefill_loaded"] >= 1 and report["prefill_loaded"] + report["prefill_deferred"] == 2
    templates = yaml.safe_load((REPO_ROOT / "model_repository/llm_engine/prefill_templates.yaml").read_text())
    before = metric_total(
        scrape_metrics(planned_stack.metrics_url), "llm_engine_prefix_cache_tokens_total", result="reused"
    )
    prompt = templates["templates"][0]["text"] + " Where is my parcel?"
    assert generate(planned_stack.grpc_url, prompt, sampling={"max_tokens": 2}).text
    after = metric_total(
        scrape_metrics(planned_stack.metrics_url), "llm_engine_prefix_cache_tokens_total", result="reused"
    )
    assert after - before >= 16 * 4, "most of the template's blocks were reused, not recomputed"
    other_tenant = generate(planned_stack.grpc_url, prompt, sampling={"max_tokens": 2}, tenant="globex")
    assert other_tenant.text
    final = metric_total(
        scrape_metrics(planned_stack.metrics_url), "llm_engine_prefix_cache_tokens_total", result="reused"
    )
    assert final == after, "another tenant never reuses the default tenant's template"


def test_rewarm_from_the_client_reloads_the_engine_with_a_new_report(planned_stack):
    from client.__main__ import main

    session = StreamingSession(planned_stack.grpc_url)
    in_flight = session.submit("served across the reload", sampling={"max_tokens": 200, "ignore_eos": True})
    out, err = io.StringIO(), io.StringIO()
    code = main(
        ["warmup", "--rewarm", "--url", planned_stack.grpc_url, "--metrics-url", planned_stack.metrics_url],
        out,
        err,
    )
    assert code == 0, err.getvalue()
    assert "reloaded and warm" in out.getvalue() and "llm_engine_warmup_stage_seconds" in out.getvalue()
    assert len(log_events(planned_stack.triton_log, "warmup_report")) == 2
    assert session.wait([in_flight], timeout_s=120)
    assert session.result(in_flight).error is None and len(session.result(in_flight).pieces) == 200
    session.close()
    assert generate(planned_stack.grpc_url, "after the re-warm", sampling={"max_tokens": 3}).text


def test_a_rewarm_whose_report_cannot_be_read_is_a_warning_not_a_failed_reload(planned_stack):
    """The reload succeeded; only the metrics port was unreadable. It was `error: re-warm ... failed`, exit
    1, so a CronJob retried (and reloaded again); the warmup job itself only warns (found in review,
    2026-12-07)."""
    from client.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    argv = [
        "warmup",
        "--rewarm",
        "--url",
        planned_stack.grpc_url,
        "--metrics-url",
        "http://127.0.0.1:9/metrics",
    ]
    code = main([*argv, "--timeout", "120"], out, err)
    assert code == 0, err.getvalue()
    assert (
        "reloaded and warm" in out.getvalue() and "warning: cannot read the warmup report" in err.getvalue()
    )
