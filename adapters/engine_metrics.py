"""Prometheus metrics for the engine through the Python backend's MetricFamily API."""

from __future__ import annotations

import threading
from functools import partial

import triton_python_backend_utils as pb_utils

from adapters.counter_deltas import CounterDeltas
from adapters.stub_messages import SerializedMetric
from engine.observer import EngineObserver
from engine.warmup import WarmupReport
from scheduler.tiers import TierTable

KNOWN_TIERS = TierTable.defaults().names
TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
OVERHEAD_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01]


WARMUP_FAILURE_STAGES = (
    "plan", "device_prewarm", "compile", "prefill", "prefill_graph", "decode", "connections", "sampling",
    "prefix_templates", "requests", "l3_prefetch",
)  # fmt: skip


# a bucket whose prefill graph capture was its warm-up is counted under prefill_graphs
WARMED_SHAPE_STAGES = ("prefill_buckets", "prefill_graphs", "decode_kv_buckets")


class TritonEngineObserver(EngineObserver):
    def __init__(self, model: str, lock: threading.Lock):
        self.model = model
        self._lock = lock  # the process's message lock (adapters/stub_messages.py)
        family = pb_utils.MetricFamily
        self.steps = family("llm_engine_steps_total", "Engine forward steps by kind", family.COUNTER)
        self.step_requests = family(
            "llm_engine_step_requests_total",
            "Requests processed summed over steps (batch size sum)",
            family.COUNTER,
        )
        self.step_seconds = family(
            "llm_engine_step_seconds_total", "Time spent in forward steps", family.COUNTER
        )
        self.multi = family(
            "llm_engine_multi_request_decode_steps_total",
            "Decode steps that served >= 2 requests",
            family.COUNTER,
        )
        self.max_batch = family(
            "llm_engine_max_decode_batch", "Largest number of requests in one decode step", family.GAUGE
        )
        self.finished = family("llm_engine_requests_finished_total", "Finished requests", family.COUNTER)
        self.tokens = family(
            "llm_engine_generated_tokens_total", "Tokens returned to clients", family.COUNTER
        )
        self.new_shapes = family(
            "llm_engine_new_shapes_after_ready_total", "Kernel shapes first seen after READY", family.COUNTER
        )
        self.queue = family("llm_engine_queue_depth", "Requests waiting for a slot", family.GAUGE)
        self.active = family("llm_engine_active_requests", "Requests holding a slot", family.GAUGE)
        self.warmup_stage = family("llm_engine_warmup_stage_seconds", "Warmup stage duration", family.GAUGE)
        self.warmup_total = family("llm_engine_warmup_seconds", "Whole warmup duration", family.GAUGE)
        self.kv_bytes = family("llm_engine_kv_cache_bytes", "KV memory reserved at start", family.GAUGE)
        self.kv_used = family("llm_engine_kv_used_bytes", "KV memory holding live tokens", family.GAUGE)
        self.kv_pool_slots = family(
            "llm_engine_kv_pool_slots", "KV slots per length-class pool, by capacity in tokens", family.GAUGE
        )
        self.kv_single_pool = family(
            "llm_engine_kv_single_pool_bytes",
            "KV memory the same slots would reserve as one pool of the sequence limit",
            family.GAUGE,
        )
        self.warmup_failures = family(
            "llm_engine_warmup_failure_total",
            "Warmup steps that failed (lazy warm-up took over)",
            family.COUNTER,
        )
        self.warmup_shapes = family(
            "llm_engine_warmup_shapes", "Kernel shapes by warmup outcome", family.GAUGE
        )
        self.prefix_tokens = family(
            "llm_engine_prefix_cache_tokens_total",
            "Prompt tokens reused from the prefix cache or computed",
            family.COUNTER,
        )
        self.prefill_items = family(
            "llm_engine_warmup_prefill_items", "Hot prefixes loaded before READY or deferred", family.GAUGE
        )
        self.cache_events = family(
            "llm_engine_cache_total",
            "Cache tier counters: hit_blocks, evictions, hits, misses, checksum_failures, bytes_loaded, ...",
            family.COUNTER,
        )
        self.cache_state = family(
            "llm_engine_cache_state",
            "Cache tier state now: blocks held (l1, l2); key-directory keys and synced, 1 or 0 (exact, l3)",
            family.GAUGE,
        )
        self.tier_control = family(
            "llm_scheduler_tier_control", "Feedback-adapted tier weight and admission threshold", family.GAUGE
        )
        self.adaptations = family(
            "llm_scheduler_adaptations_total", "Feedback adaptations per tier and kind", family.COUNTER
        )
        self.ttft_hist = family(
            "llm_engine_ttft_seconds", "Engine-side time to first token per tier", family.HISTOGRAM
        )
        self.preemptions = family(
            "llm_engine_preemptions_total",
            "Running requests suspended for a more urgent one, by the suspended request's tier",
            family.COUNTER,
        )
        self.overhead = family(
            "llm_scheduler_overhead_seconds",
            "Scheduling time per request: admission, queueing, dispatch and preemption decisions",
            family.HISTOGRAM,
        )
        # Families are attributes on purpose: the backend rejects a Metric whose family was collected.
        self._metrics: dict[tuple, SerializedMetric] = {}
        self._batch_max = 0
        self._load = (-1, -1, -1)
        self._load_lock = threading.Lock()
        self.kv_bytes_per_token = 0
        self._cache_deltas = CounterDeltas()
        self._create_known_series()

    def _create_known_series(self) -> None:
        """Create the label sets traffic will use now: each first Metric() is an IPC round trip."""
        for kind in ("prefill", "decode"):
            for family in (self.steps, self.step_requests, self.step_seconds):
                self._metric(family, kind=kind)
            # at 0 from the start, so "stays 0 when warm" reads 0 rather than an absent series
            self._metric(self.new_shapes, kind=kind)
        for tier in KNOWN_TIERS:
            self._histogram(tier)
            self._histogram(tier, self.overhead, OVERHEAD_BUCKETS)
            self._metric(self.preemptions, tier=tier)
            self._metric(self.tokens, tier=tier)
            for status in ("stop", "length", "cancelled", "error", "cached"):
                self._metric(self.finished, tier=tier, status=status)
        for result in ("reused", "computed"):
            self._metric(self.prefix_tokens, result=result)
        for family in (self.multi, self.max_batch, self.queue, self.active, self.kv_used):
            self._metric(family)

    def _labels(self, **extra: str) -> dict[str, str]:
        return {"model": self.model, **extra}

    def _metric(self, family, **labels: str):
        return self._series(family, tuple(sorted(labels.items())), labels=self._labels(**labels))

    def _series(self, family, label_key: tuple, **create) -> SerializedMetric:
        key = (id(family), label_key)
        found = self._metrics.get(key)
        if found is None:
            with self._lock:
                found = self._metrics.get(key)
                if found is None:
                    found = self._metrics[key] = SerializedMetric(family.Metric(**create), self._lock)
        return found

    def on_step(self, kind: str, batch: int, seconds: float) -> None:
        self._metric(self.steps, kind=kind).increment(1)
        self._metric(self.step_requests, kind=kind).increment(batch)
        self._metric(self.step_seconds, kind=kind).increment(seconds)
        if kind == "decode":
            if batch > 1:
                self._metric(self.multi).increment(1)
            if batch > self._batch_max:
                self._metric(self.max_batch).set(batch)
                self._batch_max = batch  # after the message went: one that failed is sent again

    def on_first_token(self, tier: str, ttft_s: float) -> None:
        self._histogram(tier).observe(ttft_s)  # its _sum and _count series too

    def on_finish(self, tier: str, status: str, tokens: int) -> None:
        self._metric(self.finished, tier=tier, status=status).increment(1)
        if tokens:
            self._metric(self.tokens, tier=tier).increment(tokens)

    def on_prefix(self, reused_tokens: int, prompt_tokens: int) -> None:
        if reused_tokens:
            self._metric(self.prefix_tokens, result="reused").increment(reused_tokens)
        self._metric(self.prefix_tokens, result="computed").increment(prompt_tokens - reused_tokens)

    def on_adaptation(self, tier: str, kind: str, value: float) -> None:
        self._metric(self.tier_control, tier=tier, kind=kind).set(value)
        self._metric(self.adaptations, tier=tier, kind=kind).increment(1)

    def on_preemption(self, tier: str) -> None:
        self._metric(self.preemptions, tier=tier).increment(1)

    def on_scheduling(self, tier: str, seconds: float) -> None:
        self._histogram(tier, self.overhead, OVERHEAD_BUCKETS).observe(seconds)

    def on_cache_counters(self, counters: dict[tuple[str, str], float]) -> None:
        """Each counter's series is made when it is first reported, at 0 if nothing happened yet: a series
        made on its first increment hid that increment from rate() and increase() (a first checksum
        failure raised no alert), and a tier that never hit had no hit rate, where it has 0."""
        for (tier, counter), value in counters.items():
            self._metric(self.cache_events, tier=tier, counter=counter)
            self._cache_deltas.send((tier, counter), value, partial(self._count_cache, tier, counter))

    def _count_cache(self, tier: str, counter: str, delta: float) -> None:
        self._metric(self.cache_events, tier=tier, counter=counter).increment(delta)

    def on_cache_gauges(self, gauges: dict[tuple[str, str], float]) -> None:
        for (tier, gauge), value in gauges.items():
            self._metric(self.cache_state, tier=tier, gauge=gauge).set(value)

    def on_new_shape(self, kind: str, size: int) -> None:
        self._metric(self.new_shapes, kind=kind).increment(1)

    def on_load(self, queued: int, active: int, kv_tokens: int) -> None:
        """Called from the engine thread and the lookup threads: compared and sent under one lock, and
        noted as sent only once all three messages went (a failed one is sent again with the next load,
        else an idle engine would report its last busy queue for good, and a drain wait for it)."""
        with self._load_lock:
            if (queued, active, kv_tokens) == self._load:
                return
            self._load = (-1, -1, -1)
            self._metric(self.queue).set(queued)
            self._metric(self.active).set(active)
            self._metric(self.kv_used).set(kv_tokens * self.kv_bytes_per_token)
            self._load = (queued, active, kv_tokens)

    def _histogram(self, tier: str, family=None, buckets: list[float] = TTFT_BUCKETS):
        family = family or self.ttft_hist
        return self._series(family, (("tier", tier),), labels=self._labels(tier=tier), buckets=buckets)

    def record_warmup(self, report: WarmupReport, kv_bytes: int, kv_bytes_per_token: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        for failure in report.failures:
            self._metric(self.warmup_failures, stage=failure["stage"].split(":")[0]).increment(1)
        for stage in WARMUP_FAILURE_STAGES:
            self._metric(self.warmup_failures, stage=stage)
        warmed = sum(stage.items for stage in report.stages if stage.name in WARMED_SHAPE_STAGES)
        self._metric(self.warmup_shapes, outcome="warmed").set(warmed)
        self._metric(self.warmup_shapes, outcome="deferred").set(len(report.deferred))
        self._metric(self.prefill_items, outcome="loaded").set(report.prefill_loaded)
        self._metric(self.prefill_items, outcome="deferred").set(report.prefill_deferred)
        for stage in report.stages:
            self._metric(self.warmup_stage, stage=stage.name).set(stage.seconds)
        self._metric(self.warmup_total).set(report.total_seconds)
        self._metric(self.kv_bytes).set(kv_bytes)
        kv_plan = report.plan.get("kv", {})
        for pool in kv_plan.get("pools", []):
            self._metric(self.kv_pool_slots, capacity=str(pool["capacity"])).set(pool["slots"])
        if "single_pool_tokens" in kv_plan:
            self._metric(self.kv_single_pool).set(kv_plan["single_pool_tokens"] * kv_bytes_per_token)
