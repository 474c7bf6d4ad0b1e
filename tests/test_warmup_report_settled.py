"""The warmup job's closing cache-tier report must include what the job itself just filled (the engine
publishes its cache figures at most once a second: read as the last answer arrives, they did not)."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import numpy as np

from client import warmup_job as wj
from client.metrics import metric_total, scrape_metrics
from tests.conftest import wait_for


def l1_miss_blocks(metrics_url: str) -> float:
    return metric_total(
        scrape_metrics(metrics_url), "llm_engine_cache_total", tier="l1", counter="miss_blocks"
    )


def settled(metrics_url: str) -> float:
    """L1 miss blocks once the engine has published everything (two scrapes 1.5 s apart agree)."""
    seen: list[float] = []

    def stable() -> bool:
        seen.append(l1_miss_blocks(metrics_url))
        return len(seen) >= 2 and seen[-1] == seen[-2]

    assert wait_for(stable, timeout_s=30, interval_s=1.5)
    return seen[-1]


def test_job_report_includes_the_blocks_this_job_filled(
    tmp_path: Path, grpc_url: str, metrics_url: str
) -> None:
    before = settled(metrics_url)
    nonce = time.time_ns()
    log = tmp_path / "q.jsonl"
    prompts = [f"A fresh question about refunds number {i} ({nonce}) with some more words" for i in range(3)]
    log.write_text("".join(json.dumps({"prompt": p, "tenant": "acme"}) + "\n" for p in prompts))
    options = wj.JobOptions(
        log=log,
        templates=None,
        metrics_url=metrics_url,
        selection=wj.SelectionConfig(clusters=1, per_cluster=3, edge_cases=False),
        send=wj.SendConfig(url=grpc_url, concurrency=3, progress=False),
    )
    out, err = io.StringIO(), io.StringIO()

    def embed(texts):
        return np.ones((len(texts), 4), dtype="float32")

    assert wj.run_job(options, out, err, embed=embed) == 0, err.getvalue()
    report = out.getvalue().split("cache tiers after the warmup")[1]
    l1 = next(line for line in report.splitlines() if line.startswith("l1 "))
    printed_misses = float(re.split(r"\s{2,}", l1)[2])
    after = settled(metrics_url)
    assert after > before  # the job's fresh prompts missed L1 and were stored there
    assert printed_misses == after, (
        f"the job reported {printed_misses:g} L1 miss blocks; the engine had {before:g} before the job "
        f"and {after:g} once it published the job's own"
    )
