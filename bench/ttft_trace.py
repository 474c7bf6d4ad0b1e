"""Where each request's first token goes, hop by hop, from Triton's own request traces.

Starts one warm server with Triton tracing on (TIMESTAMPS, every request), sends `--requests` per
length one at a time, and prints per request: the client's time to the first token, then from the
trace (all on the server's clock, from the gRPC read of the request): the wait for the scheduler
step, its compute, the engine (from its request's start to the first token's detokenizer request:
queue, prefill and the response's routing), the detokenizer's queue and compute, and the gRPC send.
Client time beyond the server's send end is the client's own (reading, its threads). This is how the
coldstart bench's slow "first" 48-token request on the H200 was found to be fast on the server: the
delay was a held-back first token (its text waited for the second one). Writes
bench/results/ttft-trace-<tag>.{json,md,png} (the PNG: median time per hop and length, stacked).

    python -m bench.ttft_trace --lengths 12,48,200 --requests 9
    python -m bench.ttft_trace --lengths 2048 --shared 0.9     # prefix-cache hits after the first
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    start_stack,
    REPO_ROOT,
    PromptFactory,
    TtftProbe,
    add_engine_args,
    engine_env,
    median,
    model_dir_for,
    print_table,
    progress,
    write_results,
)
from deploy.launch import StackOptions

HOPS = (
    "to scheduler",
    "scheduler compute",
    "engine to first token",
    "detok queue",
    "detok compute",
    "send",
    "read to send end",
)


@dataclass
class Trace:
    """One traced request of one model: its parent (the ensemble's) and named timestamps (ns)."""

    model: str | None = None
    parent: int | None = None
    stamps: dict[str, list[int]] | None = None


def load_traces(path: Path) -> dict[int, Trace]:
    """Triton writes a JSON list per file (`path`, `path.0`, `path.1`, ...) with one entry per event."""
    traces: dict[int, Trace] = {}
    for file in sorted(path.parent.glob(path.name + "*")):
        try:
            entries = json.loads(file.read_text())
        except ValueError:
            continue  # a file cut short by the shutdown
        for entry in entries:
            trace = traces.setdefault(entry["id"], Trace(stamps={}))
            trace.model = entry.get("model_name", trace.model)
            trace.parent = entry.get("parent_id", trace.parent)
            for stamp in entry.get("timestamps", []):
                trace.stamps.setdefault(stamp["name"], []).append(stamp["ns"])
    return traces


def hops_ms(top: Trace, children: list[Trace]) -> list[float]:
    """The durations of HOPS for one ensemble request's first token."""

    def first(trace: Trace, name: str) -> int:
        return min(trace.stamps[name])

    sched = next(c for c in children if c.model == "slo_scheduler")
    engine = next(c for c in children if c.model == "llm_engine")
    detok = min((c for c in children if c.model == "detokenizer"), key=lambda c: first(c, "REQUEST_START"))
    read = first(top, "GRPC_WAITREAD_END")
    points = [
        (read, first(sched, "COMPUTE_START")),
        (first(sched, "COMPUTE_START"), first(sched, "COMPUTE_END")),
        (first(engine, "REQUEST_START"), first(detok, "REQUEST_START")),
        (first(detok, "REQUEST_START"), first(detok, "COMPUTE_START")),
        (first(detok, "COMPUTE_START"), first(detok, "COMPUTE_END")),
        (first(top, "GRPC_SEND_START"), first(top, "GRPC_SEND_END")),
        (read, first(top, "GRPC_SEND_END")),
    ]
    return [(end - start) / 1e6 for start, end in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="12,48,200")
    parser.add_argument("--requests", type=int, default=9, help="requests per length, one at a time")
    parser.add_argument(
        "--shared", type=float, default=0.0, help="share of each prompt that is one prefix per length (hits)"
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    model_dir = model_dir_for(args.preset, args.model_dir)
    run_dir = REPO_ROOT / ".run" / "bench-ttft-trace"
    trace_file = run_dir / "trace.json"
    for old in run_dir.glob("trace.json*"):
        old.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    options = StackOptions(
        run_dir=run_dir,
        model_dir=model_dir,
        warmup=True,
        text_env=args.text_env,
        extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
        extra_args=[
            *("--trace-config", f"triton,file={trace_file}"),
            *("--trace-config", "triton,log-frequency=1"),
            *("--trace-config", "level=TIMESTAMPS"),
            *("--trace-config", "rate=1"),
        ],
    )
    stack = start_stack(options)
    prompts = PromptFactory(model_dir)
    probe = TtftProbe(stack.grpc_url)
    sent = []
    try:
        for tokens in (int(x) for x in args.lengths.split(",")):
            shared = int(tokens * args.shared)
            prefix = prompts.make(shared) if shared else ""
            for _ in range(args.requests):
                result = probe.request(prefix + prompts.make(tokens - shared))
                sent.append((tokens, result.first_token_s * 1000.0, result.ttft_s * 1000.0))
        progress("done; reading the traces")
    finally:
        probe.close()
        stack.stop()
    traces = load_traces(trace_file)
    children: dict[int, list[Trace]] = {}
    for trace in traces.values():
        if trace.parent is not None:
            children.setdefault(trace.parent, []).append(trace)
    tops = sorted(
        (min(t.stamps["GRPC_WAITREAD_END"]), tid)
        for tid, t in traces.items()
        if t.model == "llm" and "GRPC_WAITREAD_END" in t.stamps
    )[-len(sent) :]
    rows = [
        [tokens, token_ms, text_ms, *hops_ms(traces[tid], children[tid])]
        for (tokens, token_ms, text_ms), (_, tid) in zip(sent, tops)
    ]
    headers = ["tokens", "client first token ms", "client first text ms", *[f"{h} ms" for h in HOPS]]
    table = print_table(headers, rows)
    command = "python -m bench.ttft_trace " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    payload = {"hops": HOPS, "headers": headers, "rows": rows, "shared": args.shared}
    tag = args.tag or args.device.split(":")[0]
    base = write_results("ttft-trace", tag, payload, table, command, args.out_dir)
    plot(rows, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    return 0


def plot(rows: list[list[float]], path: Path) -> None:
    """Median time of each server hop of the first token, per prompt length, stacked (the last hop,
    read to send end, is their span and is left out), beside the client's time to the first token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({row[0] for row in rows})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottoms = [0.0] * len(lengths)
    for index, hop in enumerate(HOPS[:-1]):
        heights = [median([row[3 + index] for row in rows if row[0] == n]) for n in lengths]
        ax.bar([str(n) for n in lengths], heights, bottom=bottoms, label=hop)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    client = [median([row[1] for row in rows if row[0] == n]) for n in lengths]
    ax.plot([str(n) for n in lengths], client, "k_", markersize=30, label="client: first token")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("ms (median over the requests)")
    ax.set_title("Where the first token's time goes (Triton request traces)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
