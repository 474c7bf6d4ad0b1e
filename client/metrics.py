"""Reading Triton's Prometheus endpoint (tests and benchmarks read engine counters through it)."""

from __future__ import annotations

import http.client
import urllib.request


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{label="v",...}': value} (labels kept as written)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            end = line.rindex("}")
            key, rest = line[: end + 1], line[end + 1 :].split()
        else:
            key, *rest = line.split()
        if not rest:
            continue
        try:
            out[key] = float(rest[0])
        except ValueError:
            continue
    return out


def scrape_metrics(metrics_url: str, timeout: float = 10.0) -> dict[str, float]:
    """GET Triton's /metrics and parse it (see parse_metrics). A port that does not answer HTTP (the
    gRPC port typed for the metrics one) raises OSError, as an unreachable one does: callers catch one
    kind of error, not http.client's own."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
            return parse_metrics(resp.read().decode("utf-8", "replace"))
    except http.client.HTTPException as exc:
        raise OSError(f"{metrics_url} did not answer HTTP: {type(exc).__name__}: {exc}") from exc


def metric_total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for key, value in metrics.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


# What the server holds in flight: the engine's queue and slots, and requests Triton holds for a step (a
# stream's last windows wait there for the detokenizer after the engine has finished).
IN_FLIGHT_METRICS = (
    "llm_engine_queue_depth",
    "llm_engine_active_requests",
    "nv_inference_pending_request_count",
)


def holds_requests(metrics: dict[str, float]) -> bool:
    """Whether a scrape shows any request still in flight (IN_FLIGHT_METRICS)."""
    return any(metric_total(metrics, name) > 0 for name in IN_FLIGHT_METRICS)


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count} observed between two scrapes, summed over label sets."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if key.split("{")[0] != f"{name}_bucket" or 'le="' not in key:
            continue
        le = key.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value - before.get(key, 0.0)
    return buckets


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Upper bound of the bucket holding quantile `q` (an upper bound of the true quantile); None when
    nothing was observed, inf when it lies beyond the last finite bucket."""
    if not buckets:
        return None
    total = max(buckets.values())
    if total <= 0:
        return None
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("inf")
