"""Traffic statistics in a real Redis, and the recorder that ships them off the request path."""

import time
from pathlib import Path

import pytest

from cache.traffic_stats import (
    PEAK_WINDOW_S,
    RESERVED,
    StoreUnavailable,
    TrafficStatsStore,
    model_fingerprint,
)
from deploy.launch import find_free_port
from engine.config import EngineConfig
from engine.loader import plan_from_traffic
from engine.traffic_recorder import TrafficRecorder


@pytest.fixture
def store(redis_server, request):
    return TrafficStatsStore(redis_server, "m", request.node.name)


def test_lengths_accumulate_across_writes(store):
    store.add_lengths({10: 2, 20: 1})
    store.add_lengths({10: 3})
    assert store.load_lengths() == {10: 5, 20: 1}


def test_malformed_fields_are_not_trusted(store):
    store.add_lengths({10: 1})
    store.client.hset(store.lengths_key, mapping={"abc": "1", "30": "x", "-5": "2", "40": "0"})
    assert store.load_lengths() == {10: 1}


def test_peaks_keep_the_maximum_per_window(store):
    store.add_peak(7200.0, 3)
    store.add_peak(7300.0, 9)
    store.add_peak(7400.0, 5)
    store.add_peak(10900.0, 2)
    assert store.load_peaks() == [(7200.0, 9.0), (10800.0, 2.0)]
    assert 0 < store.client.ttl(store.peaks_key) <= 14 * 24 * 3600


def test_unreachable_redis_fails_fast_with_a_clear_error():
    dead = TrafficStatsStore(f"redis://localhost:{find_free_port()}/0", "m", "f", timeout_s=0.2)
    started = time.perf_counter()
    with pytest.raises(StoreUnavailable, match="reading prompt lengths failed"):
        dead.load_lengths()
    assert time.perf_counter() - started < 2.0


def test_recorder_keeps_data_while_redis_is_down_and_ships_it_later(redis_server, store):
    errors = []
    recorder = TrafficRecorder(
        TrafficStatsStore(f"redis://localhost:{find_free_port()}/0", "m", "f", timeout_s=0.1),
        on_error=errors.append,
    )
    recorder.observe_request(12, 28)
    recorder.observe_request(12, 28)
    recorder.observe_active(3)
    assert not recorder.flush()
    assert errors and recorder.flush_failures == 1
    recorder.store = store  # Redis is back
    assert recorder.flush()
    assert store.load_lengths() == {12: 2}
    assert store.load_lengths(RESERVED) == {28: 2}
    assert store.load_peaks()[0][1] == 3.0


def test_a_flush_that_fails_half_way_keeps_only_what_redis_did_not_take(store):
    """The histograms went in, the peak's write failed: the next flush must not add them a second time."""
    recorder = TrafficRecorder(store)
    recorder.observe_request(100, 132)
    recorder.observe_active(3)
    store.client.set(store.peaks_key, b"not a hash")  # the peak's write fails (as any Redis error would)
    assert not recorder.flush()
    store.client.delete(store.peaks_key)
    assert recorder.flush()
    assert store.load_lengths() == {100: 1} and store.load_lengths(RESERVED) == {132: 1}
    assert store.load_peaks()[0][1] == 3.0


