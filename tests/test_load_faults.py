"""client.load and client.workload against a stalled server and bad input, no server needed (found in
review, 2026-12-07): a concurrency-limited run with a request that never answers ends at its timeout, a
request still open at the end is a timeout (never ok), export errors exit 2, both perf_analyzer exports
are in arrival order, and mix weights whose sum overflows are refused."""

from __future__ import annotations

import importlib
import io
import threading

import numpy as np
import pytest

from client.workload import PlannedRequest

# the modules, not the package's `generate` function of the same name
gen = importlib.import_module("client.generate")
load = importlib.import_module("client.load")


class NeverAnsweringClient:
    """Stands in for tritonclient's InferenceServerClient: accepts the stream and every request,
    never answers (a server that stalls)."""

    def __init__(self, url: str, **kw) -> None:
        self.url = url

    def start_stream(self, callback, stream_timeout=None) -> None:
        self.callback = callback

    def async_stream_infer(self, *a, **kw) -> None:
        pass

    def stop_stream(self, cancel_requests=False) -> None:
        pass

    def close(self) -> None:
        pass


class Words:
    """Prompts of n words, without the tokenizer a corpus needs."""

    def __init__(self, *_a) -> None:
        pass

    def texts(self, lengths, rng):
        return ["w " * n for n in lengths]


def plan(n: int, tier: str = "standard", gap: float = 0.0) -> list[PlannedRequest]:
    return [PlannedRequest(i * gap, tier, "tenant-0", f"p{i}", 4, 4) for i in range(n)]


def test_concurrency_limited_run_honours_timeout_when_a_request_never_answers(monkeypatch) -> None:
    """run_load's docstring: a request without a final response `timeout_s` after its send is a
    timeout. With --concurrency-limit, the send loop waits for a free slot with no deadline, so one
    stalled request hangs the whole run forever."""
    monkeypatch.setattr(gen.grpcclient, "InferenceServerClient", NeverAnsweringClient)
    box: dict = {}

    def go() -> None:
        box["records"] = load.run_load("x:1", plan(2), concurrency_limit=1, timeout_s=0.2)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive(), "run_load with concurrency_limit=1 hung although timeout_s=0.2"
    assert [r.outcome for r in box["records"]] == ["timeout", "timeout"]


def test_a_request_still_open_at_the_end_is_never_ok(monkeypatch) -> None:
    """A request that never got a final response must be a timeout, not a success. _drain stops at
    start + send + timeout_s, measured from run_load's `send`, while the session's clock for the same
    request starts later (inside submit, after building the inputs), so the last request's total_s
    comes out just under timeout_s and record_from_result calls the unanswered request 'ok'."""
    monkeypatch.setattr(gen.grpcclient, "InferenceServerClient", NeverAnsweringClient)
    outcomes = []
    for _ in range(10):
        records = load.run_load("x:1", plan(1), timeout_s=0.05)
        outcomes.append(records[0].outcome)
    assert outcomes == ["timeout"] * 10, outcomes


def test_cli_export_of_an_empty_plan_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch) -> None:
    """--count 0 (or a --duration too short for any arrival) with --export-perf-analyzer: the export
    raises ValueError outside main's try, so the CLI dies with a traceback instead of exit 2."""

    monkeypatch.setattr(load, "CorpusPrompts", Words)
    err = io.StringIO()
    argv = [
        "--count",
        "0",
        "--export-only",
        "--targets",
        "standard=100",
        "--export-perf-analyzer",
        str(tmp_path / "out.json"),
    ]
    try:
        rc = load.main(argv, io.StringIO(), err)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of a clear error: {exc!r}")
    assert rc == 2 and "error" in err.getvalue()


def test_cli_export_to_an_unwritable_path_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(load, "CorpusPrompts", Words)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = [
        "--count",
        "2",
        "--export-only",
        "--targets",
        "standard=100",
        "--export-intervals",
        str(blocker / "out.intervals"),
    ]
    err = io.StringIO()
    try:
        rc = load.main(argv, io.StringIO(), err)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of a clear error: {exc!r}")
    assert rc == 2 and "error" in err.getvalue()


def test_exports_pair_each_entry_with_its_own_arrival_for_an_unsorted_plan(tmp_path) -> None:
    """export_request_intervals sorts the plan by at_s, export_perf_analyzer_json keeps plan order;
    perf_analyzer pairs entry i with interval i, so a plan not already in time order (run_load accepts
    one and sorts it) is replayed with the wrong request at each arrival."""
    import json

    from client.workload import export_perf_analyzer_json, export_request_intervals

    requests = [
        PlannedRequest(2.0, "critical", "tenant-0", "late critical", 4, 4),
        PlannedRequest(0.5, "batch", "tenant-1", "early batch", 4, 4),
    ]
    data = json.loads(export_perf_analyzer_json(requests, tmp_path / "d.json", None).read_text())["data"]
    gaps_us = [int(x) for x in export_request_intervals(requests, tmp_path / "i.txt").read_text().split()]
    replay_at = np.cumsum(gaps_us) / 1e6
    by_prompt = {r.prompt: r.at_s for r in requests}
    for entry, at in zip(data, replay_at):
        assert by_prompt[entry["text_input"]["content"][0]] == pytest.approx(at)


def test_cli_mix_weights_whose_sum_overflows_are_a_clear_error(monkeypatch) -> None:
    """--mix critical=1e308,batch=1e308: each weight is finite so TierMix accepts it, the sum is inf,
    every fraction 0, assign() returns 2 tiers for 20 requests and generate() dies with IndexError."""

    monkeypatch.setattr(load, "CorpusPrompts", Words)
    argv = ["--count", "20", "--export-only", "--targets", "batch=100", "--mix", "critical=1e308,batch=1e308"]
    err = io.StringIO()
    try:
        rc = load.main(argv, io.StringIO(), err)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"traceback instead of a clear error: {exc!r}")
    assert rc == 2, err.getvalue()
