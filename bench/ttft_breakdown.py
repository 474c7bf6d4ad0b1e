"""Where does each request's TTFT go? Client TTFT beside engine TTFT and per-step server time.

Starts one warm server, sends `--requests` sequential requests cycling over `--lengths`, and
prints, per request: client TTFT, the engine's TTFT (queue + prefill, from its counters) and the
time Triton accounts to each step (from the statistics API). Used to find first-request outliers
that are not in the engine.

    python -m bench.ttft_breakdown --lengths 12,48,200 --requests 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from bench.common import (
    start_stack,
    REPO_ROOT,
    EngineTtft,
    PromptFactory,
    TtftProbe,
    add_engine_args,
    engine_env,
    model_dir_for,
    print_table,
    progress,
)
from deploy.launch import StackOptions

STEPS = ("slo_scheduler", "llm_engine", "detokenizer")


def step_times_ms(http_port: int) -> dict[str, float]:
    """Cumulative queue + compute time per step, from Triton's statistics extension."""
    out = {}
    for model in STEPS:
        with urllib.request.urlopen(f"http://localhost:{http_port}/v2/models/{model}/stats", timeout=10) as r:
            stats = json.load(r)["model_stats"][0]["inference_stats"]
        out[model] = (
            sum(stats[k]["ns"] for k in ("queue", "compute_input", "compute_infer", "compute_output")) / 1e6
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="12,48,200")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument(
        "--prime",
        type=int,
        default=0,
        help="requests sent on another connection first (tells server-side from connection-side costs)",
    )
    parser.add_argument(
        "--grouped", action="store_true", help="all requests of a length in a row (as bench.coldstart)"
    )
    add_engine_args(parser, results=False)
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="wait this long after READY before the first request (tells post-READY background work apart)",
    )
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = model_dir_for(args.preset, args.model_dir)
    options = StackOptions(
        run_dir=REPO_ROOT / ".run" / "bench-ttft-breakdown",
        model_dir=model_dir,
        warmup=True,
        text_env=args.text_env,
        start_redis=not args.no_redis,
        redis_url="redis://127.0.0.1:1/0" if args.no_redis else None,
        extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
    )
    stack = start_stack(options)
    prompts = PromptFactory(model_dir)
    probe = TtftProbe(stack.grpc_url)
    engine = EngineTtft(stack.metrics_url)
    rows = []
    time.sleep(args.settle_s)
    if args.prime:
        primer = TtftProbe(stack.grpc_url)
        for index in range(args.prime):
            primer.ttft_ms(prompts.make(lengths[index % len(lengths)]), max_tokens=args.max_tokens)
        primer.close()
        engine.mean_ms_since_last()
    try:
        before = step_times_ms(stack.http_port)
        for index in range(args.requests):
            tokens = lengths[index * len(lengths) // args.requests if args.grouped else index % len(lengths)]
            client_ms = probe.ttft_ms(prompts.make(tokens), max_tokens=args.max_tokens)
            engine_ms = engine.mean_ms_since_last()
            after = step_times_ms(stack.http_port)
            steps = [after[m] - before[m] for m in STEPS]
            before = after
            rows.append([index, tokens, client_ms, engine_ms, *steps, client_ms - engine_ms])
        progress("done")
    finally:
        probe.close()
        stack.stop()
    print_table(
        ["#", "tokens", "client TTFT ms", "engine TTFT ms", *[f"{m} ms" for m in STEPS], "outside engine ms"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
