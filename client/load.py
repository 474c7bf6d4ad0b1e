"""Open-loop load generator for the `llm` ensemble: `python -m client.load --rate 5 --duration 30 ...`.

Each planned request is sent at its planned time whether or not earlier ones have answered (open loop),
so queueing shows up in TTFT instead of silently lowering the offered rate. Requests are multiplexed over
one gRPC stream per tier (client.generate.StreamingSession): Triton's stream reports an error without a
request id that tritonclient keeps, so the session can only pair errors with requests when that is
unambiguous; with a stream per tier, every error at least lands in the right tier's figures.

Per request it records client-side TTFT (send -> first non-empty piece), time per output token, total
time, and the outcome. An overload rejection (Triton UNAVAILABLE) is counted apart from other errors and
from client timeouts: the gRPC stream carries the error text without its status code, so a rejection is
recognised by the prefix the server puts on its UNAVAILABLE errors' text (`is_rejection`,
scheduler/errors.py UNAVAILABLE_PREFIX), not by words an error of any kind may contain.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np

from client.arrivals import ARRIVAL_KINDS, arrival_times, gap_cv
from client.generate import GenerationResult, StreamingSession
from client.stack_defaults import FALLBACK_GRPC_URL, URL_HELP, default_grpc_url, signing_for
from scheduler.errors import UNAVAILABLE_PREFIX
from scheduler.messages import CACHE_MODES
from scheduler.tenant_auth import ttl_argument
from deploy.arg_types import seconds
from client.workload import (
    DEFAULT_MIX,
    DEFAULT_MODEL_DIR,
    CorpusPrompts,
    LengthDistribution,
    PlannedRequest,
    ProfiledRequest,
    TenantSkew,
    TierMix,
    Workload,
    EXPORTED_TOKEN_TTL_S,
    export_perf_analyzer_json,
    export_request_intervals,
    read_perf_analyzer_profile,
)

# the server's UNAVAILABLE prefix, first, or after what Triton's ensemble scheduler puts before a step's error
REJECTION_PATTERN = re.compile(r"(?:in ensemble '[^']*', )*" + re.escape(UNAVAILABLE_PREFIX))
TIMEOUT_MESSAGE = "no final response within the client timeout; cancelled"
POLL_S = 0.002


def is_rejection(message: str) -> bool:
    """True for an overload/shedding refusal (UNAVAILABLE), judged from the message text alone: an
    INTERNAL error whose text says "retry" or "overloaded" somewhere is a failure."""
    return REJECTION_PATTERN.match(message) is not None


@dataclass(frozen=True)
class RequestRecord:
    """What one request did, as the client saw it. Times in seconds; `send_s` from the run's start.

    `outcome` is ok | rejected | error | timeout. `ttft_s`/`tpot_s` are None when no (or only one)
    piece arrived. `output_tokens` counts non-empty streamed pieces: the detokenizer sends one piece per
    token except where bytes of a character are held back, so it is a close lower bound.
    """

    index: int
    tier: str
    tenant: str
    planned_s: float
    send_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: str
    ttft_s: float | None
    tpot_s: float | None
    total_s: float
    output_tokens: int
    error: str | None = None

    @property
    def send_lag_s(self) -> float:
        """How late the client sent it (client overload or a concurrency limit): > 0 hides queueing."""
        return self.send_s - self.planned_s


@dataclass(frozen=True)
class LoadProgress:
    """A snapshot for progress reporting."""

    elapsed_s: float
    planned: int
    sent: int
    in_flight: int


ProgressCallback = Callable[[LoadProgress], None]


def record_from_result(
    index: int, plan: PlannedRequest, send_s: float, result: GenerationResult, timeout_s: float
) -> RequestRecord:
    """Classify one finished (or abandoned) request and derive TTFT/TPOT from its pieces."""
    tokens = sum(1 for piece in result.pieces if piece)
    if result.error is None and result.finished and result.total_s <= timeout_s:
        outcome, error = "ok", None
    elif result.error is None:  # still open at the end, or finished only after the client's timeout
        outcome, error = "timeout", TIMEOUT_MESSAGE
    else:
        outcome, error = ("rejected" if is_rejection(result.error) else "error"), result.error
    tpot = None
    if outcome == "ok" and result.ttft_s is not None and tokens > 1:
        tpot = (result.total_s - result.ttft_s) / (tokens - 1)
    return RequestRecord(
        index, plan.tier, plan.tenant, plan.at_s, send_s, plan.prompt_tokens, plan.max_tokens, outcome,
        result.ttft_s, tpot, result.total_s, tokens, error,
    )  # fmt: skip


def run_load(
    url: str,
    planned: Sequence[PlannedRequest],
    *,
    concurrency_limit: int | None = None,
    on_progress: ProgressCallback | None = None,
    progress_every_s: float = 1.0,
    timeout_s: float = 120.0,
    model: str = "llm",
    triton_priority: bool = True,
) -> list[RequestRecord]:
    """Send `planned` open loop and return one record per request, in plan order.

    `concurrency_limit` caps requests in flight (a client-side connection pool); a request that finds
    the pool full is sent late, and its `send_lag_s` says by how much. A request without a final
    response `timeout_s` after its send is a timeout (still-open ones are cancelled at the end).
    `triton_priority`: see StreamingSession.submit.
    """
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1 or None, got {concurrency_limit}")
    order = sorted(range(len(planned)), key=lambda i: planned[i].at_s)
    sessions: dict[str, StreamingSession] = {}
    sent: dict[int, tuple[str, str, float]] = {}  # plan index -> (tier, request id, send offset)
    recent: deque[tuple[float, str, str]] = deque()  # (send offset, tier, request id), within timeout_s
    try:
        for tier in dict.fromkeys(p.tier for p in planned):  # open streams before the clock starts
            sessions[tier] = StreamingSession(url, model=model)
        start = time.perf_counter()
        next_report = start
        for n_sent, i in enumerate(order):
            plan = planned[i]
            while True:
                now = time.perf_counter()
                if on_progress is not None and now >= next_report:
                    on_progress(LoadProgress(now - start, len(planned), n_sent, _in_flight(sessions)))
                    next_report = now + progress_every_s
                due = start + plan.at_s - now
                full = (
                    concurrency_limit is not None
                    and _live(sessions, recent, now - start - timeout_s) >= concurrency_limit
                )
                if due <= 0 and not full:
                    break
                time.sleep(POLL_S if full else min(due, progress_every_s, 0.05))
            send = time.perf_counter() - start
            rid = sessions[plan.tier].submit(
                plan.prompt, sampling=plan.sampling(), tier=plan.tier, tenant=plan.tenant,
                cache=plan.cache, triton_priority=triton_priority,
            )  # fmt: skip
            sent[i] = (plan.tier, rid, send)
            recent.append((send, plan.tier, rid))
        _drain(sessions, sent, start, timeout_s, on_progress, progress_every_s, len(planned))
        results = {tier: s.results() for tier, s in sessions.items()}
    finally:
        for session in sessions.values():
            session.close()
    return [
        record_from_result(i, planned[i], sent[i][2], results[sent[i][0]][sent[i][1]], timeout_s)
        for i in range(len(planned))
    ]


def _in_flight(sessions: Mapping[str, StreamingSession]) -> int:
    return sum(len(s.unfinished()) for s in sessions.values())


def _live(
    sessions: Mapping[str, StreamingSession], recent: deque[tuple[float, str, str]], expired: float
) -> int:
    """Requests in flight that still hold a pool slot: a request sent before `expired` (a send offset)
    is a timeout already, and one that never answers must not keep the pool full for good."""
    while recent and recent[0][0] < expired:
        recent.popleft()
    unfinished = {tier: set(session.unfinished()) for tier, session in sessions.items()}
    return sum(1 for _, tier, rid in recent if rid in unfinished[tier])


def _drain(
    sessions: Mapping[str, StreamingSession],
    sent: Mapping[int, tuple[str, str, float]],
    start: float,
    timeout_s: float,
    on_progress: ProgressCallback | None,
    progress_every_s: float,
    planned: int,
) -> None:
    """Wait until everything finished or the last-sent request's timeout passed."""
    last_send = max((s for _, _, s in sent.values()), default=0.0)
    deadline = start + last_send + timeout_s
    while True:
        in_flight = _in_flight(sessions)
        now = time.perf_counter()
        if on_progress is not None:
            on_progress(LoadProgress(now - start, planned, len(sent), in_flight))
        if in_flight == 0 or now >= deadline:
            return
        tick_end = now + min(progress_every_s, deadline - now)
        for session in sessions.values():  # wait on each in turn until the next progress tick
            session.wait(timeout_s=max(0.0, tick_end - time.perf_counter()))


