"""DrainSwitch (pure logic), then a stop that drains on its own stack: a stream in flight when the stop
begins finishes whole, and a request sent meanwhile is refused with a retry hint."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from client.generate import StreamingSession, generate, GenerationError
from client.load import is_rejection
from deploy.launch import StackOptions, _stubs_gone, start_stack
from scheduler.drain import DrainSwitch
from scheduler.errors import RequestError
from tests.conftest import MODEL_DIR, wait_for


def test_drain_switch_reads_the_marker_at_most_once_per_interval() -> None:
    now, present, looks = [0.0], [False], []

    def exists(path: str) -> bool:
        looks.append(path)
        return present[0]

    switch = DrainSwitch("/run/draining", interval_s=0.1, clock=lambda: now[0], exists=exists)
    switch.admit()
    present[0] = True
    now[0] = 0.05
    switch.admit()  # within the interval: the earlier answer stands
    assert looks == ["/run/draining"]
    now[0] = 0.11
    with pytest.raises(RequestError) as refused:
        switch.admit()
    assert refused.value.code == "UNAVAILABLE" and "retry on another replica" in refused.value.message
    present[0] = False
    now[0] = 0.25
    assert not switch.draining() and len(looks) == 3


def refused_for_draining(grpc_url: str):
    """A check for wait_for: a new request is refused because the replica drains (the step reads the
    marker at most every 0.1 s, so one sent right after it appears may still be served)."""

    def check() -> bool:
        try:
            generate(grpc_url, "a new request", sampling={"max_tokens": 1})
        except GenerationError as exc:
            assert is_rejection(str(exc)), f"a drain's refusal must read as one on the wire: {exc}"
            return "draining" in str(exc)
        return False

    return check


@pytest.mark.server
def test_a_stop_drains_streams_in_flight_and_refuses_new_requests(tmp_path) -> None:
    stack = start_stack(StackOptions(run_dir=tmp_path / "stack", model_dir=MODEL_DIR, warmup=True))
    stopper = threading.Thread(target=stack.stop)
    try:
        session = StreamingSession(stack.grpc_url)
        started: queue.Queue = queue.Queue()
        sampling = {"max_tokens": 500, "ignore_eos": True}
        rid = session.submit(f"a long answer {time.time()} " * 5, sampling=sampling, on_piece=started.put)
        started.get(timeout=60)
        stopper.start()
        assert wait_for(refused_for_draining(stack.grpc_url), timeout_s=10.0)
        assert session.wait([rid], timeout_s=60)
        result = session.result(rid)
        session.close()
        assert result.error is None and len(result.pieces) >= 400
    finally:
        if stopper.ident is None:
            stack.stop()
        else:
            stopper.join(timeout=90)


@pytest.mark.server
def test_a_stop_does_not_wait_for_a_client_that_keeps_an_idle_stream_open(tmp_path, capfd) -> None:
    """An open gRPC stream holds the ensemble live after every Python model has unloaded: tritonserver
    would wait out its whole exit timeout (30 s) and then be killed. The stop kills it once the engine
    has unloaded (and so flushed), and not before."""
    stack = start_stack(StackOptions(run_dir=tmp_path / "stack", model_dir=MODEL_DIR, warmup=False))
    session = StreamingSession(stack.grpc_url)
    try:
        rid = session.submit("an answer, then an idle stream", sampling={"max_tokens": 2})
        assert session.wait([rid], timeout_s=60) and session.result(rid).error is None
        assert _stubs_gone(stack.pids["tritonserver"]) is False  # the stubs are found while they run
        started = time.monotonic()
        stack.stop(timeout_s=60)
        took = time.monotonic() - started
    finally:
        session.close()
    assert "only idle client streams hold it" in capfd.readouterr().out
    assert took < 30, f"the stop took {took:.1f} s"
    assert '\\"event\\":\\"engine_stopped\\"' in stack.triton_log.read_text()
