"""Model parameters the engine used to accept and then over-allocate KV with, spin on, or fail the load
over without naming them (found by a review): each is refused, or the load names it."""

from __future__ import annotations

import json
import time

import pytest

from cache.traffic_stats import TrafficStatsStore, model_fingerprint
from deploy.launch import stop_run_dir
from engine.config import EngineConfig
from engine.loader import load_engine
from tests.conftest import MODEL_DIR

BASE = {
    "model_dir": str(MODEL_DIR),
    "response_cache": "false",
    "l3_kv_cache": "false",
    "prompt_buckets": "16,64",
    "max_seq_len": "128",
}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("traffic_flush_s", "0"),  # the recorder flushed to Redis without pause
        ("feedback_interval_s", "0"),  # and the feedback loop ticked without pause
        ("min_batch_size", "0"),  # with kv_headroom 0 and a recorded peak: zero slots, an IndexError
        ("kv_headroom", "0"),
        ("seed", str(10**20)),  # "Overflow when unpacking long long" from torch.manual_seed
        ("plan_min_samples", "-1"),
        ("max_queued", "-1"),
        ("l3_ttl_s", "0"),
    ],
)
def test_a_value_that_cannot_work_is_refused_naming_it(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_parameters({**BASE, name: value})


def test_plan_min_samples_zero_plans_from_the_defaults_with_no_traffic() -> None:
    """0 ('always plan from traffic') failed every load with no traffic recorded: 'percentile of an
    empty histogram', raised again by the fallback."""
    loaded = load_engine(EngineConfig.from_parameters({**BASE, "plan_min_samples": "0"}), log=lambda m: None)
    try:
        assert loaded.engine.runner.slots == 8
    finally:
        loaded.engine.shutdown(1.0)


def test_kv_slots_that_do_not_fit_in_memory_name_the_parameters() -> None:
    config = EngineConfig.from_parameters({**BASE, "max_batch_size": str(10**9), "min_batch_size": "1"})
    with pytest.raises(ValueError, match="max_batch_size=1000000000.*do not fit in cpu memory"):
        load_engine(config, log=lambda m: None)


@pytest.mark.parametrize(("peak", "floor"), [(50, 2), (1, 20)], ids=["busy", "floor-above-cap"])
def test_a_recorded_peak_never_plans_more_slots_than_max_batch_size(
    redis_server, peak: int, floor: int
) -> None:
    """min_batch_size is the plan's floor and max_batch_size its cap, applied last: a floor of 20 over a
    cap of 4 (max_batch_size 1 with the default floor of 2 is a real setting) gave the runner 20 slots,
    more KV than the operator's cap."""
    name = f"cap-{time.monotonic_ns()}"
    TrafficStatsStore(redis_server, name, model_fingerprint(MODEL_DIR, 128)).add_peak(time.time(), peak)
    params = {**BASE, "redis_url": redis_server, "max_batch_size": "4", "min_batch_size": str(floor)}
    loaded = load_engine(EngineConfig.from_parameters(params), log=lambda m: None, model_name=name)
    try:
        assert loaded.engine.runner.slots == 4
    finally:
        loaded.engine.shutdown(1.0)


@pytest.mark.parametrize("content", [{"pids": None, "grpc_port": 1}, [1, 2]], ids=["null-pids", "a-list"])
def test_stop_ignores_a_stack_file_of_another_shape(tmp_path, content) -> None:
    (tmp_path / "stack.json").write_text(json.dumps(content))
    assert stop_run_dir(tmp_path) is False and not (tmp_path / "stack.json").exists()
