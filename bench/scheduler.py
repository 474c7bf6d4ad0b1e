"""Scheduler benchmark: five queue policies on the same open-loop arrivals, swept over the arrival rate.

Policies (one fresh stack each, so no policy inherits another's prefix cache or measured rates):
  fifo             engine queue in arrival order
  triton-priority  engine fifo, plus Triton request priority = the tier's priority on each request
  priority         static tier precedence, arrival order within a tier (no aging, no feedback)
  edf              earliest first-token deadline (arrival + tier target) across all tiers
  slo              the full scheduler: precedence with aging, EDF within a tier, per-tenant fair share,
                   admission control (sheddable tiers refused with UNAVAILABLE when predicted late), and
                   the feedback loop (engine/slo_feedback.py: per-tier TTFT through the stack's Redis
                   adapts tier weights and admission thresholds; adaptations counted from its metrics)

Admission control is the scheduler's, so by default only `slo` runs with it; the baselines run with
`admission_control=false` (as in scheduler/simulation.py), i.e. they queue everything
(`--baseline-admission on` gives them the same admission controller).

"triton-priority": client/load.py's run_load has no per-request priority argument, so the requests
cannot carry a Triton priority from here. It would not matter: the engine step is decoupled and its
execute() returns at once, so Triton's own queue stays empty, and no step of the `llm` ensemble
declares priority_levels, so Triton would reset a step's priority to 0 anyway (shared/DESIGN.md).
It therefore runs exactly as fifo, on a fresh stack; the gap between the two rows is run-to-run noise.

Method. A short probe first measures the engine's capacity (requests/s with every slot busy: a burst of
requests sent at once, completions / makespan) on the fifo stack; the swept rates are fractions of it
(`--load-fractions`), so the sweep goes from below to above saturation on any machine. For each rate
the arrival schedule (gamma gaps, CV 3), the tier mix (critical 0.2, standard 0.5, batch 0.3), the
tenants (Zipf) and the heavy-tailed (lognormal) prompt and output lengths come from one seed per
rate, identical for every policy. Requests planned in the first `--warmup-s` seconds are sent but
excluded from the statistics. Rates run in ascending order on each stack; between rates the bench
waits for the engine's queue and slots to empty.

Reports per policy and rate: critical attainment (share of *all* critical requests whose TTFT met the
target; rejections, errors and timeouts are misses), TTFT P50/P95/P99 per tier, TPOT P95, batch-tier
completions and throughput, rejections and timeouts, the batch tier's longest wait (max TTFT), and per
policy the critical goodput: the highest swept rate at which >= 95% of critical requests met the
target (at that rate and every lower one), with the ratio slo / fifo. Writes
bench/results/scheduler-<tag>.{json,md,png} (attainment against rate per policy).

    python -m bench.scheduler                       # CPU, tiny model, ~7 minutes on 2 cores
    python -m bench.scheduler --rates 3,6,12 --duration 15 --policies fifo,slo
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.common import REPO_ROOT, print_table, progress, write_results
from client.arrivals import arrival_times, gap_cv
from client.load import RequestRecord, run_load, summarize
from client.metrics import metric_total, scrape_metrics
from client.workload import CorpusPrompts, LengthDistribution, TenantSkew, TierMix, Workload
from deploy.launch import StackOptions, start_stack

# CPU targets for the tiny model (cpu_scale 1: the figures below are what the engine enforces).
TIERS_YAML = """\
# bench/scheduler.py: CPU targets for the tiny model; cpu_scale 1 so these are the enforced values.
default_tier: standard
cpu_scale: 1.0
tiers:
  critical: {priority: 1, ttft_target_ms: 150, percentile: 95, sheddable: false, max_queue_ms: 3000}
  warmup:   {priority: 2, ttft_target_ms: 300, percentile: 95, sheddable: false, max_queue_ms: 10000}
  standard: {priority: 3, ttft_target_ms: 1000, percentile: 95, sheddable: false, max_queue_ms: 10000}
  batch:    {priority: 4, ttft_target_ms: 8000, percentile: 90, sheddable: true, max_queue_ms: 30000}