def records_from_profile(profiled: Sequence[ProfiledRequest]) -> dict[str, list[RequestRecord]]:
    """perf_analyzer's profiled requests as records, per experiment (e.g. 'concurrency=2'), so the same
    `summarize` table compares its closed-loop run with an open-loop one. It exports only requests that
    got responses, and no send schedule: send/planned times are 0."""
    out: dict[str, list[RequestRecord]] = {}
    for p in profiled:
        tpot = (p.total_s - p.ttft_s) / (p.output_pieces - 1) if p.output_pieces > 1 else None
        rows = out.setdefault(p.experiment, [])
        rows.append(
            RequestRecord(len(rows), p.tier, p.tenant, 0.0, 0.0, 0, 0, "ok", p.ttft_s, tpot, p.total_s,
                          p.output_pieces)
        )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ summary


@dataclass(frozen=True)
class TierSummary:
    """One row of the summary table. Latencies in ms over successful requests; attainment counts every
    request of the tier (a rejection, error or timeout is a miss)."""

    tier: str
    count: int
    ok: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    tpot_p95_ms: float
    target_ms: float
    attainment: float
    rejections: int
    errors: int
    timeouts: int


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values else float("nan")


def summarize_tier(tier: str, records: Sequence[RequestRecord], target_ms: float | None) -> TierSummary:
    ttfts = [r.ttft_s for r in records if r.outcome == "ok" and r.ttft_s is not None]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    target = float("nan") if target_ms is None else float(target_ms)
    met = sum(1 for t in ttfts if t * 1000.0 <= target)
    return TierSummary(
        tier=tier,
        count=len(records),
        ok=sum(1 for r in records if r.outcome == "ok"),
        ttft_p50_ms=_pct(ttfts, 50),
        ttft_p95_ms=_pct(ttfts, 95),
        ttft_p99_ms=_pct(ttfts, 99),
        tpot_p95_ms=_pct(tpots, 95),
        target_ms=target,
        attainment=met / len(records) if records and target_ms is not None else float("nan"),
        rejections=sum(1 for r in records if r.outcome == "rejected"),
        errors=sum(1 for r in records if r.outcome == "error"),
        timeouts=sum(1 for r in records if r.outcome == "timeout"),
    )


