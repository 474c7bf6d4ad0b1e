"""Failure isolation in the engine loop: step faults, sampler faults, later requests. Found in review
(2026-12-07): a step fault left the load gauges at the failed batch; one request's sampler fault failed the
whole decode batch."""

from __future__ import annotations

import random

import pytest

from engine.observer import EngineObserver
from engine.sampling import Sampler
from tests.conftest import wait_for
from tests.test_engine_batching import RecordingSink, make_engine, model, request, run_until_idle  # noqa: F401


class LoadRecorder(EngineObserver):
    def __init__(self) -> None:
        self.loads: list[tuple[int, int, int]] = []
        self.finished: list[str] = []

    def on_load(self, queued: int, active: int, kv_tokens: int) -> None:
        self.loads.append((queued, active, kv_tokens))

    def on_finish(self, tier: str, status: str, tokens: int) -> None:
        self.finished.append(status)


def raise_on_call(obj, name, n, exc=RuntimeError("CUDA out of memory (injected)")):
    real = getattr(obj, name)
    calls = {"n": 0}

    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(*a, **k)

    setattr(obj, name, wrapped)
    return calls


def test_load_gauge_returns_to_zero_after_a_decode_step_fault(model):  # noqa: F811
    """A decode step that raises fails the batch; the gauges must then say nothing runs (not stay at
    the last step's values until the next request comes)."""
    engine = make_engine(model, slots=2)
    recorder = LoadRecorder()
    engine.observer = recorder
    raise_on_call(engine.runner, "decode", 2)
    sinks = [RecordingSink(), RecordingSink()]
    engine.submit(request([1, 2, 3], sinks[0], rid="a", max_tokens=6))
    engine.submit(request([1, 4, 5], sinks[1], rid="b", max_tokens=6))
    engine.start()
    try:
        assert wait_for(lambda: all(s.finished for s in sinks), 15)
        assert all(s.errors and s.errors[0][0] == "INTERNAL" for s in sinks)
        assert wait_for(lambda: not engine._active and sorted(engine._free) == [0, 1], 5)
        assert recorder.finished.count("error") == 2
        # the loop goes idle; give it well over a second to publish
        assert wait_for(lambda: recorder.loads and recorder.loads[-1] == (0, 0, 0), 3), (
            f"load gauges stuck after a step fault: last published {recorder.loads[-1:]}"
        )
    finally:
        engine.shutdown(drain_timeout_s=0)


def test_a_sampler_fault_in_one_request_fails_that_request_only(model):  # noqa: F811
    """One request's sampler raises in a batched decode (NaN/inf probabilities make multinomial raise):
    that request ends INTERNAL; its greedy neighbour decodes on and matches a clean engine's output."""
    clean = make_engine(model, slots=2)
    ref = RecordingSink()
    clean.submit(request([1, 2, 3], ref, rid="g", max_tokens=6))
    run_until_idle(clean)

    engine = make_engine(model, slots=2)
    real_pick = Sampler.pick
    calls = {"n": 0}

    def pick(self, logits):
        calls["n"] += 1
        if calls["n"] == 2:  # its first decode pick
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_pick(self, logits)

    greedy, sampled = RecordingSink(), RecordingSink()
    engine.submit(request([1, 2, 3], greedy, rid="g", max_tokens=6))
    engine.submit(request([1, 4, 5], sampled, rid="s", max_tokens=6, temperature=1.0, seed=1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Sampler, "pick", pick)
        engine.start()
        try:
            assert wait_for(lambda: greedy.finished and sampled.finished, 15)
            assert sampled.errors and sampled.errors[0][0] == "INTERNAL"
            assert not greedy.errors, f"a neighbour's sampler fault failed this request: {greedy.errors}"
            assert greedy.tokens == ref.tokens
            assert wait_for(lambda: not engine._active and sorted(engine._free) == [0, 1], 5)
        finally:
            engine.shutdown(drain_timeout_s=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_faults_leave_a_serving_engine(model, seed):  # noqa: F811
    """Random prefill/decode faults over a random schedule: every request gets one final answer, slots
    are all free at the end, and a request after the faults matches a clean engine's output."""
    rng = random.Random(seed)
    clean = make_engine(model, slots=3)
    probe = [1, 7, 9, 11, 13]
    ref = RecordingSink()
    clean.submit(request(probe, ref, rid="p", max_tokens=8))
    run_until_idle(clean)

    engine = make_engine(model, slots=3)
    recorder = LoadRecorder()
    engine.observer = recorder
    raise_on_call(engine.runner, "prefill", rng.randint(1, 6))
    raise_on_call(engine.runner, "decode", rng.randint(1, 12))
    sinks = []
    for i in range(8):
        s = RecordingSink()
        sinks.append(s)
        prompt = [1] + [rng.randint(3, 299) for _ in range(rng.randint(1, 20))]
        engine.submit(request(prompt, s, rid=f"r{i}", max_tokens=rng.randint(1, 10)))
        for _ in range(rng.randint(0, 3)):
            try:
                engine.step()
            except RuntimeError:
                engine._fail_all_active("INTERNAL", "step failed")
    for _ in range(500):
        try:
            if not engine.step():
                break
        except RuntimeError:
            engine._fail_all_active("INTERNAL", "step failed")
    for s in sinks:
        finals = len(s.errors) + sum(1 for *_, f in s.windows if f)
        assert finals == 1
    assert not engine._active and sorted(engine._free) == [0, 1, 2]
    assert len(recorder.finished) == 8
    out = RecordingSink()
    engine.submit(request(probe, out, rid="p", max_tokens=8))
    run_until_idle(engine)
    assert out.tokens == ref.tokens and not out.errors
