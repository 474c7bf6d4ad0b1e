"""torch.compile cache benchmark: the warmup's compile stage on a cold and on a warm cache.

Starts the engine in-process (engine.loader, no Triton) in a fresh Python process per start, as
a replica restart would, on one fresh cache directory:

1. `off`: compile off (the eager baseline's time to READY);
2. `cold`: compile on, empty cache directory (inductor and the C++/Triton compiler run);
3. `warm`: compile on, same directory (a restart of the same model version);
4. `artifacts`: compile on, the directory's inductor/ removed so that only artifacts.bin is left
   (a fresh volume that shipped the portable file).

For each: seconds from process start to READY, the compile stage, the warmup total, and the cache
facts from the warmup report. The warm start also times steady decode steps per KV bucket, eager
vs compiled (the same runner, steps interleaved). Writes bench/results/compile-cache-<tag>.{json,md,png}.

    python -m bench.compile_cache                           # CPU, tiny model, default buckets
    python -m bench.compile_cache --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 --tag h200
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    REPO_ROOT,
    add_engine_args,
    in_process_config,
    model_dir_for,
    print_table,
    progress,
    write_results,
)

STARTS = ("off", "cold", "warm", "artifacts")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--slots", type=int, default=8, help="KV slots (decode batch)")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per bucket and variant")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--skip-artifacts-start", action="store_true")
    parser.add_argument("--child", choices=STARTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """One start; prints its figures as the last line of stdout (JSON)."""
    import torch

    from engine.loader import load_engine

    config = in_process_config(
        args, max_batch_size=args.slots, compile=args.child != "off", compile_cache_dir=str(args.cache_dir)
    )
    loaded = load_engine(config, log=lambda message: None, model_name="llm_engine", model_version="1")
    ready_s = time.time() - args.spawned_at
    report = loaded.report
    loaded.engine.shutdown(1.0)
    out = {
        "start": args.child,
        "ready_s": ready_s,
        "load_s": loaded.load_seconds,
        "warmup_s": report.total_seconds,
        "stages": {stage.name: stage.seconds for stage in report.stages},
        "compile": report.compile,
        "failures": report.failures,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m_at_ready": os.getloadavg()[0],  # other work on the machine skews every figure
    }
    if args.child == "warm":
        out["decode_ms"] = time_decode_steps(loaded.engine.runner, args.steps)
        out["fallback_steps"] = loaded.engine.runner.compile_fallbacks
    print(json.dumps(out))


def time_decode_steps(runner, steps: int) -> dict[str, dict[str, float]]:
    """Median ms of one decode step per compiled bucket, eager and compiled, steps interleaved so that
    machine noise hits both alike. Every slot is active at position bucket-1 (the bucket's full span)."""
    import torch

    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)

    results = {}
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    for bucket in sorted(runner.compiled_buckets):
        tokens = torch.randint(0, vocab, (runner.slots,), generator=generator).to(runner.device)
        positions = runner.last_positions(bucket)
        variants = {"eager": runner._decode_eager, "compiled": runner._decode_compiled}
        times: dict[str, list[float]] = {name: [] for name in variants}
        with torch.inference_mode():
            for index in range(steps + 5):
                for name, step in variants.items():
                    sync()
                    started = time.perf_counter()
                    step(tokens, positions, bucket)
                    sync()
                    if index >= 5:
                        times[name].append((time.perf_counter() - started) * 1000.0)
        results[str(bucket)] = {name: statistics.median(values) for name, values in times.items()}
    return results


