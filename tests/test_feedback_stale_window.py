"""A published TTFT window is one observation: it must move the weights once, not again on every tick
until it ages past fresh_s (2 intervals), while no new request of that tier was seen anywhere."""

from engine.slo_feedback import SloFeedbackLoop
from scheduler.feedback import FeedbackController
from scheduler.tiers import TierTable

TIERS = TierTable.defaults()


def test_an_idle_tick_does_not_act_on_the_window_already_acted_on(redis_server):
    loop = SloFeedbackLoop(
        redis_server, "m-stale", TIERS, FeedbackController(TIERS), lambda c: None, 5.0, lambda m: None
    )
    loop.client.delete(loop.key)
    target = TIERS.get("critical").ttft_target_ms
    for _ in range(20):
        loop.window.observe("critical", 3 * target)
    now = 1_000_000.0
    first = loop.tick(now)
    assert any(e.tier == "critical" and e.kind == "weight" for e in first)
    after_burst = loop.controller.weights["critical"]
    # the next two intervals see no critical request at all: nothing new to act on
    assert loop.tick(now + 5.0) == ()
    assert loop.tick(now + 10.0) == ()
    assert loop.controller.weights["critical"] == after_burst


def test_a_window_of_another_replica_is_acted_on_once(redis_server):
    def make():
        return SloFeedbackLoop(
            redis_server, "m-stale2", TIERS, FeedbackController(TIERS), lambda c: None, 5.0, lambda m: None
        )

    a, b = make(), make()
    a.client.delete(a.key)
    target = TIERS.get("critical").ttft_target_ms
    for _ in range(20):
        a.window.observe("critical", 3 * target)
    now = 2_000_000.0
    a.tick(now)
    assert b.tick(now + 1.0)  # B acts on A's window
    moved = b.controller.weights["critical"]
    assert b.tick(now + 6.0) == ()  # A's window is the same one: B already acted on it
    assert b.controller.weights["critical"] == moved
