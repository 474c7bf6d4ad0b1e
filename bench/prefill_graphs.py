"""Engine-side TTFT with eager prefills vs prefills replayed from CUDA graphs, for misses and for
prefix-cache hits (90% of the prompt cached in L1), side by side in one run.

In-process (engine.loader, no Triton): what is measured is the engine's part of TTFT, from
`submit` to the first token leaving through the sink. Without CUDA only the eager rows exist.
Writes bench/results/prefill-graphs-<tag>.{json,md,png}.

    python -m bench.prefill_graphs --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 --tag h200
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import threading
import time

from bench.common import (
    add_engine_args,
    in_process_config,
    median,
    model_dir_for,
    print_table,
    progress,
    write_results,
)
from engine.loader import load_engine
from engine.requests import EngineRequest
from scheduler.messages import EngineRequestParams

HIT_SHARE = 0.9


class _FirstToken:
    def __init__(self) -> None:
        self.first_ns = 0
        self.done = threading.Event()

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.first_ns = self.first_ns or time.perf_counter_ns()
        if final:
            self.done.set()

    def fail(self, code, message):
        raise RuntimeError(f"{code}: {message}")

    def cancelled(self):
        return False


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="12,128,512,2048,3500")
    parser.add_argument("--repeats", type=int, default=7)
    add_engine_args(parser)
    return parser.parse_args(argv)


def measure(args, graphs: bool, lengths: list[int]) -> list[dict]:
    config = in_process_config(
        args, prefill_graphs=graphs, response_cache=False, prefix_cache_blocks=2048, l2_cache_blocks=0
    )
    loaded = load_engine(config, log=lambda message: None)
    engine, block = loaded.engine, config.prefix_block_size
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(0)
    serial = iter(range(10**9))

    def ttft_ms(prompt: list[int]) -> float:
        sink = _FirstToken()
        params = EngineRequestParams(max_tokens=1, ignore_eos=True, exclude_input_in_output=True)
        began = time.perf_counter_ns()
        engine.submit(EngineRequest(f"p{next(serial)}", prompt, params, 3, 0, sink))
        if not sink.done.wait(60):
            raise TimeoutError("no first token within 60 s")
        return (sink.first_ns - began) / 1e6

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    rows = []
    try:
        for length in lengths:
            misses = [ttft_ms(fresh(length)) for _ in range(args.repeats)]
            shared = max(block, int(length * HIT_SHARE) // block * block)
            hits = []
            if shared < length:
                base = fresh(shared)
                ttft_ms(base + fresh(length - shared))  # stores the shared blocks in L1
                hits = [ttft_ms(base + fresh(length - shared)) for _ in range(args.repeats)]
            rows.append(
                {
                    "prefill": "graphs" if graphs else "eager",
                    "tokens": length,
                    "miss_ms": median(misses),
                    "hit_ms": median(hits) if hits else None,
                    "graph_buckets": list(engine.runner.prefill_graphs.buckets),
                }
            )
            progress(
                f"{rows[-1]['prefill']} {length}: miss {rows[-1]['miss_ms']:.2f} ms, hit {rows[-1]['hit_ms']}"
            )
    finally:
        engine.shutdown(1.0)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    model_dir_for(args.preset, args.model_dir)  # built once, before the measured engines load
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [False, True] if args.device.startswith("cuda") else [False]
    rows = [row for graphs in variants for row in measure(args, graphs, lengths)]
    eager = {r["tokens"]: r for r in rows if r["prefill"] == "eager"}
    table_rows = [
        [
            r["prefill"], r["tokens"], r["miss_ms"], r["hit_ms"] or "",
            (r["hit_ms"] / r["miss_ms"]) if r["hit_ms"] else "", r["miss_ms"] / eager[r["tokens"]]["miss_ms"],
        ]
        for r in rows
    ]  # fmt: skip
    headers = ["prefill", "tokens", "miss ms", "hit ms (90% cached)", "hit/miss", "miss vs eager"]
    table = print_table(headers, table_rows)
    command = "python -m bench.prefill_graphs " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    base = write_results(
        "prefill-graphs", args.tag or args.device.split(":")[0], {"rows": rows}, table, command, args.out_dir
    )
    progress(f"wrote {base}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
