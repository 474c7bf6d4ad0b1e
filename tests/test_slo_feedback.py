"""The SLO feedback loop through a real Redis: two replicas, fleet-wide observations, no Redis."""

from __future__ import annotations

import json
import time

from deploy.launch import find_free_port
from engine.slo_feedback import SloFeedbackLoop, aggregate, read_fleet
from scheduler.feedback import FeedbackController
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()


def make_loop(redis_url: str, applied: list) -> SloFeedbackLoop:
    return SloFeedbackLoop(
        redis_url, "m-test", TIERS, FeedbackController(TIERS), applied.append, 5.0, lambda m: None
    )


def test_a_tier_missing_its_target_anywhere_gains_weight_everywhere(redis_server):
    applied_a, applied_b = [], []
    replica_a, replica_b = make_loop(redis_server, applied_a), make_loop(redis_server, applied_b)
    replica_a.client.delete(replica_a.key)
    target = TIERS.get("critical").ttft_target_ms
    for _ in range(20):
        replica_a.window.observe("critical", 3 * target)  # replica A sees critical far over its target
    now = 1_000_000.0
    replica_a.tick(now)
    events = replica_b.tick(now + 1)  # replica B saw nothing itself
    assert any(e.tier == "critical" and e.kind == "weight" and e.new > e.old for e in events)
    assert replica_b.controller.weights["critical"] > 1.0
    assert applied_b, "the adapted weights were pushed into the engine"


def test_without_redis_the_last_weights_stay(redis_server):
    dead = make_loop(f"redis://localhost:{find_free_port()}/0", [])
    before = dead.controller.weights
    dead.window.observe("critical", 10_000.0)
    assert dead.tick() == ()
    assert dead.controller.weights == before and dead.failures == 1


def test_stale_and_malformed_windows_are_ignored():
    fleet = {
        b"r1:critical": b'{"count": 4, "p_ms": 100.0, "ts": 1000.0}',
        b"r2:critical": b'{"count": 4, "p_ms": 300.0, "ts": 1000.0}',
        b"r3:critical": b'{"count": 9, "p_ms": 900.0, "ts": 10.0}',
        b"r4:standard": b"not json",
    }
    observations = aggregate(fleet, now=1001.0, fresh_s=10.0)
    assert set(observations) == {"critical"}
    assert observations["critical"].count == 8 and observations["critical"].p_target_ms == 200.0


def test_windows_out_of_range_or_unparseable_are_ignored_and_do_not_poison_the_good_ones():
    good = {b"r1:critical": b'{"count": 4, "p_ms": 300.0, "ts": 1000.0}'}
    bad = {
        b"r2:critical": b'{"count": 4, "p_ms": NaN, "ts": 1000.0}',
        b"r3:critical": b'{"count": 1e400, "p_ms": 1.0, "ts": 1000.0}',
        b"r4:critical": b'{"count": 4, "p_ms": -5.0, "ts": 1000.0}',
        b"r5:critical": b'{"count": true, "p_ms": 9000.0, "ts": 1000.0}',
        b"r6:critical": b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json.loads
        b"r7:critical": b'{"count": 4, "p_ms": 9000.0, "ts": 1e400}',
        b"r8:critical": b'{"count": 4, "p_ms": 9000.0, "ts": 1060.0}',  # a minute ahead
        b"r9:critical": b"[4, 9000.0, 1000.0]",
        b"nocolon": b'{"count": 4, "p_ms": 9000.0, "ts": 1000.0}',
    }
    read = read_fleet({**good, **bad}, now=1001.0, fresh_s=10.0)
    assert read.observations["critical"].count == 4 and read.observations["critical"].p_target_ms == 300.0
    assert set(read.discard) == set(bad)


def test_a_window_a_little_ahead_is_fresh_and_long_stale_ones_are_discarded():
    fleet = {
        b"skewed:critical": b'{"count": 2, "p_ms": 100.0, "ts": 1003.0}',  # within CLOCK_SKEW_S
        b"idle:critical": b'{"count": 2, "p_ms": 900.0, "ts": 950.0}',  # stale, kept a while
        b"gone:critical": b'{"count": 2, "p_ms": 900.0, "ts": 10.0}',  # older than the key's TTL
    }
    read = read_fleet(fleet, now=1001.0, fresh_s=10.0, retain_s=160.0)
    assert read.observations["critical"].count == 2 and read.observations["critical"].p_target_ms == 100.0
    assert set(read.discard) == {b"gone:critical"}


