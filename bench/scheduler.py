"""Scheduler benchmark: five queue policies on the same open-loop arrivals, swept over the arrival rate.

Policies (one fresh stack each, so no policy inherits another's prefix cache or measured rates):
  fifo             engine queue in arrival order; requests carry no Triton priority
  triton-priority  engine fifo, requests carry the tier's Triton priority (the slo_scheduler step
                   declares priority_levels, so only that step's own queue can reorder them)
  priority         static tier precedence, arrival order within a tier (no aging, no feedback)
  edf              earliest first-token deadline (arrival + tier target) across all tiers
  slo              the full scheduler: precedence with aging, EDF within a tier, per-tenant fair share,
                   preemption of lower tiers' running requests for a request that would miss its
                   deadline waiting for a slot (scheduler/preemption.py), admission control
                   (sheddable tiers refused with UNAVAILABLE when predicted late), Triton priority, and
                   the feedback loop (engine/slo_feedback.py; adaptations counted from its metrics)

Admission control and preemption are the scheduler's, so by default only `slo` runs with them; the
baselines queue everything (`--baseline-admission on` gives them the same admission controller).

Method. A short probe first measures the engine's capacity (requests/s with every slot busy: a burst of
requests sent at once, completions / makespan) on the first policy's stack; the swept rates are
fractions of it (`--load-fractions`), so the sweep goes from below to above saturation on any machine.
For each seed and rate the arrival schedule (gamma gaps, CV 3, scaled so that each window holds
exactly rate x duration arrivals: client/arrivals.py paced_arrival_times), the tier mix (critical
0.2, standard 0.5, batch 0.3), the tenants (Zipf) and the heavy-tailed (lognormal) prompt and output
lengths come from one seed, identical for every policy. Requests planned in the first `--warmup-s`
seconds are sent but excluded from the statistics. Between runs the bench waits for the engine's queue
and slots to empty.

Reports per policy and rate, pooled over the seeds: critical attainment (share of *all* critical
requests whose TTFT met the target; rejections, errors and timeouts are misses) and its range over the
seeds, TTFT P50/P95/P99 per tier, TPOT P95, batch-tier completions and throughput, rejections and
timeouts, the batch tier's longest wait (max TTFT) against its configured maximum queue time,
preemptions, and the scheduler's overhead P99 (engine histogram llm_scheduler_overhead_seconds: time
spent on admission, queueing, dispatch and preemption decisions per request; a bucket upper bound).
Per policy: the critical goodput (highest swept rate at which >= 95% of critical requests met the
target, at it and every lower rate), pooled and per seed, with the ratio to fifo. Writes
bench/results/scheduler-<tag>.{json,md,png} (attainment and critical P95 against rate per policy).

    python -m bench.scheduler                       # CPU, tiny model, 2 seeds, ~25 minutes on 2 cores
    python -m bench.scheduler --rates 3,6,12 --seeds 1 --policies fifo,slo
    python -m bench.scheduler --device cuda --dtype bfloat16 --preset 1b --slots 8 --text-env ... --tag h200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.common import (
    start_stack,
    REPO_ROOT,
    add_engine_args,
    engine_env,
    model_dir_for,
    print_table,
    progress,
    write_results,
)
from client.arrivals import paced_arrival_times
from client.load import RequestRecord, run_load, summarize
from client.metrics import histogram_delta, histogram_quantile, metric_total, scrape_metrics
from client.workload import CorpusPrompts, LengthDistribution, TenantSkew, TierMix, Workload
from deploy.launch import StackOptions

# TTFT targets (ms) per device: the CPU ones suit the tiny model, the GPU ones are tiers.yaml's.
DEFAULT_TARGETS_MS = {
    "cpu": {"critical": 150.0, "standard": 1000.0, "batch": 8000.0},
    "cuda": {"critical": 120.0, "standard": 500.0, "batch": 5000.0},
}
MAX_QUEUE_MS = {"critical": 3000, "warmup": 10000, "standard": 10000, "batch": 30000}
TIER_PRIORITY = {"critical": 1, "warmup": 2, "standard": 3, "batch": 4}
MIX = {"critical": 0.2, "standard": 0.5, "batch": 0.3}
GOODPUT_ATTAINMENT = 0.95
OVERHEAD_METRIC = "llm_scheduler_overhead_seconds"

# policy name -> engine queue policy
POLICIES = {"fifo": "fifo", "triton-priority": "fifo", "priority": "priority", "edf": "edf", "slo": "slo"}
SCHEDULER_POLICIES = ("slo",)  # admission control and preemption
TRITON_PRIORITY_POLICIES = ("triton-priority", "slo")


def tiers_yaml(targets_ms: dict[str, float]) -> str:
    """The tier file the engine enforces in this run (cpu_scale 1: the figures are the enforced ones)."""
    warmup = min(targets_ms["critical"] * 2, targets_ms["standard"])
    rows = {
        "critical": (targets_ms["critical"], 95, "false"),
        "warmup": (warmup, 95, "false"),
        "standard": (targets_ms["standard"], 95, "false"),
        "batch": (targets_ms["batch"], 90, "true"),
    }
    lines = ["# bench/scheduler.py: the targets of this run; cpu_scale 1 so they are the enforced values.",
             "default_tier: standard", "cpu_scale: 1.0", "tiers:"]  # fmt: skip
    for name, (target, pct, shed) in rows.items():
        lines.append(
            f"  {name}: {{priority: {TIER_PRIORITY[name]}, ttft_target_ms: {target:g}, percentile: {pct}, "
            f"sheddable: {shed}, max_queue_ms: {MAX_QUEUE_MS[name]}}}"
        )
    return "\n".join(lines) + "\n"


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
    """One policy at one rate, pooled over the seeds."""

    policy: str
    engine_policy: str
    admission: bool
    rate: float
    seeds: list[int]
    planned: int
    measured: int
    window_s: float
    tiers: dict[str, TierStats]
    critical_attainment_by_seed: dict[int, float]
    tpot_p95_ms: float
    batch_throughput_rps: float
    batch_tokens_per_s: float
    rejected: int
    timeouts: int
    errors: int
    max_send_lag_ms: float
    wall_s: float
    engine_adaptations: float
    preemptions: float = 0.0
    overhead_p99_ms: float | None = None  # bucket upper bound; inf beyond the last bucket
    load_avg_1m: tuple[float, float] = (float("nan"), float("nan"))  # machine load before / after
    tier_control: dict[str, float] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)

    @property
    def critical_attainment(self) -> float:
        return self.tiers["critical"].attainment if "critical" in self.tiers else float("nan")


def _max_ms(records: list[RequestRecord]) -> float:
    values = [r.ttft_s for r in records if r.outcome == "ok" and r.ttft_s is not None]
    return max(values) * 1000.0 if values else float("nan")


def _critical_attainment(records: list[RequestRecord], targets_ms: dict[str, float]) -> float:
    rows = {row.tier: row for row in summarize(records, targets_ms)}
    return rows["critical"].attainment if "critical" in rows else float("nan")


def analyse(
    policy: str, rate: float, by_seed: dict[int, list[RequestRecord]], warmup_s: float, duration_s: float,
    targets_ms: dict[str, float],
) -> RunResult:  # fmt: skip
    """Pool the seeds' measured requests (arrivals after the warm-up) into one result."""
    measured_by_seed = {seed: [r for r in recs if r.planned_s >= warmup_s] for seed, recs in by_seed.items()}
    measured = [r for recs in measured_by_seed.values() for r in recs]
    window = max(1e-9, duration_s - warmup_s) * len(by_seed)
    rows = {row.tier: row for row in summarize(measured, targets_ms)}
    tiers: dict[str, TierStats] = {}
    for tier in targets_ms:
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
        seeds=sorted(by_seed),
        planned=sum(len(recs) for recs in by_seed.values()),
        measured=len(measured),
        window_s=window,
        tiers=tiers,
        critical_attainment_by_seed={
            seed: _critical_attainment(recs, targets_ms) for seed, recs in measured_by_seed.items()
        },
        tpot_p95_ms=float(np.percentile(tpots, 95)) * 1000.0 if tpots else float("nan"),
        batch_throughput_rps=len(batch_ok) / window,
        batch_tokens_per_s=sum(r.output_tokens for r in batch_ok) / window,
        rejected=sum(1 for r in measured if r.outcome == "rejected"),
        timeouts=sum(1 for r in measured if r.outcome == "timeout"),
        errors=len(errors),
        max_send_lag_ms=max((r.send_lag_s for recs in by_seed.values() for r in recs), default=0.0) * 1000.0,
        wall_s=0.0,
        engine_adaptations=0.0,
        error_examples=sorted({(r.error or "")[:200] for r in errors})[:3],
    )


