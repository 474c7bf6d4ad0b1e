"""llm_engine's adapter and the engine's gauges, found in review (2026-12-07): a final response whose send
failed still ends the request, a server-side failure in submit is INTERNAL (not the client's bad input),
and a gauge whose message failed is set again."""

from __future__ import annotations

import threading

import pytest

import numpy as np

from scheduler.messages import EngineRequestParams
from tests import fake_triton_backend as ft

FINAL = 1


@pytest.fixture
def engine_model(monkeypatch):
    ft.install(monkeypatch)
    return ft.load_model("llm_engine")


def make(model_mod, engine):
    from engine.cancel_mailbox import request_keys
    from adapters.triton_common import TritonWarmupSamples

    m = model_mod.TritonPythonModel.__new__(model_mod.TritonPythonModel)
    m.engine, m.namespace, m.keys = engine, 1234, request_keys()
    m.messages = threading.Lock()
    m.triton_warmup = TritonWarmupSamples({})
    return m


def req(params=None):
    raw = np.frombuffer(EngineRequestParams(**(params or {})).to_bytes(), dtype=np.uint8)
    return ft.InferenceRequest(
        inputs=[
            ft.Tensor("input_ids", np.array([1, 2, 3], dtype=np.int64)),
            ft.Tensor("request_params", raw.copy()),
            ft.Tensor("priority", np.array([1], dtype=np.int32)),
            ft.Tensor("deadline_ns", np.array([0], dtype=np.int64)),
        ]
    )


def test_a_final_response_whose_send_failed_still_lets_the_request_end(engine_model):
    """The final window's send raises (an IPC/shared-memory failure): the engine's step fails and it ends
    the request with fail("INTERNAL"). That error must go out with the final flag, else the client hangs;
    TritonSink marked itself closed before the send succeeded, so the error is dropped."""

    class Engine:
        def submit(self, request, own=False):
            self.sink = request.sink

    engine = Engine()
    request = req()
    make(engine_model, engine).execute([request])
    request.sender.fail_next = 1
    with pytest.raises(RuntimeError):
        engine.sink.send([7, 8], 0, True, 0)  # raises into the engine's step
    engine.sink.fail("INTERNAL", "engine step failed: RuntimeError: ...")  # Engine._fail_all_active
    assert [flags for _, flags in request.sender.sent].count(FINAL) == 1, (
        f"nothing final ever reached Triton: {request.sender.sent}"
    )


def test_a_server_side_failure_in_submit_is_not_reported_as_the_clients_bad_input(engine_model):
    """engine.submit raising anything but RequestError (a cache tier, an inline semantic lookup, a bug) is a
    server error; execute() answered it INVALID_ARG "bad engine input", so clients never retry it. The
    lookup-thread path of the same submit answers INTERNAL."""

    class Engine:
        def submit(self, request, own=False):
            raise RuntimeError("semantic embedder failed")

    request = req()
    make(engine_model, Engine()).execute([request])
    ((response, flags),) = request.sender.sent
    assert flags == FINAL
    assert response.error().code() == ft.TritonError.INTERNAL, response.error().message()


@pytest.fixture
def observer(monkeypatch):
    series = ft.install_metrics(monkeypatch)
    from adapters.engine_metrics import TritonEngineObserver
    from engine.observer import GuardedObserver

    return GuardedObserver(TritonEngineObserver("llm_engine", threading.Lock()), lambda line: None), series


def test_a_queue_gauge_whose_message_failed_is_set_again(observer):
    """on_load remembers the load as published before its gauge messages went out: one that failed is
    never sent again while the load stays the same, so an idle engine reports its last busy queue forever
    (the drain waits for llm_engine_queue_depth == 0)."""
    obs, series = observer
    queue = series[("llm_engine_queue_depth", (("model", "llm_engine"),))]
    obs.on_load(5, 2, 100)
    queue.fail_next = 1
    obs.on_load(0, 0, 0)  # the message fails; GuardedObserver counts it
    obs.on_load(0, 0, 0)  # the next step: the engine still reads an empty queue
    assert queue.value == 0, f"llm_engine_queue_depth stuck at {queue.value} with an empty queue"
