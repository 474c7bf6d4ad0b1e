"""Cold-start benchmark: first-request TTFT after READY vs steady state, warmup off vs on.

One run starts the server with warmup off, then `--starts` times with warmup on. For each prompt
length it sends the first request of that length, then `--steady` more, and reports first /
median(steady). A first request is one sample: on the H200 a 7 ms TTFT varies by +-15% from request
to request, so with several starts the ratio is the median first request over the starts (the worst
one beside it). Writes bench/results/coldstart-<tag>.{json,md,png}.

TTFT here is the time to the first token's response, text or not: a first token that ends inside a
UTF-8 character comes back as an empty piece and its text waits for the next token (the random 1B
model's greedy first token for the first 48-token prompt is 0xD9, half of a two-byte character), which
is the prompt's property, not the server's temperature. The time to the first text is reported beside
it. With `--idle-s`, each length's first request and `--idle-steady` more follow an idle pause of that
length: a replica that has served for an hour and then idled pays the wake-up of every hop too, and
first / idle-steady separates that from the cold start.

    python -m bench.coldstart                                   # CPU, tiny model
    python -m bench.coldstart --device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 \
        --lengths 12,48,200,900,1800,3500 --text-env $TEXT_ENV --no-redis --tag h200
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from bench.common import (
    start_stack,
    REPO_ROOT,
    EngineTtft,
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
from deploy.launch import StackOptions

TARGET_RATIO = 1.1  # issue 3: first request at most 1.1x steady at every length


@dataclass
class LengthResult:
    tokens: int
    first_ms: list[float]  # to the first token; one per server start
    steady_ms: list[float]
    engine_first_ms: list[float]
    engine_steady_ms: list[float]
    first_text_ms: list[float] = field(default_factory=list)
    steady_text_ms: list[float] = field(default_factory=list)
    idle_steady_ms: list[float] = field(default_factory=list)  # steady requests after an idle pause

    @property
    def steady_median_ms(self) -> float:
        return median(self.steady_ms)

    @property
    def ratio(self) -> float:
        return median(self.first_ms) / self.steady_median_ms

    @property
    def worst_ratio(self) -> float:
        return max(self.first_ms) / self.steady_median_ms

    @property
    def text_ratio(self) -> float:
        return median(self.first_text_ms) / median(self.steady_text_ms)

    @property
    def idle_ratio(self) -> float | None:
        return median(self.first_ms) / median(self.idle_steady_ms) if self.idle_steady_ms else None


@dataclass
class ConfigResult:
    warmup: bool
    ready_s: list[float]
    lengths: list[LengthResult] = field(default_factory=list)

    def merge(self, other: ConfigResult) -> ConfigResult:
        """The same configuration started again: per length, the samples of both starts."""
        self.ready_s += other.ready_s
        for mine, theirs in zip(self.lengths, other.lengths, strict=True):
            for sample in fields(LengthResult)[1:]:  # every list of samples, after `tokens`
                getattr(mine, sample.name).extend(getattr(theirs, sample.name))
        return self


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", default="12,48,200,900", help="prompt lengths in tokens (comma-separated)"
    )
    parser.add_argument("--steady", type=int, default=8, help="requests per length after the first")
    parser.add_argument("--starts", type=int, default=1, help="server starts with warmup on")
    parser.add_argument(
        "--idle-s", type=float, default=0.0, help="idle pause before each first and idle-steady request"
    )
    parser.add_argument("--idle-steady", type=int, default=2, help="steady requests after an idle pause")
    add_engine_args(parser)
    parser.add_argument(
        "--no-redis", action="store_true", help="do not start redis-server (none on the GPU image)"
    )
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace, model_dir: Path, warmup: bool, lengths: list[int]) -> ConfigResult:
    label = "on" if warmup else "off"
    options = StackOptions(
        run_dir=REPO_ROOT / ".run" / f"bench-coldstart-{label}",
        model_dir=model_dir,
        warmup=warmup,
        text_env=args.text_env,
        start_redis=not args.no_redis,
        redis_url=None if not args.no_redis else "redis://127.0.0.1:1/0",
        extra_env=engine_env(args.device, args.dtype, args.max_seq_len),
    )
    progress(f"warmup {label}: starting the server")
    started = time.perf_counter()
    stack = start_stack(options)
    result = ConfigResult(warmup=warmup, ready_s=[time.perf_counter() - started])
    progress(f"warmup {label}: READY after {result.ready_s[0]:.1f} s")
    prompts = PromptFactory(model_dir)
    probe = TtftProbe(stack.grpc_url)
    engine = EngineTtft(stack.metrics_url)
    try:
        for tokens in lengths:
            time.sleep(args.idle_s)
            first, first_text = probe.first_token_ms(prompts.make(tokens))
            engine_first = engine.mean_ms_since_last()
            steady = [probe.first_token_ms(prompts.make(tokens)) for _ in range(args.steady)]
            item = LengthResult(
                tokens, [first], [s[0] for s in steady], [engine_first], [engine.mean_ms_since_last()],
                [first_text], [s[1] for s in steady],
            )  # fmt: skip
            for _ in range(args.idle_steady if args.idle_s > 0 else 0):
                time.sleep(args.idle_s)
                item.idle_steady_ms.append(probe.first_token_ms(prompts.make(tokens))[0])
            engine.mean_ms_since_last()  # closes the window: the next length's first request stands alone
            result.lengths.append(item)
            progress(
                f"warmup {label}: {tokens:>5} tokens first {first:8.2f} ms  "
                f"steady {item.steady_median_ms:8.2f} ms  ratio {item.ratio:5.2f}"
            )
    finally:
        probe.close()
        stack.stop()
    return result


def plot(results: list[ConfigResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    lengths = [item.tokens for item in results[0].lengths]
    for index, config in enumerate(results):
        xs = [i + (index - 0.5) * width for i in range(len(lengths))]
        ax.bar(
            xs,
            [item.ratio for item in config.lengths],
            width,
            label=f"warmup {'on' if config.warmup else 'off'}",
        )
    ax.axhline(TARGET_RATIO, color="red", linestyle="--", label=f"target {TARGET_RATIO}x")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("first-request TTFT / steady median TTFT")
    ax.set_yscale("log")
    ax.set_title("Cold-start penalty per prompt length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = model_dir_for(args.preset, args.model_dir)
    cold = run_config(args, model_dir, False, lengths)
    warm = run_config(args, model_dir, True, lengths)
    for _ in range(args.starts - 1):
        warm.merge(run_config(args, model_dir, True, lengths))
    results = [cold, warm]
    headers = [
        "warmup",
        "tokens",
        "first TTFT ms",
        "steady median ms",
        "first/steady",
        "worst first/steady",
        "target",
        "engine first ms",
        "engine steady ms",
        "first/steady (first text)",
        "first/idle-steady",
    ]
    rows = []
    for config in results:
        for item in config.lengths:
            target = "" if not config.warmup else ("met" if item.ratio <= TARGET_RATIO else "MISSED")
            rows.append(
                [
                    "on" if config.warmup else "off",
                    item.tokens,
                    median(item.first_ms),
                    item.steady_median_ms,
                    item.ratio,
                    item.worst_ratio,
                    target,
                    median(item.engine_first_ms),
                    median(item.engine_steady_ms),
                    item.text_ratio,
                    "" if item.idle_ratio is None else item.idle_ratio,
                ]
            )
    table = print_table(headers, rows)
    ready = " | ".join(
        f"warmup {'on' if c.warmup else 'off'}: READY in {', '.join(f'{s:.1f}' for s in c.ready_s)} s"
        for c in results
    )
    print(ready)
    tag = args.tag or args.device.split(":")[0]
    command = "python -m bench.coldstart " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    payload = {
        "configs": results,
        "target_ratio": TARGET_RATIO,
        "device": args.device,
        "model_dir": str(model_dir),
    }
    base = write_results("coldstart", tag, payload, table + "\n\n" + ready, command, args.out_dir)
    plot(results, base.with_suffix(".png"))
    progress(f"wrote {base}.json/.md/.png")
    met = all(item.ratio <= TARGET_RATIO for item in warm.lengths)
    print(
        f"target (warmup on, median first/steady over {args.starts} start(s) <= {TARGET_RATIO} for every"
        f" length): {'met' if met else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