"""
TARGETS_MS = {"critical": 150.0, "standard": 1000.0, "batch": 8000.0}
TIER_PRIORITY = {"critical": 1, "warmup": 2, "standard": 3, "batch": 4}
MIX = {"critical": 0.2, "standard": 0.5, "batch": 0.3}
GOODPUT_ATTAINMENT = 0.95

# policy name -> engine queue policy
POLICIES = {"fifo": "fifo", "triton-priority": "fifo", "priority": "priority", "edf": "edf", "slo": "slo"}
ADMISSION_POLICIES = ("slo",)


def load_supports_priority() -> bool:
    """Whether client.load.run_load can put a Triton request priority on each request."""
    return "priority" in inspect.signature(run_load).parameters


TRITON_PRIORITY_NOTE = (
    "triton-priority ran as engine fifo without a Triton request priority: client.load.run_load has no "
    "priority argument. With a decoupled engine Triton's own queue stays empty (execute() returns at "
    "once) and no step of the llm ensemble declares priority_levels (Triton would reset the step's "
    "priority to 0), so Triton priority levels alone cannot reorder anything: this row equals fifo, and "
    "its difference from the fifo row is run-to-run noise."
)


# ------------------------------------------------------------------------------------------ results


@dataclass
class TierStats:
    n: int
    ok: int
    attainment: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    tpot_p95_ms: float
    rejected: int
    errors: int
    timeouts: int


@dataclass
class RunResult:
    policy: str
    engine_policy: str
    admission: bool
    rate: float
    seed: int
    planned: int
    measured: int
    window_s: float
    gap_cv: float
    tiers: dict[str, TierStats]
    tpot_p95_ms: float
    batch_throughput_rps: float
    batch_tokens_per_s: float
    rejected: int
    timeouts: int
    errors: int
    max_send_lag_ms: float
    wall_s: float
    engine_adaptations: float
    load_avg_1m: tuple[float, float] = (float("nan"), float("nan"))  # machine load before / after the run
    tier_control: dict[str, float] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)

    @property
    def critical_attainment(self) -> float:
        return self.tiers["critical"].attainment if "critical" in self.tiers else float("nan")


def _max_ms(records: list[RequestRecord]) -> float:
    values = [r.ttft_s for r in records if r.outcome == "ok" and r.ttft_s is not None]
    return max(values) * 1000.0 if values else float("nan")


def analyse(
    policy: str, rate: float, seed: int, records: list[RequestRecord], warmup_s: float, duration_s: float,
    wall_s: float, adaptations: float, tier_control: dict[str, float], gap: float,
) -> RunResult:  # fmt: skip
    measured = [r for r in records if r.planned_s >= warmup_s]
    window = max(1e-9, duration_s - warmup_s)
    rows = {row.tier: row for row in summarize(measured, TARGETS_MS)}
    tiers: dict[str, TierStats] = {}
    for tier in TARGETS_MS:
        row = rows.get(tier)
        if row is None:
            continue
        tier_records = [r for r in measured if r.tier == tier]
        tiers[tier] = TierStats(
            row.count, row.ok, row.attainment, row.ttft_p50_ms, row.ttft_p95_ms, row.ttft_p99_ms,
            _max_ms(tier_records), row.tpot_p95_ms, row.rejections, row.errors, row.timeouts,
        )  # fmt: skip
    tpots = [r.tpot_s for r in measured if r.tpot_s is not None]
    batch_ok = [r for r in measured if r.tier == "batch" and r.outcome == "ok"]
    errors = [r for r in measured if r.outcome == "error"]
    return RunResult(
        policy=policy,
        engine_policy=POLICIES[policy],
        admission=False,
        rate=rate,
        seed=seed,
        planned=len(records),
        measured=len(measured),
        window_s=window,
        gap_cv=gap,
        tiers=tiers,
        tpot_p95_ms=float(np.percentile(tpots, 95)) * 1000.0 if tpots else float("nan"),
        batch_throughput_rps=len(batch_ok) / window,
        batch_tokens_per_s=sum(r.output_tokens for r in batch_ok) / window,
        rejected=sum(1 for r in measured if r.outcome == "rejected"),
        timeouts=sum(1 for r in measured if r.outcome == "timeout"),
        errors=len(errors),
        max_send_lag_ms=max((r.send_lag_s for r in records), default=0.0) * 1000.0,
        wall_s=wall_s,
        engine_adaptations=adaptations,
        tier_control=tier_control,
        error_examples=sorted({(r.error or "")[:200] for r in errors})[:3],
    )


def critical_goodput(runs: list[RunResult]) -> float:
    """Highest swept rate at which >= 95% of critical requests met the target, at it and every lower
    rate (0 when even the lowest rate misses)."""
    best = 0.0
    for run in sorted(runs, key=lambda r: r.rate):
        if not run.critical_attainment >= GOODPUT_ATTAINMENT:
            break
        best = run.rate
    return best


# ----------------------------------------------------------------------------------------- running


def workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    return Workload(
        prompts=CorpusPrompts(model_dir),
        mix=TierMix(MIX),
        tenants=TenantSkew(args.tenants, 1.1),
        prompt_lengths=LengthDistribution(args.prompt_median, 1.0, 4, args.prompt_max),
        output_lengths=LengthDistribution(args.output_median, 0.8, 2, args.output_max),
    )


def engine_idle(metrics_url: str, timeout_s: float) -> bool:
    """Wait until the engine has nothing queued and no slot busy (left-overs of the previous rate)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            m = scrape_metrics(metrics_url)
            if (
                metric_total(m, "llm_engine_queue_depth") == 0
                and metric_total(m, "llm_engine_active_requests") == 0
            ):
                return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def feedback_state(metrics_url: str) -> tuple[float, dict[str, float]]:
    """Total feedback adaptations so far and the tier weights/thresholds the engine exports (if any)."""
    try:
        m = scrape_metrics(metrics_url)
    except OSError:
        return float("nan"), {}
    control = {k: v for k, v in m.items() if k.startswith("llm_scheduler_tier_control")}
    return metric_total(m, "llm_scheduler_adaptations_total"), control


