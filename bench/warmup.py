"""Warmup benchmark: cold vs warmup v1 (fixed buckets) vs warmup planned from recorded traffic.

Each configuration starts a fresh server (and its own Redis), then sends `--first` requests right
after READY and `--steady` more, one at a time, with prompt lengths drawn from a heavy-tailed
lognormal distribution (the same sequence for every configuration). The planned configuration
finds yesterday's traffic in Redis: a histogram of `--history` earlier draws from the same
distribution (another seed). Reports first/steady TTFT, P99 of the first 100 vs steady P99,
time to READY, warmup time by stage and new-shape counts; draws TTFT against request index.
Writes bench/results/warmup-<tag>.{json,md,png}.

    python -m bench.warmup                         # CPU, tiny model
    python -m bench.warmup --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 \
        --text-env $TEXT_ENV --redis-server .gpubundle/redis/redis-server --tag h200
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import (
    start_stack,
    PROBE_MAX_TOKENS,
    REPO_ROOT,
    PromptFactory,
    TtftProbe,
    add_engine_args,
    engine_env,
    median,
    model_dir_for,
    plot_ttft_by_index,
    print_table,
    progress,
    write_results,
)
from cache.traffic_stats import RESERVED, TrafficStatsStore, model_fingerprint
from client.metrics import metric_total, scrape_metrics
from deploy.launch import StackOptions, find_free_port, start_redis_server
from deploy.logs import warmup_report

CONFIGS = ("cold", "v1", "planned")


@dataclass
class ConfigResult:
    name: str
    ready_s: float
    ttft_ms: list[float]
    lengths: list[int]
    warmup_total_s: float
    stages: dict[str, float]
    plan: dict
    new_shapes_after_ready: float
    first_n: int
    summary: dict[str, float] = field(default_factory=dict)

    def summarize(self) -> None:
        """Compare like with like: the steady phase opens with the first 100 lengths replayed, so
        P99(first 100) is set against P99 of the very same lengths later, and each request's
        TTFT is normalised by the steady median of its length class."""
        n = self.first_n
        first, replay = self.ttft_ms[:n], self.ttft_ms[n : 2 * n]
        by_class: dict[int, list[float]] = {}
        for length, ttft in zip(self.lengths[n:], self.ttft_ms[n:]):
            by_class.setdefault(length_class(length), []).append(ttft)
        steady_of = {c: median(v) for c, v in by_class.items()}
        slowdown = [t / steady_of[length_class(length)] for length, t in zip(self.lengths[:n], first)]
        self.summary = {
            "first_ms": first[0],
            "steady_same_class_ms": steady_of[length_class(self.lengths[0])],
            "first_over_steady": slowdown[0],
            "max_slowdown_first100": max(slowdown),
            "p99_first_ms": float(np.percentile(first, 99)),
            "p99_steady_ms": float(np.percentile(replay, 99)),
            "p99_ratio": float(np.percentile(first, 99) / np.percentile(replay, 99)),
        }


def length_class(tokens: int) -> int:
    """Power-of-two class, independent of any configuration's buckets."""
    return 1 << max(0, (tokens - 1).bit_length())


def lognormal_lengths(count: int, median_tokens: float, sigma: float, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(median_tokens), sigma, count)
    return [int(min(max(4, round(x)), max_len - 8)) for x in draws]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--first", type=int, default=100)
    parser.add_argument("--steady", type=int, default=500)
    parser.add_argument("--median-tokens", type=float, default=96)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (1.0: p99 ~ 10x median)")
    parser.add_argument("--history", type=int, default=5000, help="recorded prompts the planned config finds")
    parser.add_argument("--budget-s", type=float, default=0.0, help="warmup budget (0: none)")
    add_engine_args(parser)
    parser.add_argument("--redis-server", default="redis-server")
    return parser.parse_args(argv)


