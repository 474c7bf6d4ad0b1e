"""bench/coldstart.py: the engine-side 'first' figure of a length is that length's first request only (it
averaged in the previous length's idle-steady requests: found in review, 2026-12-07)."""

import argparse
import types

import bench.coldstart as coldstart

LOG: list[float] = []  # engine TTFT (ms) of every request the fake server answered, in order


class FakeStack:
    grpc_url = "fake:1"
    metrics_url = "http://fake/metrics"

    def stop(self):
        pass


class FakePrompts:
    def __init__(self, model_dir):
        pass

    def make(self, tokens):
        return str(tokens)


class FakeProbe:
    def __init__(self, url):
        pass

    def first_token_ms(self, prompt):
        ms = float(prompt)  # client and engine TTFT = the prompt length, so every request is identifiable
        LOG.append(ms)
        return ms, ms

    def close(self):
        pass


class FakeEngineTtft:
    def __init__(self, url):
        self.seen = len(LOG)

    def mean_ms_since_last(self):
        new = LOG[self.seen :]
        self.seen = len(LOG)
        return sum(new) / len(new) if new else float("nan")


def test_engine_first_excludes_previous_lengths_idle_steady_requests(monkeypatch):
    LOG.clear()
    monkeypatch.setattr(coldstart, "start_stack", lambda options: FakeStack())
    monkeypatch.setattr(coldstart, "PromptFactory", FakePrompts)
    monkeypatch.setattr(coldstart, "TtftProbe", FakeProbe)
    monkeypatch.setattr(coldstart, "EngineTtft", FakeEngineTtft)
    monkeypatch.setattr(
        coldstart, "time", types.SimpleNamespace(sleep=lambda s: None, perf_counter=lambda: 0.0)
    )
    args = argparse.Namespace(
        steady=3,
        idle_s=1.0,
        idle_steady=2,
        text_env=None,
        no_redis=True,
        device="cpu",
        dtype="float32",
        max_seq_len=2048,
    )
    result = coldstart.run_config(args, model_dir=None, warmup=True, lengths=[10, 1000])
    short, long = result.lengths
    assert short.engine_first_ms == [10.0]
    assert short.engine_steady_ms == [10.0]
    # the 1000-token length's first request took 1000 ms in the engine; the figure must say so,
    # not average in the two idle-steady 10-token requests of the previous length
    assert long.engine_first_ms == [1000.0]
