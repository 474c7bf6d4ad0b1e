"""Prefix-cache benchmark, in one run:

(a) TTFT for prompts that share 90% of a long prefix: a hit (same tenant, prefix cached) vs a
    miss (a fresh tenant each time: the tenant salt guarantees a miss, same shapes otherwise),
    per tier that serves the hit, each on its own server:
      l1  the device pool holds the prefix;
      l2  a device pool just big enough for one long prompt, so an "evictor" prompt (another tenant)
          sent before every hit demotes the prefix to the host pool, whence the hit promotes it;
      l3  the same small device pool and no host pool: the evicted prefix is found in Redis (the
          cost model decides whether loading beats recomputing; the decisions are reported);
      exact  the whole prompt again (greedy), its answer kept in the exact response cache after its
          second sighting: the hit never reaches the model (the semantic cache does not look up
          prompts past MiniLM's 256-token window, so it has no row at these lengths).
    Which tier served is read from the engine's cache counters (blocks per tier), not assumed;
(b) throughput at 0% hit rate on one server, three kinds of requests interleaved: `cache=use` (every
    cache), `cache=kv-only` (the KV prefix tiers, no response cache) and `cache=bypass` (no cache), to
    show what maintaining the caches costs: all of them (use vs bypass) and the KV prefix tiers alone
    (kv-only vs bypass; the exact response cache's Redis GET per greedy request is a separate
    feature); an A/A control (bypassed vs bypassed) gives the method's floor, and the server's own
    timers of its prefix-cache work give the same cost without the machine's noise. Measured twice on
    that server: one request at a time (every microsecond of host work on the critical path), then
    under load, `--throughput-concurrency` clients each keeping one request in flight (the batched
    engine, as vLLM's "under 1% throughput cost at 0% hit rate" is measured).
Writes bench/results/prefix-cache-<tag>.{json,md,png}.

    python -m bench.prefix_cache                       # CPU, tiny model
    python -m bench.prefix_cache --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 \
        --lengths 512,2048,3500 --text-env $TEXT_ENV --tag h200
"""

from __future__ import annotations

import argparse
import queue
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
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
    quartiles,
    write_results,
)
from client.metrics import metric_total, scrape_metrics
from deploy.launch import StackOptions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="512,1800", help="prompt lengths (tokens), 90%% shared prefix")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--throughput-requests", type=int, default=10, help="requests per turn")
    parser.add_argument("--throughput-rounds", type=int, default=40, help="rounds of one turn per arm")
    parser.add_argument("--control-rounds", type=int, default=10, help="A/A rounds, both halves bypassed")
    parser.add_argument(
        "--throughput-concurrency", type=int, default=8,
        help="clients in flight for (b)'s second run, under load (0 or 1: no such run)",
    )  # fmt: skip
    parser.add_argument(
        "--throughput-concurrent-requests", type=int, default=None,
        help="requests per turn of the run under load (default: 3 x the concurrency: 3 waves a turn)",
    )  # fmt: skip
    parser.add_argument(
        "--load-rounds", type=int, default=None,
        help="rounds of the run under load (default: --throughput-rounds); with few rounds one at a time, "
        "a GPU call spends its time where the cost is least settled",
    )  # fmt: skip
    parser.add_argument(
        "--load-control-rounds", type=int, default=None,
        help="A/A rounds under load (default: --control-rounds)",
    )  # fmt: skip
    parser.add_argument(
        "--throughput-only",
        action="store_true",
        help="run (b) only; writes prefix-cache-throughput-<tag>.json/.md/.png",
    )
    add_engine_args(parser)
    return parser.parse_args(argv)


def options(args, name: str, model_dir: Path, blocks: int) -> StackOptions:
    return StackOptions(
        run_dir=REPO_ROOT / ".run" / f"bench-prefix-{name}",
        model_dir=model_dir,
        warmup=True,
        text_env=args.text_env,
        overrides={"llm_engine": {"prefix_cache_blocks": str(blocks), "prefill_templates": ""}},
        extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
    )


