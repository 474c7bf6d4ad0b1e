"""The warmup job (client/warmup_job.py): selection on a fixed log, log parsing, CLI modes, dry run, and a
real run against the live server that must show up in the engine's warmup-tier counter."""

from __future__ import annotations

import dataclasses

import hashlib
import io
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from client import warmup_job as wj
from client.__main__ import main
from client.generate import generate
from client.metrics import metric_total, scrape_metrics
from tests.conftest import wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = REPO_ROOT / "models" / "tiny-llama" / "tokenizer.json"
TOPICS = ("refund", "shipping", "password")


def topic_embed(texts: list[str]) -> np.ndarray:
    """Deterministic stand-in for MiniLM: one axis per topic keyword plus a small jitter from SHA-256, so
    the clusters of the fixed log are known exactly (the real model is exercised by the CLI tests)."""
    out = np.zeros((len(texts), 8), dtype=np.float32)
    for row, text in enumerate(texts):
        axis = next(i for i, topic in enumerate(TOPICS) if topic in text.lower())
        jitter = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.uint8) / 255.0
        out[row] = jitter * 0.02
        out[row, axis] += 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


# (tenant, prompt, count): the head of each topic, then a tail of rare prompts (38 distinct in all)
HEAD = [
    ("acme", "Refund for order 1?", 30),
    ("acme", "Shipping to Berlin?", 20),
    ("globex", "Refund for order 1?", 12),  # same text, other tenant: its own entry
    ("acme", "Refund for order 2?", 9),
    ("globex", "Shipping to Lyon?", 8),
    ("globex", "Shipping to Osaka?", 7),
    ("globex", "Reset my password?", 6),
    ("acme", "Reset my password please", 5),
]
TAIL = [
    ("acme" if i % 2 else "globex", text.format(i), 1 + i % 3)
    for text in ("Refund for order {}00?", "Shipping to depot {}?", "Password hint number {}?")
    for i in range(10)
]


def fixed_log() -> list[wj.LogRecord]:
    """Counts as in HEAD and TAIL, interleaved; 4 of acme's 30 refund requests differ only in whitespace."""
    remaining = {(t, p): n for t, p, n in HEAD + TAIL}
    records: list[wj.LogRecord] = []
    while any(remaining.values()):
        for (tenant, prompt), left in remaining.items():
            if left:
                variant = (
                    prompt.replace(" ", "  ", 1) if prompt == "Refund for order 1?" and left <= 4 else prompt
                )
                records.append(wj.LogRecord(variant if tenant == "acme" else prompt, tenant))
                remaining[(tenant, prompt)] = left - 1
    return records


TEMPLATES = [
    wj.SloTemplate("checkout", "acme", "You are the checkout assistant. Question:"),
    wj.SloTemplate("dup_of_log", "acme", "Reset my   password please"),  # already picked from the log
    wj.SloTemplate("other_tenant", "initech", "Reset my password please"),  # same text, other tenant: kept
]


def key(item: wj.WarmupItem) -> tuple[object, ...]:
    return (item.prompt, item.tenant, item.reason, item.frequency, item.cluster, item.detail)


@pytest.mark.parametrize("clusters", [3, None], ids=["k=3", "k=auto"])
def test_selection_on_fixed_log_is_exactly_as_specified(clusters: int | None) -> None:
    config = wj.SelectionConfig(top_percent=5.0, per_cluster=2, clusters=clusters, edge_cases=False)
    items = wj.select_warmup_set(fixed_log(), TEMPLATES, embed=topic_embed, config=config)
    # 38 distinct (tenant, prompt): top 5% = ceil(1.9) = 2; clusters numbered by first appearance
    # (refund 0, shipping 1, password 2); each cluster's top 2, minus those already taken (no refill)
    assert [key(i) for i in items] == [
        ("Refund for order 1?", "acme", "top_frequency", 30, 0, ""),
        ("Shipping to Berlin?", "acme", "top_frequency", 20, 1, ""),
        ("Refund for order 1?", "globex", "cluster_top", 12, 0, ""),
        ("Shipping to Lyon?", "globex", "cluster_top", 8, 1, ""),
        ("Reset my password?", "globex", "cluster_top", 6, 2, ""),
        ("Reset my password please", "acme", "cluster_top", 5, 2, ""),
        ("You are the checkout assistant. Question:", "acme", "slo_template", 0, None, "checkout"),
        ("Reset my password please", "initech", "slo_template", 0, None, "other_tenant"),
    ]


