"""What semantic-cache lookups cost the requests submitted behind them: inline vs on their own threads,
each lookup embedding alone or sharing a forward pass with those under way (cache/embed_coalescer.py).

With the semantic cache on, every deterministic request's lookup embeds its prompt (and may run the pair
classifier). `Engine.submit` runs on the Python backend's execute thread, one request after another, so
inline each lookup held up every request behind it. In-process (no Triton), the real engine with the real
semantic cache and a real redis-server, per round and mode: a burst of `--burst` greedy requests
(questions on distinct topics, in a tenant of their own that holds 20 unrelated entries, so each lookup
embeds and compares but finds nothing: misses, which the report checks), then one sampled request (no
lookup), submitted back to back as one execute call would. The modes take turns going first, and each
round waits for the response writer before the next. Reported per mode: the time the burst's submits
take and, counted from the burst's start (the requests arrive together; Triton holds them while execute
is busy), the sampled request's time to first token and the greedy requests' median and last, and for
the coalesced modes the texts each MiniLM pass embedded from the burst's start to its last first token:
the lookups' passes (a store of a request that finished meanwhile joins them or runs alone). The
modes that do not coalesce call MiniLMEmbedder directly: one pass per text, one after another.

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
from collections.abc import Callable
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
from cache.response_cache import ExactAnswer
from deploy.launch import find_free_port, start_redis_server
from engine.loader import load_engine
from engine.lookup_pool import LookupPool
from engine.requests import EngineRequest
from scheduler.messages import EngineRequestParams
from scheduler.tenant_auth import TenantAuth

# one burst's questions: distinct topics, so that none answers another (a burst would hit itself)
QUESTIONS = (
    "How do I reset my router password when the admin page will not load?",
    "What is the boiling point of water at the top of Mount Everest?",
    "Which chess opening is best for a beginner playing with the white pieces?",
    "How long should I let bread dough rise before baking it?",
    "Why does my car battery drain overnight when the engine is off?",
    "What are the rules for carrying a lithium battery on a plane?",
    "How can I tell whether a houseplant is overwatered or underwatered?",
    "When did the Roman Empire split into an eastern and a western half?",
    "How do I merge two branches in git without losing my local changes?",
    "What is a good stretching routine after a long run?",
    "How much vacation time do employees in France get each year?",
    "Which telescope should an amateur buy to look at the rings of Saturn?",
)


class FirstTokenSink:
    def __init__(self, on_first: Callable[[], None] = lambda: None) -> None:
        self.started = time.perf_counter()
        self.first_s: float | None = None
        self.done = threading.Event()
        self.error: str | None = None
        self.on_first = on_first

    def send(self, token_ids, read_offset, final, trim_bytes) -> None:
        if self.first_s is None:
            self.first_s = time.perf_counter() - self.started
            self.on_first()
        if final:
            self.done.set()

    def fail(self, code, message) -> None:
        self.error = f"{code}: {message}"
        self.done.set()

    def cancelled(self) -> bool:
        return False


# what each round's tenant holds before its burst, so that a lookup embeds and compares as it would in a
# tenant with history, yet finds nothing to serve: questions on none of the burst's topics
FILLERS = tuple(
    f"What is the capital city of {country}?"
    for country in (
        "Peru", "Kenya", "Norway", "Vietnam", "Chile", "Ghana", "Finland", "Nepal", "Uruguay", "Morocco",
        "Latvia", "Bhutan", "Ecuador", "Senegal", "Slovenia", "Mongolia", "Bolivia", "Tunisia", "Estonia",
        "Laos",
    )
)  # fmt: skip


def fill_tenant(engine, tenant: str, embeddings) -> None:
    params = EngineRequestParams(max_tokens=4, temperature=0.0, tenant=tenant)
    semantic = engine.responses.semantic
    for question, embedding in zip(FILLERS, embeddings):
        semantic.store(question, tenant, params, ExactAnswer((0,), final=True), embedding=embedding)


class LookupWindow:
    """The embedder's counters when the last of `n` greedy requests has its first token: every lookup of
    the burst has embedded by then (a request is queued only after its lookup), and only the stores of
    requests that finished meanwhile besides: the passes counted are the lookups'."""

    def __init__(self, n: int, counters: Callable[[], dict[str, int]]):
        self._lock = threading.Lock()
        self._left, self._counters = n, counters
        self.before = counters()
        self.after: dict[str, int] | None = None

    def first_token(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.after = self._counters()


@dataclass
class ModeResult:
    mode: str
    workers: int  # 0: inline
    coalesced: bool = False  # embed calls share passes (CoalescingEmbedder) or each runs its own
    submit_ms: list[float] = field(default_factory=list)  # the whole burst's submits, per round
    sampled_ttft_ms: list[float] = field(default_factory=list)
    greedy_ttft_ms: list[float] = field(default_factory=list)  # median of the burst, per round
    last_greedy_ttft_ms: list[float] = field(default_factory=list)
    hits: int = 0  # requests answered from the cache: 0 unless a burst's questions answer each other
    embed_passes: int = 0  # coalesced modes: MiniLM passes of the bursts' lookups (`LookupWindow`)
    embed_texts: int = 0

    def row(self) -> list[object]:
        per_pass = f"{self.embed_texts / self.embed_passes:.2f}" if self.embed_passes else "-"
        return [
            self.mode,
            f"{median(self.submit_ms):.1f}",
            f"{median(self.sampled_ttft_ms):.1f}",
            f"{median(self.greedy_ttft_ms):.1f}",
            f"{median(self.last_greedy_ttft_ms):.1f}",
            self.hits,
            per_pass,
        ]


# the modes, side by side in one run: (name, lookup threads, coalesced)
MODES = (
    ("inline", 0, False),
    ("1 thread", 1, False),
    ("2 threads", 2, False),
    ("8 threads", 8, False),
    ("2 threads, coalesced", 2, True),
    ("4 threads, coalesced", 4, True),
    ("8 threads, coalesced", 8, True),
)


def run_round(
    engine, encode, result: ModeResult, tenant: str, burst: int, embed_counters: Callable | None = None
) -> None:
    """One burst in a tenant of its own (empty semantic cache); waits for the response writer after it, so
    that no write of this round runs into the next. `embed_counters`: the coalescing embedder's, whose
    passes and texts during the lookups go to `result`."""
    greedy = EngineRequestParams(max_tokens=4, temperature=0.0, ignore_eos=True, stream=True, tenant=tenant)
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, ignore_eos=True, stream=True, tenant=tenant)
    window = LookupWindow(burst, embed_counters) if embed_counters is not None else None
    on_first = window.first_token if window is not None else (lambda: None)
    sinks = [FirstTokenSink(on_first) for _ in range(burst)] + [FirstTokenSink()]
    cached = engine.stats.finished.get("cached", 0)
    started = time.perf_counter()
    for i, sink in enumerate(sinks):
        sink.started = started  # they arrive together: Triton holds them while execute is busy
        params = sampled if i == burst else greedy
        ids = encode(QUESTIONS[i % len(QUESTIONS)])
        engine.submit(EngineRequest(f"{tenant}-{i}", ids, params, 3, 0, sink))
    result.submit_ms.append((time.perf_counter() - started) * 1e3)
    for sink in sinks:
        if not sink.done.wait(120) or sink.error:
            raise RuntimeError(f"a request did not finish: {sink.error}")
    firsts = [1e3 * (s.first_s or 0.0) for s in sinks]
    result.sampled_ttft_ms.append(firsts[-1])
    result.greedy_ttft_ms.append(median(firsts[:-1]))
    result.last_greedy_ttft_ms.append(max(firsts[:-1]))
    result.hits += engine.stats.finished.get("cached", 0) - cached
    if window is not None and window.after is not None:
        result.embed_passes += window.after["passes"] - window.before["passes"]
        result.embed_texts += window.after["texts"] - window.before["texts"]
    if not engine.responses.drain_writes(30.0):
        raise RuntimeError("the response writer did not catch up within 30 s")


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
    ax.set_title("Semantic-cache lookups: inline, on threads, coalesced embedding")
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
            engine.tenant_auth = TenantAuth()  # in-process: its tenants are this benchmark's own, unsigned
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(config.model_dir) / "tokenizer.json"))

            def encode(text: str) -> list[int]:
                return tokenizer.encode(text).ids

            shipped, semantic = engine.lookups, engine.responses.semantic
            coalescer = semantic.embedder  # the loader's CoalescingEmbedder over MiniLM
            results = [ModeResult(name, workers, coalesced) for name, workers, coalesced in MODES]
            pools = {r.workers: LookupPool(r.workers) for r in results if r.workers}
            try:
                fillers = engine.responses.semantic.embed_queries(list(FILLERS))
                fill_tenant(engine, "warm", fillers)
                run_round(engine, encode, ModeResult("warm", 0), "warm", args.burst)  # first-use costs
                for round_no in range(args.rounds):
                    k = round_no % len(results)  # each mode first, second and last in turn
                    for result in results[k:] + results[:k]:
                        engine.lookups = pools.get(result.workers)
                        semantic.embedder = coalescer if result.coalesced else coalescer.inner
                        tenant = f"r{round_no}-{results.index(result)}"
                        fill_tenant(engine, tenant, fillers)
                        counters = coalescer.snapshot if result.coalesced else None
                        run_round(engine, encode, result, tenant, args.burst, counters)
                    progress(f"round {round_no + 1}/{args.rounds}")
            finally:
                engine.lookups, semantic.embedder = shipped, coalescer
                for pool in pools.values():
                    pool.shutdown()
                engine.shutdown(5.0)
            for result in results:
                progress(f"{result.mode}: {result.row()}")
        finally:
            redis.terminate()
            redis.wait(timeout=10)
    headers = [
        "lookups", "burst submits ms", "sampled TTFT ms", "greedy TTFT ms (median)", "greedy TTFT ms (last)",
        "cache hits", "texts per MiniLM pass",
    ]  # fmt: skip
    table = print_table(headers, [r.row() for r in results])
    note = (
        f"\nper round and mode: {args.burst} greedy requests (distinct topics, in a tenant of their own "
        "holding 20 unrelated entries: semantic misses) then 1 sampled, submitted back to back; the modes "
        f"take turns going first; medians over {args.rounds} rounds; {args.preset} model on {args.device}; "
        "the semantic cache as shipped (MiniLM embedding, guard, verifier, pair classifier); coalesced: "
        "concurrent embed calls share one MiniLM pass (texts per pass: from the burst's start to its last "
        "greedy first token, the lookups' passes and those of any store that ran by then; a store reuses "
        "its lookup's vector, kept per tenant, when it has one)\n"
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