def goodput(points: list[tuple[float, float]]) -> float:
    """Highest rate whose attainment (and every lower rate's) is >= 95%; 0 when the lowest misses.
    Rates without a critical request (NaN) are skipped."""
    best = 0.0
    for rate, attainment in sorted(points):
        if math.isnan(attainment):
            continue  # no critical request measured at this rate (and seed): no evidence either way
        if attainment < GOODPUT_ATTAINMENT:
            break
        best = rate
    return best


def critical_goodput(runs: list[RunResult]) -> float:
    return goodput([(r.rate, r.critical_attainment) for r in runs])


def goodput_by_seed(runs: list[RunResult]) -> dict[int, float]:
    seeds = sorted({s for r in runs for s in r.critical_attainment_by_seed})
    return {
        seed: goodput([(r.rate, r.critical_attainment_by_seed.get(seed, float("nan"))) for r in runs])
        for seed in seeds
    }


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
    """Wait until the engine has nothing queued and no slot busy (left-overs of the previous run)."""
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


def scrape_or_empty(metrics_url: str) -> dict[str, float]:
    try:
        return scrape_metrics(metrics_url)
    except OSError:
        return {}


def probe_capacity(url: str, wl: Workload, args: argparse.Namespace) -> float:
    """Requests/s the engine completes with every slot busy: `--probe-count` requests sent within
    ~0.5 s (same length distributions, all tier standard), completions / makespan."""
    times = np.linspace(0.0, 0.5, args.probe_count)
    plan = [replace(p, tier="standard") for p in wl.generate(times, seed=args.seeds[0] + 99_991)]
    started = time.perf_counter()
    records = run_load(url, plan, timeout_s=args.timeout, triton_priority=False)
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


