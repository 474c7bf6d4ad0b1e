"""Command line client: `python -m client generate [options] PROMPT`, `python -m client warmup --rewarm`,
`python -m client warmup --log LOG [--templates YAML] [options]` (the warmup job, client/warmup_job.py),
`python -m client prime` (readiness and priming), `python -m client cache` (the cache tiers' figures),
`python -m client forget-tenant` (erase a tenant's cached data in Redis), `python -m client tenant-token`
(sign a tenant's token)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.cache_report import __doc__ as cache_report_doc
from client.cache_report import as_dicts, format_rows, redis_memory, tier_rows
from client.generate import GenerationError, GenerationResult, generate
from client.metrics import scrape_metrics
from client.prime import PrimeConfig, prime, prime_once
from scheduler.errors import RequestError
from scheduler.messages import CACHE_MODES, utf8_encodable
from scheduler.tenant_auth import (
    ANONYMOUS_ENV,
    DEFAULT_TENANT,
    DEFAULT_TOKEN_TTL,
    SECRET_ENV,
    secret_error,
    tenant_token,
    ttl_argument,
    utc_text,
)
from scheduler.validation import validate_tenant
from client.rewarm import rewarm
from client.stack_defaults import (
    FALLBACK_GRPC_URL,
    FALLBACK_METRICS_URL,
    URL_HELP,
    default_grpc_url,
    default_metrics_url,
    signing_for,
)
from client.warmup_job import JobOptions, SelectionConfig, SendConfig, run_job
from deploy.arg_types import seconds

URL_OPTION_HELP = f"Triton gRPC address ({URL_HELP} {FALLBACK_GRPC_URL})"
METRICS_OPTION_HELP = f"Triton's metrics ({URL_HELP} {FALLBACK_METRICS_URL})"
JOB_ONLY = (
    "templates", "top_percent", "per_cluster", "clusters", "edge_cases", "dry_run", "tenant_field",
    "concurrency", "max_tokens", "max_prompt_tokens", "tokenizer", "no_progress", "fill_response_cache",
    "max_items", "max_embedded",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one generation and print its timing")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--url", help=URL_OPTION_HELP)
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
    gen.add_argument(
        "--tenant-token",
        help=f"the tenant's token, where the server authenticates tenants (default: made from {SECRET_ENV} "
        "when set here)",
    )
    gen.add_argument(
        "--cache", choices=CACHE_MODES,
        help="use (default): every cache; kv-only: reuse and keep KV prefixes but no response cache, so "
             "the answer is always generated afresh; refresh: as kv-only, and the fresh answer is kept in "
             "the response caches; bypass: read and write no cache tier",
    )  # fmt: skip
    gen.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="the text in the final response, not piece by piece",
    )
    gen.add_argument("--exclude-input", dest="exclude_input_in_output", action="store_true", default=None,
                     help="send exclude_input_in_output=true")  # fmt: skip
    gen.add_argument("--timeout", type=seconds, default=120.0, help="seconds to wait (default: %(default)s)")
    warm = commands.add_parser(
        "warmup",
        help="fill the caches from a query log (--log) or re-warm the engine (--rewarm)",
        description="Job mode (--log): select hot prompts from a query log, SLO templates and edge cases, "
        "and send them at tier warmup. Re-warm mode (--rewarm): reload the engine so its warmup runs again.",
    )
    mode = warm.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rewarm", action="store_true", help="reload the engine and re-run warmup")
    mode.add_argument("--log", type=Path, help="job mode: JSONL query log ({prompt, tenant, ts} per line)")
    warm.add_argument("--url", help=URL_OPTION_HELP)
    warm.add_argument(
        "--metrics-url",
        help="Triton's metrics: --rewarm reads its warmup report there (default: as for `cache`); the job "
        "prints the cache tiers from there once it has sent its requests (only when given)",
    )
    warm.add_argument("--model", help="model: llm_engine to re-warm, llm (the ensemble) to send the job to")
    warm.add_argument("--timeout", type=seconds, default=600.0, help="seconds to wait (default: %(default)s)")
    job = warm.add_argument_group("job mode (with --log only)")
    job.add_argument("--templates", type=Path, help="YAML of SLO-sensitive scenario templates")
    job.add_argument("--top-percent", type=float, help="top share of prompts by frequency (default 5)")
    job.add_argument("--per-cluster", type=int, help="most frequent prompts taken per cluster (default 2)")
    job.add_argument("--clusters", help="auto (silhouette, the default) or a number of clusters")
    job.add_argument(
        "--edge-cases", action=argparse.BooleanOptionalAction, default=None,
        help="add synthetic edge cases (default: on; --no-edge-cases leaves them out)",
    )  # fmt: skip
    job.add_argument(
        "--max-items", help="log prompts sent at most (top and per-cluster; default 1000, none: no cap)"
    )
    job.add_argument("--max-embedded", type=int, help="most frequent prompts clustered (default 20000)")
    job.add_argument("--dry-run", action="store_true", default=None, help="print the selection, send nothing")
    job.add_argument("--tenant-field", help="log field holding the tenant (default: tenant)")
    job.add_argument("--concurrency", type=int, help="requests in flight (default 4)")
    job.add_argument("--max-tokens", type=int, help="new tokens per warmup request (default 4)")
    job.add_argument("--max-prompt-tokens", type=int, help="the server's prompt limit (default 2047)")
    job.add_argument("--tokenizer", type=Path, help="the served model's tokenizer.json, for exact lengths")
    job.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    job.add_argument(
        "--fill-response-cache", action=argparse.BooleanOptionalAction, default=None,
        help="greedy requests with cache=refresh: the response caches keep each answer, and a repeat run "
        "still prefills (default: on; entries serve greedy clients asking --max-tokens tokens); "
        "--no-fill-response-cache: unseeded sampling, nothing kept there",
    )  # fmt: skip
    primer = commands.add_parser(
        "prime",
        help="send the serving path's first requests (readiness check: exit 0 once ready and primed)",
        description="Wait until the server is ready, then send a few warmup-tier requests through the "
        "ensemble so the first client requests do not pay its first-use cost (client/prime.py). With "
        "--marker, a later call only checks readiness (for a container's readiness probe).",
    )
    primer.add_argument("--url", help=URL_OPTION_HELP)
    primer.add_argument("--model", default="llm", help="model to prime (default: %(default)s)")
    primer.add_argument("--marker", type=Path, help="file written once primed; present: prime no more")
    primer.add_argument("--timeout", type=seconds, default=60.0, help="seconds per request (default: 60)")
    primer.add_argument(
        "--drain-file",
        type=Path,
        help="not ready while this file exists: the launcher's stop creates <run_dir>/draining and the "
        "replica then refuses new requests, so a readiness probe takes it out of its Service first",
    )
    cache = commands.add_parser(
        "cache",
        help="the cache tiers at a glance: hits, fill, evictions, time saved, Redis trouble",
        description=cache_report_doc,
    )
    cache.add_argument("--metrics-url", help=METRICS_OPTION_HELP)
    cache.add_argument(
        "--json",
        action="store_true",
        help='one JSON object instead of a table: {"tiers": [one object per tier], "redis": ...}',
    )
    cache.add_argument(
        "--redis-url", help="also show the Redis's memory: used against maxmemory, policy, keys evicted"
    )
    erase = commands.add_parser(
        "forget-tenant",
        help="delete what Redis holds for one tenant: its exact and semantic answers and its KV blocks",
        description="Delete a tenant's exact and semantic response-cache entries and the KV blocks the "
        "engines noted for it, for every model (cache/tenant_erasure.py). Blocks written before that index "
        "existed go by their TTL (l3_ttl_s, 24 h by default).",
    )
    erase.add_argument("tenant", help="the tenant, as the server names it")
    erase.add_argument(
        "--redis-url", required=True, help="the Redis the replicas use, e.g. redis://redis:6379/0"
    )
    erase.add_argument("--dry-run", action="store_true", help="count the entries, delete nothing")
    token = commands.add_parser(
        "tenant-token",
        help=f"print the token a client sends to act as a tenant (needs {SECRET_ENV})",
        description=f"With {SECRET_ENV} set on the server, a request naming a tenant other than 'default' "
        "must carry that tenant's token (input or request parameter tenant_token): an HMAC-SHA256 of the "
        "name and an expiry under the secret (scheduler/tenant_auth.py). Give it to that tenant's clients "
        "only.",
    )
    token.add_argument("tenant", help="the tenant, as its requests name it")
    token.add_argument(
        "--ttl",
        type=ttl_argument,
        default=ttl_argument(DEFAULT_TOKEN_TTL),
        help=f"how long the token is good for: 3600s, 90m, 24h, 30d (default {DEFAULT_TOKEN_TTL}), or "
        "'never' (only a new secret revokes it; servers with LLM_TENANT_TOKEN_REQUIRE_EXPIRY refuse it)",
    )
    return parser


def run_tenant_token(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        print(f"error: {SECRET_ENV} is not set: set it to the servers' secret", file=err)
        return 2
    if (problem := secret_error()) is not None:
        print(f"error: {problem}", file=err)
        return 2
    try:
        tenant = validate_tenant(args.tenant)
    except RequestError as exc:
        print(f"error: {exc}", file=err)
        return 2
    if tenant == DEFAULT_TENANT:
        print(
            f"note: {DEFAULT_TENANT!r} is the shared tenant: its token is needed for restricted tiers "
            f"(scheduler/tiers.yaml), and for every request on servers with {ANONYMOUS_ENV}=false",
            file=err,
        )
    expires_at = None if args.ttl is None else int(time.time()) + args.ttl
    print(tenant_token(secret, tenant, expires_at), file=out)
    if expires_at is not None:
        print(f"good until {utc_text(expires_at)}", file=err)
    return 0


def run_forget_tenant(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import redis

    from cache.redis_topology import probe_topology
    from cache.response_cache import make_redis_client
    from cache.tenant_erasure import erase_tenant

    try:  # a name no server accepts was never a tenant: "deleted 0 keys" would read as an erasure done
        validate_tenant(args.tenant)
    except RequestError as exc:
        print(f"error: {exc.message}", file=err)
        return 2
    try:
        client = make_redis_client(args.redis_url, timeout_s=10.0)  # SCAN pages and batched UNLINKs
    except ValueError as exc:  # a URL redis-py cannot read ("localhost:6379", no scheme)
        print(f"error: {exc}", file=err)
        return 2
    try:
        probe_topology(client)  # a SCAN of one master of several would leave the others' keys
        erasure = erase_tenant(client, args.tenant, dry_run=args.dry_run)
    except (redis.RedisError, ValueError) as exc:
        print(f"error: {exc}", file=err)
        return 1
    finally:
        client.close()
    verb = "would delete" if erasure.dry_run else "deleted"
    counts = ", ".join(f"{count} {cache} keys" for cache, count in erasure.keys.items())
    print(f"tenant {erasure.tenant!r}: {verb} {counts}", file=out)
    return 0


def run_cache(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        rows = tier_rows(scrape_metrics(args.metrics_url))
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {args.metrics_url}: {exc}", file=err)
        return 1
    if not rows:
        print(f"error: {args.metrics_url} reports no cache tier (is llm_engine loaded?)", file=err)
        return 1
    memory = None
    if args.redis_url:
        import redis

        from cache.response_cache import make_redis_client, redact_url

        try:
            client = make_redis_client(args.redis_url, timeout_s=5.0)
        except ValueError as exc:  # a URL redis-py cannot read ("localhost:6379", no scheme)
            print(f"error: {exc}", file=err)
            return 2
        try:
            memory = redis_memory(client)
        except (redis.RedisError, ValueError) as exc:  # ValueError: UnsupportedRedis
            print(f"error: cannot read {redact_url(args.redis_url)}: {exc}", file=err)
            return 1
        finally:
            client.close()
    if args.json:
        print(
            json.dumps({"tiers": as_dicts(rows), "redis": None if memory is None else asdict(memory)}),
            file=out,
        )
    else:
        print(format_rows(rows) + ("" if memory is None else "\n" + memory.describe()), file=out)
    return 0


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
    shown = False

    def show(piece: str) -> None:
        nonlocal shown
        shown = shown or bool(piece)
        out.write(piece)
        out.flush()

    try:
        result = generate(
            args.url, args.prompt, sampling=sampling_from_args(args), stream=args.stream,
            exclude_input_in_output=args.exclude_input_in_output, tier=args.tier, tenant=args.tenant,
            cache=args.cache, model=args.model, on_piece=show, timeout_s=args.timeout,
            tenant_token=args.tenant_token,
        )  # fmt: skip
    except (GenerationError, InferenceServerException, OSError, UnicodeError, KeyboardInterrupt) as exc:
        if shown:  # end the line of the pieces streamed before the error
            out.write("\n")
            out.flush()
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C: the session cancelled the request on its way out
            err.write("error: interrupted; the request was cancelled\n")
            return 130
        if isinstance(exc, UnicodeError):  # an argument the shell passed as bytes that are not UTF-8
            exc = f"an argument is not UTF-8 text ({exc})"
        err.write(f"error: {exc}\n")
        return 1
    out.write("\n" + format_stats(result) + "\n")
    out.flush()
    return 0


def job_options(args: argparse.Namespace) -> JobOptions:
    """Job-mode arguments -> JobOptions; options not given keep the dataclasses' defaults."""
    clusters = None if args.clusters in (None, "auto") else int(args.clusters)
    given = {
        "top_percent": args.top_percent,
        "per_cluster": args.per_cluster,
        "clusters": clusters,
        "edge_cases": args.edge_cases,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_embedded": args.max_embedded,
    }
    selection = SelectionConfig(**{key: value for key, value in given.items() if value is not None})
    if args.max_items is not None:
        cap = None if args.max_items == "none" else int(args.max_items)
        selection = dataclasses.replace(selection, max_items=cap)
    sending = {
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "fill_response_cache": args.fill_response_cache,
    }  # fmt: skip
    send = SendConfig(
        url=args.url, model=args.model or "llm", timeout_s=args.timeout, progress=not args.no_progress,
        **{key: value for key, value in sending.items() if value is not None},
    )  # fmt: skip
    return JobOptions(
        log=args.log, templates=args.templates, selection=selection, send=send,
        tenant_field=args.tenant_field or "tenant", tokenizer=args.tokenizer, dry_run=bool(args.dry_run),
        metrics_url=args.metrics_url,
    )  # fmt: skip


