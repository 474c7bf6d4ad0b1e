"""Prometheus counters of the scheduler step's prefix tokenizer, through pb_utils.MetricFamily."""

from __future__ import annotations

import time
from dataclasses import asdict

import triton_python_backend_utils as pb_utils

from adapters.counter_deltas import CounterDeltas

from scheduler.tokenize import PrefixTokenStats

PUBLISH_EVERY_S = 1.0  # each increment is an IPC round trip to the server: not one per request


class PrefixTokenizerMetrics:
    """`llm_scheduler_prefix_tokenizer_total{result=hits|misses|verified|mismatches}`, published from
    the step's own thread at most once a second (the next request after that carries the update)."""

    def __init__(self, model: str, clock=time.monotonic):
        family = pb_utils.MetricFamily
        self.family = family(
            "llm_scheduler_prefix_tokenizer_total",
            "Long prompts whose shared text prefix was reused (hits) or encoded (misses); composed ids "
            "checked against a whole encode (verified) and checks that failed (mismatches: reuse off)",
            family.COUNTER,
        )
        self.clock = clock
        self._series = {
            name: self.family.Metric(labels={"model": model, "result": name})
            for name in asdict(PrefixTokenStats())
        }
        self._published = CounterDeltas()
        self._due = 0.0

    def publish(self, stats: PrefixTokenStats) -> None:
        now = self.clock()
        if now < self._due:
            return
        self._due = now + PUBLISH_EVERY_S
        for name, value in asdict(stats).items():
            self._published.send(name, value, self._series[name].increment)