def test_a_tick_deletes_bad_and_long_stale_windows_but_not_one_rewritten_meanwhile(redis_server):
    loop = make_loop(redis_server, [])
    loop.client.delete(loop.key)
    now = 1_000_000.0
    loop.client.hset(
        loop.key,
        mapping={
            "good:critical": '{"count": 4, "p_ms": 100.0, "ts": %f}' % now,
            "nan:critical": '{"count": 4, "p_ms": NaN, "ts": %f}' % now,
            "future:critical": '{"count": 4, "p_ms": 100.0, "ts": %f}' % (now + 3600),
            "gone:critical": '{"count": 4, "p_ms": 100.0, "ts": %f}' % (now - 3600),
        },
    )
    loop.tick(now)
    assert set(loop.client.hkeys(loop.key)) == {b"good:critical"} and loop.fields_deleted == 3
    stale = loop.client.hget(loop.key, "good:critical")
    loop.client.hset(loop.key, "good:critical", '{"count": 5, "p_ms": 100.0, "ts": %f}' % now)
    loop._delete_fields({b"good:critical": stale})  # its owner rewrote it after this replica read it
    assert loop.client.hexists(loop.key, "good:critical") and loop.fields_deleted == 3
    loop.client.delete(loop.key)


def test_a_wrong_typed_key_is_deleted_and_counted_then_the_loop_works_again(redis_server):
    applied, logs = [], []
    loop = SloFeedbackLoop(
        redis_server, "m-test", TIERS, FeedbackController(TIERS), applied.append, 5.0, logs.append
    )
    loop.client.set(loop.key, b"garbage")
    target = TIERS.get("critical").ttft_target_ms
    for _ in range(2):
        for _ in range(20):
            loop.window.observe("critical", 3 * target)
        loop.tick()
    assert loop.wrong_type == 1 and loop.failures == 0
    assert any('"slo_feedback_wrong_type"' in line for line in logs)
    assert loop.client.type(loop.key) == b"hash" and applied
    loop.client.delete(loop.key)


def test_the_loop_thread_survives_a_tick_that_raises(redis_server):
    """Anything a tick raises (here: applying the weights) is logged and counted; later ticks adapt."""
    logs, applied = [], []

    def apply(controller):
        if not applied:
            applied.append("raised")
            raise RuntimeError("applying the weights failed once")
        applied.append(controller)

    loop = SloFeedbackLoop(redis_server, "m-test", TIERS, FeedbackController(TIERS), apply, 0.05, logs.append)
    loop.client.delete(loop.key)
    target = TIERS.get("critical").ttft_target_ms
    loop.start()
    try:
        deadline = time.time() + 5
        while time.time() < deadline and len(applied) < 2:
            for _ in range(20):
                loop.window.observe("critical", 3 * target)
            time.sleep(0.05)
        assert loop._thread.is_alive() and len(applied) >= 2
        assert loop.tick_errors == 1
        assert any(json.loads(line).get("event") == "slo_feedback_error" for line in logs if line[0] == "{")
    finally:
        loop.stop()
        loop.client.delete(loop.key)


def test_read_fleet_discards_a_window_with_a_huge_integer():
    """A JSON integer too large for a float (a lying replica, bit rot) is a bad window, not an error."""
    huge = "1" + "0" * 400
    fleet = {
        b"good:critical": b'{"count": 4, "p_ms": 300.0, "ts": 1000.0}',
        b"liar:critical": ('{"count": %s, "p_ms": 1.0, "ts": 1000.0}' % huge).encode(),
    }
    read = read_fleet(fleet, now=1001.0, fresh_s=10.0)
    assert set(read.discard) == {b"liar:critical"}
    assert read.observations["critical"].count == 4


def test_a_tick_survives_and_deletes_a_window_with_a_huge_integer(redis_server):
    applied = []
    loop = SloFeedbackLoop(
        redis_server, "m-huge", TIERS, FeedbackController(TIERS), applied.append, 5.0, lambda m: None
    )
    loop.client.delete(loop.key)
    now = 1_000_000.0
    loop.client.hset(loop.key, "liar:critical", '{"count": 4, "p_ms": 1.0, "ts": %s}' % ("1" + "0" * 400))
    try:
        loop.tick(now)  # it raised OverflowError: every tick of every replica, for as long as the key lived
        assert not loop.client.hexists(loop.key, "liar:critical")
        assert loop.fields_deleted == 1
    finally:
        loop.client.delete(loop.key)
