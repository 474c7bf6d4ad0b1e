"""The load generator: summary arithmetic and outcome classification (no server), then a short open-loop
run and a perf_analyzer run of the exported plan against the real stack (`grpc_url`)."""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import wait_for

from client.arrivals import arrival_times
from client.generate import GenerationResult
from client.metrics import IN_FLIGHT_METRICS, holds_requests, metric_total, scrape_metrics
from client.load import main as load_main
from client.load import (
    RequestRecord,
    is_rejection,
    record_from_result,
    records_from_profile,
    run_load,
    summarize,
    summary_table,
)
from deploy.launch import find_free_port
from client.workload import (
    DEFAULT_MODEL_DIR,
    CorpusPrompts,
    LengthDistribution,
    PlannedRequest,
    TierMix,
    Workload,
    export_perf_analyzer_json,
    export_request_intervals,
    read_perf_analyzer_profile,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def rec(
    tier: str, outcome: str = "ok", ttft_ms: float | None = 10.0, tpot_ms: float | None = 5.0
) -> RequestRecord:
    ttft = None if ttft_ms is None else ttft_ms / 1000
    tpot = None if tpot_ms is None else tpot_ms / 1000
    return RequestRecord(0, tier, "t", 0.0, 0.0, 8, 4, outcome, ttft, tpot, 0.1, 4, None)


def test_summary_percentiles_attainment_and_failure_counts() -> None:
    records = [rec("critical", ttft_ms=float(ms)) for ms in range(1, 101)]  # 1..100 ms
    records += [rec("critical", "rejected", None, None), rec("critical", "timeout", None, None)]
    records += [rec("batch", ttft_ms=500.0), rec("batch", "error", None, None)]
    rows = {r.tier: r for r in summarize(records, {"critical": 50.0, "standard": 100.0, "batch": 1000.0})}
    assert list(rows) == ["critical", "batch", "all"]  # tiers without requests are left out
    crit = rows["critical"]
    assert (crit.count, crit.ok, crit.rejections, crit.timeouts, crit.errors) == (102, 100, 1, 1, 0)
    assert crit.ttft_p50_ms == pytest.approx(50.5) and crit.ttft_p99_ms == pytest.approx(99.01)
    assert crit.attainment == pytest.approx(50 / 102)  # failures are misses
    assert rows["batch"].attainment == 0.5 and rows["batch"].errors == 1
    assert rows["all"].count == 104 and rows["all"].attainment == pytest.approx(51 / 104)
    table = summary_table(list(rows.values()))
    assert "| critical | 102" in table and "49.0%" in table


def test_summary_tier_without_target_has_no_attainment() -> None:
    (row, _all) = summarize([rec("warmup")], {})
    assert row.tier == "warmup" and math.isnan(row.attainment) and math.isnan(row.target_ms)
    assert "| warmup" in summary_table([row])


def test_rejections_are_told_apart_from_errors_and_timeouts() -> None:
    plan = PlannedRequest(1.0, "batch", "t", "p", 4, 8)

    def outcome(
        error: str | None, total_s: float = 0.5, pieces: tuple[str, ...] = ("a", "b", "", "c")
    ) -> str:
        result = GenerationResult("", list(pieces), 0.1, total_s, error, "r")
        return record_from_result(0, plan, 1.2, result, timeout_s=10.0).outcome

    assert outcome(None) == "ok"
    assert outcome(None, total_s=11.0) == "timeout"
    # the gRPC stream carries no status code: UNAVAILABLE errors' text starts with UNAVAILABLE_PREFIX
    assert outcome("in ensemble 'llm', UNAVAILABLE: tier 'batch' request shed; retry in 2 s") == "rejected"
    assert outcome("in ensemble 'llm', unknown slo_tier 'x'; allowed: critical") == "error"
    assert is_rejection("UNAVAILABLE: the engine is shutting down; retry on another replica")
    assert not is_rejection("engine step failed: RuntimeError: CUDA error; retry")
    ok = record_from_result(
        0, plan, 1.2, GenerationResult("", ["a", "b", "", "c"], 0.1, 0.5, None, "r"), 10.0
    )
    assert ok.output_tokens == 3 and ok.tpot_s == pytest.approx(0.2) and ok.send_lag_s == pytest.approx(0.2)


def test_the_cli_computes_every_answer_by_default_and_exports_that(tmp_path: Path) -> None:
    """A greedy plan replayed with the server's default (`use`) is answered from the exact response cache
    from a prompt's second sighting on: perf_analyzer then measured that cache at ~700 requests/s, not
    serving (found by a README walkthrough). The CLI sends and exports `kv-only` unless told otherwise."""
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("make setup builds models/tiny-llama")
    modes = {}
    for extra, name in (([], "default"), (["--cache", "use"], "use")):
        path = tmp_path / f"{name}.json"
        argv = ["--count", "3", "--export-only", "--export-perf-analyzer", str(path), *extra]
        assert load_main(argv, io.StringIO(), io.StringIO()) == 0
        modes[name] = {e["cache"]["content"][0] for e in json.loads(path.read_text())["data"]}
    assert modes == {"default": {"kv-only"}, "use": {"use"}}


def test_the_cli_exits_1_when_requests_fail() -> None:
    """A run whose requests all failed (no server) must not look like a success to a script."""
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("make setup builds models/tiny-llama")
    out = io.StringIO()
    argv = ["--url", f"localhost:{find_free_port()}", "--count", "2", "--rate", "50", "--timeout", "10"]
    assert load_main(argv, out, io.StringIO()) == 1
    assert "error example" in out.getvalue()


# ------------------------------------------------------------------------------------ against a server


@pytest.fixture(scope="module")
def tiny_plan() -> list[PlannedRequest]:
    if not (DEFAULT_MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("make setup builds models/tiny-llama")
    workload = Workload(
        prompts=CorpusPrompts(DEFAULT_MODEL_DIR),
        mix=TierMix({"critical": 0.25, "warmup": 0.1, "standard": 0.4, "batch": 0.25}),
        prompt_lengths=LengthDistribution(median=16, sigma=0.6, minimum=4, maximum=64),
        output_lengths=LengthDistribution(median=3, sigma=0.3, minimum=2, maximum=4),
    )
    return workload.generate(arrival_times("poisson", 10.0, count=20, seed=4), seed=4)


def test_open_loop_run_completes_with_plausible_latencies(
    grpc_url: str, tiny_plan: list[PlannedRequest]
) -> None:
    progress = []
    records = run_load(grpc_url, tiny_plan, on_progress=progress.append, progress_every_s=0.5, timeout_s=60.0)
    assert len(records) == 20
    failed = [(r.tier, r.outcome, r.error) for r in records if r.outcome != "ok"]
    assert not failed
    assert [r.tier for r in records] == [p.tier for p in tiny_plan]
    assert [r.tenant for r in records] == [p.tenant for p in tiny_plan]
    assert Counter(r.tier for r in records) == Counter(p.tier for p in tiny_plan)
    for r, p in zip(records, tiny_plan):
        assert r.planned_s == p.at_s and -0.001 <= r.send_lag_s < 0.5  # sent on time: open loop
        assert 0 < r.ttft_s < 5.0 and r.ttft_s <= r.total_s
        assert 1 <= r.output_tokens <= p.max_tokens
        assert r.tpot_s is None or 0 < r.tpot_s < 2.0
    assert any(r.tpot_s is not None for r in records)
    assert progress and progress[-1].sent == 20 and progress[-1].in_flight == 0
    rows = summarize(
        records, {"critical": 60_000.0, "warmup": 60_000.0, "standard": 60_000.0, "batch": 60_000.0}
    )
    assert rows[-1].tier == "all" and rows[-1].ok == 20 and rows[-1].attainment == 1.0


def test_a_burst_of_cache_hits_from_many_streams_is_served(
    grpc_url: str, metrics_url: str, tiny_plan: list[PlannedRequest]
) -> None:
    """300 requests at 120/s, the plan's 20 prompts again and again (mostly exact-cache hits, answered on
    Triton's execute thread while the engine loop runs): before the engine process sent its metric
    messages one at a time, this crashed the server in about one start in six (adapters/stub_messages.py)."""
    times = arrival_times("poisson", 120.0, count=300, seed=7)
    burst = [replace(tiny_plan[i % len(tiny_plan)], at_s=float(t)) for i, t in enumerate(times)]
    before = metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", status="cached")
    records = run_load(grpc_url, burst, timeout_s=60.0)
    assert [(r.outcome, r.error) for r in records if r.outcome != "ok"] == []
    cached = metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", status="cached")
    assert cached - before >= 150  # the burst was mostly hits, the case that crashed


def _perf_analyzer() -> tuple[str, str] | None:
    """(binary, extra LD_LIBRARY_PATH) from the environment or `.tools/env.sh` (make setup)."""
    values = {k: os.environ.get(k, "") for k in ("PERF_ANALYZER", "PERF_ANALYZER_LD_LIBRARY_PATH")}
    env_sh = REPO_ROOT / ".tools" / "env.sh"
    if not values["PERF_ANALYZER"] and env_sh.exists():
        for key, value in re.findall(r"^export (\w+)=(.*)$", env_sh.read_text(), re.MULTILINE):
            if key in values:
                values[key] = value.strip().strip("'\"")
    binary = values["PERF_ANALYZER"]
    return (binary, values["PERF_ANALYZER_LD_LIBRARY_PATH"]) if binary and Path(binary).exists() else None


def _server_state(stack) -> str:
    """What the server holds in flight and its log's tail, for a hang's report."""
    try:
        metrics = scrape_metrics(stack.metrics_url)
    except OSError as exc:
        metrics, lines = {}, [f"metrics unreadable: {exc}"]
    else:
        lines = []
    lines += [
        f"{key} {value:g}" for key, value in sorted(metrics.items()) if key.split("{")[0] in IN_FLIGHT_METRICS
    ]
    log_tail = Path(stack.triton_log).read_text(errors="replace").splitlines()[-40:]
    return "\n".join(["server state:", *lines, "tritonserver log tail:", *log_tail])


def _llm_completed(metrics_url: str) -> float:
    """Requests the ensemble finished (its final response sent), as Triton counts them."""
    return metric_total(scrape_metrics(metrics_url), "nv_inference_request_success", model="llm")


@dataclass
class PerfAnalyzerHang(Exception):
    """perf_analyzer ran past its time; `server_done`: the server had finished every request it was sent
    (so perf_analyzer lost track of one)."""

    server_done: bool
    report: str


def _run_perf_analyzer(command: list[str], env: dict[str, str], stack, requests: int, timeout_s: float):
    """(exit status, output); past the timeout, interrupts it (it then prints what it measured) and raises
    PerfAnalyzerHang with its output and the server's state."""
    before = _llm_completed(stack.metrics_url)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        completed = _llm_completed(stack.metrics_url) - before
        state = _server_state(stack)
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        report = f"after {timeout_s:g} s the server had finished {completed:g} of {requests} requests\n"
        raise PerfAnalyzerHang(completed >= requests, report + output[-3000:] + "\n" + state) from None


def test_perf_analyzer_accepts_the_exported_plan(
    stack, grpc_url: str, metrics_url: str, tiny_plan: list[PlannedRequest], tmp_path: Path
) -> None:
    """perf_analyzer replays the exported plan through the real stack. If perf_analyzer hangs although the
    server finished all 20 requests, the run is repeated once (with a warning); a request the server did
    not finish fails the test at once, with the server's state."""
    found = _perf_analyzer()
    if found is None:
        pytest.skip("perf_analyzer not installed (make setup)")
    binary, libs = found
    data = export_perf_analyzer_json(tiny_plan, tmp_path / "plan.json")
    intervals = export_request_intervals(tiny_plan, tmp_path / "plan.intervals")
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")]))}
    for attempt in (1, 2):
        profile = tmp_path / f"profile-{attempt}.json"
        command = [binary, "-m", "llm", "-i", "grpc", "--streaming", "-u", grpc_url,
                   "--input-data", str(data), "--request-intervals", str(intervals), "--request-count", "20",
                   "--profile-export-file", str(profile)]  # fmt: skip
        try:
            returncode, output = _run_perf_analyzer(command, env, stack, requests=20, timeout_s=60.0)
            break
        except PerfAnalyzerHang as hang:
            if not hang.server_done or attempt == 2:
                pytest.fail(f"perf_analyzer did not finish: {hang.report}")
            warnings.warn(f"perf_analyzer hung with every request served; run again. {hang.report[:2000]}")
    assert returncode == 0, output[-3000:]
    served = re.search(
        r"Server:\s+Inference count: \d+\s+Execution count: \d+\s+Successful request count: (\d+)", output
    )
    assert served and int(served.group(1)) == 20, output[-3000:]
    profiled = read_perf_analyzer_profile(profile)
    assert len(profiled) == 20
    # a prompt this session already served greedily comes back from the response cache in one piece
    assert all(0 < p.ttft_s <= p.total_s < 30 and p.responses >= 1 for p in profiled)
    by_experiment = records_from_profile(profiled)
    (records,) = by_experiment.values()
    assert Counter(r.tier for r in records) == Counter(p.tier for p in tiny_plan)  # the same mix, replayed
    assert all(r.tenant for r in records)
    assert summarize(records, {})[-1].count == len(profiled)

    # and the server let go of every request: nothing left queued, holding a slot or pending in Triton
    assert wait_for(lambda: not holds_requests(scrape_metrics(metrics_url)), timeout_s=10.0), _server_state(
        stack
    )
