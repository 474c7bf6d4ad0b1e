"""Host time of a prefix-cache store at 0% hits, in-process (no Triton).

At capacity the engine thread is the bottleneck, and at 0% hits the only KV-tier work on it is the store
of every prompt's new blocks (`bench.prefix_cache` (b) at capacity: the KV tiers cost about 1.3% of
throughput, the store 0.56 ms of host time per request). This measures that store alone, per scenario:
L1 with free rows; L1 full with L2 (every store demotes as many blocks to L2); L1 full without L2 (they
are forgotten); L1 full with L2 right after the thread slept 20 ms; and on CUDA, L1 full with L2 while
20 ms of work is queued on the device, which shows whether a store ever waits for the device (it must
not). The slept row is the control for the busy one: on the H200 host a store after 20 ms of host sleep
with no device work (0.52-0.60 ms median) was slower than one with the device busy (0.25-0.49 ms),
against 0.10-0.11 ms back to back (throwaway script, 2026-11-30): what slows a store there is the
thread having waited (cold caches, a core that idled), not the device. One fresh cache per scenario on
one loaded model; prompts are unique random ids.

    python -m bench.store_cost [--stores 400] [--prompt-tokens 256]
    python -m bench.store_cost --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 --tag h200
Writes bench/results/store-cost-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from dataclasses import dataclass

import torch

from bench.common import (
    add_engine_args,
    in_process_config,
    median,
    percentile,
    print_table,
    progress,
    write_results,
)
from engine.l2_pool import HostBlockPool
from engine.loader import load_engine
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache

BUSY_CYCLES = 40_000_000  # torch.cuda._sleep: ~20 ms at the H200's ~2 GHz


@dataclass(frozen=True)
class Scenario:
    name: str
    fill: bool  # store prompts until L1 is full before timing
    l2: bool
    busy_device: bool = False
    host_idle_s: float = 0.0  # the thread sleeps this long before each timed store


SCENARIOS = (
    Scenario("L1 with free rows", fill=False, l2=True),
    Scenario("L1 full, demoting to L2", fill=True, l2=True),
    Scenario("L1 full, no L2", fill=True, l2=False),
    Scenario("L1 full, L2, after 20 ms of host sleep", fill=True, l2=True, host_idle_s=0.02),
)
BUSY = Scenario("L1 full, L2, device busy (20 ms queued)", fill=True, l2=True, busy_device=True)


@dataclass
class StoreTimes:
    scenario: str
    seconds: list[float]
    evictions_per_store: float

    @property
    def row(self) -> list[object]:
        ms = sorted(s * 1000 for s in self.seconds)
        p90 = percentile(ms, 90)
        figures = [f"{value:.3f}" for value in (median(ms), p90, sum(ms) / len(ms))]
        return [self.scenario, len(ms), *figures, f"{self.evictions_per_store:g}"]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stores", type=int, default=400, help="timed stores per scenario")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--l1-blocks", type=int, default=256, help="L1 rows (the server's default)")
    parser.add_argument("--l2-blocks", type=int, default=1024, help="L2 slots (the server's default)")
    add_engine_args(parser)
    return parser.parse_args(argv)


def measure(runner: ModelRunner, args, scenario: Scenario, seed: int) -> StoreTimes:
    block = 16
    cache = PrefixCache(runner, args.l1_blocks, block, "store-cost")
    if scenario.l2:
        pool = cache.pool
        cache.l2 = HostBlockPool(
            args.l2_blocks, tuple(pool.shape[1:]), pool.dtype, pin=runner.device.type == "cuda"
        )
    rng = random.Random(seed)
    vocab = runner.vocab_size

    def store() -> float:
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        keys = cache.chain_keys(prompt, "bench")
        if scenario.busy_device:
            torch.cuda._sleep(BUSY_CYCLES)
        if scenario.host_idle_s:
            time.sleep(scenario.host_idle_s)
        started = time.perf_counter()
        cache.store(0, prompt[: len(keys) * block], "bench", head=keys)
        elapsed = time.perf_counter() - started
        if scenario.busy_device:
            torch.cuda.synchronize()
        return elapsed

    blocks_per_prompt = (args.prompt_tokens - 1) // block
    if scenario.fill:
        for _ in range(args.l1_blocks // max(1, blocks_per_prompt) + 8):
            store()
    stores = (
        args.stores if scenario.fill else min(args.stores, args.l1_blocks // max(1, blocks_per_prompt) - 1)
    )
    evictions = cache.evictions
    seconds = [store() for _ in range(stores)]
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return StoreTimes(scenario.name, seconds, (cache.evictions - evictions) / max(1, stores))


def plot(results: list[StoreTimes], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for result in results:
        ms = sorted(s * 1000 for s in result.seconds)
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=result.scenario)
    ax.set_xscale("log")
    ax.set_xlabel("host time per store (ms)")
    ax.set_ylabel("fraction of stores")
    ax.set_title("prefix-cache store at 0% hits, in-process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    args = parse_args(argv)
    config = in_process_config(
        args, warmup=False, response_cache=False, prefix_cache_blocks=0
    )  # each scenario builds its own cache on the runner
    runner = load_engine(config, log=lambda message: None).engine.runner
    scenarios = SCENARIOS + ((BUSY,) if runner.device.type == "cuda" else ())
    results = []
    for seed, scenario in enumerate(scenarios):
        results.append(measure(runner, args, scenario, seed))
        progress(f"{scenario.name}: median {results[-1].row[2]} ms")
    headers = ["scenario", "stores", "median ms", "p90 ms", "mean ms", "evictions per store"]
    table = print_table(headers, [result.row for result in results])
    text = (
        f"{table}\n\nHost time of `PrefixCache.store` for {args.prompt_tokens}-token prompts at 0% hits "
        f"(every prompt new), L1 {args.l1_blocks} rows of 16 tokens, L2 {args.l2_blocks} slots, "
        f"{runner.device.type} ({args.dtype}, preset {args.preset}). Host clock, no device sync inside the "
        "timed store: on a GPU this is the engine thread's time, not the copies'."
    )
    command = "python -m bench.store_cost " + " ".join(shlex.quote(a) for a in argv)
    tag = args.tag or args.device.split(":")[0]
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": [r.__dict__ for r in results]}
    base = write_results("store-cost", tag, payload, text, command, args.out_dir)
    plot(results, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
