"""Re-warm trigger: reload the engine model so its initialize() runs the warmup stage again.

Triton (explicit model control) loads the new instance next to the serving one and switches over
only once it is READY, i.e. warm; requests in flight finish on the old instance. The warmup
report is read back from the engine's Prometheus metrics, the same figures the log reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient

from client.metrics import scrape_metrics

REPORT_METRICS = (
    "llm_engine_warmup_seconds",
    "llm_engine_warmup_stage_seconds",
    "llm_engine_warmup_shapes",
    "llm_engine_warmup_prefill_items",
    "llm_engine_warmup_failure_total",
    "llm_engine_kv_cache_bytes",
)


@dataclass
class RewarmResult:
    model: str
    reload_seconds: float
    report: dict[str, float] = field(default_factory=dict)
    report_error: str | None = None  # the reload succeeded, but its report could not be read


def rewarm(url: str, metrics_url: str, model: str = "llm_engine", timeout_s: float = 600.0) -> RewarmResult:
    client = grpcclient.InferenceServerClient(url)
    started = time.perf_counter()
    client.load_model(model, client_timeout=timeout_s)
    if not client.is_model_ready(model, client_timeout=timeout_s):
        raise RuntimeError(f"{model} is not ready after the reload; see the server log")
    elapsed = time.perf_counter() - started
    try:  # the engine is reloaded and warm: a metrics port that cannot be read only loses the report
        metrics = scrape_metrics(metrics_url)
    except (OSError, ValueError) as exc:
        return RewarmResult(model, elapsed, {}, f"cannot read the warmup report at {metrics_url}: {exc}")
    report = {key: value for key, value in metrics.items() if key.split("{")[0] in REPORT_METRICS}
    return RewarmResult(model, elapsed, report)
