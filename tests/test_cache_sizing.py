"""Cache tiers sized in bytes and checked against free memory before they are allocated."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cache_sizing import GIB, CacheRequest, host_available_bytes, parse_memory, plan_tiers
from engine.config import EngineConfig

BLOCK = 2**20  # 1 MiB blocks keep the arithmetic readable


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GIB), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5G", 1_500_000_000),
     ("4096", 4096), (" 3 kib ", 3072), ("24Gi", 24 * GIB), ("", 0), ("0", 0)],
)  # fmt: skip
def test_memory_sizes_parse_in_both_unit_systems(text, expected):
    assert parse_memory("l2_cache_memory", text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "8 GiB of it", "1e9", "GiB"])
def test_a_malformed_memory_size_names_its_parameter(text):
    with pytest.raises(ValueError, match=r"l2_cache_memory=.*not a memory size"):
        parse_memory("l2_cache_memory", text)


def test_a_memory_size_wins_over_the_block_count():
    request = CacheRequest(l1_blocks=256, l2_blocks=1024, l1_memory=10 * BLOCK + 5, l2_memory=0)
    sizes = plan_tiers(request, BLOCK, on_device=True, device_free=100 * GIB, host_available=100 * GIB)
    assert (sizes.l1_blocks, sizes.l2_blocks) == (10, 1024)
    assert "L1 10 blocks (10.0 MiB)" in sizes.describe()


def test_an_l1_larger_than_free_device_memory_is_refused_naming_the_parameter():
    request = CacheRequest(256, 0, l1_memory=20 * GIB)
    with pytest.raises(ValueError, match=r"L1 \(20480 blocks, 20.00 GiB\) does not fit.*prefix_cache_memory"):
        plan_tiers(request, BLOCK, on_device=True, device_free=21 * GIB, host_available=None)
    # the reserve (10% of what is free, at least 512 MiB) is what made 20 of 21 GiB too much
    fits = plan_tiers(request, BLOCK, on_device=True, device_free=23 * GIB, host_available=None)
    assert fits.l1_blocks == 20480


def test_pinned_l2_beyond_the_hosts_available_memory_is_refused():
    request = CacheRequest(16, 0, l2_memory=8 * GIB)
    with pytest.raises(ValueError, match=r"L2 \(8.00 GiB of host memory\) does not fit.*l2_cache_memory"):
        plan_tiers(request, BLOCK, on_device=True, device_free=None, host_available=9 * GIB)
    assert plan_tiers(request, BLOCK, True, None, host_available=11 * GIB).l2_blocks == 8 * 1024


def test_pinned_l2_is_checked_at_its_exact_size():
    """Registered in place, a pinned L2 takes what it asks for: 5 GiB is not rounded up to 8."""
    request = CacheRequest(16, 0, l2_memory=5 * GIB)
    sizes = plan_tiers(request, BLOCK, on_device=True, device_free=None, host_available=7 * GIB)
    assert sizes.l2_host_bytes == 5 * GIB and "L2 5120 blocks (5.00 GiB)" in sizes.describe()
    with pytest.raises(ValueError, match=r"L2 \(5.00 GiB of host memory\) does not fit"):
        plan_tiers(request, BLOCK, on_device=True, device_free=None, host_available=6 * GIB)


def test_on_the_cpu_l1_is_host_memory_too():
    request = CacheRequest(0, 0, l1_memory=5 * GIB, l2_memory=4 * GIB)
    assert plan_tiers(request, BLOCK, on_device=True, device_free=None, host_available=10 * GIB).l1_blocks
    with pytest.raises(ValueError, match=r"L1 and L2 \(9.00 GiB.*prefix_cache_memory"):
        plan_tiers(request, BLOCK, on_device=False, device_free=None, host_available=10 * GIB)


def test_a_memory_size_smaller_than_one_block_is_an_error_not_a_silent_off():
    with pytest.raises(
        ValueError, match="prefix_cache_memory=.*holds no block.*unset it and set prefix_cache_blocks=0"
    ):
        plan_tiers(CacheRequest(256, 0, l1_memory=BLOCK // 2), BLOCK, True, None, None)
    with pytest.raises(ValueError, match="l2_cache_memory=.*holds no block.*l2_cache_blocks=0"):
        plan_tiers(CacheRequest(256, 1024, l2_memory=8), BLOCK, True, None, None)  # "8" meant as 8 GiB
    assert plan_tiers(CacheRequest(0, 0), BLOCK, True, 0, 0).l1_blocks == 0  # blocks 0: off, as before


def test_without_a_prefix_cache_l2_is_neither_sized_nor_checked():
    """L2 holds what L1 evicts: with L1 off it is never allocated, so no host check may refuse it."""
    sizes = plan_tiers(CacheRequest(0, 0, l2_memory=64 * GIB), BLOCK, True, None, host_available=GIB)
    assert (sizes.l1_blocks, sizes.l2_blocks) == (0, 0)


def _fake_host(tmp_path: Path, available_kib: int, cgroup: dict[str, str]) -> tuple[Path, Path]:
    proc, group = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    for name, text in cgroup.items():
        (group / name).parent.mkdir(parents=True, exist_ok=True)
        (group / name).write_text(text + "\n")
    return proc, group


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [({}, 8 * GIB),
     ({"memory.max": str(6 * GIB), "memory.current": str(2 * GIB)}, 4 * GIB),  # a container's limit
     ({"memory.max": "max", "memory.current": str(2 * GIB)}, 8 * GIB),
     ({"memory/memory.limit_in_bytes": str(3 * GIB), "memory/memory.usage_in_bytes": str(GIB)}, 2 * GIB),
     ({"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "5"}, 8 * GIB),
     # the page cache's inactive file pages are reclaimable: not part of what the limit leaves
     ({"memory.max": str(6 * GIB), "memory.current": str(5 * GIB),
       "memory.stat": f"anon {2 * GIB}\nfile {3 * GIB}\ninactive_file {3 * GIB}"}, 4 * GIB),
     ({"memory/memory.limit_in_bytes": str(3 * GIB), "memory/memory.usage_in_bytes": str(2 * GIB),
       "memory/memory.stat": f"cache {GIB}\ntotal_inactive_file {GIB}"}, 2 * GIB),
     ({"memory.max": str(6 * GIB), "memory.current": str(GIB), "memory.stat": "inactive_file bad"}, 5 * GIB)],
)  # fmt: skip
def test_available_host_memory_is_the_lower_of_the_host_and_its_cgroup(tmp_path, cgroup, expected):
    proc, group = _fake_host(tmp_path, 8 * GIB // 1024, cgroup)
    assert host_available_bytes(proc, group) == expected


def test_unreadable_host_memory_is_unknown_not_zero(tmp_path):
    assert host_available_bytes(tmp_path / "none", tmp_path / "none") is None


def test_the_config_rejects_a_malformed_size_and_negative_counts(tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_memory='8 gigs'"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "prefix_cache_memory": "8 gigs"})
    with pytest.raises(ValueError, match="l2_cache_blocks must be >= 0"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "l2_cache_blocks": "-5"})
    with pytest.raises(ValueError, match="l3_explore_s must be >= 0"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "l3_explore_s": "-1"})
    assert EngineConfig.from_parameters({"model_dir": str(tmp_path), "l3_explore_s": "0"}).l3_explore_s == 0
    with pytest.raises(ValueError, match="l3_tenant_max_blocks must be >= 0"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "l3_tenant_max_blocks": "-1"})
    quota = EngineConfig.from_parameters({"model_dir": str(tmp_path), "l3_tenant_max_blocks": "5000"})
    assert quota.l3_tenant_max_blocks == 5000
    with pytest.raises(ValueError, match="exact_tenant_max_entries must be >= 0"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "exact_tenant_max_entries": "-1"})
    exact = EngineConfig.from_parameters({"model_dir": str(tmp_path), "exact_tenant_max_entries": "300"})
    assert exact.exact_tenant_max_entries == 300
    with pytest.raises(ValueError, match="semantic_tenant_max_entries must be >= 1"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "semantic_tenant_max_entries": "0"})
    with pytest.raises(ValueError, match="semantic_lookup_threads must be >= 0"):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), "semantic_lookup_threads": "-1"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("l2_cache_memroy", "8GiB", "unknown parameter 'l2_cache_memroy'.*did you mean 'l2_cache_memory'"),
        ("prefix_block_size", "0", "prefix_block_size must be >= 1"),
        ("semantic_threshold", "80", r"semantic_threshold is a cosine in \(0, 1\]"),
        ("semantic_pair_min", "1.5", r"semantic_pair_min is a probability in \[0, 1\]"),
        ("l3_explore_s", "nan", "l3_explore_s=nan must be a finite number"),
        ("prefill_budget_s", "-0.5", r"prefill_budget_s=-0.5 must be a finite number in \[0, "),
    ],
)
def test_the_config_rejects_a_misspelled_or_out_of_range_parameter(tmp_path, key, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_parameters({"model_dir": str(tmp_path), key: value})


def test_the_python_backends_own_parameters_pass(tmp_path):
    config = EngineConfig.from_parameters({"model_dir": str(tmp_path), "EXECUTION_ENV_PATH": "/env.tar.gz"})
    assert config.extra == {"EXECUTION_ENV_PATH": "/env.tar.gz"}


def test_an_env_reference_to_an_empty_variable_takes_its_default(tmp_path, monkeypatch):
    """`${VAR:-default}` means unset or empty, as in a shell or a compose file."""
    monkeypatch.setenv("LLM_WARMUP", "")
    params = {"model_dir": str(tmp_path), "warmup": "${LLM_WARMUP:-false}"}
    assert EngineConfig.from_parameters(params).warmup is False
    monkeypatch.setenv("LLM_WARMUP", "true")
    assert EngineConfig.from_parameters(params).warmup is True


def _load(**overrides):
    from engine.loader import load_engine
    from tests.conftest import MODEL_DIR

    config = EngineConfig(
        model_dir=str(MODEL_DIR), response_cache=False, l3_kv_cache=False, prefill_templates="", warmup=False,
        **overrides,
    )  # fmt: skip
    return load_engine(config, log=lambda message: None).engine


def test_the_loader_sizes_both_tiers_from_memory_and_reports_their_capacity():
    from engine.cache_stats import cache_gauges

    engine = _load(prefix_cache_blocks=4, l2_cache_blocks=4)
    try:
        block = engine.prefix_cache.bytes // engine.prefix_cache.capacity
    finally:
        engine.shutdown(1.0)
    engine = _load(prefix_cache_memory=str(7 * block + block // 2), l2_cache_memory=f"{11 * block}")
    try:
        gauges = cache_gauges(engine.prefix_cache, None)
        assert (engine.prefix_cache.capacity, len(engine.prefix_cache.l2.pool)) == (7, 11)
        assert gauges[("l1", "capacity_blocks")] == 7 and gauges[("l1", "capacity_bytes")] == 7 * block
        assert gauges[("l2", "capacity_blocks")] == 11 and gauges[("l2", "capacity_bytes")] == 11 * block
        assert ("l2", "page_locked") not in gauges  # host memory either way: nothing to lock for DMA
    finally:
        engine.shutdown(1.0)


def test_a_tier_that_cannot_fit_fails_the_load_naming_its_parameter():
    with pytest.raises(ValueError, match=r"L1 and L2 \(.* of host memory\) does not fit.*l2_cache_memory"):
        _load(l2_cache_memory="1000TiB")