def test_model_fingerprint_is_stable_and_depends_on_the_limit(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert model_fingerprint(tmp_path, 2048) == model_fingerprint(tmp_path, 2048)
    assert model_fingerprint(tmp_path, 2048) != model_fingerprint(tmp_path, 4096)


def test_histograms_are_separate_and_unknown_names_are_refused(redis_server, store):
    store.add_lengths({10: 1})
    store.add_lengths({26: 1}, RESERVED)
    assert store.load_lengths() == {10: 1}
    assert store.load_lengths(RESERVED) == {26: 1}
    with pytest.raises(ValueError, match="unknown length histogram"):
        store.load_lengths("output_lengths")


def test_out_of_range_values_are_skipped_and_counted(store):
    store.client.hset(
        store.lengths_key, mapping={"10": "3", "20": "1" + "0" * 400, "30": "-2", "1" + "0" * 12: "1"}
    )
    now = time.time()
    peaks = {str(now): "4", str(now - 1): "inf", str(now - 2): "nan", str(now - 3): "-inf"}
    store.client.hset(store.peaks_key, mapping={**peaks, str(now - 4): "-1", str(now - 5): "1e9", "inf": "2"})
    assert store.load_lengths() == {10: 3}
    assert store.load_peaks() == [(now, 4.0)]
    assert store.malformed == 3 + 6


@pytest.fixture
def plan_config(redis_server, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return EngineConfig(model_dir=str(tmp_path), redis_url=redis_server)


def plan_store(config: EngineConfig, model: str) -> TrafficStatsStore:
    return TrafficStatsStore(config.redis_url, model, model_fingerprint(config.model_dir, 2048))


def test_non_finite_or_huge_traffic_values_never_fail_the_plan(plan_config, request):
    store = plan_store(plan_config, request.node.name)
    store.client.hset(store.peaks_key, mapping={str(time.time()): "inf", str(time.time() - 1): "nan"})
    for name in ("prompt_lengths", RESERVED):
        store.client.hset(store.histogram_key(name), mapping={"100": "1" + "0" * 400, "200": "60"})
    plan = plan_from_traffic(plan_config, Path(plan_config.model_dir), 2048, request.node.name)
    assert plan.slots == plan_config.max_batch_size and plan.histogram == {200: 60}
    assert plan.buckets.source == "traffic"
    assert plan.failures == [{"stage": "plan", "error": "skipped 4 malformed traffic values"}]


def test_a_plan_that_raises_falls_back_to_the_defaults(plan_config, request, monkeypatch):
    store = plan_store(plan_config, request.node.name)
    store.add_lengths({100: 60})
    store.add_peak(time.time(), 3)

    def broken(*args, **kwargs):
        raise OverflowError("planning failed")

    monkeypatch.setattr("engine.loader.predict_reserve", broken)
    plan = plan_from_traffic(plan_config, Path(plan_config.model_dir), 2048, request.node.name)
    assert plan.buckets.source == "default" and plan.slots == plan_config.max_batch_size
    assert plan.histogram == {}
    assert plan.failures == [{"stage": "plan", "error": "OverflowError: planning failed"}]


def test_a_field_redis_refuses_is_reset_and_the_others_are_counted_once(store):
    store.client.hset(store.lengths_key, "100", "not a number")
    errors = []
    recorder = TrafficRecorder(store, on_error=errors.append)
    recorder.observe_request(100, 132)
    recorder.observe_request(50, 82)
    assert not recorder.flush()  # 100's HINCRBY was refused; its field is reset, its count kept
    assert "reset 1 bad fields" in errors[-1] and store.repairs == 1
    assert recorder.flush()
    for _ in range(3):
        recorder.flush()
    assert store.load_lengths() == {50: 1, 100: 1} and store.load_lengths(RESERVED) == {82: 1, 132: 1}


def test_a_field_that_would_overflow_is_reset(store):
    store.client.hset(store.lengths_key, "100", str(2**63 - 1))
    write = store.add_lengths({100: 1, 50: 2})
    assert write.unsent == {100: 1} and store.repairs == 1
    assert store.add_lengths(write.unsent).unsent == {}
    assert store.load_lengths() == {50: 2, 100: 1}


def test_a_histogram_of_another_type_is_deleted_and_refilled(store):
    store.client.set(store.lengths_key, b"garbage")
    errors = []
    recorder = TrafficRecorder(store, on_error=errors.append)
    recorder.observe_request(100, 132)
    assert not recorder.flush()
    assert "deleted the key of another type" in errors[-1] and store.repairs == 1
    recorder.observe_request(100, 132)
    assert recorder.flush()
    assert store.load_lengths() == {100: 2} and store.load_lengths(RESERVED) == {132: 2}


def test_a_peak_key_of_another_type_is_deleted_and_a_bad_peak_is_replaced(store):
    store.client.set(store.peaks_key, b"garbage")
    with pytest.raises(StoreUnavailable, match="deleted the key of another type"):
        store.add_peak(7200.0, 3)
    assert store.repairs == 1
    store.client.hset(store.peaks_key, mapping={str(7200): "abc", str(7200 + PEAK_WINDOW_S): "nan"})
    store.add_peak(7200.0, 3)
    store.add_peak(7200.0 + PEAK_WINDOW_S, 2)
    assert store.load_peaks() == [(7200.0, 3.0), (7200.0 + PEAK_WINDOW_S, 2.0)]
