"""Reading Triton's Prometheus endpoint (tests and benchmarks read engine counters through it)."""

from __future__ import annotations

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
    """GET Triton's /metrics and parse it (see parse_metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode("utf-8", "replace"))


def metric_total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for key, value in metrics.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total
