"""Cancelled streams leave nothing in flight: in Triton 2.51 an error response from a step of a cancelled
ensemble request leaked that request (counted in flight until the server's exit timeout), so the engine
and detokenizer end a cancelled request with a plain final response. Its own stack: the leak shows only
when the server stops. The same holds for queued requests that expire (their tier's max_queue_ms),
whether their client is still waiting or has cancelled."""

from __future__ import annotations

import queue
import re
from pathlib import Path

import yaml

from client.generate import StreamingSession, generate
from deploy.launch import StackOptions, start_stack
from client.metrics import holds_requests, metric_total, scrape_metrics
from scheduler.tiers import TierTable
from tests.conftest import MODEL_DIR, wait_for

IN_FLIGHT_AT_STOP = re.compile(r"Model 'llm' \(version \d+\) has (\d+) in-flight inferences")


def test_cancelled_streams_leave_nothing_in_flight(tmp_path, capfd):
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
    leaked = leaked_at_stop(stack.triton_log)
    assert leaked == [], f"the ensemble still counted {max(leaked)} requests in flight at shutdown"
    # no client stream was left open: the server exited by itself, the launcher killed nothing
    assert "only idle client streams hold it" not in capfd.readouterr().out


def leaked_at_stop(log: Path) -> list[int]:
    return [int(n) for n in IN_FLIGHT_AT_STOP.findall(log.read_text(errors="replace"))]


def short_queue_tiers(path: Path, standard_max_queue_ms: float) -> Path:
    """The default tiers, with a short max_queue_ms for the standard tier (x cpu_scale on the CPU)."""
    table = TierTable.defaults()
    tiers = {
        t.name: {
            "priority": t.priority, "ttft_target_ms": t.ttft_target_ms, "percentile": t.percentile,
            "sheddable": t.sheddable,
            "max_queue_ms": standard_max_queue_ms if t.name == "standard" else t.max_queue_ms,
        }
        for t in table.tiers
    }  # fmt: skip
    data = {"default_tier": table.default_name, "cpu_scale": table.cpu_scale, "tiers": tiers}
    path.write_text(yaml.safe_dump(data))
    return path


def both_queued(metrics_url: str, busy: StreamingSession) -> bool:
    """Whether the two standard requests wait in the engine's queue behind the busy ones: the depth is
    the busy requests not yet running (all unfinished but the one that is) plus those two. A busy request
    runs ~1.5 s on the CPU, so waiting for a fixed depth of 9 held only while the first one ran, and
    missed it once on a loaded machine. Unfinished is read first: a busy one that ends between the two
    reads lowers the depth, which only makes this answer False for one more poll."""
    ahead = max(0, len(busy.unfinished()) - 1)
    return metric_total(scrape_metrics(metrics_url), "llm_engine_queue_depth") >= ahead + 2


def test_queued_requests_expire_with_a_clear_error_and_leave_nothing_in_flight(tmp_path):
    tiers = str(short_queue_tiers(tmp_path / "tiers.yaml", 300))  # 3 s on the CPU
    overrides = {
        "llm_engine": {"tiers_file": tiers, "max_batch_size": "1"},
        "slo_scheduler": {"tiers_file": tiers},
    }
    stack = start_stack(
        StackOptions(run_dir=tmp_path / "stack", model_dir=MODEL_DIR, warmup=False, overrides=overrides)
    )
    try:
        busy = StreamingSession(stack.grpc_url)
        started: queue.Queue = queue.Queue()
        for i in range(8):  # the one slot, then 7 critical requests ahead in the queue (never expiring here)
            busy.submit(f"busy {i} " * 5, sampling={"max_tokens": 512, "ignore_eos": True}, tier="critical",
                        on_piece=started.put)  # fmt: skip
        started.get(timeout=60)
        waiting, gone = StreamingSession(stack.grpc_url), StreamingSession(stack.grpc_url)
        waiting_id = waiting.submit("a request that waits", sampling={"max_tokens": 3})
        gone.submit("a request whose client gives up", sampling={"max_tokens": 3})
        assert wait_for(lambda: both_queued(stack.metrics_url, busy))
        gone.cancel()  # queued in the engine, where the cancel is not seen
        assert waiting.wait([waiting_id], timeout_s=30)
        error = waiting.result(waiting_id).error or ""
        assert "max_queue_ms" in error and "queued" in error
        expired = lambda: metric_total(  # noqa: E731
            scrape_metrics(stack.metrics_url), "llm_engine_requests_finished_total", status="expired"
        )
        assert wait_for(lambda: expired() == 2, timeout_s=10)
        assert busy.unfinished(), "the busy requests ended before the queued ones expired"
        busy.cancel()
        waiting.close()
        assert wait_for(lambda: not holds_requests(scrape_metrics(stack.metrics_url)), timeout_s=30.0)
    finally:
        stack.stop()
    assert leaked_at_stop(stack.triton_log) == []
