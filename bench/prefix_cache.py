"""Prefix-cache benchmark (L1, the engine's device pool), in one run:

(a) TTFT for prompts that share 90% of a long prefix: a hit (same tenant, prefix cached) vs a
    miss (a fresh tenant each time: the tenant salt guarantees a miss, same shapes otherwise);
(b) throughput at 0% hit rate with the prefix cache on vs off (a second server with
    prefix_cache_blocks=0), to show what maintaining the cache costs.
Writes bench/results/prefix-cache-<tag>.{json,md,png}.

    python -m bench.prefix_cache                       # CPU, tiny model
    python -m bench.prefix_cache --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 \
        --lengths 512,2048,3500 --text-env $TEXT_ENV --tag h200
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from bench.common import (
    REPO_ROOT,
    PromptFactory,
    TtftProbe,
    add_engine_args,
    engine_env,
    median,
    model_dir_for,
    print_table,
    progress,
    write_results,
)
from deploy.launch import StackOptions, start_stack


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="512,1800", help="prompt lengths (tokens), 90%% shared prefix")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--throughput-requests", type=int, default=40)
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


def throughput(args, model_dir: Path, blocks: int, prompts_text: list[str]) -> float:
    with start_stack(options(args, f"throughput-{blocks}", model_dir, blocks)) as stack:
        probe = TtftProbe(stack.grpc_url)
        try:
            probe.ttft_ms(prompts_text[0], tenant="bench-warm")
            started = time.perf_counter()
            for i, text in enumerate(prompts_text):
                probe.ttft_ms(
                    text, max_tokens=16, tenant=f"bench-t{i}"
                )  # every request its own tenant: 0% hits
            return len(prompts_text) / (time.perf_counter() - started)
        finally:
            probe.close()


def plot(rows: list[list[object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [str(r[0]) for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="miss")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="hit (90% prefix cached)")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("Prefix cache: TTFT hit vs miss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = model_dir_for(args.preset, args.model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = PromptFactory(model_dir)
    progress("(a) hit vs miss")
    with start_stack(options(args, "hits", model_dir, 256)) as stack:
        probe = TtftProbe(stack.grpc_url)
        try:
            rows = hit_vs_miss(args, probe, prompts, lengths)
        finally:
            probe.close()
    table_a = print_table(["tokens", "miss TTFT ms", "hit TTFT ms", "hit/miss"], rows)
    progress("(b) throughput at 0% hit rate, cache on vs off")
    texts = [prompts.make(256) for _ in range(args.throughput_requests)]
    on, off = throughput(args, model_dir, 256, texts), throughput(args, model_dir, 0, texts)
    loss = 1 - on / off
    table_b = print_table(["prefix cache", "requests/s"], [["on", on], ["off", off]])
    print(f"throughput cost of the cache at 0% hits: {loss * 100:.2f}%")
    tag = args.tag or args.device.split(":")[0]
    command = "python -m bench.prefix_cache " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    payload = {"hit_vs_miss": rows, "throughput": {"on": on, "off": off, "loss": loss}, "device": args.device}
    text = f"(a)\n{table_a}\n\n(b)\n{table_b}\n\nthroughput cost at 0% hits: {loss * 100:.2f}%"
    base = write_results("prefix-cache", tag, payload, text, command, args.out_dir)
    plot(rows, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
