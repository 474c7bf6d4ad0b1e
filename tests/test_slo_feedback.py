"""The SLO feedback loop through a real Redis: two replicas, fleet-wide observations, no Redis."""

from __future__ import annotations

from deploy.launch import find_free_port
from engine.slo_feedback import SloFeedbackLoop, aggregate
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
