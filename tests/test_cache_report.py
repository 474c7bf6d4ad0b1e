"""`python -m client cache`: the tiers' figures read from a metrics scrape."""

from __future__ import annotations

import http.server
import io
import json
import threading

import pytest

from client.__main__ import main
from client.cache_report import format_rows, tier_rows
from client.metrics import parse_metrics

SAMPLES = [  # (family, tier, counter or gauge, value) as the engine exports them
    ("total", "l1", "hit_blocks", 30), ("total", "l1", "miss_blocks", 90), ("total", "l1", "evictions", 12),
    ("total", "l1", "seconds_saved", 0.25),
    ("state", "l1", "blocks", 64), ("state", "l1", "capacity_blocks", 256),
    ("total", "l3", "hits", 40), ("total", "l3", "misses", 1), ("total", "l3", "checksum_failures", 2),
    ("total", "l3", "chains_loaded", 4), ("total", "l3", "chains_partial", 1),
    ("total", "l3", "chains_missing", 6), ("total", "l3", "chains_recompute", 9),
    ("total", "l3", "incompatible", 1), ("total", "l3", "full_refusals", 3),
    ("total", "l3", "readonly_refusals", 1),
    ("total", "l3", "decision_load", 2), ("total", "l3", "decision_recompute", 9),
    ("total", "l3", "decision_explore", 1), ("total", "l3", "quota_evictions", 5),
    ("total", "exact", "hits", 3), ("total", "exact", "misses", 1), ("total", "exact", "errors", 7),
    ("total", "exact", "quota_evictions", 11),
]  # fmt: skip
SCRAPE = (
    "# HELP llm_engine_cache_total cache counters\n"
    + "".join(
        f'llm_engine_cache_{family}{{model="llm_engine",version="1",tier="{tier}",'
        f'{"counter" if family == "total" else "gauge"}="{name}"}} {value}\n'
        for family, tier, name, value in SAMPLES
    )
    + 'nv_inference_count{model="llm"} 99\n'
)


def test_each_reported_tier_gets_its_figures_and_absent_tiers_none():
    rows = {row.tier: row for row in tier_rows(parse_metrics(SCRAPE))}
    assert set(rows) == {"l1", "l3", "exact"}  # no L2 or semantic samples: not running
    l1, l3, exact = rows["l1"], rows["l3"], rows["exact"]
    assert (l1.hits, l1.misses, l1.held, l1.capacity, l1.fill, l1.evictions) == (30, 90, 64, 256, 0.25, 12)
    assert l1.seconds_saved == 0.25 and l1.hit_rate == 0.25  # blocks: 30 served of 120 asked
    # L3 over chains asked: 5 served of 20 (blocks loaded and store-level misses are not the measure)
    assert (l3.hits, l3.misses, l3.hit_rate, l3.unit) == (5, 15, 0.25, "chains")
    assert (l3.bad_values, l3.refused_writes, l3.capacity, l3.evictions) == (3, 4, None, 5)  # quota trims
    assert (exact.hit_rate, exact.errors, exact.unit, exact.evictions) == (0.75, 7, "requests", 11)
    assert (exact.seconds_saved, exact.seconds_lost) == (None, None)  # it times no recompute: not "0.000"
    assert l3.decisions == {"load": 2, "recompute": 9, "explore": 1} and l1.decisions is None


def test_the_table_shows_fill_and_hit_rate():
    table = format_rows(tier_rows(parse_metrics(SCRAPE)))
    l1 = next(line for line in table.splitlines() if line.startswith("l1 "))
    assert "64 / 256 (25%)" in l1 and "30 blocks" in l1
    assert "75.0%" in next(line for line in table.splitlines() if line.startswith("exact "))
    assert "l3 chains Redis held: 2 loaded, 9 recomputed" in table and "1 loaded to re-measure" in table
    assert "pageable" not in table


def test_an_l2_that_could_not_be_locked_is_called_out():
    scrape = SCRAPE + (
        'llm_engine_cache_state{model="llm_engine",version="1",tier="l2",gauge="page_locked"} 0\n'
        'llm_engine_cache_state{model="llm_engine",version="1",tier="l2",gauge="capacity_blocks"} 8\n'
    )  # no "blocks" gauge: the table still formats
    rows = {row.tier: row for row in tier_rows(parse_metrics(scrape))}
    assert rows["l2"].page_locked == 0 and rows["l1"].page_locked is None
    assert "l2 is pageable: CUDA refused to lock its pages" in format_rows(list(rows.values()))


def test_an_unreachable_server_is_an_error_not_an_empty_table():
    out, err = io.StringIO(), io.StringIO()
    assert main(["cache", "--metrics-url", "http://127.0.0.1:9/metrics"], out=out, err=err) == 1
    assert "cannot read" in err.getvalue() and out.getvalue() == ""


@pytest.fixture
def metrics_url():
    """A /metrics endpoint that serves SCRAPE."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(SCRAPE.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()


def test_json_output_is_one_object_per_tier(metrics_url):
    out = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--json"], out=out, err=io.StringIO()) == 0
    report = json.loads(out.getvalue())
    tiers = {row["tier"]: row for row in report["tiers"]}
    assert tiers["l1"]["fill"] == 0.25 and tiers["exact"]["hit_rate"] == 0.75 and report["redis"] is None


def test_with_a_redis_url_the_report_shows_how_full_redis_is(metrics_url, redis_server):
    out = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--redis-url", redis_server], out=out) == 0
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("redis: ") and "policy volatile-lru" in last and "keys evicted" in last
    assert last.endswith("; standalone")
    out = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--redis-url", redis_server, "--json"], out=out) == 0
    memory = json.loads(out.getvalue())["redis"]
    assert memory["maxmemory"] > 0 and memory["used_bytes"] > 0  # the launcher's Redis is bounded
    assert memory["topology"] == "standalone"
    err = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--redis-url", "redis://127.0.0.1:9/0"], err=err) == 1
    assert "cannot read redis://127.0.0.1:9/0" in err.getvalue()
