"""The request mix: exact tier quotas, Zipf tenants, heavy-tailed lengths, perf_analyzer export shape."""

from __future__ import annotations

from scheduler.tenant_auth import SECRET_ENV

import stat

import os

import io

import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from scheduler.tenant_auth import token_from_env
from client.workload import (
    DEFAULT_MODEL_DIR,
    CorpusPrompts,
    LengthDistribution,
    PlannedRequest,
    TenantSkew,
    TierMix,
    Workload,
    export_perf_analyzer_json,
)


class WordPrompts:
    """n words for n tokens: fast and tokenizer-free, for tests of everything but the text."""

    def texts(self, lengths: Sequence[int], rng: np.random.Generator) -> list[str]:
        start = int(rng.integers(1000))
        return [" ".join(f"w{start + i}" for _ in range(n)) for i, n in enumerate(lengths)]


def workload(**kwargs) -> Workload:
    return Workload(prompts=WordPrompts(), **kwargs)


def test_tier_fractions_are_exact_quotas_even_for_short_plans() -> None:
    mix = TierMix.parse("critical=0.2,standard=0.5,batch=0.3")
    for n in (10, 20, 37, 1000):
        counts = Counter(r.tier for r in workload(mix=mix).generate(n, seed=n))
        exact = {"critical": 0.2 * n, "standard": 0.5 * n, "batch": 0.3 * n}
        assert sum(counts.values()) == n
        assert all(abs(counts[t] - exact[t]) < 1 for t in exact), (n, counts)


def test_tiers_are_shuffled_not_blocked() -> None:
    tiers = [r.tier for r in workload(mix=TierMix({"critical": 1, "batch": 1})).generate(200, seed=1)]
    assert tiers[:100].count("critical") not in (0, 100)


def test_mix_weights_are_normalized_and_bad_ones_rejected() -> None:
    assert TierMix.parse("critical=2,batch=8").fractions == {"critical": 0.2, "batch": 0.8}
    with pytest.raises(ValueError, match="expected tier=fraction"):
        TierMix.parse("critical")
    with pytest.raises(ValueError, match="expected a number"):
        TierMix.parse("critical=lots")
    with pytest.raises(ValueError, match="not all 0"):
        TierMix.parse("critical=0,batch=0")


def test_tenants_follow_zipf() -> None:
    skew = TenantSkew(count=8, exponent=1.0)
    counts = Counter(skew.assign(100_000, np.random.default_rng(0)))
    names = skew.names
    assert names[0] == "tenant-0" and len(set(names)) == 8
    shares = np.array([counts[t] for t in names]) / 100_000
    np.testing.assert_allclose(shares, skew.probabilities, atol=0.01)
    assert shares[0] / shares[1] == pytest.approx(2.0, rel=0.05)  # (1/1) / (1/2)
    assert list(shares) == sorted(shares, reverse=True)


def test_prompt_lengths_have_a_long_capped_tail() -> None:
    dist = LengthDistribution(median=48, sigma=1.0, minimum=4, maximum=1024)
    lengths = dist.sample(100_000, np.random.default_rng(5))
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p50 == pytest.approx(48, rel=0.05)
    assert p99 / p50 > 8  # lognormal sigma 1: P99 ~ 10x the median
    assert lengths.mean() > 1.4 * p50  # right-skewed
    assert lengths.min() >= 4 and lengths.max() == 1024  # the cap is reached and respected


def test_plan_uses_the_schedule_and_is_reproducible() -> None:
    times = np.array([0.1, 0.5, 0.7, 2.0])
    a = workload().generate(times, seed=3)
    b = workload().generate(times, seed=3)
    assert a == b
    assert [r.at_s for r in a] == list(times)
    assert all(r.max_tokens >= 1 and r.prompt_tokens >= 4 and r.prompt for r in a)
    assert workload().generate(4, seed=4) != a
    assert all(r.at_s == 0.0 for r in workload().generate(3, seed=0))