def uses_admission(policy: str, args: argparse.Namespace) -> bool:
    return policy in SCHEDULER_POLICIES or args.baseline_admission == "on"


def stack_options(policy: str, args: argparse.Namespace, tiers_file: Path) -> StackOptions:
    overrides = {
        "llm_engine": {
            "max_batch_size": str(args.slots),
            "plan_kv_from_traffic": "false",
            "admission_control": "true" if uses_admission(policy, args) else "false",
            "preemption": "true" if policy in SCHEDULER_POLICIES else "false",
        }
    }
    env = engine_env(args.device, args.dtype, args.max_seq_len)
    env.update({"LLM_QUEUE_POLICY": POLICIES[policy], "LLM_TIERS_FILE": str(tiers_file)})
    return StackOptions(
        run_dir=REPO_ROOT / ".run" / f"bench-scheduler-{policy}",
        model_dir=args.model_dir,
        warmup=True,
        overrides=overrides,
        text_env=args.text_env,
        extra_env=env,
    )


def run_policy(
    policy: str, rates: list[float] | None, args: argparse.Namespace, wl: Workload, tiers_file: Path,
    schedules: dict,
) -> tuple[list[RunResult], list[float] | None, float | None]:  # fmt: skip
    """Start a stack for `policy`, (probe if no rates yet), run every seed and rate."""
    options = stack_options(policy, args, tiers_file)
    options.run_dir.mkdir(parents=True, exist_ok=True)
    admission = uses_admission(policy, args)
    progress(
        f"{policy}: starting a stack (engine queue {POLICIES[policy]}, "
        f"admission {'on' if admission else 'off'})"
    )
    capacity = None
    with start_stack(options) as stack:
        if rates is None:
            capacity = probe_capacity(stack.grpc_url, wl, args)
            rates = [round(f * capacity, 1) for f in args.load_fractions]
            engine_idle(stack.metrics_url, 60)
        runs = [run_rate(policy, index, rate, args, wl, stack, schedules) for index, rate in enumerate(rates)]
        for run in runs:
            run.admission = admission
    return runs, rates, capacity


