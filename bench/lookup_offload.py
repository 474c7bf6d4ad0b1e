"""What semantic-cache lookups cost the requests submitted behind them: inline vs on their own threads.

With the semantic cache on, every deterministic request's lookup embeds its prompt (and may run the pair
classifier). `Engine.submit` runs on the Python backend's execute thread, one request after another, so
inline each lookup held up every request behind it. In-process (no Triton), the real engine with the real
semantic cache and a real redis-server: per round, a burst of `--burst` greedy requests (distinct prompts:
misses) and then one sampled request (no lookup) are submitted back to back, as one execute call would;
reported per mode are the time the burst's submits take and, counted from the burst's start (the
requests arrive together; Triton holds them while execute is busy), the sampled request's time to first
token and the greedy requests' median and last.

    python -m bench.lookup_offload [--rounds 10] [--burst 8]
Writes bench/results/lookup-offload-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import (
    link_plot,
    add_engine_args,
    in_process_config,
    median,
    print_table,
    progress,
    write_results,
)
from deploy.launch import find_free_port, start_redis_server
from engine.loader import load_engine
from engine.lookup_pool import LookupPool
from engine.requests import EngineRequest
from scheduler.messages import EngineRequestParams

WORDS = "how do I reset my router password when the admin page will not load after an update".split()


class FirstTokenSink:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first_s: float | None = None
        self.done = threading.Event()
        self.error: str | None = None

    def send(self, token_ids, read_offset, final, trim_bytes) -> None:
        if self.first_s is None:
            self.first_s = time.perf_counter() - self.started
        if final:
            self.done.set()

    def fail(self, code, message) -> None:
        self.error = f"{code}: {message}"
        self.done.set()

    def cancelled(self) -> bool:
        return False


@dataclass
class ModeResult:
    mode: str
    submit_ms: list[float] = field(default_factory=list)  # the whole burst's submits, per round
    sampled_ttft_ms: list[float] = field(default_factory=list)
    greedy_ttft_ms: list[float] = field(default_factory=list)  # median of the burst, per round
    last_greedy_ttft_ms: list[float] = field(default_factory=list)

    def row(self) -> list[object]:
        return [
            self.mode,
            f"{median(self.submit_ms):.1f}",
            f"{median(self.sampled_ttft_ms):.1f}",
            f"{median(self.greedy_ttft_ms):.1f}",
            f"{median(self.last_greedy_ttft_ms):.1f}",
        ]


def prompt_ids(tokenizer_encode, round_no: int, i: int) -> list[int]:
    words = [WORDS[(round_no * 7 + i * 3 + k) % len(WORDS)] for k in range(10)]
    return tokenizer_encode(f"Question {round_no}-{i}: " + " ".join(words) + "?")


def run_round(engine, encode, result: ModeResult, round_no: int, burst: int) -> None:
    greedy = EngineRequestParams(max_tokens=4, temperature=0.0, ignore_eos=True, stream=True)
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, ignore_eos=True, stream=True)
    sinks = [FirstTokenSink() for _ in range(burst + 1)]
    started = time.perf_counter()
    for i, sink in enumerate(sinks):
        sink.started = started  # they arrive together: Triton holds them while execute is busy
        params = sampled if i == burst else greedy
        ids = prompt_ids(encode, round_no, i)
        engine.submit(EngineRequest(f"r{round_no}-{i}", ids, params, 3, 0, sink))
    result.submit_ms.append((time.perf_counter() - started) * 1e3)
    for sink in sinks:
        if not sink.done.wait(120) or sink.error:
            raise RuntimeError(f"a request did not finish: {sink.error}")
    firsts = [1e3 * (s.first_s or 0.0) for s in sinks]
    result.sampled_ttft_ms.append(firsts[-1])
    result.greedy_ttft_ms.append(median(firsts[:-1]))
    result.last_greedy_ttft_ms.append(max(firsts[:-1]))


def plot(results: list[ModeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["burst submits", "sampled TTFT", "greedy TTFT (median)", "greedy TTFT (last)"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for k, r in enumerate(results):
        values = [
            median(v) for v in (r.submit_ms, r.sampled_ttft_ms, r.greedy_ttft_ms, r.last_greedy_ttft_ms)
        ]
        ax.bar([i + k * width for i in range(len(labels))], values, width, label=r.mode)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("ms (median of rounds)")
    ax.legend()
    ax.set_title("Semantic-cache lookups inline vs off the submitting thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lookup_offload", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--burst", type=int, default=8, help="greedy requests submitted back to back")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    tag = args.tag or args.device
    with tempfile.TemporaryDirectory(prefix="bench-lookups-") as tmp:
        port = find_free_port()
        redis, _ = start_redis_server("redis-server", Path(tmp), port, "256mb")
        try:
            config = in_process_config(
                args, warmup=False, redis_url=f"redis://127.0.0.1:{port}/0", semantic_cache=True
            )
            loaded = load_engine(config, log=lambda message: None)
            engine = loaded.engine
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(config.model_dir) / "tokenizer.json"))

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text).ids

            shipped = engine.lookups
            results = []
            try:
                run_round(engine, encode, ModeResult("warm"), -1, args.burst)  # first-use costs, not measured
                for k, workers in enumerate((0, 1, 2)):  # 0: inline, as before the pool
                    engine.lookups = LookupPool(workers) if workers else None
                    result = ModeResult(f"{workers} thread{'s' * (workers > 1)}" if workers else "inline")
                    for round_no in range(args.rounds):
                        run_round(engine, encode, result, 1000 * k + round_no, args.burst)
                    if engine.lookups is not None:
                        engine.lookups.shutdown()
                    progress(f"{result.mode}: {result.row()}")
                    results.append(result)
            finally:
                engine.lookups = shipped
                engine.shutdown(5.0)
        finally:
            redis.terminate()
            redis.wait(timeout=10)
    headers = [
        "lookups",
        "burst submits ms",
        "sampled TTFT ms",
        "greedy TTFT ms (median)",
        "greedy TTFT ms (last)",
    ]
    table = print_table(headers, [r.row() for r in results])
    note = (
        f"\nper round: {args.burst} greedy requests (distinct prompts, semantic misses) then 1 sampled, "
        f"submitted back to back; medians over {args.rounds} rounds per mode; {args.preset} model on "
        f"{args.device}; the semantic cache as shipped (MiniLM embedding, guard, verifier, pair classifier)\n"
    )
    print(note)
    command = "python -m bench.lookup_offload " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = {"results": [asdict(r) for r in results], "args": {k: str(v) for k, v in vars(args).items()}}
    base = write_results("lookup-offload", tag, payload, table + "\n" + note, command.strip(), args.out_dir)
    plot(results, base.with_suffix(".png"))
    link_plot(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