def test_no_duplicates_and_whitespace_variants_counted_together() -> None:
    items = wj.select_warmup_set(
        fixed_log(), TEMPLATES, embed=topic_embed,
        config=wj.SelectionConfig(top_percent=50, per_cluster=5, clusters=3, edge_cases=True),
    )  # fmt: skip
    keys = [(i.tenant, wj.normalize_prompt(i.prompt)) for i in items]
    assert len(keys) == len(set(keys))
    refund = [i for i in items if i.tenant == "acme" and i.prompt.startswith("Refund")]
    # the most frequent raw form is sent, the count covers every whitespace variant
    assert refund[0].prompt == "Refund for order 1?" and refund[0].frequency == 30
    assert {i.tenant for i in items} == {"acme", "globex", "initech"}


def test_top_percent_rounds_up_and_per_cluster_zero() -> None:
    config = wj.SelectionConfig(top_percent=10, per_cluster=0, clusters=3, edge_cases=False)
    items = wj.select_warmup_set(fixed_log(), [], embed=topic_embed, config=config)
    assert [(i.prompt, i.tenant) for i in items] == [  # ceil(3.8) = 4
        ("Refund for order 1?", "acme"), ("Shipping to Berlin?", "acme"),
        ("Refund for order 1?", "globex"), ("Refund for order 2?", "acme"),
    ]  # fmt: skip


def test_edge_cases() -> None:
    long_prompt = "Refund question with a very long body: " + "details " * 50
    records = [*fixed_log(), wj.LogRecord(long_prompt, "globex")]
    config = wj.SelectionConfig(
        top_percent=0, per_cluster=0, clusters=3, edge_cases=True, max_prompt_tokens=500
    )
    items = wj.select_warmup_set(records, [], embed=topic_embed, config=config)
    edges = {i.detail: i for i in items}
    assert all(i.reason == "edge_case" for i in items)
    assert list(edges) == ["longest_seen", "near_limit", "very_short", "non_ascii"]
    assert edges["longest_seen"].prompt == long_prompt and edges["longest_seen"].tenant == "globex"
    near = wj.utf8_token_bound(edges["near_limit"].prompt)
    assert 450 - 10 <= near <= 450  # 90% of the limit, never over it
    assert len(edges["very_short"].prompt) <= 3
    assert not edges["non_ascii"].prompt.isascii()
    assert edges["near_limit"].tenant == "acme"  # synthetic cases go to the busiest tenant


def test_the_near_limit_prompt_holds_only_its_tenants_text() -> None:
    """Sent as the busiest tenant, it is built from that tenant's prompts only: another tenant's text
    would be cached under the busiest tenant's keys, beyond the reach of forget-tenant."""
    records = [wj.LogRecord("Acme question about refunds", "acme")] * 10 + [
        wj.LogRecord("GLOBEX-CONFIDENTIAL refund memo draft", "globex")
    ] * 3
    config = wj.SelectionConfig(clusters=1, edge_cases=True, max_prompt_tokens=200)
    near = next(i for i in wj.select_warmup_set(records, [], embed=topic_embed, config=config)
                if i.detail == "near_limit")  # fmt: skip
    assert near.tenant == "acme" and "Acme question" in near.prompt and "GLOBEX" not in near.prompt


def test_prompts_over_the_limit_are_left_out() -> None:
    over = wj.LogRecord("Refund " + "x" * 600, "acme")
    records = [over] * 50 + fixed_log()
    config = wj.SelectionConfig(clusters=3, edge_cases=True, max_prompt_tokens=500)
    selection = wj.select_from_counts(wj.count_prompts(records), [], embed=topic_embed, config=config)
    assert over.prompt not in {i.prompt for i in selection.items}
    assert selection.too_long == 1