def run_rate(
    policy: str, index: int, rate: float, args: argparse.Namespace, wl: Workload, stack, schedules: dict
) -> RunResult:
    """Every seed's schedule at one rate on a running stack, pooled into one result."""
    by_seed: dict[int, list[RequestRecord]] = {}
    before = scrape_or_empty(stack.metrics_url)
    load_before, wall, idle = os.getloadavg()[0], 0.0, True
    for seed in args.seeds:
        key = (seed, rate)
        if key not in schedules:
            times = paced_arrival_times("gamma", rate, args.duration, cv=args.cv, seed=seed + 1000 * index)
            schedules[key] = wl.generate(times, seed=seed + 1000 * index)
        started = time.perf_counter()
        by_seed[seed] = run_load(
            stack.grpc_url, schedules[key], timeout_s=args.timeout,
            triton_priority=policy in TRITON_PRIORITY_POLICIES,
        )  # fmt: skip
        wall += time.perf_counter() - started
        idle = engine_idle(stack.metrics_url, 60) and idle
    after = scrape_or_empty(stack.metrics_url)
    result = analyse(policy, rate, by_seed, args.warmup_s, args.duration, args.targets)
    result.wall_s = wall
    result.load_avg_1m = (load_before, os.getloadavg()[0])
    result.engine_adaptations = _delta(before, after, "llm_scheduler_adaptations_total")
    result.preemptions = _delta(before, after, "llm_engine_preemptions_total")
    result.tier_control = {k: v for k, v in after.items() if k.startswith("llm_scheduler_tier_control")}
    p99 = histogram_quantile(histogram_delta(before, after, OVERHEAD_METRIC), 0.99)
    result.overhead_p99_ms = None if p99 is None else p99 * 1000.0
    crit = result.tiers.get("critical")
    progress(
        f"{policy} @ {rate:g} req/s: {result.planned} requests ({len(args.seeds)} seeds) in {wall:.1f} s; "
        f"critical attainment {result.critical_attainment:.1%} "
        f"(P95 {crit.ttft_p95_ms if crit else float('nan'):.0f} ms); rejected {result.rejected}, "
        f"timeouts {result.timeouts}, errors {result.errors}, preemptions {result.preemptions:g}; "
        f"load avg {result.load_avg_1m[0]:.1f} -> {result.load_avg_1m[1]:.1f}"
        + ("" if idle else "; engine not idle 60 s after a run")
    )
    return result


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return metric_total(after, name) - metric_total(before, name)


# ------------------------------------------------------------------------------------------ output


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _pcts(stats: TierStats | None) -> str:
    if stats is None:
        return "-"
    return f"{_f(stats.ttft_p50_ms)}/{_f(stats.ttft_p95_ms)}/{_f(stats.ttft_p99_ms)}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def _seeds_measured(run: RunResult) -> list[float]:
    """Each seed's critical attainment, less the seeds that sent no critical request (NaN): min and max of
    a list holding NaN depend on where it sits."""
    return [v for v in run.critical_attainment_by_seed.values() if not math.isnan(v)]


def _seed_range(run: RunResult) -> str:
    values = _seeds_measured(run)
    return f"{min(values):.0%}-{max(values):.0%}" if values else "-"


def _overhead(value: float | None) -> str:
    if value is None:
        return "-"
    return "> 10" if math.isinf(value) else f"<= {value:g}"


def results_table(runs: list[RunResult]) -> str:
    headers = [
        "policy", "rate /s", "n", "crit attain", "by seed", "crit TTFT p50/p95/p99 ms",
        "std TTFT p50/p95/p99 ms", "batch TTFT p50/p95/p99 ms", "TPOT p95 ms", "batch done", "batch req/s",
        "rejected c/s/b", "timeouts", "batch max wait s", "std attain", "preempt", "sched p99 ms", "load avg",
    ]  # fmt: skip
    rows = []
    for r in runs:
        c, s, b = (r.tiers.get(t) for t in ("critical", "standard", "batch"))
        rows.append([
            r.policy, f"{r.rate:g}", r.measured, _pct(r.critical_attainment), _seed_range(r), _pcts(c),
            _pcts(s), _pcts(b), _f(r.tpot_p95_ms, 1), f"{b.ok}/{b.n}" if b else "-",
            _f(r.batch_throughput_rps, 2), "/".join(str(x.rejected) if x else "0" for x in (c, s, b)),
            r.timeouts, _f(b.ttft_max_ms / 1000.0 if b else float("nan"), 2),
            _pct(s.attainment if s else float("nan")), f"{r.preemptions:g}", _overhead(r.overhead_p99_ms),
            _f(max(r.load_avg_1m), 1),
        ])  # fmt: skip
    return print_table(headers, rows)


