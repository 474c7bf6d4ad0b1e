"""Warmup with the hot prefixes in L3 (Redis): the L3 prefetch overlapped with kernel warmup, on vs off.

One Redis is filled with the KV blocks of `--documents` long documents by a first replica (prefill
budget large enough to compute them all). Then new replicas start against it, each in a fresh
process (`engine.loader.load_engine`, the code `initialize()` runs, without Triton around it), with
the documents as hot prefixes: `l3_prefetch` on and off alternately, `--repeats` times, for every
prefill budget in `--budgets`. Reported per configuration (medians over the repeats, min-max beside):
total warmup seconds, the prefix_templates stage, the kernel stages, the prefetch thread's wall time
and how long prefix_templates waited on it, templates loaded within the budget.
Writes bench/results/l3-prefetch-<tag>.{json,md}.

    python -m bench.l3_prefetch                     # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import numpy as np
import yaml

from bench.common import (
    REPO_ROOT,
    PromptFactory,
    add_engine_args,
    model_dir_for,
    print_table,
    progress,
    write_results,
)
from deploy.launch import find_free_port, start_redis_server

MARK = "L3_PREFETCH_REPORT "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--document-tokens", type=int, default=1200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budgets", default="0.3,5", help="prefill_budget_s values, comma-separated")
    add_engine_args(parser)
    parser.add_argument("--redis-server", default="redis-server")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON EngineConfig parameters
    return parser.parse_args(argv)


def child(params: dict[str, str]) -> int:
    """One replica: load, warm, print the warmup report, shut down."""
    from dataclasses import asdict

    from engine.config import EngineConfig
    from engine.loader import load_engine

    loaded = load_engine(EngineConfig.from_parameters(params), log=lambda message: None)
    engine = loaded.engine
    cache = engine.prefix_cache
    l3 = cache.l3 if cache is not None else None
    extra = {
        "load_seconds": loaded.load_seconds,
        "l3_loaded_blocks": l3.loaded_blocks if l3 is not None else 0,
        "l3_errors": l3.store.stats.errors if l3 is not None else 0,
    }
    print(MARK + json.dumps({"report": asdict(loaded.report), **extra}), flush=True)
    engine.shutdown(drain_timeout_s=5)
    return 0


def run_replica(params: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.l3_prefetch", "--child", json.dumps(params)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"replica failed (rc {out.returncode}): {out.stderr[-2000:]}")


def stage_s(report: dict, name: str) -> float:
    return sum(s["seconds"] for s in report["stages"] if s["name"] == name)


def summarize(runs: list[dict]) -> dict:
    def values(fn) -> list[float]:
        return [float(fn(r)) for r in runs]

    prefetch = [r["report"]["l3_prefetch"] for r in runs]
    metrics = {
        "warmup_total_s": values(lambda r: r["report"]["total_seconds"]),
        "prefix_templates_s": values(lambda r: stage_s(r["report"], "prefix_templates")),
        "kernel_stages_s": values(
            lambda r: stage_s(r["report"], "prefill_buckets") + stage_s(r["report"], "decode_kv_buckets")
        ),
        "l3_prefetch_wall_s": [p.get("seconds", 0.0) for p in prefetch],
        "templates_waited_s": [p.get("templates_waited_s", 0.0) for p in prefetch],
        "templates_loaded": values(lambda r: r["report"]["prefill_loaded"]),
        "templates_deferred": values(lambda r: r["report"]["prefill_deferred"]),
        "l3_blocks_loaded_by_ready": values(lambda r: r["l3_loaded_blocks"]),
    }
    return {
        name: {"median": float(np.median(v)), "min": min(v), "max": max(v), "runs": v}
        for name, v in metrics.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(json.loads(args.child))
    model_dir = model_dir_for(args.preset, args.model_dir)
    factory = PromptFactory(model_dir)
    documents = [factory.make(args.document_tokens) + "\n" for _ in range(args.documents)]
    run_dir = REPO_ROOT / ".run" / "bench-l3-prefetch"
    run_dir.mkdir(parents=True, exist_ok=True)
    templates = run_dir / "hot_prefixes.yaml"
    templates.write_text(yaml.safe_dump({"templates": [{"tenant": "default", "text": d} for d in documents]}))
    port = find_free_port()
    redis, _ = start_redis_server(args.redis_server, run_dir, port)
    base = {
        "model_dir": str(model_dir),
        "device": args.device,
        "dtype": args.dtype,
        "max_seq_len": str(args.max_seq_len),
        "redis_url": f"redis://localhost:{port}/0",
        "prefill_templates": str(templates),
        "response_cache": "false",
        "warmup": "true",
    }
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    results: dict[str, dict] = {}
    try:
        seed = run_replica({**base, "prefill_budget_s": "120", "l3_prefetch": "false"})
        progress(
            f"seeded Redis: {seed['report']['prefill_loaded']} templates computed "
            f"({stage_s(seed['report'], 'prefix_templates'):.2f} s)"
        )
        runs: dict[tuple[float, bool], list[dict]] = {(b, p): [] for b in budgets for p in (True, False)}
        for repeat in range(args.repeats):
            for budget in budgets:
                order = (True, False) if repeat % 2 == 0 else (False, True)  # alternate who goes first
                for prefetch in order:
                    run = run_replica(
                        {**base, "prefill_budget_s": str(budget), "l3_prefetch": str(prefetch).lower()}
                    )
                    runs[(budget, prefetch)].append(run)
                    progress(
                        f"repeat {repeat} budget {budget} prefetch {prefetch}: warmup "
                        f"{run['report']['total_seconds']:.3f} s, prefix_templates "
                        f"{stage_s(run['report'], 'prefix_templates'):.3f} s"
                    )
        for (budget, prefetch), group in runs.items():
            results[f"budget={budget} prefetch={'on' if prefetch else 'off'}"] = {
                "budget_s": budget,
                "prefetch": prefetch,
                **summarize(group),
                "l3_prefetch_sections": [r["report"]["l3_prefetch"] for r in group],
                "stages": [
                    {s["name"]: [s["seconds"], s["start_s"], s["end_s"]] for s in r["report"]["stages"]}
                    for r in group
                ],
            }
    finally:
        redis.terminate()
    rows = []
    for name, r in results.items():

        def cell(key: str) -> str:
            m = r[key]
            return f"{m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})"

        rows.append(
            [
                r["budget_s"],
                "on" if r["prefetch"] else "off",
                cell("warmup_total_s"),
                cell("prefix_templates_s"),
                cell("kernel_stages_s"),
                cell("l3_prefetch_wall_s") if r["prefetch"] else "-",
                cell("templates_waited_s") if r["prefetch"] else "-",
                f"{r['templates_loaded']['median']:.0f}/{args.documents}",
            ]
        )
    table = print_table(
        [
            "budget s",
            "prefetch",
            "warmup total s",
            "prefix_templates s",
            "kernel stages s",
            "prefetch wall s",
            "templates waited s",
            "loaded",
        ],
        rows,
    )
    note = (
        f"\n{args.documents} hot prefixes of ~{args.document_tokens} tokens, all in Redis; "
        f"median (min-max) of {args.repeats} fresh processes per row, on/off alternated."
    )
    command = "python -m bench.l3_prefetch " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    out = write_results(
        "l3-prefetch",
        args.tag or args.device.split(":")[0],
        {"documents": args.documents, "document_tokens": args.document_tokens, "results": results},
        table + note,
        command,
        args.out_dir,
    )
    progress(f"wrote {out}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
