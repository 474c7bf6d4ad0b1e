"""Found in review: `python -m client load` counted an error as a rejection (load shedding, expected
under overload) when its text held "unavailable", "retry", "overload" or "shed" anywhere, so a failure
whose text happened to say "retry" was reported as shedding, and a run of them exited 0. The gRPC stream
carries no status code: what a rejection is must be told from a marker the server defines for its
UNAVAILABLE errors, wherever they come from, and only from that."""

from __future__ import annotations

import time

import pytest

from client.generate import GenerationResult
from client.load import is_rejection, record_from_result
from client.workload import PlannedRequest
from scheduler.admission import AdmissionController, EngineLoad
from scheduler.drain import DrainSwitch
from scheduler.errors import RequestError
from scheduler.slo_queue import SloQueue
from scheduler.tiers import TierTable
from tests import fake_triton_backend as ft
from tests.test_engine_batching import RecordingSink, make_engine, model, request  # noqa: F401

ENSEMBLE = "in ensemble 'llm', "  # what Triton's ensemble scheduler puts before a step's error


def outcome(error: str) -> str:
    plan = PlannedRequest(1.0, "batch", "t", "p", 4, 8)
    result = GenerationResult("", [], None, 0.5, error, "r")
    return record_from_result(0, plan, 1.2, result, timeout_s=10.0).outcome


def on_the_wire(monkeypatch, code: str, message: str) -> list[str]:
    """The texts a client reads for an error the server ends a request with: what the adapters hand
    Triton (`triton_error`, as llm_engine's sink and every step's error response do), from a model
    asked directly and from a step of the `llm` ensemble."""
    ft.install(monkeypatch)
    from adapters.triton_common import triton_error

    sent = triton_error(code, message).message()
    return [sent, ENSEMBLE + sent]


@pytest.mark.parametrize(
    "failure",
    [
        "engine step failed: RuntimeError: CUDA error: unspecified launch failure; retry the kernel",
        "request failed to start: ConnectionError: Redis retry limit reached",
        "ValueError: overloaded operator in template 'x'",
        "sampling the next token failed: RuntimeError: unavailable device",
    ],
)
def test_an_internal_error_whose_text_says_retry_is_a_failure_not_a_rejection(monkeypatch, failure):
    for text in [ENSEMBLE + failure, *on_the_wire(monkeypatch, "INTERNAL", failure)]:
        assert outcome(text) == "error", text


def server_rejections(engine) -> list[str]:  # noqa: F811
    """Every UNAVAILABLE message the scheduler and the engine send, produced by the code that sends it."""
    tiers = TierTable.defaults()
    load = EngineLoad(slots=1, running_requests=1, prefill_tokens_per_s=1.0, decode_step_s=1.0,
                      queued_prefill_tokens={"batch": 10**6}, queued_requests={"batch": 100})  # fmt: skip
    messages = [
        AdmissionController(tiers).check("batch", 100, load, time.time_ns()).error.message,  # shed
        AdmissionController(tiers, max_queued=1).check("batch", 1, load, time.time_ns()).error.message,
    ]
    queue = SloQueue(tiers, max_len=1)
    queue.push("a", 3, 0, key="a")
    with pytest.raises(RequestError) as full:
        queue.push("b", 3, 0, key="b")
    with pytest.raises(RequestError) as draining:
        DrainSwitch("/run/draining", exists=lambda path: True).admit()
    engine._accepting = False
    with pytest.raises(RequestError) as stopping:
        engine.submit(request([1, 2, 3], RecordingSink()))
    engine._accepting = True
    late = request([1, 2, 3], expired := RecordingSink(), rid="late")
    late.received_ns = time.time_ns() - 3600 * 10**9
    engine.submit(late)
    engine.step()
    unloaded = RecordingSink()
    engine.submit(request([1, 2, 3], unloaded, rid="unloaded"))
    engine.shutdown(drain_timeout_s=0.0)
    errors = [(e.code, e.message) for e in (full.value, draining.value, stopping.value)]
    errors += expired.errors + unloaded.errors
    assert {code for code, _ in errors} == {"UNAVAILABLE"}, errors
    return messages + [message for _, message in errors]


def test_every_rejection_the_server_sends_is_still_one(monkeypatch, model):  # noqa: F811
    rejections = server_rejections(make_engine(model, slots=1))
    assert len(rejections) == 7
    for message in rejections:
        for text in on_the_wire(monkeypatch, "UNAVAILABLE", message):
            assert is_rejection(text) and outcome(text) == "rejected", text