def goodput_table(
    by_policy: dict[str, list[RunResult]], rates: list[float], capacity: float | None
) -> tuple[str, dict]:
    pooled = {p: critical_goodput(runs) for p, runs in by_policy.items()}
    per_seed = {p: goodput_by_seed(runs) for p, runs in by_policy.items()}
    base, base_seeds = pooled.get("fifo"), per_seed.get("fifo", {})
    below = (capacity or max(rates)) * 0.9
    rows, summary = [], {}
    for policy, value in pooled.items():
        ratio = value / base if base else (float("inf") if value else float("nan"))
        seed_ratios = [per_seed[policy][s] / base_seeds[s] for s in per_seed[policy] if base_seeds.get(s)]
        batch = _batch_ratio(by_policy[policy], by_policy.get("fifo", []), below)
        overhead = [r.overhead_p99_ms for r in by_policy[policy] if r.overhead_p99_ms is not None]
        longest = max(
            (r.tiers["batch"].ttft_max_ms for r in by_policy[policy] if "batch" in r.tiers),
            default=float("nan"),
        )
        summary[policy] = {
            "goodput_rps": value, "ratio_vs_fifo": ratio, "goodput_by_seed": per_seed[policy],
            "ratio_by_seed": seed_ratios, "batch_throughput_vs_fifo_below_saturation": batch,
            "overhead_p99_ms_max": max(overhead) if overhead else None, "batch_longest_wait_ms": longest,
        }  # fmt: skip
        rows.append([
            policy, f"{value:g}" if value else f"< {min(rates):g} (none met)",
            f"{ratio:.2f}x" if math.isfinite(ratio) else ("fifo met no rate" if value else "-"),
            ", ".join(f"{v:g}" for v in per_seed[policy].values()),
            ", ".join(f"{x:.2f}x" for x in seed_ratios) or "-",
            "-" if batch is None else f"{batch:.2f}x", _overhead(max(overhead) if overhead else None),
            _f(longest / 1000.0, 1),
        ])  # fmt: skip
    headers = [
        "policy", "critical goodput req/s (pooled)", "vs fifo", "goodput by seed", "vs fifo by seed",
        f"batch req/s vs fifo (rates < {below:.1f}/s)", "sched overhead p99 ms (worst rate)",
        "batch longest wait s",
    ]  # fmt: skip
    return print_table(headers, rows), summary


def _batch_ratio(runs: list[RunResult], fifo: list[RunResult], below: float) -> float | None:
    """Batch-tier completions / fifo's, summed over the rates below saturation (None without fifo)."""
    fifo_by_rate = {r.rate: r.batch_throughput_rps for r in fifo if r.rate < below}
    mine = sum(r.batch_throughput_rps for r in runs if r.rate in fifo_by_rate)
    theirs = sum(fifo_by_rate.values())
    return mine / theirs if theirs else None