def run_start(args: argparse.Namespace, start: str, cache_dir: Path, argv: list[str]) -> dict:
    progress(f"start '{start}' (cache {cache_dir})")
    command = [sys.executable, "-m", "bench.compile_cache", *argv, "--child", start]
    command += ["--cache-dir", str(cache_dir), "--spawned-at", repr(time.time())]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"start {start} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(starts: list[dict], decode: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [s["start"] for s in starts]
    compile_s = [s["stages"].get("compile", 0.0) for s in starts]
    rest_s = [s["warmup_s"] - c for s, c in zip(starts, compile_s)]
    other_s = [s["ready_s"] - s["warmup_s"] for s in starts]
    left.bar(names, other_s, label="process start, imports, load")
    left.bar(names, rest_s, bottom=other_s, label="other warmup stages")
    left.bar(names, compile_s, bottom=[a + b for a, b in zip(other_s, rest_s)], label="compile stage")
    for index, value in enumerate(compile_s):
        left.annotate(f"{value:.1f} s", (index, starts[index]["ready_s"]), ha="center", va="bottom")
    left.set_ylabel("seconds to READY")
    left.set_title("Time to READY per start (compile cache)")
    left.legend()
    buckets = list(decode)
    xs = range(len(buckets))
    right.bar([x - 0.2 for x in xs], [decode[b]["eager"] for b in buckets], width=0.4, label="eager")
    right.bar([x + 0.2 for x in xs], [decode[b]["compiled"] for b in buckets], width=0.4, label="compiled")
    right.set_xticks(list(xs), buckets)
    right.set_xlabel("KV bucket (tokens)")
    right.set_ylabel("decode step, median ms")
    right.set_title("Steady decode step: eager vs torch.compile")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    model_dir_for(args.preset, args.model_dir)  # build once here, not in a timed start
    owned = args.cache_dir is None
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="compile-cache-bench-"))
    child_argv = [a for a in argv if a != "--skip-artifacts-start"]
    if "--cache-dir" in child_argv:
        at = child_argv.index("--cache-dir")
        del child_argv[at : at + 2]
    try:
        starts = []
        for start in STARTS:
            if start == "artifacts":
                if args.skip_artifacts_start:
                    continue
                keyed = Path(starts[1]["compile"]["cache_dir"])
                shutil.rmtree(keyed / "inductor")
            starts.append(run_start(args, start, cache_dir, child_argv))
    finally:
        if owned:
            shutil.rmtree(cache_dir, ignore_errors=True)
    headers = [
        "start",
        "READY s",
        "compile stage s",
        "warmup s",
        "outcome",
        "FX hits/misses",
        "artifacts",
        "load avg",
    ]
    rows = []
    for s in starts:
        info = s["compile"]
        cache = info.get("cache", {})
        artifacts = ""
        if info:
            artifacts = "loaded" if info["artifacts_loaded"] else ""
            if info["artifacts_saved_bytes"]:
                artifacts += f"saved {info['artifacts_saved_bytes'] / 1024:.0f} KiB"
        rows.append(
            [
                s["start"],
                s["ready_s"],
                s["stages"].get("compile", 0.0),
                s["warmup_s"],
                info.get("outcome", "off"),
                f"{cache.get('fxgraph_hit', 0)}/{cache.get('fxgraph_miss', 0)}" if info else "",
                artifacts,
                s["loadavg_1m_at_ready"],
            ]
        )
    table = print_table(headers, rows)
    decode = next(s for s in starts if s["start"] == "warm")["decode_ms"]
    decode_rows = [[b, v["eager"], v["compiled"], v["eager"] / v["compiled"]] for b, v in decode.items()]
    decode_table = print_table(["KV bucket", "eager ms", "compiled ms", "speed-up"], decode_rows)
    failures = [f for s in starts for f in s["failures"]]
    if failures:
        print(f"warmup failures: {failures}")
    tag = args.tag or args.device.split(":")[0]
    command = "python -m bench.compile_cache " + " ".join(shlex.quote(a) for a in argv)
    payload = {
        "starts": starts,
        "decode_ms": decode,
        "device": args.device,
        "dtype": args.dtype,
        "slots": args.slots,
        "max_seq_len": args.max_seq_len,
        "model_dir": str(model_dir_for(args.preset, args.model_dir)),
    }
    body = (
        f"{table}\n\nSteady decode step ({args.slots} slots, every slot at the bucket's last position, "
        f"median of {args.steps} interleaved steps):\n\n{decode_table}"
    )
    base = write_results("compile-cache", tag, payload, body, command, args.out_dir)
    plot(starts, decode, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