def summarize(records: Sequence[RequestRecord], targets_ms_by_tier: Mapping[str, float]) -> list[TierSummary]:
    """One row per tier (in the order of `targets_ms_by_tier`, then any other tier seen) and a row 'all'
    whose attainment judges each request by its own tier's target."""
    tiers = [t for t in targets_ms_by_tier if any(r.tier == t for r in records)]
    tiers += sorted({r.tier for r in records} - set(tiers))
    rows = [summarize_tier(t, [r for r in records if r.tier == t], targets_ms_by_tier.get(t)) for t in tiers]
    overall = summarize_tier("all", records, None)
    judged = [r for r in records if r.tier in targets_ms_by_tier]
    met = sum(
        1 for r in judged
        if r.outcome == "ok" and r.ttft_s is not None and r.ttft_s * 1000.0 <= targets_ms_by_tier[r.tier]
    )  # fmt: skip
    attainment = met / len(judged) if judged else float("nan")
    rows.append(TierSummary(**{**asdict(overall), "attainment": attainment}))
    return rows


SUMMARY_HEADERS = [
    "tier", "n", "ok", "TTFT p50 ms", "TTFT p95 ms", "TTFT p99 ms", "TPOT p95 ms", "target ms",
    "attain", "rejected", "errors", "timeouts",
]  # fmt: skip