def test_malformed_lines_are_skipped_and_counted() -> None:
    lines = [
        '{"prompt": "Refund for order 1?", "tenant": "acme", "ts": "2024-06-11T08:00:00Z"}',
        "not json at all",
        "",
        "[1, 2]",
        '{"tenant": "acme"}',
        '{"prompt": "   ", "tenant": "acme"}',
        '{"prompt": "ok", "tenant": "bad tenant!"}',
        '{"prompt": "Shipping to Berlin?"}',
        '{"prompt": "Shipping to Berlin?", "org": "globex"',
        '{"prompt": "My parcel \\ud83d", "tenant": "acme"}',  # half an emoji: a logger cut UTF-16 text
        "[" * 100_000,  # nested too deep for the parser: RecursionError, not a JSON error
    ]
    log = wj.parse_query_log(lines)
    assert [(p.text, p.tenant, p.frequency) for p in log.stats] == [
        ("Refund for order 1?", "acme", 1), ("Shipping to Berlin?", "default", 1),
    ]  # fmt: skip
    assert log.records == 2
    assert [m.line_no for m in log.malformed] == [2, 4, 5, 6, 7, 9, 10, 11]
    assert log.total_lines == 10
    assert "not valid JSON" in log.malformed[0].reason and "JSON object" in log.malformed[1].reason
    assert "tenant" in log.malformed[4].reason
    assert "UTF-8" in log.malformed[6].reason and "nested too deep" in log.malformed[7].reason
    text = "\n".join(log.describe_malformed("q.jsonl", shown=2))
    assert "q.jsonl:2: skipped" in text and "and 6 more" in text and "skipped 8 malformed of 10" in text
    assert [p.tenant for p in wj.parse_query_log(lines[7:8], tenant_field="org").stats] == ["default"]


def test_templates_file_is_validated(tmp_path: Path) -> None:
    shipped = wj.load_templates(REPO_ROOT / "data" / "slo_templates.yaml")
    assert 3 <= len(shipped) <= 5 and all(t.tenant and t.scenario and t.prompt for t in shipped)
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenarios:\n  - scenario: x\n    tenant: 'no spaces allowed'\n    prompt: hi\n")
    with pytest.raises(ValueError, match=r"scenarios\[0\]: 'tenant'"):
        wj.load_templates(bad)


def _write_log(path: Path, records: list[wj.LogRecord], extra: list[str] = ()) -> Path:
    import json

    lines = [
        json.dumps({"prompt": r.prompt, "tenant": r.tenant, "ts": "2024-06-11T08:00:00Z"}) for r in records
    ]
    path.write_text("\n".join([*lines, *extra]) + "\n", encoding="utf-8")
    return path


class _NoSession:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("the dry run opened a stream to the server")


