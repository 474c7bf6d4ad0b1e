"""Warmup stage run in `initialize()` before the model reports READY.

With `compile` on, a first stage compiles the decode step per KV bucket with torch.compile, its
artifacts kept between restarts (engine/compile_cache.py). It then runs every kernel shape live
traffic can reach: one prefill per prompt bucket and one decode
step per KV-length bucket (decode always covers every slot, so batch size adds no shape), the
sampling path, and finally whole requests through the engine's own admission, streaming and
finishing code (with metrics detached, so warmup never shows up as traffic). Each stage is
timed; the report is logged as JSON.

With an L3 tier and hot prefixes (and `l3_prefetch`, the default), the prefixes' blocks are fetched
from Redis on another thread from the very start (engine/l3_prefetch.py), overlapping the kernel
stages; the prefix_templates stage then adopts them instead of asking Redis, waiting for a fetch
still in flight at most until its budget ends. The report's stage "l3_prefetch" is that thread's
wall time, concurrent with the others (`start_s`/`end_s` of every stage place it), and the
`l3_prefetch` section has its counts and how long prefix_templates waited on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from engine.compile_cache import CompileCache, compile_decode_buckets
from engine.engine import Engine
from engine.l3_prefetch import L3Prefetcher
from engine.observer import EngineObserver, EngineStats
from engine.requests import EngineRequest
from engine.sampling import warm_sampling
from scheduler.messages import EngineRequestParams


# cache "kv-only": never answered from (nor written to) the response caches, whose warmup-tier answers are
# written at once: from the second start on both were exact hits that ran none of the engine's code, and
# they put entries in tenant "default"'s namespace
_WARMUP_REQUESTS = (
    EngineRequestParams(max_tokens=3, stream=True, ignore_eos=True, tier="warmup", cache="kv-only"),
    EngineRequestParams(
        max_tokens=3,
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        seed=1,
        stop=("zz",),
        tier="warmup",
        cache="kv-only",
    ),
)


class _DiscardSink:
    def send(self, token_ids: list[int], read_offset: int, final: bool, trim_bytes: int) -> None: ...

    def fail(self, code: str, message: str) -> None: ...

    def cancelled(self) -> bool:
        return False


@dataclass
class StageTiming:
    name: str
    seconds: float
    items: int
    device_seconds: float | None = None  # CUDA-event time of the same span (GPU only)
    start_s: float | None = None  # host-clock span, seconds since run_warmup's origin_ns (the loader's: the
    end_s: float | None = None  # load's start; a stage of several measurements: first start to last end);
    # None for "plan"


@dataclass
class WarmupReport:
    enabled: bool
    device: str
    stages: list[StageTiming] = field(default_factory=list)
    prompt_buckets: list[int] = field(default_factory=list)
    kv_buckets: list[int] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)
    cuda_graph_buckets: list[int] = field(default_factory=list)
    prefill_graph_buckets: list[int] = field(default_factory=list)
    suffix_graph_buckets: list[int] = field(default_factory=list)  # prefills after a prefix-cache hit
    prefill_loaded: int = 0
    prefill_deferred: int = 0
    failures: list[dict] = field(default_factory=list)
    compile: dict = field(default_factory=dict)  # engine.compile_cache.compile_decode_buckets; {} when off
    l3_prefetch: dict = field(default_factory=dict)  # L3Prefetcher.summary + the stage's waits; {} when off
    device_prewarm: dict = field(default_factory=dict)  # engine.device_prewarm.PrewarmSummary; {} when off
    total_seconds: float = 0.0  # the warmup stage, plus the prewarm's waited_s (it ran during the load)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class _StageClock:
    """Times a stage on the host clock (the device synchronized at both ends, so queued kernels count)
    and, on CUDA, also with CUDA events on the device's own clock: the two side by side calibrate
    each other (device time close to host time means the stage was GPU-bound, far below it means
    Python and launch overhead)."""

    def __init__(self, device: torch.device, origin_ns: int = 0):
        self.device = device
        self.origin_ns = origin_ns
        self.last_span: tuple[float, float] = (0.0, 0.0)  # of the last measure, seconds since origin_ns

    def measure(self, work: Callable[[], int]) -> tuple[float, float | None, int]:
        """(host seconds, device seconds or None off CUDA, items)."""
        self._sync()
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        started = time.perf_counter_ns()
        items = work()
        if events is not None:
            events[1].record()
        self._sync()
        ended = time.perf_counter_ns()
        host_s = (ended - started) / 1e9
        self.last_span = ((started - self.origin_ns) / 1e9, (ended - self.origin_ns) / 1e9)
        device_s = None if events is None else events[0].elapsed_time(events[1]) / 1000.0
        return host_s, device_s, items

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def shape_order(buckets: tuple[int, ...], histogram: Mapping[int, int] | None) -> list[int]:
    """Buckets by the share of recorded prompts they serve (largest first); ascending without history,
    so that a spent budget leaves the rarest shapes for background warming."""
    if not histogram:
        return sorted(buckets)
    mass = dict.fromkeys(buckets, 0)
    for length, count in histogram.items():
        bucket = next((b for b in sorted(buckets) if b >= length), None)
        if bucket is not None:
            mass[bucket] += count
    return sorted(buckets, key=lambda b: (-mass[b], b))


def open_connections(engine: Engine) -> int:
    """Connect the Redis clients the request path uses (exact and semantic response caches, L3), so
    that the first requests after READY do not pay the TCP connect and handshake: on the CPU the first
    request's engine TTFT was 8.9 ms against 5.1 steady, and the first one with full prefix blocks
    (L3 asked) 9.1 against 7.3. An unreachable Redis is not a warmup failure here: the request path
    has its circuit breakers. Returns the clients connected."""
    clients = []
    if engine.responses is not None:
        clients.append(engine.responses.cache.client)
        if engine.responses.semantic is not None:
            clients.append(engine.responses.semantic.client)
    if engine.prefix_cache is not None and engine.prefix_cache.l3 is not None:
        clients.append(engine.prefix_cache.l3.store.client)
    connected = 0
    for client in clients:
        try:
            connected += bool(client.ping())
        except Exception:  # redis.RedisError and socket errors: the breakers handle it later
            continue
    return connected


def prefill_templates(
    engine: Engine, hot_prefixes: list[tuple[list[int], str]], budget_s: float, report: WarmupReport
) -> int:
    """Load hot prefixes (token ids, tenant) in priority order into the prefix cache within
    `budget_s` once the kernels are warm; the rest is left to the idle engine after READY.

    With an L3 prefetch running (`engine.template_prefetch`), a prefix whose fetch is still in flight
    is waited for up to the end of the budget; if it is still not there, it and the rest are deferred
    (the background step takes each once its fetch completes)."""
    deadline = time.perf_counter() + budget_s
    loaded = 0
    prefetch = engine.template_prefetch
    waits, waited_s = 0, 0.0
    for index, (prompt, tenant) in enumerate(hot_prefixes):
        now = time.perf_counter()
        ready = now < deadline
        if ready and prefetch is not None and prefetch.pending(prompt, tenant):
            waits += 1
            ready = prefetch.wait(prompt, tenant, deadline - now)
            waited_s += time.perf_counter() - now
        if not ready:
            engine.deferred_templates.extend(hot_prefixes[index:])
            break
        try:
            cached = engine.prefill_template(prompt, tenant)
        except Exception as exc:  # one broken template never blocks the others
            report.failures.append(
                {"stage": f"prefix_templates:{index}", "error": f"{type(exc).__name__}: {exc}"}
            )
            continue
        if cached:
            loaded += 1
        else:  # computed, but no block of it is cached (shorter than one block, or the store failed)
            error = f"nothing cached: {len(prompt)} tokens, no full block of it in the prefix cache"
            report.failures.append({"stage": f"prefix_templates:{index}", "error": error})
    report.prefill_loaded = loaded
    report.prefill_deferred = len(engine.deferred_templates)
    if prefetch is not None:
        report.l3_prefetch.update(templates_waits=waits, templates_waited_s=waited_s)
    return loaded


class _KernelStages:
    """The per-bucket kernel warm-up and its three stage timings.

    With prefill graphs on, a bucket's graph capture is its warm-up (the capture's own warm run is
    the eager prefill), so a bucket is not also run eager first: on the H200 that saved 0.6 s of a
    1.9 s stage. Graphs are captured while their time stays within `graph_budget_s`; past it a
    bucket is warmed eager and its graph captured in the background when the engine is idle, so a
    bucket without its graph yet is slower (launch overhead) but never cold."""

    STAGES = {"prefill": "prefill_buckets", "prefill_graph": "prefill_graphs", "decode": "decode_kv_buckets"}

    def __init__(
        self, engine: Engine, clock: _StageClock, report: WarmupReport, deadline: float, graph_budget_s: float
    ):
        self.engine = engine
        self.clock = clock
        self.report = report
        self.deadline = deadline
        self.graph_budget_s = graph_budget_s
        self.spent = dict.fromkeys(self.STAGES, 0.0)
        self.device_spent: dict[str, float | None] = dict.fromkeys(self.STAGES)
        self.counts = dict.fromkeys(self.STAGES, 0)
        self.spans: dict[str, tuple[float, float] | None] = dict.fromkeys(self.STAGES)

    def warm_prefill(self, bucket: int) -> None:
        if self.engine.runner.use_prefill_graphs:
            in_time = time.perf_counter() < self.deadline
            in_budget = in_time and self.spent["prefill_graph"] < self.graph_budget_s
            if in_budget and self.warm("prefill_graph", bucket):
                return
            self.engine.deferred_shapes.append(("prefill_graph", bucket))
        self.warm("prefill", bucket)

    def warm(self, kind: str, bucket: int) -> bool:
        """Warm one shape; past the deadline (or on failure) it is left to lazy or background warming."""
        shape = "decode" if kind == "decode" else "prefill"
        if time.perf_counter() >= self.deadline:
            self.engine.deferred_shapes.append((kind, bucket))
            return False
        try:
            seconds, device_seconds, _ = self.clock.measure(
                lambda: self.engine.runner.warm_shape(kind, bucket) or 1
            )
        except Exception as exc:  # lazy warm-up takes over for this shape
            error = f"{type(exc).__name__}: {exc}"
            self.report.failures.append({"stage": f"{kind}:{bucket}", "error": error})
            return False
        self.engine.note_shape(shape, bucket)
        self.spent[kind] += seconds
        first = self.spans[kind] or self.clock.last_span
        self.spans[kind] = (first[0], self.clock.last_span[1])
        self.counts[kind] += 1
        if device_seconds is not None:
            self.device_spent[kind] = (self.device_spent[kind] or 0.0) + device_seconds
        return True

    def timings(self) -> list[StageTiming]:
        kinds = [k for k in self.STAGES if k != "prefill_graph" or self.engine.runner.use_prefill_graphs]
        return [
            StageTiming(self.STAGES[k], self.spent[k], self.counts[k], self.device_spent[k], *self._span(k))
            for k in kinds
        ]

    def _span(self, kind: str) -> tuple[float | None, float | None]:
        return self.spans[kind] or (None, None)


def run_warmup(
    engine: Engine,
    enabled: bool,
    budget_s: float = 0.0,
    histogram: Mapping[int, int] | None = None,
    hot_prefixes: list[tuple[list[int], str]] | None = None,
    prefill_budget_s: float = 0.3,
    compile_cache: CompileCache | None = None,
    l3_prefetch: bool = True,
    graph_budget_s: float = float("inf"),
    origin_ns: int | None = None,
) -> WarmupReport:
    """Warm every shape within `budget_s` (0: no budget); what does not fit is left in
    `engine.deferred_shapes` for the engine to warm in the background while idle. A failing step
    is recorded in the report and never fails the load (the shape is then warmed lazily).

    With `compile_cache`, the stage "compile" comes first (the decode warm-up and CUDA-graph capture
    then run the compiled step) and spends the same budget; a bucket it does not reach stays eager
    (it is never compiled later: a compile takes seconds and would stall live traffic).

    Prefill CUDA graphs (`runner.use_prefill_graphs`) replace the eager warm-up of their bucket
    while their capture time stays within `graph_budget_s` (and `budget_s`); the rest is captured
    in the background (see _KernelStages).

    With `l3_prefetch`, an L3 tier and hot prefixes, the prefixes' L3 fetch starts first, on its own
    thread, and runs alongside the kernel stages (see the module docstring).

    `origin_ns` (perf_counter_ns, default: now) anchors every stage's `start_s`/`end_s`; the loader
    passes the start of the load, as the device prewarm's span is anchored there."""
    runner = engine.runner
    report = WarmupReport(enabled=enabled, device=str(runner.device))
    if not enabled:
        return report
    started = time.perf_counter_ns()
    origin = started if origin_ns is None else origin_ns
    clock = _StageClock(runner.device, origin)
    cache = engine.prefix_cache
    prefetcher = None
    if l3_prefetch and hot_prefixes and cache is not None and cache.l3 is not None:
        if engine.template_prefetch is not None:  # a second warmup of the same engine
            engine.template_prefetch.close()
        prefetcher = L3Prefetcher(
            cache.l3, cache.chain_keys, hot_prefixes, on_ready=engine.wake, max_blocks=cache.capacity
        )
        engine.template_prefetch = prefetcher
        prefetcher.start()
    deadline = time.perf_counter() + budget_s if budget_s > 0 else float("inf")
    if compile_cache is not None:

        def compile_work() -> int:
            order = shape_order(tuple(runner.kv_buckets), histogram)
            report.compile = compile_decode_buckets(runner, compile_cache, order, deadline, report.failures)
            return len(report.compile["compiled_buckets"])

        try:
            seconds, device_seconds, items = clock.measure(compile_work)
            report.stages.append(StageTiming("compile", seconds, items, device_seconds, *clock.last_span))
        except Exception as exc:  # the runner keeps serving eager
            report.failures.append({"stage": "compile", "error": f"{type(exc).__name__}: {exc}"})
    kernels = _KernelStages(engine, clock, report, deadline, graph_budget_s)
    for bucket in shape_order(engine.prompt_buckets, histogram):
        kernels.warm_prefill(bucket)
        kernels.warm("decode", bucket)
    report.stages.extend(kernels.timings())

    def sampling() -> int:
        return warm_sampling(runner.model.config.vocab_size, runner.slots, runner.device)

    def requests() -> int:
        observer, engine.observer = engine.observer, EngineObserver()
        try:
            for index, params in enumerate(_WARMUP_REQUESTS):
                request = EngineRequest(f"warmup-{index}", [1, 2, 3], params, 2, 0, _DiscardSink())
                engine.submit(request, own=True)
                while engine.step():
                    pass
        finally:
            engine.observer = observer
            engine.stats = EngineStats(shapes_seen=engine.stats.shapes_seen)
        return len(_WARMUP_REQUESTS)

    def templates() -> int:  # without a prefix cache (prefix_cache_blocks=0) none can be loaded
        hot = (hot_prefixes or []) if engine.prefix_cache is not None else []
        return prefill_templates(engine, hot, prefill_budget_s, report)

    stages = (
        ("connections", lambda: open_connections(engine)),
        ("sampling", sampling),
        ("prefix_templates", templates),
        ("requests", requests),
    )
    for name, work in stages:
        try:
            seconds, device_seconds, items = clock.measure(work)
        except Exception as exc:
            report.failures.append({"stage": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        report.stages.append(StageTiming(name, seconds, items, device_seconds, *clock.last_span))
    if prefetcher is not None:  # still running when templates were deferred: READY does not wait
        summary = prefetcher.summary(origin)
        report.l3_prefetch = {**summary, **report.l3_prefetch}
        if summary["error"]:  # an unexpected exception (Redis errors are the store's counters, as without it)
            report.failures.append({"stage": "l3_prefetch", "error": summary["error"]})
        report.stages.append(
            StageTiming(
                "l3_prefetch",
                summary["seconds"],
                summary["blocks"],
                None,
                summary["start_s"],
                summary["end_s"],
            )
        )
    runner.clear()
    report.prompt_buckets = list(engine.prompt_buckets)
    report.kv_buckets = list(runner.kv_buckets)
    report.deferred = [f"{kind}:{bucket}" for kind, bucket in engine.deferred_shapes]
    report.cuda_graph_buckets = list(runner.graph_buckets)
    report.prefill_graph_buckets = list(runner.prefill_graphs.buckets)
    report.suffix_graph_buckets = list(runner.prefill_graphs.suffix_buckets)
    if report.compile:  # steps of compiled buckets that ran eagerly during warmup (a guard failed): 0
        report.compile["fallback_steps"] = runner.compile_fallbacks
    report.total_seconds = (time.perf_counter_ns() - started) / 1e9
    return report