def plot(by_policy: dict[str, list[RunResult]], capacity: float | None, target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    markers = {"fifo": "o", "triton-priority": "x", "priority": "s", "edf": "^", "slo": "D"}
    for policy, runs in by_policy.items():
        runs = sorted(runs, key=lambda r: r.rate)
        x = [r.rate for r in runs]
        marker = markers.get(policy, ".")
        line = ax1.plot(x, [100 * r.critical_attainment for r in runs], marker=marker, label=policy)[0]
        low = [100 * min(_seeds_measured(r), default=math.nan) for r in runs]
        high = [100 * max(_seeds_measured(r), default=math.nan) for r in runs]
        ax1.fill_between(x, low, high, color=line.get_color(), alpha=0.12)
        ax2.plot(
            x, [r.tiers["critical"].ttft_p95_ms if "critical" in r.tiers else float("nan") for r in runs],
            marker=marker, label=policy,
        )  # fmt: skip
    ax1.axhline(100 * GOODPUT_ATTAINMENT, color="grey", linestyle=":", label="95%")
    ax2.axhline(target_ms, color="grey", linestyle=":", label=f"target {target_ms:g} ms")
    for ax in (ax1, ax2):
        if capacity:
            ax.axvline(capacity, color="red", alpha=0.3, label=f"probed capacity {capacity:.1f}/s")
        ax.set_xlabel("offered rate (req/s, gamma arrivals CV 3)")
        ax.legend(fontsize=8)
    ax1.set_ylabel(f"critical requests within {target_ms:g} ms TTFT (%)")
    ax1.set_title("Critical-tier SLO attainment (pooled; band: range over seeds)")
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
    p.add_argument("--load-fractions", default="0.1,0.2,0.3,0.45,0.6,0.8,1.0",
                   help="rates as fractions of the probed capacity (default: %(default)s)")  # fmt: skip
    p.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per rate and seed")
    p.add_argument("--warmup-s", type=float, default=2.0, help="arrivals before this are not counted")
    p.add_argument("--cv", type=float, default=3.0, help="gamma gap coefficient of variation")
    p.add_argument("--slots", type=int, default=4, help="engine max_batch_size (KV slots)")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prompt-median", type=float, default=32.0)
    p.add_argument("--prompt-max", type=int, default=384)
    p.add_argument("--output-median", type=float, default=24.0)
    p.add_argument("--output-max", type=int, default=192)
    p.add_argument("--probe-count", type=int, default=40)
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (a miss)")
    p.add_argument("--seeds", default="1,2", help="comma-separated arrival seeds (default: %(default)s)")
    p.add_argument("--targets", default=None,
                   help="TTFT targets (ms), e.g. critical=150,batch=9000 (default: per device)")  # fmt: skip
    p.add_argument("--baseline-admission", choices=("off", "on"), default="off")
    p.add_argument(
        "--merge", type=Path, nargs="+", help="report from earlier result JSONs instead of running"
    )
    add_engine_args(p)
    args = p.parse_args(argv)
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = sorted(set(args.policy_list) - set(POLICIES))
    if unknown:
        p.error(f"unknown policies {unknown}; allowed: {', '.join(POLICIES)}")
    args.load_fractions = [float(x) for x in args.load_fractions.split(",")]
    args.rate_list = sorted(float(x) for x in args.rates.split(",")) if args.rates else None
    args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    targets = dict(DEFAULT_TARGETS_MS["cpu" if args.device == "cpu" else "cuda"])
    for item in filter(None, (args.targets or "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in targets:
            p.error(f"--targets: unknown tier {name!r}; allowed: {', '.join(targets)}")
        targets[name.strip()] = float(value)
    args.targets = targets
    args.model_dir = model_dir_for(args.preset, args.model_dir)
    args.tag = args.tag or ("cpu" if args.device == "cpu" else args.device)
    return args


def setup_text(args: argparse.Namespace, rates: list[float], capacity: float | None) -> str:
    state = git_state()
    model = f"{args.model_dir.name} on {args.device} ({args.dtype})"
    return (
        f"Setup: {model}, engine max_batch_size {args.slots}; per rate and seed {args.duration:g} s of "
        f"gamma arrivals (CV {args.cv:g}, exactly rate x duration per window), first {args.warmup_s:g} s "
        "excluded; seeds "
        f"{', '.join(map(str, args.seeds))} (+1000 x rate index; the same schedules for every policy); mix "
        + ", ".join(f"{k} {v}" for k, v in MIX.items())
        + f"; {args.tenants} tenants (Zipf 1.1); prompt tokens lognormal median {args.prompt_median:g} "
        f"sigma 1 (max {args.prompt_max}), output tokens median {args.output_median:g} sigma 0.8 "
        f"(max {args.output_max}); TTFT targets (ms) "
        + ", ".join(f"{k} {v:g}" for k, v in args.targets.items())
        + f"; batch max queue {MAX_QUEUE_MS['batch'] / 1000:g} s; client timeout {args.timeout:g} s. "
        "Probed capacity: "
        + (f"{capacity:.1f} req/s" if capacity else "not probed (--rates given)")
        + f"; rates {', '.join(f'{r:g}' for r in rates)} req/s. Admission control and preemption: "
        + (
            "slo only (baselines queue everything)"
            if args.baseline_admission == "off"
            else "admission for all"
        )
        + f". Triton request priority: {', '.join(TRITON_PRIORITY_POLICIES)} only. Serving code: commit "
        f"{state['commit'][:10]}"
        + (
            f", uncommitted changes in {state['uncommitted_serving_code']}"
            if state["uncommitted_serving_code"]
            else ""
        )
        + "."
    )


def report(
    by_policy: dict[str, list[RunResult]], rates: list[float], capacity: float | None, setup: str,
    targets: dict[str, float], extra: dict, command: str, tag: str, out_dir: Path | None,
    machine: str | None = None,
) -> Path:  # fmt: skip
    """Tables, JSON and plot of whatever has run so far (written after every policy)."""
    all_runs = [r for runs in by_policy.values() for r in runs]
    table = results_table(all_runs)
    gtable, summary = goodput_table(by_policy, rates, capacity)
    payload = {
        "setup": setup, "targets_ms": targets, "capacity_rps": capacity, "rates": rates, "summary": summary,
        **extra, "runs": [asdict(r) for r in all_runs],
    }  # fmt: skip
    crit = targets["critical"]
    md = (
        f"{table}\n\nTTFT percentiles are over successful requests, pooled over the seeds; attainment "
        "counts every request of the tier (rejections, errors, timeouts are misses); 'by seed': the range "
        "of critical attainment over the seeds. 'rejected c/s/b': critical/standard/batch. 'preempt': "
        "running requests suspended for a more urgent one. 'sched p99 ms': upper bound of the histogram "
        "bucket holding the 99th percentile of per-request scheduling time in the engine. 'load avg': the "
        "machine's higher 1-minute load average before/after the run.\n\n"
        f"Critical goodput (highest swept rate with >= 95% of critical requests within {crit:g} ms, at it "
        f"and every lower rate):\n\n{gtable}\n\n{setup}\n"
    )
    base = write_results("scheduler", tag, payload, md, command, out_dir, machine)
    plot(by_policy, capacity, crit, base.with_suffix(".png"))
    return base


def load_runs(path: Path) -> tuple[list[RunResult], dict]:
    """Runs saved by an earlier invocation (its JSON), for --merge."""
    data = json.loads(path.read_text(encoding="utf-8"))
    runs = []
    for raw in data["runs"]:
        raw = dict(raw)
        raw["tiers"] = {k: TierStats(**v) for k, v in raw["tiers"].items()}
        raw["critical_attainment_by_seed"] = {
            int(k): v for k, v in raw["critical_attainment_by_seed"].items()
        }
        raw["load_avg_1m"] = tuple(raw["load_avg_1m"])
        runs.append(RunResult(**raw))
    return runs, data


def merge(paths: list[Path], command: str, tag: str, out_dir: Path | None) -> Path:
    """One report from runs of several invocations (e.g. policies split over GPU sessions)."""
    by_policy: dict[str, list[RunResult]] = {}
    first: dict = {}
    for path in paths:
        runs, data = load_runs(path)
        first = first or data
        for run in runs:
            by_policy.setdefault(run.policy, []).append(run)
    by_policy = {p: by_policy[p] for p in POLICIES if p in by_policy}
    rates = sorted({r.rate for runs in by_policy.values() for r in runs})
    sources = "; ".join(f"{p.name}: `{json.loads(p.read_text())['command']}`" for p in paths)
    setup = f"{first['setup']} Measured {first['date']}; merged from {sources}."
    extra = {"merged_from": [str(p) for p in paths]}
    return report(
        by_policy, rates, first["capacity_rps"], setup, first["targets_ms"], extra, command, tag, out_dir,
        first["machine"],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.scheduler " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    if args.merge:
        base = merge(args.merge, command.strip(), args.tag, args.out_dir)
        progress(f"wrote {base}.json/.md/.png")
        return 0
    began = time.perf_counter()
    run_root = REPO_ROOT / ".run" / "bench-scheduler"
    run_root.mkdir(parents=True, exist_ok=True)
    tiers_text = tiers_yaml(args.targets)
    tiers_file = run_root / "tiers.yaml"
    tiers_file.write_text(tiers_text, encoding="utf-8")
    wl = workload(args.model_dir, args)
    rates, capacity = args.rate_list, None
    schedules: dict = {}
    by_policy: dict[str, list[RunResult]] = {}
    for policy in args.policy_list:
        runs, rates, probed = run_policy(policy, rates, args, wl, tiers_file, schedules)
        capacity = capacity or probed
        by_policy[policy] = runs
        assert rates is not None
        extra = {
            "tiers_yaml": tiers_text, "git": git_state(), "elapsed_s": time.perf_counter() - began,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }  # fmt: skip
        setup = setup_text(args, rates, capacity)
        base = report(
            by_policy, rates, capacity, setup, args.targets, extra, command.strip(), args.tag, args.out_dir
        )
        progress(f"{policy} done; wrote {base}.json/.md/.png")
    print(setup)
    progress(f"whole benchmark took {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