def is_ascii_int(text: str) -> bool:
    """Digits int() reads: "²".isdigit() is True, and int("²") raises."""
    return text.isascii() and text.isdigit()


def check_warmup_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Job options make no sense with --rewarm; say so instead of ignoring them."""
    if args.rewarm:
        given = [name for name in JOB_ONLY if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"{flags} only apply to the warmup job (--log), not to --rewarm")
    if args.clusters not in (None, "auto") and not (is_ascii_int(args.clusters) and int(args.clusters) >= 1):
        parser.error(f"--clusters must be 'auto' or a positive integer, got {args.clusters!r}")
    if args.max_items not in (None, "none") and not is_ascii_int(args.max_items):
        parser.error(f"--max-items must be 'none' or an integer >= 0, got {args.max_items!r}")


def run_rewarm(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    model = args.model or "llm_engine"
    try:
        result = rewarm(args.url, args.metrics_url or default_metrics_url(), model, args.timeout)
    except (InferenceServerException, RuntimeError, OSError) as exc:
        print(f"error: re-warm of {model} failed: {exc}", file=err)
        return 1
    if result.report_error is not None:
        print(f"{result.model} reloaded and warm in {result.reload_seconds:.2f} s", file=out)
        print(f"warning: {result.report_error}", file=err)
        return 0
    print(f"{result.model} reloaded and warm in {result.reload_seconds:.2f} s; warmup report:", file=out)
    for key, value in sorted(result.report.items()):
        print(f"  {key} {value:g}", file=out)
    return 0


def run_prime(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.drain_file is not None and args.drain_file.exists():
        print(f"error: draining ({args.drain_file} exists): this replica refuses new requests", file=err)
        return 1
    try:
        ready = grpcclient.InferenceServerClient(url=args.url).is_model_ready(
            args.model, client_timeout=args.timeout
        )
    except InferenceServerException as exc:
        print(f"error: {args.url} is not reachable: {exc}", file=err)
        return 1
    if not ready:
        print(f"error: {args.model} is not ready on {args.url}", file=err)
        return 1
    config = PrimeConfig(url=args.url, model=args.model, timeout_s=args.timeout)
    result = prime(config) if args.marker is None else prime_once(config, args.marker)
    if result is None:
        print(f"{args.model} ready (primed before: {args.marker})", file=out)
        return 0
    if not result.ok:
        print(f"error: priming {args.model} failed for {result.failed}/{result.requests}:", file=err)
        for error in result.errors:
            print(f"  {error}", file=err)
        return 1
    print(f"{args.model} primed: {result.requests} requests in {result.seconds * 1000:.0f} ms", file=out)
    return 0


def resolve_default_urls(args: argparse.Namespace) -> None:
    """Fill in --url (and `cache`'s --metrics-url) when not given: the running stack of `make run`
    (.run/main/stack.json), else localhost:8001 / :8002 (client/stack_defaults.py)."""
    if getattr(args, "url", "") is None:
        args.url = default_grpc_url()
    if args.command == "cache" and args.metrics_url is None:
        args.metrics_url = default_metrics_url()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("url", "model", "metrics_url"):  # gRPC encodes them: a shell's non-UTF-8 bytes raise there
        if not utf8_encodable(getattr(args, name, None) or ""):
            parser.error(f"--{name.replace('_', '-')} is not UTF-8 text")
    resolve_default_urls(args)
    out = out or sys.stdout
    err = err or sys.stderr
    if args.command in ("generate", "prime") and (problem := secret_error()) is not None:
        print(f"error: {problem}", file=err)
        return 2
    if args.command in ("tenant-token", "forget-tenant"):  # no stack's: the operator's secret, or none
        return run_command(parser, args, out, err)
    with signing_for(getattr(args, "url", None) or default_grpc_url()):
        return run_command(parser, args, out, err)


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.command == "generate":
        return run_generate(args, out, err)
    if args.command == "prime":
        return run_prime(args, out, err)
    if args.command == "cache":
        return run_cache(args, out, err)
    if args.command == "forget-tenant":
        return run_forget_tenant(args, out, err)
    if args.command == "tenant-token":
        return run_tenant_token(args, out, err)
    if args.command == "warmup":
        check_warmup_args(parser, args)
        if args.rewarm:
            return run_rewarm(args, out, err)
        try:
            options = job_options(args)
        except ValueError as exc:
            parser.error(str(exc))
        return run_job(options, out, err)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