def test_changing_tenants_keeps_tiers_and_lengths_of_a_seed() -> None:
    a = workload(tenants=TenantSkew(4)).generate(50, seed=9)
    b = workload(tenants=TenantSkew(16)).generate(50, seed=9)
    assert [(r.tier, r.max_tokens, r.prompt_tokens) for r in a] == [
        (r.tier, r.max_tokens, r.prompt_tokens) for r in b
    ]


def test_perf_analyzer_json_shape(tmp_path: Path) -> None:
    plan = [
        PlannedRequest(0.0, "critical", "tenant-0", 'say "hi"\nüñí', 3, 5),
        PlannedRequest(0.2, "batch", "tenant-3", "x", 40, 1),
    ]
    path = export_perf_analyzer_json(plan, tmp_path / "sub" / "in.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert list(data) == ["data"] and len(data["data"]) == 2
    entry = data["data"][0]
    assert set(entry) == {"text_input", "stream", "sampling_parameters", "slo_tier", "tenant", "tenant_token"}
    (token,) = entry["tenant_token"]["content"]  # the suite's secret is set: signed for 30 days
    expiry = int(token.split(".")[0])
    assert token == token_from_env("tenant-0", now=expiry - 30 * 86400, ttl_s=30 * 86400)
    assert abs(expiry - time.time() - 30 * 86400) < 60
    assert all(v["shape"] == [1] and len(v["content"]) == 1 for v in entry.values())
    assert entry["text_input"]["content"] == ['say "hi"\nüñí']
    assert entry["stream"]["content"] == [True]
    assert entry["slo_tier"]["content"] == ["critical"] and entry["tenant"]["content"] == ["tenant-0"]
    assert json.loads(entry["sampling_parameters"]["content"][0]) == {"max_tokens": 3, "ignore_eos": True}
    assert json.loads(data["data"][1]["sampling_parameters"]["content"][0])["max_tokens"] == 40
    with pytest.raises(ValueError, match="at least one"):
        export_perf_analyzer_json([], tmp_path / "empty.json")


def test_a_plans_cache_mode_is_exported_and_none_leaves_the_servers_default(tmp_path: Path) -> None:
    plan = [
        PlannedRequest(0.0, "batch", "t", "x", 4, 1, cache="kv-only"),
        PlannedRequest(0.1, "batch", "t", "x", 4),
    ]
    entries = json.loads(export_perf_analyzer_json(plan, tmp_path / "in.json").read_text())["data"]
    assert entries[0]["cache"] == {"content": ["kv-only"], "shape": [1]} and "cache" not in entries[1]


@pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "tokenizer.json").exists(), reason="make setup builds the model")
def test_corpus_prompts_have_about_the_requested_token_count() -> None:
    prompts = CorpusPrompts(DEFAULT_MODEL_DIR)
    plan = Workload(prompts=prompts).generate(40, seed=2)
    for r in plan:
        assert abs(prompts.count(r.prompt) - r.prompt_tokens) <= max(2, 0.05 * r.prompt_tokens), (
            r.prompt_tokens
        )
    assert len({r.prompt for r in plan}) == len(plan)
    assert [r.prompt for r in Workload(prompts=prompts).generate(40, seed=2)] == [r.prompt for r in plan]


def test_corpus_prompts_missing_tokenizer_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--model-dir"):
        CorpusPrompts(tmp_path)


def test_exported_perf_analyzer_tokens_are_not_readable_by_others(tmp_path: Path, monkeypatch):
    """`client.load --export-perf-analyzer` wrote 30-day tenant tokens (default's included, which opens
    the restricted tiers) into a file created with the process umask: 0644, readable by every local user
    (found in review, 2026-12-07)."""
    from client.load import main as load_main

    monkeypatch.setenv(SECRET_ENV, "a-server-secret")
    path = tmp_path / "in.json"
    old = os.umask(0o022)  # the usual umask
    try:
        args = ["--count", "4", "--tenants", "2", "--export-perf-analyzer", str(path), "--export-only"]
        assert load_main(args, io.StringIO(), io.StringIO()) == 0
    finally:
        os.umask(old)
    entries = json.loads(path.read_text())["data"]
    assert any("tenant_token" in e for e in entries)
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, oct(path.stat().st_mode)
