"""A new replica with start-up prefill from Redis (L3) vs a new replica without, vs a long-warm one.

Hot traffic: questions about a set of long shared documents. Replica A serves it long enough to be
warm (and fills Redis); replica B starts with the same Redis and the documents as its hot
prefixes, which its warmup loads from L3 within the budget before READY; replica C starts cold
(empty Redis, no hot prefixes). For each, the TTFT of the first 100 hot requests after READY.
Target: B's first-100 P99 within 1.2x of A's. Writes bench/results/replica-prefill-<tag>.{json,md,png}.

    python -m bench.replica_prefill
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
import yaml

from bench.common import (
    start_stack,
    REPO_ROOT,
    PromptFactory,
    TtftProbe,
    add_engine_args,
    engine_env,
    model_dir_for,
    plot_ttft_by_index,
    print_table,
    progress,
    write_results,
)
from deploy.launch import StackOptions, find_free_port, start_redis_server


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--document-tokens", type=int, default=1200)
    parser.add_argument("--requests", type=int, default=100)
    add_engine_args(parser)
    parser.add_argument("--redis-server", default="redis-server")
    return parser.parse_args(argv)


def serve(
    args, name: str, model_dir: Path, redis_url: str, templates: Path | None, prompts: list[str]
) -> list[float]:
    overrides = {"prefill_templates": str(templates) if templates else "", "prefill_budget_s": "5"}
    options = StackOptions(
        run_dir=REPO_ROOT / ".run" / f"bench-replica-{name}",
        model_dir=model_dir,
        warmup=True,
        text_env=args.text_env,
        start_redis=False,
        redis_url=redis_url,
        overrides={"llm_engine": {**overrides, "response_cache": "false"}},
        extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
    )
    with start_stack(options) as stack:
        probe = TtftProbe(stack.grpc_url)
        try:
            progress(f"{name}: READY; {len(prompts)} hot requests")
            return [probe.ttft_ms(text) for text in prompts]
        finally:
            probe.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_for(args.preset, args.model_dir)
    factory = PromptFactory(model_dir)
    documents = [factory.make(args.document_tokens) + "\n" for _ in range(args.documents)]
    rng = np.random.default_rng(7)
    hot = [
        f"{documents[rng.integers(len(documents))]}Question {i}: what does it say?"
        for i in range(args.requests)
    ]
    run_dir = REPO_ROOT / ".run" / "bench-replica"
    run_dir.mkdir(parents=True, exist_ok=True)
    templates = run_dir / "hot_prefixes.yaml"
    templates.write_text(yaml.safe_dump({"templates": [{"tenant": "default", "text": d} for d in documents]}))
    shared_port, empty_port = find_free_port(), find_free_port()
    shared, _ = start_redis_server(args.redis_server, run_dir, shared_port)
    try:
        shared_url = f"redis://localhost:{shared_port}/0"
        warm_up = [f"{d}Warm-up question {i}" for i in range(3) for d in documents]
        a = serve(args, "long-warm", model_dir, shared_url, None, warm_up + hot)[len(warm_up) :]
        b = serve(args, "l3-prefill", model_dir, shared_url, templates, hot)
        empty_dir = run_dir / "empty"
        empty_dir.mkdir(exist_ok=True)
        empty, _ = start_redis_server(args.redis_server, empty_dir, empty_port)
        try:
            c = serve(args, "cold", model_dir, f"redis://localhost:{empty_port}/0", None, hot)
        finally:
            empty.terminate()
    finally:
        shared.terminate()
    rows = []
    series = {"long-warm replica": a, "new replica, L3 prefill": b, "new replica, cold": c}
    for name, ttft in series.items():
        p99 = float(np.percentile(ttft, 99))
        rows.append([name, float(np.percentile(ttft, 50)), p99, p99 / float(np.percentile(a, 99))])
    table = print_table(["replica", "first-100 P50 ms", "first-100 P99 ms", "P99 / long-warm P99"], rows)
    command = "python -m bench.replica_prefill " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    base = write_results(
        "replica-prefill", args.tag or args.device.split(":")[0], {"rows": rows}, table, command, args.out_dir
    )
    plot_ttft_by_index(
        series,
        base.with_suffix(".png"),
        "First hot requests: new replica with L3 prefill vs cold vs long-warm",
        style=".-",
    )
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