def summary_table(rows: Sequence[TierSummary]) -> str:
    """A Markdown table of the summary rows."""
    cells = [
        [r.tier, str(r.count), str(r.ok), _ms(r.ttft_p50_ms), _ms(r.ttft_p95_ms), _ms(r.ttft_p99_ms),
         _ms(r.tpot_p95_ms), _ms(r.target_ms), "-" if math.isnan(r.attainment) else f"{r.attainment:.1%}",
         str(r.rejections), str(r.errors), str(r.timeouts)]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(SUMMARY_HEADERS)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(SUMMARY_HEADERS, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


# ---------------------------------------------------------------------------------------------- CLI


def parse_targets(text: str) -> dict[str, float]:
    """'critical=1200,standard=5000' -> {tier: TTFT target in ms}."""
    targets: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            target = float(value)
        except ValueError:
            target = float("nan")
        if not name.strip() or not target > 0:
            raise ValueError(f"bad target {part!r}; expected tier=milliseconds > 0, e.g. critical=1200")
        targets[name.strip()] = target
    return targets


def default_targets(device: str) -> dict[str, float]:
    """TTFT targets from the scheduler's packaged tiers.yaml, scaled for the device (CPU: cpu_scale)."""
    from scheduler.tiers import TierTable

    return {tier.name: tier.ttft_target_ms for tier in TierTable.load().for_device(device)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help=f"Triton gRPC address ({URL_HELP} {FALLBACK_GRPC_URL})")
    p.add_argument("--model", default="llm", help="model to load (default: %(default)s)")
    p.add_argument("--rate", type=float, default=5.0, help="mean arrivals per second (default: %(default)s)")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--duration", type=float, help="seconds of arrivals (default 30 unless --count)")
    span.add_argument("--count", type=int, help="exactly this many requests instead of --duration")
    p.add_argument("--arrivals", choices=ARRIVAL_KINDS, default="poisson", help="arrival process")
    p.add_argument("--cv", type=float, default=3.0, help="gap CV for --arrivals gamma (default: %(default)s)")
    p.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()),
                   help="tier=weight,... (default: %(default)s)")  # fmt: skip
    p.add_argument("--tenants", type=int, default=8, help="number of tenants (default: %(default)s)")
    p.add_argument("--zipf", type=float, default=1.1, help="tenant Zipf exponent (default: %(default)s)")
    p.add_argument("--prompt-median", type=float, default=48.0, help="prompt tokens, lognormal median")
    p.add_argument("--prompt-sigma", type=float, default=1.0, help="prompt tokens, lognormal sigma")
    p.add_argument("--prompt-max", type=int, default=1024, help="prompt tokens cap (default: %(default)s)")
    p.add_argument("--output-median", type=float, default=12.0, help="max_tokens, lognormal median")
    p.add_argument("--output-sigma", type=float, default=0.8, help="max_tokens, lognormal sigma")
    p.add_argument("--output-max", type=int, default=128, help="max_tokens cap (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for arrivals and the mix (default: %(default)s)")
    p.add_argument("--concurrency-limit", type=int, help="cap on requests in flight (default: none)")
    p.add_argument("--timeout", type=seconds, default=120.0, help="per-request client timeout, seconds")
    p.add_argument("--cache", choices=CACHE_MODES, default="kv-only",
                   help="the requests' cache mode (default: %(default)s: every answer is computed; with "
                   "'use', greedy prompts seen twice are answered from the exact response cache, and a "
                   "replay measures that cache instead of serving)")  # fmt: skip
    p.add_argument("--targets", help="TTFT targets tier=ms,... (default: scheduler/tiers.yaml for --device)")
    p.add_argument("--device", default="cpu", help="device whose targets apply by default (cpu | cuda)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="tokenizer for prompt lengths")
    p.add_argument("--export-perf-analyzer", type=Path, metavar="PATH",
                   help="also write the plan as perf_analyzer --input-data JSON")  # fmt: skip
    p.add_argument("--export-intervals", type=Path, metavar="PATH",
                   help="also write the arrival gaps for perf_analyzer --request-intervals")  # fmt: skip
    p.add_argument("--export-only", action="store_true", help="write the export and exit without sending")
    p.add_argument("--export-token-ttl", type=ttl_argument, default=EXPORTED_TOKEN_TTL_S, metavar="TTL",
                   help="how long the tenant tokens in the export are good for (30d by default; 24h, 7d, "
                   "never)")  # fmt: skip
    p.add_argument("--records", type=Path, metavar="PATH", help="write one JSON line per request here")
    p.add_argument("--summarize-perf-analyzer", type=Path, metavar="PROFILE",
                   help="print per-tier tables of a perf_analyzer --profile-export-file; exit")  # fmt: skip
    return p


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(
        prompts=CorpusPrompts(args.model_dir),
        mix=TierMix.parse(args.mix),
        tenants=TenantSkew(args.tenants, args.zipf),
        prompt_lengths=LengthDistribution(args.prompt_median, args.prompt_sigma, 4, args.prompt_max),
        output_lengths=LengthDistribution(args.output_median, args.output_sigma, 1, args.output_max),
    )


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        if args.concurrency_limit is not None and args.concurrency_limit < 1:
            raise ValueError(f"--concurrency-limit must be >= 1, got {args.concurrency_limit}")
        targets = parse_targets(args.targets) if args.targets else default_targets(args.device)
        if args.summarize_perf_analyzer:
            profiled = read_perf_analyzer_profile(args.summarize_perf_analyzer)
            for experiment, records in records_from_profile(profiled).items():
                out.write(f"perf_analyzer {experiment}:\n{summary_table(summarize(records, targets))}\n")
            return 0
        duration = args.duration if args.duration is not None or args.count is not None else 30.0
        times = arrival_times(
            args.arrivals, args.rate, duration_s=duration, count=args.count, cv=args.cv, seed=args.seed
        )
        planned = [
            replace(p, cache=args.cache) for p in workload_from_args(args).generate(times, seed=args.seed)
        ]
    except (ValueError, OSError, KeyError) as exc:
        err.write(f"error: {exc}\n")
        return 2
    url = args.url or default_grpc_url()
    with signing_for(url):  # a make-run stack's own secret, when this process has none
        return send_plan(args, url, planned, times, targets, out, err)


def send_plan(
    args: argparse.Namespace,
    url: str,
    planned: list[PlannedRequest],
    times: np.ndarray,
    targets: Mapping[str, float],
    out: TextIO,
    err: TextIO,
) -> int:
    """The exports and the run of a planned load (`main` after planning)."""
    span = float(times[-1]) if times.size else 0.0
    out.write(
        f"plan: {len(planned)} requests over {span:.1f} s ({args.arrivals}, rate {args.rate:g}/s, "
        f"gap CV {gap_cv(times):.2f}), seed {args.seed}\n"
    )
    try:
        if args.export_perf_analyzer:
            path = export_perf_analyzer_json(planned, args.export_perf_analyzer, args.export_token_ttl)
            out.write(f"perf_analyzer input data: {path} ({len(planned)} entries)\n")
        if args.export_intervals and planned:
            path = export_request_intervals(planned, args.export_intervals)
            out.write(f"perf_analyzer request intervals: {path} ({len(planned)} gaps, microseconds)\n")
        if args.records and not args.export_only and planned:  # found unwritable now, not after the run
            args.records.parent.mkdir(parents=True, exist_ok=True)
            with open(args.records, "a", encoding="utf-8"):
                pass
    except (ValueError, OSError) as exc:  # an empty plan, a path that cannot be written
        err.write(f"error: {exc}\n")
        return 2
    if args.export_only or not planned:
        return 0

    tty = err.isatty()

    def progress(p: LoadProgress) -> None:
        """One line, rewritten in place on a terminal; a line per report in a log."""
        line = f"[load] {p.elapsed_s:6.1f} s  sent {p.sent}/{p.planned}  in flight {p.in_flight}"
        err.write(f"\r{line}" if tty else f"{line}\n")
        err.flush()

    records = run_load(
        url, planned, concurrency_limit=args.concurrency_limit,
        on_progress=progress, progress_every_s=1.0 if tty else 5.0, timeout_s=args.timeout, model=args.model,
    )  # fmt: skip
    if tty:
        err.write("\n")
    records_failed = False
    if args.records:
        lines = [json.dumps({**asdict(r), "send_lag_s": r.send_lag_s}) for r in records]
        try:
            args.records.write_text("\n".join(lines) + "\n", encoding="utf-8")
        except OSError as exc:  # e.g. the disk filled during the run: the summary below still prints
            err.write(f"error: cannot write the records to {args.records}: {exc}\n")
            records_failed = True
    lag = max((r.send_lag_s for r in records), default=0.0)
    out.write(summary_table(summarize(records, targets)) + "\n")
    out.write(f"max send lag {lag * 1000:.1f} ms (client-side lateness; large values mean the client, "
              "not the server, was the bottleneck)\n")  # fmt: skip
    failures = [r for r in records if r.outcome in ("error", "timeout")]
    for r in failures[:3]:
        out.write(f"error example ({r.tier}): {r.error}\n")
    # overload rejections are an outcome a load test may seek: not failures
    return 1 if failures or records_failed else 0


if __name__ == "__main__":
    sys.exit(main())