def probe_capacity(url: str, wl: Workload, args: argparse.Namespace) -> float:
    """Requests/s the engine completes with every slot busy: `--probe-count` requests sent within
    ~0.5 s (same length distributions, all tier standard), completions / makespan."""
    times = np.linspace(0.0, 0.5, args.probe_count)
    plan = [replace(p, tier="standard") for p in wl.generate(times, seed=args.seed + 99_991)]
    started = time.perf_counter()
    records = run_load(url, plan, timeout_s=args.timeout)
    ok = [r for r in records if r.outcome == "ok"]
    if not ok:
        raise RuntimeError(
            f"capacity probe: no request succeeded; e.g. {records[0].error if records else '-'}"
        )
    makespan = max(r.send_s + r.total_s for r in ok) - min(r.send_s for r in records)
    capacity = len(ok) / makespan
    progress(
        f"probe: {len(ok)}/{len(records)} requests done in {makespan:.1f} s -> capacity "
        f"~{capacity:.1f} req/s ({time.perf_counter() - started:.1f} s)"
    )
    return capacity


def run_policy(
    policy: str, rates: list[float] | None, args: argparse.Namespace, model_dir: Path, wl: Workload,
    tiers_file: Path, schedules: dict,
) -> tuple[list[RunResult], list[float] | None, float | None]:  # fmt: skip
    """Start a stack for `policy`, (probe if no rates yet), run every rate; returns runs, rates, capacity."""
    admission = policy in ADMISSION_POLICIES or args.baseline_admission == "on"
    run_dir = REPO_ROOT / ".run" / f"bench-scheduler-{policy}"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = {
        "llm_engine": {
            "max_batch_size": str(args.slots),
            "plan_kv_from_traffic": "false",
            "admission_control": "true" if admission else "false",
        }
    }
    options = StackOptions(
        run_dir=run_dir,
        model_dir=model_dir,
        warmup=True,
        overrides=overrides,
        extra_env={"LLM_QUEUE_POLICY": POLICIES[policy], "LLM_TIERS_FILE": str(tiers_file)},
    )
    progress(
        f"{policy}: starting a stack (engine queue {POLICIES[policy]}, "
        f"admission {'on' if admission else 'off'})"
    )
    capacity = None
    runs: list[RunResult] = []
    with start_stack(options) as stack:
        if rates is None:
            capacity = probe_capacity(stack.grpc_url, wl, args)
            rates = [round(f * capacity, 1) for f in args.load_fractions]
            engine_idle(stack.metrics_url, 60)
        for index, rate in enumerate(rates):
            seed = args.seed + 1000 * index
            if rate not in schedules:
                times = arrival_times("gamma", rate, duration_s=args.duration, cv=args.cv, seed=seed)
                schedules[rate] = (seed, times, wl.generate(times, seed=seed))
            seed, times, plan = schedules[rate]
            before, _ = feedback_state(stack.metrics_url)
            load_before = os.getloadavg()[0]
            started = time.perf_counter()
            records = run_load(stack.grpc_url, plan, timeout_s=args.timeout)
            wall = time.perf_counter() - started
            idle = engine_idle(stack.metrics_url, 60)
            after, control = feedback_state(stack.metrics_url)
            result = analyse(
                policy, rate, seed, records, args.warmup_s, args.duration, wall, after - before, control,
                gap_cv(times),
            )  # fmt: skip
            result.admission = admission
            result.load_avg_1m = (load_before, os.getloadavg()[0])
            runs.append(result)
            crit = result.tiers.get("critical")
            progress(
                f"{policy} @ {rate:g} req/s: {len(plan)} requests in {wall:.1f} s; critical attainment "
                f"{result.critical_attainment:.1%} "
                f"(P95 {crit.ttft_p95_ms if crit else float('nan'):.0f} ms); "
                f"rejected {result.rejected}, timeouts {result.timeouts}, errors {result.errors}; "
                f"load avg {result.load_avg_1m[0]:.1f} -> {result.load_avg_1m[1]:.1f}"
                + ("" if idle else "; engine not idle 60 s after the run")
            )
    return runs, rates, capacity