def hit_vs_miss(args, probe: TtftProbe, prompts: PromptFactory, lengths: list[int]) -> list[list[object]]:
    rows = []
    for tokens in lengths:
        prefix = prompts.make(int(tokens * 0.9))
        suffixes = [prompts.make(max(2, tokens - int(tokens * 0.9))) for _ in range(2 * args.repeats + 1)]
        probe.ttft_ms(prefix + suffixes[0], tenant="bench-hit")  # primes the cache
        hits = [probe.ttft_ms(prefix + s, tenant="bench-hit") for s in suffixes[1 : args.repeats + 1]]
        misses = [
            probe.ttft_ms(prefix + s, tenant=f"bench-miss-{tokens}-{i}")
            for i, s in enumerate(suffixes[args.repeats + 1 :])
        ]
        hit_ms, miss_ms = median(hits), median(misses)
        rows.append([tokens, miss_ms, hit_ms, hit_ms / miss_ms])
        progress(
            f"{tokens} tokens: miss {miss_ms:.2f} ms, hit {hit_ms:.2f} ms, hit/miss {hit_ms / miss_ms:.3f}"
        )
    return rows


TIERS = ("l1", "l2", "l3", "exact")


def tier_options(args, tier: str, model_dir: Path, small_l1: int) -> StackOptions:
    """A server on which a repeated prefix is served from `tier`."""
    opts = options(args, f"tier-{tier}", model_dir, 256 if tier in ("l1", "exact") else small_l1)
    if tier == "l3":
        opts.overrides["llm_engine"]["l2_cache_blocks"] = "0"
    return opts


def cache_totals(
    metrics_url: str, probe: TtftProbe, flush_text: str, counters: dict[str, tuple[str, str]]
) -> dict[str, float]:
    """{name: the engine's cache counter (tier, counter)} now. The engine publishes its cache counters at
    most once a second from its serving thread, so wait past that and send one tiny request (another
    tenant, a miss) to make it publish."""
    time.sleep(1.1)
    probe.ttft_ms(flush_text, tenant="bench-flush")
    m = scrape_metrics(metrics_url)
    return {
        name: metric_total(m, "llm_engine_cache_total", tier=tier, counter=counter)
        for name, (tier, counter) in counters.items()
    }


SERVED = {"l1": ("l1", "hit_blocks"), "l2": ("l2", "hit_blocks"), "l3": ("l3", "hits"),
          "l3_load": ("l3", "decision_load"), "l3_recompute": ("l3", "decision_recompute"),
          "l3_explore": ("l3", "decision_explore"), "exact": ("exact", "hits"),
          "exact_stores": ("exact", "stores")}  # fmt: skip
BOOKKEEPING = {"lookup": ("prefix", "lookup_seconds"), "store": ("prefix", "store_seconds"),
               "store_cpu": ("prefix", "store_cpu_seconds"),
               "l3_probe": ("l3", "probe_seconds"), "l3_probes": ("l3", "probes"),
               "l3_probe_wait": ("l3", "probe_wait_seconds"),
               "exact": ("exact", "request_seconds")}  # fmt: skip


def served_blocks(metrics_url: str, probe: TtftProbe, prompts: PromptFactory) -> dict[str, float]:
    """Blocks (L1/L2) and chains (L3 hits) served per tier so far."""
    return cache_totals(metrics_url, probe, prompts.make(8), SERVED)


