"""Traffic statistics in a real Redis, and the recorder that ships them off the request path."""

import time

import pytest

from cache.traffic_stats import RESERVED, StoreUnavailable, TrafficStatsStore
from deploy.launch import find_free_port
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
    from cache.traffic_stats import model_fingerprint

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
