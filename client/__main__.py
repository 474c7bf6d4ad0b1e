"""Command line client: `python -m client generate [options] PROMPT`, `python -m client warmup --rewarm`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from tritonclient.utils import InferenceServerException

from client.generate import GenerationError, GenerationResult, generate
from client.rewarm import rewarm


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one generation and print its timing")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    gen.add_argument("--model", default="llm", help="model to query (default: %(default)s)")
    gen.add_argument("--max-tokens", type=int, help="sampling_parameters.max_tokens")
    gen.add_argument("--temperature", type=float, help="sampling_parameters.temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, help="sampling_parameters.top_p")
    gen.add_argument("--top-k", type=int, help="sampling_parameters.top_k (0 = off)")
    gen.add_argument("--seed", type=int, help="sampling_parameters.seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past EOS")
    gen.add_argument("--tier", help="slo_tier, e.g. critical | warmup | standard | batch")
    gen.add_argument("--tenant", help="tenant id")
    gen.add_argument("--no-stream", dest="stream", action="store_false", help="one response, not pieces")
    gen.add_argument("--exclude-input", dest="exclude_input_in_output", action="store_true", default=None,
                     help="send exclude_input_in_output=true")  # fmt: skip
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default: %(default)s)")
    warm = commands.add_parser("warmup", help="re-warm the engine (reload it: warmup runs before it serves)")
    warm.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    warm.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="Triton metrics URL")
    warm.add_argument("--model", default="llm_engine", help="model to re-warm (default: %(default)s)")
    warm.add_argument(
        "--rewarm", action="store_true", required=True, help="reload the engine and re-run warmup"
    )
    warm.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default: %(default)s)")
    return parser


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """Only the options given on the command line, so the server's defaults apply to the rest."""
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    sampling = {key: value for key, value in given.items() if value is not None}
    return sampling or None


def format_stats(result: GenerationResult) -> str:
    ttft = "n/a" if result.ttft_s is None else f"{result.ttft_s * 1000:.1f} ms"
    return f"TTFT {ttft}  total {result.total_s * 1000:.1f} ms  pieces {len(result.pieces)}"


def run_generate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    def show(piece: str) -> None:
        out.write(piece)
        out.flush()

    try:
        result = generate(
            args.url, args.prompt, sampling=sampling_from_args(args), stream=args.stream,
            exclude_input_in_output=args.exclude_input_in_output, tier=args.tier, tenant=args.tenant,
            model=args.model, on_piece=show, timeout_s=args.timeout,
        )  # fmt: skip
    except (GenerationError, InferenceServerException, OSError) as exc:
        out.write("\n")
        out.flush()
        err.write(f"error: {exc}\n")
        return 1
    out.write("\n" + format_stats(result) + "\n")
    out.flush()
    return 0


def run_rewarm(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        result = rewarm(args.url, args.metrics_url, args.model, args.timeout)
    except (InferenceServerException, RuntimeError, OSError) as exc:
        print(f"error: re-warm of {args.model} failed: {exc}", file=err)
        return 1
    print(f"{result.model} reloaded and warm in {result.reload_seconds:.2f} s; warmup report:", file=out)
    for key, value in sorted(result.report.items()):
        print(f"  {key} {value:g}", file=out)
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    err = err or sys.stderr
    if args.command == "generate":
        return run_generate(args, out, err)
    if args.command == "warmup":
        return run_rewarm(args, out, err)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