def per_tier(args, model_dir: Path, prompts: PromptFactory, lengths: list[int]) -> list[list[object]]:
    """Hit vs miss TTFT per serving tier; an evictor before every l2/l3 hit pushes the prefix out of L1."""
    small_l1 = -(-max(lengths) // 16) + 1
    rows = []
    for tier in TIERS:
        with start_stack(tier_options(args, tier, model_dir, small_l1)) as stack:
            probe = TtftProbe(stack.grpc_url)
            try:
                for tokens in lengths:
                    before = served_blocks(stack.metrics_url, probe, prompts)
                    if tier == "exact":
                        hits, misses = exact_hits_and_misses(args, stack.metrics_url, probe, prompts, tokens)
                    else:
                        hits, misses = prefix_hits_and_misses(args, tier, probe, prompts, tokens, small_l1)
                    after = served_blocks(stack.metrics_url, probe, prompts)
                    served = {k: after[k] - before[k] for k in after}
                    hit_ms, miss_ms = median(hits), median(misses)
                    rows.append([
                        tier, tokens, miss_ms, hit_ms, hit_ms / miss_ms,
                        f"{served['l1']:g}/{served['l2']:g}/{served['l3']:g}/{served['exact']:g}",
                        f"{served['l3_load']:g}/{served['l3_recompute']:g}/{served['l3_explore']:g}",
                    ])  # fmt: skip
                    progress(
                        f"{tier} {tokens} tokens: miss {miss_ms:.2f} ms, hit {hit_ms:.2f} ms, served {served}"
                    )
            finally:
                probe.close()
    return rows


def prefix_hits_and_misses(
    args, tier: str, probe: TtftProbe, prompts: PromptFactory, tokens: int, small_l1: int
) -> tuple[list[float], list[float]]:
    """TTFTs of prompts sharing 90% of a prefix: its tenant's (hits) and fresh tenants' (misses)."""
    prefix = prompts.make(int(tokens * 0.9))
    tail = max(2, tokens - int(tokens * 0.9))
    # primes the tiers, twice: L3 writes a block on its reuse, so after one sighting Redis held nothing
    # and the first l3 "hit" recomputed the whole prompt (a miss among the hits)
    for _ in range(2):
        probe.ttft_ms(prefix + prompts.make(tail), tenant="bench-hit")
    hits, misses = [], []
    for i in range(args.repeats):
        if tier != "l1":
            probe.ttft_ms(prompts.make(small_l1 * 16 + 8), tenant=f"bench-evict-{tokens}-{i}")
        hits.append(probe.ttft_ms(prefix + prompts.make(tail), tenant="bench-hit"))
        misses.append(probe.ttft_ms(prefix + prompts.make(tail), tenant=f"bench-miss-{tokens}-{i}"))
    return hits, misses


def exact_hits_and_misses(
    args, metrics_url: str, probe: TtftProbe, prompts: PromptFactory, tokens: int
) -> tuple[list[float], list[float]]:
    """TTFTs of one greedy prompt whose answer the exact cache holds (hits) and of fresh prompts of the
    same length (misses: computed in full). The answer is written behind on the prompt's second sighting;
    the hits wait until the engine counts the write."""
    prompt = prompts.make(tokens)
    stores = cache_totals(metrics_url, probe, prompts.make(8), SERVED)["exact_stores"]
    for _ in range(2):
        probe.ttft_ms(prompt, tenant="bench-exact")
    deadline = time.monotonic() + 30
    while cache_totals(metrics_url, probe, prompts.make(8), SERVED)["exact_stores"] <= stores:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the exact cache did not keep the {tokens}-token answer within 30 s")
    hits = [probe.ttft_ms(prompt, tenant="bench-exact") for _ in range(args.repeats)]
    misses = [
        probe.ttft_ms(prompts.make(tokens), tenant=f"bench-exact-miss-{tokens}-{i}")
        for i in range(args.repeats)
    ]
    return hits, misses


THROUGHPUT_MAX_TOKENS = 16
# requests/s of one turn that sends these prompts with this `cache` mode, each its own tenant: 0% hits
Rate = Callable[[list[str], str | None], float]


def requests_per_s(probe: TtftProbe, prompts_text: list[str], cache: str | None = None) -> float:
    started = time.perf_counter()
    for i, text in enumerate(prompts_text):  # own tenant: 0% hits
        probe.ttft_ms(text, max_tokens=THROUGHPUT_MAX_TOKENS, tenant=f"bench-t{i}-{started}", cache=cache)
    return len(prompts_text) / (time.perf_counter() - started)


class ConcurrentSender:
    """Closed-loop load: one thread per client, each sending its next prompt as soon as its last one
    finished, so len(probes) requests stay in flight and the engine batches them. Each client has its
    own gRPC stream (a tritonclient client holds one stream at a time), opened once for the run so that
    no turn pays for client start-up."""

    def __init__(self, probes: list[TtftProbe]):
        self.probes = probes
        self.pool = ThreadPoolExecutor(len(probes), thread_name_prefix="bench-load")

    def requests_per_s(self, prompts_text: list[str], cache: str | None = None) -> float:
        """Requests completed / the turn's wall time; each request its own tenant: 0% hits."""
        todo: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        for item in enumerate(prompts_text):
            todo.put(item)
        started = time.perf_counter()

        def client(probe: TtftProbe) -> None:
            while True:
                try:
                    i, text = todo.get_nowait()
                except queue.Empty:
                    return
                probe.request(text, THROUGHPUT_MAX_TOKENS, tenant=f"bench-c{i}-{started}", cache=cache)

        for future in [self.pool.submit(client, probe) for probe in self.probes]:
            future.result()
        return len(prompts_text) / (time.perf_counter() - started)

    def close(self) -> None:
        self.pool.shutdown()
        for probe in self.probes:
            probe.close()


# (b)'s arms, by `cache` mode: every cache; the KV prefix tiers (L1/L2/L3) only; none (the baseline)
ARMS = ("use", "kv-only", "bypass")
# (b)'s comparisons against the baseline: (label, arm)
COMPARISONS = (("all caches (use) vs bypassed", "use"), ("KV tiers (kv-only) vs bypassed", "kv-only"))


@dataclass
class ThroughputRun:
    rounds: list[dict[str, float]]  # requests/s of each arm (ARMS) per round
    control: list[tuple[float, float]]  # A/A rounds, both halves bypassed: the method's own noise and bias
    bookkeeping_s: dict[str, float]  # the server's own prefix-cache timers over the rounds (BOOKKEEPING)
    requests: int  # requests that used the KV prefix tiers over the rounds (use and kv-only)
    use_requests: int = 0  # of which `use`: the ones that also looked up and noted their answer

    def pairs(self, arm: str) -> list[tuple[float, float]]:
        """(arm, bypass) requests/s per round."""
        return [(r[arm], r["bypass"]) for r in self.rounds]


def round_order(index: int, count: int) -> list[int]:
    """Round `index`'s order of `count` modes: rotation `index // 2`, reversed in odd rounds, so that
    every two rounds run each pair of modes both ways, and each mode runs in each position and right
    after each other mode equally often (three modes: all six orders every six rounds). Rotations alone
    always ran `use` after `bypass`; reversing every other pass through them (until 2026-12-07) ran it
    after `bypass` in 3 of the 4 rounds one at a time that the GPU runs use."""
    order = [(index // 2 + k) % count for k in range(count)]
    return order[::-1] if index % 2 else order


def interleaved(rate: Rate, texts: list[str], modes: tuple[str, ...], rounds: int):
    """The rate of each of `modes` per round, in the order of `modes`; one turn each, in `round_order`."""
    out = []
    for index in range(rounds):
        rates = {k: rate(texts, modes[k]) for k in round_order(index, len(modes))}
        out.append(tuple(rates[k] for k in range(len(modes))))
    return out


def measure(
    stack, probe: TtftProbe, rate: Rate, texts: list[str], label: str, rounds: tuple[int, int]
) -> ThroughputRun:
    """Interleaved rounds of ARMS, the server's prefix-cache timers around them, then the A/A rounds;
    `rounds`: (of the arms, of the A/A control)."""
    flush = texts[0][:40]
    before = cache_totals(stack.metrics_url, probe, flush, BOOKKEEPING)
    rates = interleaved(rate, texts, ARMS, rounds[0])
    after = cache_totals(stack.metrics_url, probe, flush, BOOKKEEPING)
    control = interleaved(rate, texts, ("bypass", "bypass"), rounds[1])
    rounds = [dict(zip(ARMS, r)) for r in rates]
    medians = ", ".join(f"{arm} {median([r[arm] for r in rounds]):.2f}/s" for arm in ARMS)
    progress(f"(b) {label}, {len(rounds)} rounds: {medians} (medians)")
    spent = {name: after[name] - before[name] for name in BOOKKEEPING}
    use = len(rounds) * len(texts) + 1  # + a flush
    return ThroughputRun(rounds, control, spent, use + len(rounds) * len(texts), use)


def throughput(
    args, model_dir: Path, prompts_text: list[str], concurrent_text: list[str]
) -> tuple[ThroughputRun, ThroughputRun | None]:
    """Requests/s of each arm (ARMS) per round on ONE server, in short interleaved turns
    (`--throughput-requests` each, in `round_order`): bypassed requests read and write no
    cache tier, so use vs bypass is the caches' whole cost per request and kv-only vs bypass the KV
    prefix tiers' alone (kv-only skips the response caches: no lookup, no answer noted or written). Two
    servers (one without a cache) were biased: an A/A run of that design, both servers without a cache,
    showed 5.4% between them, more than the effect. A/A rounds here (both halves bypassed) show this
    method's floor. The server's own timers of the prefix cache's work (lookup, store, the L3 probe
    inside lookup), which use and kv-only requests both do, are read around the rounds: the same cost
    free of the machine's noise. Then the same rounds under load (`--throughput-concurrency` clients,
    `concurrent_text` a turn) on the same server, a second start being a second source of bias; None
    when the concurrency is 1 or less."""
    concurrency = args.throughput_concurrency
    with start_stack(options(args, "throughput", model_dir, 256)) as stack:
        probe = TtftProbe(stack.grpc_url)
        try:
            requests_per_s(probe, prompts_text[:4])  # fill the pool's first blocks, warm the path
            single = (args.throughput_rounds, args.control_rounds)
            run = measure(stack, probe, partial(requests_per_s, probe), prompts_text, "one at a time", single)
            if concurrency <= 1:
                return run, None
            progress(f"(b) under load: {concurrency} clients, {len(concurrent_text)} requests a turn")
            sender = ConcurrentSender([TtftProbe(stack.grpc_url) for _ in range(concurrency)])
            try:
                sender.requests_per_s(concurrent_text[: 2 * concurrency])  # warm the batched path
                label = f"at concurrency {concurrency}"
                load_rounds = (args.load_rounds or args.throughput_rounds,
                               args.load_control_rounds or args.control_rounds)  # fmt: skip
                return run, measure(stack, probe, sender.requests_per_s, concurrent_text, label, load_rounds)
            finally:
                sender.close()
        finally:
            probe.close()


def plot(tier_rows: list[list[object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [f"{r[0]}\n{r[1]} tok" for r in tier_rows]
    xs = range(len(tier_rows))
    ax.bar([x - 0.2 for x in xs], [r[2] for r in tier_rows], 0.4, label="miss")
    ax.bar(
        [x + 0.2 for x in xs], [r[3] for r in tier_rows], 0.4, label="hit (90% prefix cached; exact: answer)"
    )
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("tier that served the hit, prompt length")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("TTFT hit vs miss per serving tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def round_costs(rounds: list[tuple[float, float]]) -> list[float]:
    """Each round's cost of its first half against its second: 1 - rate / baseline rate."""
    return [1 - a / b for a, b in rounds]


def plot_costs(runs: list[tuple[str, ThroughputRun | None]], path: Path) -> None:
    """Each round's cost against bypass, per arm and run, beside the A/A control: the spread that a
    median has to be read against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, run) for label, run in runs if run is not None]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 4.2), squeeze=False)
    for ax, (label, run) in zip(axes[0], shown):
        series = {arm: round_costs(run.pairs(arm)) for _, arm in COMPARISONS}
        series["A/A"] = round_costs(run.control)
        ax.boxplot([[100 * cost for cost in costs] for costs in series.values()])
        ax.set_xticks(range(1, len(series) + 1), list(series))
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="1% target")
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set_title(f"(b) {label}, {len(run.rounds)} rounds")
        ax.set_ylabel("throughput cost vs bypassed (%)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cost_row(label: str, rounds: list[tuple[float, float]]) -> list[object]:
    losses = sorted(round_costs(rounds))
    overall = 1 - sum(r[0] for r in rounds) / sum(r[1] for r in rounds)
    p25, p75 = quartiles(losses)
    return [label, len(rounds), median([r[0] for r in rounds]), median([r[1] for r in rounds]),
            f"{median(losses) * 100:.2f}%", f"{p25 * 100:.1f}% to {p75 * 100:.1f}%",
            f"{overall * 100:.2f}%"]  # fmt: skip


def cost_table(run: ThroughputRun, suffix: str = "") -> tuple[str, dict[str, float]]:
    """The interleaved rates, each arm against bypass (with the A/A control), `suffix` after each
    comparison's label; and the median cost of each arm (COMPARISONS) against bypass."""
    losses = {arm: median(round_costs(run.pairs(arm))) for _, arm in COMPARISONS}
    rows = [cost_row(label + suffix, run.pairs(arm)) for label, arm in COMPARISONS]
    if run.control:
        rows.append(cost_row("A/A control: bypassed vs bypassed" + suffix, run.control))
    table = print_table(
        ["comparison", "rounds", "req/s first (median)", "req/s second (median)", "cost: median of rounds",
         "cost: P25-P75 of rounds", "cost: mean rates"],
        rows,
    )  # fmt: skip
    return table, losses


def costs_text(losses: dict[str, float]) -> str:
    return f"all caches (use) {losses['use'] * 100:.2f}%, KV tiers (kv-only) {losses['kv-only'] * 100:.2f}%"


def run_payload(run: ThroughputRun, losses: dict[str, float]) -> dict[str, object]:
    return {"arms": ARMS, **asdict(run), "median_loss_vs_bypass": losses}


def throughput_tables(run: ThroughputRun, suffix: str = "") -> tuple[str, str, dict[str, float]]:
    """(b) as two tables: the rates and costs (cost_table), and the server's timers."""
    rates, losses = cost_table(run, suffix)
    tiered = [r[arm] for r in run.rounds for arm in ("use", "kv-only")]  # the arms that do this work
    request_ms = 1000 * sum(1 / rate for rate in tiered) / len(tiered)
    per_request = {name: 1000 * value / run.requests for name, value in run.bookkeeping_s.items()}
    spent_ms = per_request["lookup"] + per_request["store"]
    exact_ms = 1000 * run.bookkeeping_s.get("exact", 0.0) / max(run.use_requests, 1)
    timers = print_table(
        ["request ms (use, kv-only)", "lookup ms", "of which waiting for the L3 probe ms",
         "L3 probe round trip ms (from arrival)", "L3 probes per request", "store ms",
         "of which the store's CPU ms", "cache work per request", "exact cache ms (use)"],
        [[request_ms, per_request["lookup"], per_request["l3_probe_wait"], per_request["l3_probe"],
          run.bookkeeping_s["l3_probes"] / run.requests, per_request["store"],
          per_request.get("store_cpu", float("nan")), f"{spent_ms / request_ms * 100:.2f}%", exact_ms]],
    )  # fmt: skip
    return rates, timers, losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_for(args.preset, args.model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = PromptFactory(model_dir)
    if not args.throughput_only:
        progress("(a) hit vs miss")
        with start_stack(options(args, "hits", model_dir, 256)) as stack:
            probe = TtftProbe(stack.grpc_url)
            try:
                rows = hit_vs_miss(args, probe, prompts, lengths)
            finally:
                probe.close()
        table_a = print_table(["tokens", "miss TTFT ms", "hit TTFT ms", "hit/miss"], rows)
        progress("(a) per serving tier")
        tier_rows = per_tier(args, model_dir, prompts, lengths)
        table_tiers = print_table(
            ["tier", "tokens", "miss TTFT ms", "hit TTFT ms", "hit/miss",
             "served: L1/L2 blocks, L3 chains, exact answers", "L3 load/recompute/explore decisions"],
            tier_rows,
        )  # fmt: skip
    progress("(b) throughput at 0% hit rate, cache use vs kv-only vs bypass on one server")
    texts = [prompts.make(256) for _ in range(args.throughput_requests)]  # new tenant per turn: 0% hits
    concurrency = args.throughput_concurrency
    per_turn = args.throughput_concurrent_requests or 3 * concurrency
    concurrent_text = [prompts.make(256) for _ in range(per_turn if concurrency > 1 else 0)]
    run, loaded = throughput(args, model_dir, texts, concurrent_text)
    table_b, table_timers, losses = throughput_tables(run)
    costs = costs_text(losses)
    print(f"throughput cost at 0% hits vs bypassed, medians over {len(run.rounds)} rounds: {costs}")
    loaded_md, loaded_payload = "", None
    if loaded is not None:
        table_loaded, timers_loaded, loaded_losses = throughput_tables(loaded, f", concurrency {concurrency}")
        loaded_costs = (
            f"medians over {len(loaded.rounds)} rounds of {per_turn} requests at concurrency {concurrency}: "
            f"{costs_text(loaded_losses)}"
        )
        print(f"throughput cost at 0% hits vs bypassed, {loaded_costs}")
        loaded_payload = {
            "concurrency": concurrency, "requests_per_turn": per_turn, **run_payload(loaded, loaded_losses)
        }  # fmt: skip
        loaded_md = (
            f"\n\n(b) under load, concurrency {concurrency}: {concurrency} clients, each on its own gRPC "
            f"stream, send their next request as soon as the last one finished (closed loop; the engine "
            f"batches up to its max_batch_size), {per_turn} requests of 256 tokens per arm per turn, "
            f"max_tokens={THROUGHPUT_MAX_TOKENS}, every request its own tenant; requests/s = requests "
            f"completed / the turn's wall time; the same arms, orders and A/A control, after the rounds "
            f"above on the same server\n{table_loaded}\n\nthroughput cost at 0% hits against bypassed "
            f"requests under load, {loaded_costs}\n\nThe server's timers over the rounds under load:\n"
            f"{timers_loaded}"
        )
    tag = args.tag or args.device.split(":")[0]
    command = "python -m bench.prefix_cache " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    text_b = (
        f"(b)\n{table_b}\n\n"
        f"throughput cost at 0% hits against requests that bypass every cache (`cache=bypass`), "
        f"interleaved on one server: {costs} (medians over {len(run.rounds)} rounds of "
        f"{args.throughput_requests} requests per arm, the three arms in every order in turn). "
        f"`use` requests look up and store their prefix and, being greedy, look up their answer in the "
        f"exact response cache and note it (it is written on its prompt's second sighting, never here); "
        f"`kv-only` requests do only the former: the KV prefix tiers' own cost. The A/A row is the "
        f"method's own floor.\n\nThe server's own timers over those rounds (host "
        f"clock, per use or kv-only request; "
        f'`llm_engine_cache_total{{tier="prefix"|"l3"}}`), the same cost without the machine\'s noise; the '
        f"last column is the exact response cache's lookup and admission per `use` request "
        f'(`{{tier="exact", counter="request_seconds"}}`), on the request path:\n'
        f"{table_timers}{loaded_md}"
    )
    payload = {
        "throughput": {"requests_per_turn": args.throughput_requests, **run_payload(run, losses)},
        "throughput_concurrent": loaded_payload,
        "device": args.device,
    }
    panels = [("one at a time", run), (f"concurrency {concurrency}", loaded)]
    if args.throughput_only:  # (b) alone: its own file, so a longer (b) fits one GPU call
        base = write_results("prefix-cache-throughput", tag, payload, text_b, command, args.out_dir)
        plot_costs(panels, base.with_suffix(".png"))
        progress(f"wrote {base}.json/.md/.png")
        return 0
    payload = {"hit_vs_miss": rows, "per_tier": tier_rows, **payload}
    text = (
        f"(a) L1 (prefix kept in the device pool)\n{table_a}\n\n(a) per serving tier (medians of "
        f"{args.repeats}; before every l2/l3 hit an evictor prompt of another tenant pushes the prefix out "
        f"of a device pool sized for one long prompt; an exact hit is the whole prompt again, its greedy "
        f"answer kept after its second sighting, against fresh prompts of that length; 'served' are the "
        f"engine's own counters over the row, evictors and misses included)\n{table_tiers}\n\n{text_b}"
    )
    base = write_results("prefix-cache", tag, payload, text, command, args.out_dir)
    plot(tier_rows, base.with_suffix(".png"))
    costs_png = base.with_name(f"{base.name}-costs.png")
    plot_costs(panels, costs_png)
    progress(f"wrote {base}.json/.md/.png and {costs_png.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