# ------------------------------------------------------------------------------------------ output


def _f(value: float, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pcts(stats: TierStats | None) -> str:
    if stats is None:
        return "-"
    return f"{_f(stats.ttft_p50_ms)}/{_f(stats.ttft_p95_ms)}/{_f(stats.ttft_p99_ms)}"


def results_table(runs: list[RunResult]) -> str:
    headers = [
        "policy", "rate /s", "n", "crit attain", "crit TTFT p50/p95/p99 ms", "std TTFT p50/p95/p99 ms",
        "batch TTFT p50/p95/p99 ms", "TPOT p95 ms", "batch done", "batch req/s", "rejected c/s/b",
        "timeouts", "batch max wait s", "std attain", "batch attain", "load avg",
    ]  # fmt: skip
    rows = []
    for r in runs:
        c, s, b = (r.tiers.get(t) for t in ("critical", "standard", "batch"))
        rows.append([
            r.policy, f"{r.rate:g}", r.measured, _pct(r.critical_attainment), _pcts(c), _pcts(s), _pcts(b),
            _f(r.tpot_p95_ms, 1), f"{b.ok}/{b.n}" if b else "-", _f(r.batch_throughput_rps, 2),
            "/".join(str(x.rejected) if x else "0" for x in (c, s, b)), r.timeouts,
            _f(b.ttft_max_ms / 1000.0 if b else float("nan"), 2), _pct(s.attainment if s else float("nan")),
            _pct(b.attainment if b else float("nan")), _f(max(r.load_avg_1m), 1),
        ])  # fmt: skip
    return print_table(headers, rows)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def goodput_table(by_policy: dict[str, list[RunResult]], rates: list[float]) -> tuple[str, dict]:
    goodput = {p: critical_goodput(runs) for p, runs in by_policy.items()}
    base = goodput.get("fifo")
    rows, ratios = [], {}
    for policy, value in goodput.items():
        if base:
            ratio = value / base
            text = f"{ratio:.2f}x"
        elif value:
            ratio, text = float("inf"), f"fifo 0 (below {min(rates):g}/s); this {value:g}/s"
        else:
            ratio, text = float("nan"), "both below the lowest rate"
        ratios[policy] = ratio
        shown = f"{value:g}" if value else f"< {min(rates):g} (none met)"
        rows.append([policy, shown, text])
    table = print_table(["policy", "critical goodput req/s (>=95% within target)", "vs fifo"], rows)
    return table, {"goodput_rps": goodput, "ratio_vs_fifo": ratios}


def plot(by_policy: dict[str, list[RunResult]], capacity: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    markers = {"fifo": "o", "triton-priority": "x", "priority": "s", "edf": "^", "slo": "D"}
    for policy, runs in by_policy.items():
        runs = sorted(runs, key=lambda r: r.rate)
        x = [r.rate for r in runs]
        ax1.plot(
            x, [100 * r.critical_attainment for r in runs], marker=markers.get(policy, "."), label=policy
        )
        ax2.plot(
            x, [r.tiers["critical"].ttft_p95_ms if "critical" in r.tiers else float("nan") for r in runs],
            marker=markers.get(policy, "."), label=policy,
        )  # fmt: skip
    ax1.axhline(100 * GOODPUT_ATTAINMENT, color="grey", linestyle=":", label="95%")
    ax2.axhline(TARGETS_MS["critical"], color="grey", linestyle=":", label="target 150 ms")
    for ax in (ax1, ax2):
        if capacity:
            ax.axvline(capacity, color="red", alpha=0.3, label=f"probed capacity {capacity:.1f}/s")
        ax.set_xlabel("offered rate (req/s, gamma arrivals CV 3)")
        ax.legend(fontsize=8)
    ax1.set_ylabel("critical requests within 150 ms TTFT (%)")
    ax1.set_title("Critical-tier SLO attainment")
    ax2.set_ylabel("critical TTFT P95 (ms)")
    ax2.set_yscale("log")
    ax2.set_title("Critical-tier TTFT P95")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_state() -> dict:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(
                cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = run(
        "git", "status", "--short", "--", "engine", "scheduler", "adapters", "model_repository", "client"
    )
    return {"commit": run("git", "rev-parse", "HEAD"), "uncommitted_serving_code": dirty.splitlines()}


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--rates", help="req/s, comma-separated (default: fractions of the probed capacity)")
    p.add_argument("--load-fractions", default="0.15,0.35,0.6,1.1",
                   help="rates as fractions of the probed capacity (default: %(default)s)")  # fmt: skip
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    p.add_argument("--warmup-s", type=float, default=3.0, help="arrivals before this are not counted")
    p.add_argument("--cv", type=float, default=3.0, help="gamma gap coefficient of variation")
    p.add_argument("--slots", type=int, default=2, help="engine max_batch_size (KV slots)")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prompt-median", type=float, default=32.0)
    p.add_argument("--prompt-max", type=int, default=384)
    p.add_argument("--output-median", type=float, default=8.0)
    p.add_argument("--output-max", type=int, default=64)
    p.add_argument("--probe-count", type=int, default=40)
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (a miss)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--baseline-admission", choices=("off", "on"), default="off")
    p.add_argument("--model-dir", type=Path, default=REPO_ROOT / "models" / "tiny-llama")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = sorted(set(args.policy_list) - set(POLICIES))
    if unknown:
        p.error(f"unknown policies {unknown}; allowed: {', '.join(POLICIES)}")
    args.load_fractions = [float(x) for x in args.load_fractions.split(",")]
    args.rate_list = sorted(float(x) for x in args.rates.split(",")) if args.rates else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    run_root = REPO_ROOT / ".run" / "bench-scheduler"
    run_root.mkdir(parents=True, exist_ok=True)
    tiers_file = run_root / "tiers.yaml"
    tiers_file.write_text(TIERS_YAML, encoding="utf-8")
    wl = workload(args.model_dir, args)
    notes = []
    if "triton-priority" in args.policy_list:
        if load_supports_priority():
            notes.append("client.load.run_load now accepts priority=, but this bench does not pass it yet: "
                         "triton-priority still ran as plain fifo; update bench/scheduler.py.")  # fmt: skip
        else:
            notes.append(TRITON_PRIORITY_NOTE)
    rates, capacity = args.rate_list, None
    schedules: dict = {}
    by_policy: dict[str, list[RunResult]] = {}
    for policy in args.policy_list:
        runs, rates, probed = run_policy(policy, rates, args, args.model_dir, wl, tiers_file, schedules)
        capacity = capacity or probed
        by_policy[policy] = runs
    assert rates is not None
    all_runs = [r for runs in by_policy.values() for r in runs]
    table = results_table(all_runs)
    gtable, goodput = goodput_table(by_policy, rates)
    adaptations = {p: sum(r.engine_adaptations for r in runs) for p, runs in by_policy.items()}
    state = git_state()
    setup = (
        f"Setup: tiny-llama on CPU, engine max_batch_size {args.slots}; per rate {args.duration:g} s "
        f"of gamma arrivals (CV {args.cv:g}), first {args.warmup_s:g} s excluded; mix "
        + ", ".join(f"{k} {v}" for k, v in MIX.items())
        + f"; {args.tenants} tenants (Zipf 1.1); prompt tokens lognormal median {args.prompt_median:g} "
        f"sigma 1 (max {args.prompt_max}), output tokens median {args.output_median:g} sigma 0.8 "
        f"(max {args.output_max}); TTFT targets (ms) "
        + ", ".join(f"{k} {v:g}" for k, v in TARGETS_MS.items())
        + f"; client timeout {args.timeout:g} s. Probed capacity: "
        + (f"{capacity:.1f} req/s" if capacity else "not probed (--rates given)")
        + f"; rates {', '.join(f'{r:g}' for r in rates)} req/s; seeds {args.seed} + 1000 x rate index, the "
        "same schedule for every policy. Admission control: "
        + ("all policies" if args.baseline_admission == "on" else "slo only (baselines queue everything)")
        + f". Feedback adaptations counted by the engine during the runs: {adaptations}. Serving code: "
        f"commit {state['commit'][:10]}"
        + (
            f", uncommitted changes in {state['uncommitted_serving_code']}"
            if state["uncommitted_serving_code"]
            else ""
        )
        + "."
    )
    print(setup)
    for note in notes:
        print(f"Note: {note}")
    elapsed = time.perf_counter() - began
    progress(f"whole benchmark took {elapsed:.0f} s")
    command = "python -m bench.scheduler " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    payload = {
        "setup": setup,
        "notes": notes,
        "tiers_yaml": TIERS_YAML,
        "targets_ms": TARGETS_MS,
        "capacity_rps": capacity,
        "rates": rates,
        "goodput": goodput,
        "feedback_adaptations": adaptations,
        "git": state,
        "elapsed_s": elapsed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [asdict(r) for r in all_runs],
    }
    md = (
        f"{table}\n\nTTFT percentiles are over successful requests; attainment counts every request of the "
        "tier (rejections, errors, timeouts are misses). 'rejected c/s/b': critical/standard/batch. "
        "'load avg': the machine's higher 1-minute load average before/after the run (2 cores: the "
        "bench itself accounts for ~2; well above that, other processes competed for the CPU).\n\n"
        f"Critical goodput (highest swept rate with >= 95% of critical requests within 150 ms, at it and "
        f"every lower rate):\n\n{gtable}\n\n{setup}\n\n" + "".join(f"Note: {n}\n\n" for n in notes)
    )
    base = write_results("scheduler", args.tag, payload, md.rstrip() + "\n", command.strip(), args.out_dir)
    plot(by_policy, capacity, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
