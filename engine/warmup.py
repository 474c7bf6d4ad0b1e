"""Warmup stage run in `initialize()` before the model reports READY.

It runs every kernel shape live traffic can reach: one prefill per prompt bucket and one decode
step per KV-length bucket (decode always covers every slot, so batch size adds no shape), the
sampling path, and finally whole requests through the engine's own admission, streaming and
finishing code (with metrics detached, so warmup never shows up as traffic). Each stage is
timed; the report is logged as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

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


@dataclass
class WarmupReport:
    enabled: bool
    device: str
    stages: list[StageTiming] = field(default_factory=list)
    prompt_buckets: list[int] = field(default_factory=list)
    kv_buckets: list[int] = field(default_factory=list)
    total_seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class _StageClock:
    """Wall time of a stage; synchronizes the GPU so queued kernels are counted."""

    def __init__(self, device: torch.device):
        self.device = device

    def measure(self, work: Callable[[], int]) -> tuple[float, int]:
        self._sync()
        started = time.perf_counter_ns()
        items = work()
        self._sync()
        return (time.perf_counter_ns() - started) / 1e9, items

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_warmup(engine: Engine, enabled: bool) -> WarmupReport:
    runner = engine.runner
    report = WarmupReport(enabled=enabled, device=str(runner.device))
    if not enabled:
        return report
    clock = _StageClock(runner.device)
    started = time.perf_counter_ns()

    def prefill_all() -> int:
        for bucket in engine.prompt_buckets:
            runner.prefill(0, [1] * min(bucket, runner.max_len - 1), bucket)
            engine.note_shape("prefill", bucket)
        return len(engine.prompt_buckets)

    def decode_all() -> int:
        tokens = torch.ones(runner.slots, dtype=torch.long, device=runner.device)
        for bucket in runner.kv_buckets:
            positions = torch.full((runner.slots,), bucket - 1, dtype=torch.long, device=runner.device)
            runner.decode(tokens, positions, bucket)
            engine.note_shape("decode", bucket)
        return len(runner.kv_buckets)

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

    stages = (
        ("prefill_buckets", prefill_all),
        ("decode_kv_buckets", decode_all),
        ("sampling", sampling),
        ("requests", requests),
    )
    for name, work in stages:
        seconds, items = clock.measure(work)
        report.stages.append(StageTiming(name, seconds, items))
    runner.cache.zero_()
    report.prompt_buckets = list(engine.prompt_buckets)
    report.kv_buckets = list(runner.kv_buckets)
    report.total_seconds = (time.perf_counter_ns() - started) / 1e9
    return report