def test_dry_run_sends_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wj, "StreamingSession", _NoSession)
    log = _write_log(tmp_path / "q.jsonl", fixed_log(), extra=["{broken"])
    options = wj.JobOptions(
        log=log, templates=None, dry_run=True,
        selection=wj.SelectionConfig(clusters=3, edge_cases=True),
        send=wj.SendConfig(url="localhost:1", progress=False),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(options, out, err, embed=topic_embed) == 0
    assert "dry run: nothing sent" in out.getvalue() and "Refund for order 1?" in out.getvalue()
    assert "skipped 1 malformed" in err.getvalue()


def test_the_summary_names_a_clustering_cap_only_when_one_was_hit(tmp_path: Path) -> None:
    """One prompt logged by two tenants is one text to cluster: every text clustered, no cap to name."""
    records = [wj.LogRecord(f"Where is my refund {i}?", t) for i in range(4) for t in ("acme", "globex")]
    options = wj.JobOptions(
        log=_write_log(tmp_path / "q.jsonl", records), templates=None, dry_run=True,
        selection=wj.SelectionConfig(clusters=2), send=wj.SendConfig(url="localhost:1", progress=False),
    )  # fmt: skip
    out = io.StringIO()
    assert wj.run_job(options, out, io.StringIO(), embed=topic_embed) == 0
    assert "8 distinct prompts; selected" in out.getvalue()
    capped = dataclasses.replace(options, selection=wj.SelectionConfig(clusters=2, max_embedded=2))
    out = io.StringIO()
    assert wj.run_job(capped, out, io.StringIO(), embed=topic_embed) == 0
    assert "8 distinct prompts, the 2 most frequent clustered" in out.getvalue()


def test_cli_dry_run_on_the_shipped_log(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The committed log and templates through the real CLI and the real MiniLM embedder."""
    monkeypatch.setattr(wj, "StreamingSession", _NoSession)
    data = REPO_ROOT / "data"
    argv = ["warmup", "--log", str(data / "query_log.jsonl"), "--templates", str(data / "slo_templates.yaml"),
            "--edge-cases", "--dry-run", "--url", "localhost:1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing sent" in out
    assert out.count("| top_frequency ") == 20  # 391 distinct prompts -> ceil(19.55)
    assert out.count("| slo_template ") == 4 and out.count("| edge_case ") == 4
    assert main([*argv, "--max-items", "5"]) == 0  # the cap: 5 log prompts, templates and edge cases stay
    captured = capsys.readouterr()
    assert out.count("| top_frequency ") + out.count("| cluster_top ") > 5
    assert captured.out.count("| top_frequency ") + captured.out.count("| cluster_top ") == 5
    assert captured.out.count("| slo_template ") == 4 and "past --max-items 5" in captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["warmup"], "one of the arguments --rewarm --log is required"),
        (["warmup", "--rewarm", "--log", "q.jsonl"], "not allowed with argument"),
        (["warmup", "--rewarm", "--dry-run"], "--dry-run only apply to the warmup job"),
        (["warmup", "--log", "q.jsonl", "--clusters", "many"], "--clusters must be 'auto'"),
        (["warmup", "--log", "q.jsonl", "--max-items", "lots"], "--max-items must be 'none'"),
        (["warmup", "--rewarm", "--max-items", "5"], "--max-items only apply to the warmup job"),
    ],
)
def test_cli_modes_are_exclusive(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_live_job_sends_at_warmup_tier(grpc_url: str, metrics_url: str) -> None:
    """A small real run: templates, log picks and edge cases (near-limit included, sized with the served
    model's tokenizer) all succeed, and the engine counts each one as a finished warmup-tier request."""
    count_tokens = wj.token_counter(TOKENIZER)
    nonce = str(time.time_ns())  # fresh prompts, so no response cache can answer them without the engine
    records = [wj.LogRecord(f"{r.prompt} ({nonce})", r.tenant) for r in fixed_log()]
    templates = [
        wj.SloTemplate("checkout", "initech", f"You are the checkout assistant ({nonce}). Question:")
    ]
    config = wj.SelectionConfig(clusters=3, per_cluster=1, edge_cases=True)
    items = wj.select_warmup_set(
        records, templates, embed=topic_embed, config=config, count_tokens=count_tokens
    )
    assert {i.reason for i in items} == set(wj.REASONS)

    before = metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", tier="warmup")
    outcomes = wj.send_warmup_set(
        items, wj.SendConfig(url=grpc_url, concurrency=3, progress=False), io.StringIO()
    )
    assert [o.error for o in outcomes if not o.ok] == []
    assert len(outcomes) == len(items) and all(o.sent for o in outcomes)
    deadline, grown = time.monotonic() + 10, 0.0
    while time.monotonic() < deadline:
        after = metric_total(scrape_metrics(metrics_url), "llm_engine_requests_finished_total", tier="warmup")
        grown = after - before
        if grown >= len(items):
            break
        time.sleep(0.2)
    assert grown == len(items)
    rows = {row[0]: row for row in wj.summary_rows(outcomes)}
    assert rows["all"][1:4] == [len(items), len(items), 0]


def test_live_repeat_runs_prefill_again_and_fill_the_response_cache(grpc_url: str, metrics_url: str) -> None:
    """Warmup requests never read the response caches, so a repeat run (or a new replica sharing Redis)
    still prefills; by default (fill_response_cache, greedy with cache=refresh) they keep their answers
    there, which a greedy client asking as many tokens or fewer is then served from. The spec has the job
    fill the response caches; before `refresh` it could fill them only by being answered from them on a
    repeat.
    Unseeded warmup (--no-fill-response-cache) keeps nothing there."""

    def total(name: str, **labels: str) -> float:
        return metric_total(scrape_metrics(metrics_url), name, **labels)

    def cached(tier: str) -> float:
        return total("llm_engine_requests_finished_total", tier=tier, status="cached")

    nonce = str(time.time_ns())
    filled = [wj.WarmupItem(f"Where is my order {nonce}-{i}?", "acme", wj.REASON_TOP, 1, 0) for i in range(3)]
    sampled = [wj.WarmupItem(f"Where is parcel {nonce}-{i}?", "acme", wj.REASON_TOP, 1, 0) for i in range(3)]
    warm_cached, stores = cached("warmup"), total("llm_engine_cache_total", tier="exact", counter="stores")
    for items, fill in ((sampled, False), (sampled, False), (filled, True), (filled, True)):
        config = wj.SendConfig(url=grpc_url, progress=False, fill_response_cache=fill)
        assert all(o.ok for o in wj.send_warmup_set(items, config, io.StringIO()))
    assert cached("warmup") == warm_cached  # no warmup request was answered from a cache

    def stored() -> float:
        """Stores so far: the writes are asynchronous, and an engine publishes its cache counters as it
        steps (at most once a second), so a request that touches no response cache makes it step."""
        generate(grpc_url, f"a step {nonce}", sampling={"max_tokens": 1}, cache="kv-only")
        return total("llm_engine_cache_total", tier="exact", counter="stores") - stores

    assert wait_for(lambda: stored() >= 2 * len(filled), interval_s=0.5)  # both filled runs wrote them all
    greedy = {"max_tokens": wj.SendConfig(url="").max_tokens, "temperature": 0.0}
    served = cached("standard")
    generate(grpc_url, filled[0].prompt, sampling=greedy, tenant="acme")
    assert wait_for(lambda: cached("standard") == served + 1)  # answered from what the warmup kept
    generate(grpc_url, filled[1].prompt, sampling={**greedy, "max_tokens": 2}, tenant="acme")
    assert wait_for(lambda: cached("standard") == served + 2)  # and a client asking fewer tokens, too
    generate(grpc_url, sampled[0].prompt, sampling=greedy, tenant="acme")  # unseeded warmup kept nothing
    assert cached("standard") == served + 2

    # a run with fewer tokens refreshes the prefill but does not cut the kept answers down to its budget
    def decided() -> float:  # answers written, or not written since the entry there serves more
        return stored() + total("llm_engine_cache_total", tier="exact", counter="kept")

    before = decided()
    short = wj.SendConfig(url=grpc_url, progress=False, max_tokens=2)
    assert all(o.ok for o in wj.send_warmup_set(filled, short, io.StringIO()))
    assert wait_for(lambda: decided() >= before + len(filled), interval_s=0.5)
    for item in filled:
        generate(grpc_url, item.prompt, sampling=greedy, tenant="acme")
    assert wait_for(lambda: cached("standard") == served + 2 + len(filled))


def test_live_job_reports_the_cache_tiers_it_filled(tmp_path: Path, grpc_url: str, metrics_url: str) -> None:
    nonce = str(time.time_ns())
    log = _write_log(
        tmp_path / "q.jsonl", [wj.LogRecord(f"{r.prompt} ({nonce})", r.tenant) for r in fixed_log()]
    )
    options = wj.JobOptions(
        log=log, templates=None, metrics_url=metrics_url,
        selection=wj.SelectionConfig(clusters=2, per_cluster=1),
        send=wj.SendConfig(url=grpc_url, concurrency=2, progress=False),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(options, out, err, embed=topic_embed) == 0, err.getvalue()
    report = out.getvalue().split("cache tiers after the warmup")[1]
    l1 = next(line for line in report.splitlines() if line.startswith("l1 "))
    assert "/ 256 (" in l1  # blocks held against the default capacity
    unreachable = dataclasses.replace(options, metrics_url="http://127.0.0.1:9/metrics")
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(unreachable, out, err, embed=topic_embed) == 0, "the job's requests still succeeded"
    assert "warning: cannot read the cache tiers" in err.getvalue()


def test_a_big_log_is_capped_keeping_every_clusters_picks_and_clustering_only_its_most_frequent() -> None:
    """A day's log: 2,000 distinct prompts, one topic (password) all rare. --max-items 12 keeps every
    cluster's picks (topic coverage, the rare topic's included) and fills up with the most frequent;
    only the 300 most frequent prompts are embedded; templates and edge cases still go; the near-limit
    prompt is built from a bounded amount of the log's text."""
    records = [
        wj.LogRecord(f"{('refund', 'shipping')[i % 2]} question number {i}", "acme")
        for i in range(1900)
        for _ in range(1 + (2000 - i) // 100)  # earlier prompts more frequent, all at least twice
    ] + [wj.LogRecord(f"password question number {i}", "acme") for i in range(1900, 2000)]
    embedded: list[int] = []

    def embed(texts: list[str]) -> np.ndarray:
        embedded.append(len(texts))
        return topic_embed(texts)

    config = wj.SelectionConfig(clusters=3, per_cluster=2, max_items=12, max_embedded=2000, edge_cases=True)
    selection = wj.select_from_counts(wj.count_prompts(records), TEMPLATES, embed=embed, config=config)
    from_log = [item for item in selection.items if item.reason in ("top_frequency", "cluster_top")]
    assert len(from_log) == 12 and selection.capped == 100 + 2 - 12  # the top 5%, and the rare topic's 2
    assert {item.cluster for item in from_log} == {0, 1, 2}
    rare = [item.prompt for item in from_log if item.reason == "cluster_top"]
    assert rare == ["password question number 1900", "password question number 1901"]
    top = [int(item.prompt.rsplit(" ", 1)[1]) for item in from_log if item.reason == "top_frequency"]
    assert top == list(range(10))  # the most frequent stay
    by_reason = Counter(item.reason for item in selection.items)
    assert by_reason["slo_template"] == len(TEMPLATES) and by_reason["edge_case"] == 4
    assert sum(embedded) == 2000 and max(embedded) <= wj.EMBED_CHUNK  # in chunks, for the progress bar
    near = next(item for item in selection.items if item.detail == "near_limit")
    assert wj.utf8_token_bound(near.prompt) <= config.max_prompt_tokens
    few = dataclasses.replace(config, max_items=None, max_embedded=300)
    uncapped = wj.select_from_counts(wj.count_prompts(records), [], embed=embed, config=few)
    assert uncapped.capped == 0 and uncapped.clustered == 300 and sum(embedded) == 2300
    assert not any(item.prompt.startswith("password") for item in uncapped.items)  # never clustered


@pytest.mark.parametrize(
    ("flag", "expected"), [([], True), (["--edge-cases"], True), (["--no-edge-cases"], False)]
)
def test_edge_cases_are_selected_unless_turned_off(flag: list[str], expected: bool) -> None:
    """The issue's selection adds synthetic edge cases; they were opt-in (`--edge-cases`), so a job run
    with the defaults never warmed the largest bucket or multi-byte detokenizing (found by a spec review)."""
    from client.__main__ import build_parser, job_options

    args = build_parser().parse_args(["warmup", "--log", "q.jsonl", *flag])
    assert job_options(args).selection.edge_cases is expected
    assert wj.SelectionConfig().edge_cases


# Found in review (2026-12-07): inputs that stopped the job with a traceback, or were read wrong
def _dry_options(log: Path, templates: Path | None = None) -> wj.JobOptions:
    return wj.JobOptions(
        log=log, templates=templates, dry_run=True,
        selection=wj.SelectionConfig(clusters=1, edge_cases=False),
        send=wj.SendConfig(url="localhost:1", progress=False),
    )  # fmt: skip


def test_a_line_with_a_huge_integer_is_skipped_not_fatal(tmp_path: Path, monkeypatch) -> None:
    """One line with an integer of more than 4300 digits (a corrupted ts) makes json.loads raise a plain
    ValueError, not JSONDecodeError: it escapes _parse_line and stops the whole job (exit 2)."""
    monkeypatch.setattr(wj, "StreamingSession", _NoSession)
    good = json.dumps({"prompt": "Refund for order 1?", "tenant": "acme"})
    bad = '{"prompt": "Refund for order 2?", "tenant": "acme", "ts": ' + "1" * 5000 + "}"
    log = wj.parse_query_log([good, bad])
    assert log.records == 1 and [m.line_no for m in log.malformed] == [2]
    path = tmp_path / "q.jsonl"
    path.write_text(good + "\n" + bad + "\n", encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(_dry_options(path), out, err, embed=topic_embed) == 0, err.getvalue()


def test_non_utf8_bytes_in_a_prompt_are_skipped_and_counted(tmp_path: Path) -> None:
    """A prompt cut inside a multi-byte character by a logger (bytes, not UTF-8) is skipped like the
    lone-surrogate case, not warmed as a replacement-character prompt no client sends."""
    path = tmp_path / "q.jsonl"
    path.write_bytes(
        b'{"prompt": "Refund for order 1?", "tenant": "acme"}\n'
        b'{"prompt": "O\xc3 est ma commande \xe2\x82", "tenant": "acme"}\n'
    )
    log = wj.read_query_log(path)
    assert [s.text for s in log.stats] == ["Refund for order 1?"]
    assert [m.line_no for m in log.malformed] == [2]


def test_auto_k_survives_a_singleton_cluster_in_a_big_log() -> None:
    """More than 3000 distinct prompts and one outlier: KMeans(k=2) puts the outlier alone, the silhouette's
    3000-point sample misses it, and silhouette_score raises ValueError out of the selection."""
    n = 4000
    sampled = set(np.random.RandomState(0).permutation(n)[:3000].tolist())
    outlier = min(set(range(n)) - sampled)

    def embed(texts: list[str]) -> np.ndarray:
        rows = []
        for text in texts:
            i = int(text.split()[-1].rstrip("?"))
            rows.append([0.0, 1.0, 0.0, 0.0] if i == outlier else
                        [1.0, 0.0, 0.0, 0.0] + np.random.RandomState(i).rand(4) * 1e-3)  # fmt: skip
        return np.asarray(rows, dtype=np.float32)

    stats = [wj.PromptStats("acme", f"Question number {i}?", f"Question number {i}?", 10_000 - i, i)
             for i in range(n)]  # fmt: skip
    selection = wj.select_from_counts(stats, [], embed=embed, config=wj.SelectionConfig(edge_cases=False))
    assert selection.items


def test_top_percent_rounds_up_exactly() -> None:
    """Documented: top --top-percent of distinct prompts, rounded up. 2.2% of 1500 is exactly 33, but the
    float product 1500 * 2.2 / 100 is 33.000000000000004 and ceil gives 34."""
    stats = [wj.PromptStats("acme", f"q {i}", f"q {i}", 5000 - i, i) for i in range(1500)]
    config = wj.SelectionConfig(top_percent=2.2, per_cluster=0, clusters=1, edge_cases=False, max_items=None)
    selection = wj.select_from_counts(stats, [], embed=lambda t: np.ones((len(t), 2)), config=config)
    assert len(selection.items) == 33


def test_a_templates_file_with_a_complex_key_is_a_clear_error(tmp_path: Path) -> None:
    """safe_load reports an unhashable key as a YAMLError; _UniqueKeyLoader checks `key in seen` first and
    raises TypeError, which run_job does not catch: a traceback instead of exit 2."""
    bad = tmp_path / "t.yaml"
    bad.write_text("scenarios:\n  - ? [a, b]\n    : x\n    scenario: s\n    prompt: p\n")
    out, err = io.StringIO(), io.StringIO()
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "hi", "tenant": "acme"}\n')
    assert wj.run_job(_dry_options(log, bad), out, err, embed=topic_embed) == 2
    assert "error:" in err.getvalue()


def test_a_deeply_nested_templates_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("scenarios: " + "[" * 2000 + "]" * 2000 + "\n")
    log = tmp_path / "q.jsonl"
    log.write_text('{"prompt": "hi", "tenant": "acme"}\n')
    out, err = io.StringIO(), io.StringIO()
    assert wj.run_job(_dry_options(log, bad), out, err, embed=topic_embed) == 2
    assert "error:" in err.getvalue()


def test_yaml_merge_keys_work_as_in_safe_load(tmp_path: Path) -> None:
    """The loader is documented as safe_load plus a duplicate-key check; a merge key (<<: *anchor), valid
    YAML that safe_load reads, is refused with 'could not determine a constructor for ...merge'."""
    path = tmp_path / "t.yaml"
    path.write_text(
        "common: &acme {tenant: acme}\n"
        "scenarios:\n"
        "  - <<: *acme\n    scenario: checkout\n    prompt: You are the checkout assistant.\n"
    )
    assert wj.load_templates(path) == [wj.SloTemplate("checkout", "acme", "You are the checkout assistant.")]


def test_the_documented_python_api_runs_on_the_sample_log() -> None:
    """docs/WARMUP_JOB.md's "Python API" snippet (it passed `log.records`, a count, and raised TypeError)."""
    log = wj.read_query_log(Path(__file__).resolve().parents[1] / "data" / "query_log.jsonl")
    templates = wj.load_templates(Path(__file__).resolve().parents[1] / "data" / "slo_templates.yaml")

    def embed(texts: list[str]) -> np.ndarray:  # any fixed vectors: the snippet's shape is what is checked
        return np.random.default_rng(0).normal(size=(len(texts), 8)).astype(np.float32)

    items = wj.select_from_counts(
        log.stats, templates, embed=embed, config=wj.SelectionConfig(edge_cases=True)
    ).items
    assert items and {item.reason for item in items} >= {wj.REASON_TOP}
