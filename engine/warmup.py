"""Warmup stage run in `initialize()` before the model reports READY.

With `compile` on, a first stage compiles the decode step per KV bucket with torch.compile, its
artifacts kept between restarts (engine/compile_cache.py). It then runs every kernel shape live
traffic can reach: one prefill per prompt bucket and one decode
step per KV-length bucket (decode always covers every slot, so batch size adds no shape), the
sampling path, and finally whole requests through the engine's own admission, streaming and
finishing code (with metrics detached, so warmup never shows up as traffic). Each stage is
timed; the report is logged as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from engine.compile_cache import CompileCache, compile_decode_buckets
from engine.engine import Engine
from engine.observer import EngineObserver, EngineStats
from engine.requests import EngineRequest
from engine.sampling import Sampler
from scheduler.messages import EngineRequestParams


_WARMUP_REQUESTS = (
    EngineRequestParams(max_tokens=3, stream=True, ignore_eos=True, tier="warmup"),
    EngineRequestParams(
        max_tokens=3, temperature=0.8, top_p=0.9, top_k=20, seed=1, stop=("zz",), tier="warmup"
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
    prefill_loaded: int = 0
    prefill_deferred: int = 0
    failures: list[dict] = field(default_factory=list)
    compile: dict = field(default_factory=dict)  # engine.compile_cache.compile_decode_buckets; {} when off
    total_seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class _StageClock:
    """Times a stage on the host clock (the device synchronized at both ends, so queued kernels count)
    and, on CUDA, also with CUDA events on the device's own clock: the two side by side calibrate
    each other (device time close to host time means the stage was GPU-bound, far below it means
    Python and launch overhead)."""

    def __init__(self, device: torch.device):
        self.device = device

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
        host_s = (time.perf_counter_ns() - started) / 1e9
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


def prefill_templates(
    engine: Engine, hot_prefixes: list[tuple[list[int], str]], budget_s: float, report: WarmupReport
) -> int:
    """Load hot prefixes (token ids, tenant) in priority order into the prefix cache within
    `budget_s` once the kernels are warm; the rest is left to the idle engine after READY."""
    deadline = time.perf_counter() + budget_s
    loaded = 0
    for index, (prompt, tenant) in enumerate(hot_prefixes):
        if time.perf_counter() >= deadline:
            engine.deferred_templates.extend(hot_prefixes[index:])
            break
        try:
            engine.prefill_template(prompt, tenant)
            loaded += 1
        except Exception as exc:  # one broken template never blocks the others
            report.failures.append(
                {"stage": f"prefix_templates:{index}", "error": f"{type(exc).__name__}: {exc}"}
            )
    report.prefill_loaded = loaded
    report.prefill_deferred = len(engine.deferred_templates)
    return loaded


def run_warmup(
    engine: Engine,
    enabled: bool,
    budget_s: float = 0.0,
    histogram: Mapping[int, int] | None = None,
    hot_prefixes: list[tuple[list[int], str]] | None = None,
    prefill_budget_s: float = 0.3,
    compile_cache: CompileCache | None = None,
) -> WarmupReport:
    """Warm every shape within `budget_s` (0: no budget); what does not fit is left in
    `engine.deferred_shapes` for the engine to warm in the background while idle. A failing step
    is recorded in the report and never fails the load (the shape is then warmed lazily).

    With `compile_cache`, the stage "compile" comes first (the decode warm-up and CUDA-graph capture
    then run the compiled step) and spends the same budget; a bucket it does not reach stays eager
    (it is never compiled later: a compile takes seconds and would stall live traffic)."""
    runner = engine.runner
    report = WarmupReport(enabled=enabled, device=str(runner.device))
    if not enabled:
        return report
    clock = _StageClock(runner.device)
    started = time.perf_counter_ns()
    deadline = time.perf_counter() + budget_s if budget_s > 0 else float("inf")
    spent = {"prefill": 0.0, "decode": 0.0}
    device_spent: dict[str, float | None] = {"prefill": None, "decode": None}
    counts = {"prefill": 0, "decode": 0}
    if compile_cache is not None:

        def compile_work() -> int:
            order = shape_order(tuple(runner.kv_buckets), histogram)
            report.compile = compile_decode_buckets(runner, compile_cache, order, deadline, report.failures)
            return len(report.compile["compiled_buckets"])

        try:
            seconds, device_seconds, items = clock.measure(compile_work)
            report.stages.append(StageTiming("compile", seconds, items, device_seconds))
        except Exception as exc:  # the runner keeps serving eager
            report.failures.append({"stage": "compile", "error": f"{type(exc).__name__}: {exc}"})
    for bucket in shape_order(engine.prompt_buckets, histogram):
        for kind in ("prefill", "decode"):
            if time.perf_counter() >= deadline:
                engine.deferred_shapes.append((kind, bucket))
                continue
            try:
                seconds, device_seconds, _ = clock.measure(lambda: runner.warm_shape(kind, bucket) or 1)
            except Exception as exc:  # lazy warm-up takes over for this shape
                report.failures.append({"stage": f"{kind}:{bucket}", "error": f"{type(exc).__name__}: {exc}"})
                continue
            engine.note_shape(kind, bucket)
            spent[kind] += seconds
            counts[kind] += 1
            if device_seconds is not None:
                device_spent[kind] = (device_spent[kind] or 0.0) + device_seconds
    report.stages.append(
        StageTiming("prefill_buckets", spent["prefill"], counts["prefill"], device_spent["prefill"])
    )
    report.stages.append(
        StageTiming("decode_kv_buckets", spent["decode"], counts["decode"], device_spent["decode"])
    )

    def sampling() -> int:
        logits = torch.randn(runner.slots, runner.model.config.vocab_size, device=runner.device)
        samplers = [Sampler(0.0, 1.0, 0, None, runner.device), Sampler(0.8, 0.9, 40, 0, runner.device)]
        for sampler in samplers:
            sampler.pick(logits[0])
        return len(samplers)

    def requests() -> int:
        observer, engine.observer = engine.observer, EngineObserver()
        try:
            for index, params in enumerate(_WARMUP_REQUESTS):
                engine.submit(EngineRequest(f"warmup-{index}", [1, 2, 3], params, 2, 0, _DiscardSink()))
                while engine.step():
                    pass
        finally:
            engine.observer = observer
            engine.stats = EngineStats(shapes_seen=engine.stats.shapes_seen)
        return len(_WARMUP_REQUESTS)

    def templates() -> int:
        return prefill_templates(engine, hot_prefixes or [], prefill_budget_s, report)

    for name, work in (("sampling", sampling), ("prefix_templates", templates), ("requests", requests)):
        try:
            seconds, device_seconds, items = clock.measure(work)
        except Exception as exc:
            report.failures.append({"stage": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        report.stages.append(StageTiming(name, seconds, items, device_seconds))
    runner.cache.zero_()
    report.prompt_buckets = list(engine.prompt_buckets)
    report.kv_buckets = list(runner.kv_buckets)
    report.deferred = [f"{kind}:{bucket}" for kind, bucket in engine.deferred_shapes]
    report.cuda_graph_buckets = list(runner.graph_buckets)
    if report.compile:  # steps of compiled buckets that ran eagerly during warmup (a guard failed): 0
        report.compile["fallback_steps"] = runner.compile_fallbacks
    report.total_seconds = (time.perf_counter_ns() - started) / 1e9
    return report