def run_config(args, name: str, model_dir: Path, lengths: list[int], history: list[int]) -> ConfigResult:
    run_dir = REPO_ROOT / ".run" / f"bench-warmup-{name}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = find_free_port()
    redis_proc, _ = start_redis_server(args.redis_server, run_dir, port)
    redis_url = f"redis://localhost:{port}/0"
    try:
        if name == "planned":
            store = TrafficStatsStore(redis_url, "llm_engine", model_fingerprint(model_dir, args.max_seq_len))
            store.add_lengths(Counter(history))
            store.add_lengths(Counter(n + PROBE_MAX_TOKENS for n in history), RESERVED)
        options = StackOptions(
            run_dir=run_dir,
            model_dir=model_dir,
            warmup=name != "cold",
            text_env=args.text_env,
            start_redis=False,
            redis_url=redis_url,
            overrides={"llm_engine": {"warmup_budget_s": str(args.budget_s)}},
            extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
        )
        progress(f"{name}: starting the server")
        started = time.perf_counter()
        stack = start_stack(options)
        ready_s = time.perf_counter() - started
        progress(f"{name}: READY after {ready_s:.1f} s; sending {len(lengths)} requests")
        prompts = PromptFactory(model_dir)
        texts = [prompts.make(n) for n in lengths]
        probe = TtftProbe(stack.grpc_url)
        try:
            ttft = []
            for index, text in enumerate(texts):
                ttft.append(probe.ttft_ms(text))
                if (index + 1) % 100 == 0:
                    progress(f"{name}: {index + 1}/{len(texts)} requests")
            new_shapes = metric_total(
                scrape_metrics(stack.metrics_url), "llm_engine_new_shapes_after_ready_total"
            )
        finally:
            probe.close()
            stack.stop()
        report = warmup_report(stack.triton_log)
        result = ConfigResult(
            name=name,
            ready_s=ready_s,
            ttft_ms=ttft,
            lengths=lengths,
            warmup_total_s=report.get("total_seconds", 0.0),
            stages={s["name"]: s["seconds"] for s in report.get("stages", [])},
            plan={
                **report.get("plan", {}),
                "buckets": report.get("prompt_buckets", []),
                "prefill_loaded": report.get("prefill_loaded", 0),
                "prefill_deferred": report.get("prefill_deferred", 0),
            },
            new_shapes_after_ready=new_shapes,
            first_n=args.first,
        )
        result.summarize()
        return result
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def kv_pools(plan: dict) -> str:
    return " + ".join(f"{p['capacity']}x{p['slots']}" for p in plan["kv"]["pools"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_for(args.preset, args.model_dir)
    first = lognormal_lengths(args.first, args.median_tokens, args.sigma, args.max_seq_len, seed=2)
    extra = lognormal_lengths(
        max(0, args.steady - args.first), args.median_tokens, args.sigma, args.max_seq_len, seed=3
    )
    lengths = first + first + extra  # the steady phase replays the first lengths, then more
    history = lognormal_lengths(args.history, args.median_tokens, args.sigma, args.max_seq_len, seed=1)
    results = [run_config(args, name, model_dir, lengths, history) for name in CONFIGS]
    headers = [
        "config", "READY s", "warmup s", "first ms", "steady ms (same class)", "first/steady",
        "max slowdown first100", "P99 first100 ms", "P99 same lengths later ms", "P99 ratio",
        "new shapes after READY", "hot prefixes loaded/deferred", "KV pools (capacity x slots)",
        "KV reserved / one pool",
    ]  # fmt: skip
    rows = [
        [
            r.name, r.ready_s, r.warmup_total_s, r.summary["first_ms"], r.summary["steady_same_class_ms"],
            r.summary["first_over_steady"], r.summary["max_slowdown_first100"], r.summary["p99_first_ms"],
            r.summary["p99_steady_ms"], r.summary["p99_ratio"], int(r.new_shapes_after_ready),
            f"{r.plan['prefill_loaded']}/{r.plan['prefill_deferred']}", kv_pools(r.plan),
            r.plan["kv"]["slot_tokens"] / r.plan["kv"]["single_pool_tokens"],
        ]
        for r in results
    ]  # fmt: skip
    table = print_table(headers, rows)
    stages = "\n".join(
        f"- {r.name}: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r.stages.items())
        + f"; plan {r.plan}"
        for r in results
    )
    print(stages)
    lengths_note = (
        f"prompt lengths: lognormal median {args.median_tokens:g} sigma {args.sigma:g}: "
        f"p50 {int(np.percentile(lengths, 50))}, p99 {int(np.percentile(lengths, 99))}, "
        f"max {max(lengths)} tokens; hot prefixes: model_repository/llm_engine/prefill_templates.yaml "
        "within prefill_budget_s 0.3 s"
    )
    print(lengths_note)
    tag = args.tag or args.device.split(":")[0]
    command = "python -m bench.warmup " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    payload = {"configs": results, "device": args.device, "model_dir": str(model_dir)}
    base = write_results(
        "warmup",
        tag,
        payload,
        f"{table}\n\nWarmup stages:\n{stages}\n\n{lengths_note}",
        command,
        args.out_dir,
    )
    plot_ttft_by_index(
        {r.name: r.ttft_ms for r in results},
        base.with_suffix(".png"),
        "TTFT per request, lognormal prompt lengths",
        divider=(args.first, "first 100 | steady"),
    )
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
