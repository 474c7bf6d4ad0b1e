"""Tier table: defaults, lookup errors, YAML loading, CPU scaling."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.errors import RequestError
from scheduler.tiers import DEFAULT_CONFIG_PATH, Tier, TierTable


def test_packaged_yaml_matches_builtin_defaults() -> None:
    assert TierTable.load() == TierTable.defaults()
    assert TierTable.load(DEFAULT_CONFIG_PATH) == TierTable.defaults()


def test_default_tiers_in_precedence_order() -> None:
    table = TierTable.defaults()
    assert table.names == ("critical", "warmup", "standard", "batch")
    assert [t.priority for t in table] == [1, 2, 3, 4]
    assert table.get("critical").ttft_target_ms == 120
    assert table.get("batch").sheddable and not table.get("critical").sheddable
    assert table.default.name == "standard"
    assert len(table) == 4 and "batch" in table and "gold" not in table


@pytest.mark.parametrize("name", [None, ""])
def test_missing_tier_is_default(name: str | None) -> None:
    assert TierTable.defaults().get(name).name == "standard"


def test_unknown_tier_lists_allowed() -> None:
    with pytest.raises(RequestError) as info:
        TierTable.defaults().get("gold")
    assert info.value.code == "INVALID_ARG"
    assert str(info.value) == "unknown slo_tier 'gold'; allowed: critical, warmup, standard, batch"


def test_cpu_scaling() -> None:
    table = TierTable.defaults()
    cpu = table.for_device("cpu")
    assert cpu.get("critical").ttft_target_ms == 120 * table.cpu_scale
    assert cpu.get("critical").max_queue_ms == table.get("critical").max_queue_ms * table.cpu_scale
    assert cpu.for_device("cpu") == cpu  # scaling is applied once
    assert table.for_device("cuda:0") is table


def test_ttft_target_ns() -> None:
    assert Tier("x", 1, 1.5).ttft_target_ns == 1_500_000


def test_load_custom_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "default_tier: normal\ncpu_scale: 4\ntiers:\n"
        "  normal: {priority: 2, ttft_target_ms: 300}\n"
        "  vip: {priority: 1, ttft_target_ms: 50, percentile: 99.9, sheddable: false, max_queue_ms: 500}\n",
        encoding="utf-8",
    )
    table = TierTable.load(path)
    assert table.names == ("vip", "normal")
    assert table.default.name == "normal"
    assert table.get("vip").percentile == 99.9
    assert table.for_device("cpu").get("vip").ttft_target_ms == 200


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tiers: {a: {priority: 1, ttft_target_ms: 1, colour: red}}", "unknown keys ['colour']"),
        ("tiers: {a: {priority: 0, ttft_target_ms: 1}}", "priority must be an int in 1..2147483647"),
        ("tiers: {a: {priority: 2147483648, ttft_target_ms: 1}}", "priority must be an int in 1..2147483647"),
        ("tiers: {a: {priority: 1, ttft_target_ms: -5}}", "ttft_target_ms must be in (0, 1e+09]"),
        # infinity and NaN are refused at load: int() of them would fail every request of the tier
        ("tiers: {a: {priority: 1, ttft_target_ms: .inf}}", "ttft_target_ms must be in (0, 1e+09]"),
        ("tiers: {a: {priority: 1, ttft_target_ms: .nan}}", "ttft_target_ms must be in (0, 1e+09]"),
        (
            "tiers: {a: {priority: 1, ttft_target_ms: 1, max_queue_ms: .inf}}",
            "max_queue_ms must be in (0, 1e+09]",
        ),
        (
            "default_tier: a\ncpu_scale: .inf\ntiers: {a: {priority: 1, ttft_target_ms: 1}}",
            "cpu_scale must be in (0, 1000]",
        ),
        ("tiers: {a: {priority: 1}}", "'priority' and 'ttft_target_ms' are required"),
        ("default_tier: b\ntiers: {a: {priority: 1, ttft_target_ms: 1}}", "default tier 'b' is not defined"),
        ("tierz: {}", "unknown tier config keys"),
        ("tiers: {}", "non-empty 'tiers'"),
    ],
)
def test_bad_yaml_is_explained(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="tiers.yaml") as info:
        TierTable.load(path)
    assert needle in str(info.value)


def test_a_longest_target_scaled_for_the_cpu_stays_a_valid_tier() -> None:
    tier = Tier("slow", 3, ttft_target_ms=1e9, max_queue_ms=1e9)
    scaled = TierTable((tier,), "slow", cpu_scale=1000.0).for_device("cpu").get("slow")
    assert scaled.ttft_target_ms == 1e9 and scaled.max_queue_ns == 10**15


def test_replace_tier_returns_new_table() -> None:
    table = TierTable.defaults()
    faster = table.replace_tier(Tier("standard", 3, 400.0))
    assert faster.get("standard").ttft_target_ms == 400
    assert table.get("standard").ttft_target_ms == 500
    with pytest.raises(RequestError):
        table.replace_tier(Tier("gold", 1, 1.0))


def test_request_error_codes() -> None:
    assert RequestError.unavailable("x").code == "UNAVAILABLE"
    assert RequestError.internal("y").code == "INTERNAL"
    with pytest.raises(ValueError, match="allowed: INVALID_ARG"):
        RequestError("NOPE", "z")  # type: ignore[arg-type]
