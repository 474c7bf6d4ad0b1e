"""Found in review: a request's L3 probe is queued on the `l3-probe` thread when it arrives. A request
that then never reaches its lookup (refused by admission, a full queue, a shutdown; cancelled or expired
while queued) left its probe queued: it still ran against Redis, one round trip each, and under a flood
of refused requests the requests that do run found their own probes queued behind that backlog."""

from __future__ import annotations

import threading
import time

import pytest

from engine.cache_stats import cache_counters
from scheduler.admission import AdmissionController
from scheduler.errors import RequestError
from tests.test_engine_batching import RecordingSink, model, request  # noqa: F401
from tests.test_kv_tiers import replica

BLOCKS = 3  # full blocks of 16 per prompt, plus one token


def prompt(n: int) -> list[int]:
    return [1] + [(n * 7 + i) % 250 + 3 for i in range(16 * BLOCKS)]


class GatedProbes:
    """The store's Redis probe, recording the chains asked; the first one holds the probe thread until
    `release`, so that probes started meanwhile queue behind it (a slow Redis and a burst of arrivals)."""

    def __init__(self, store):
        self.asked: list[tuple[bytes, ...]] = []
        self.holding, self.release = threading.Event(), threading.Event()
        self._real = store.exists_each_in_redis
        store.exists_each_in_redis = self

    def __call__(self, keys):
        self.asked.append(tuple(keys))
        if len(self.asked) == 1:
            self.holding.set()
            self.release.wait(10)
        return self._real(keys)


@pytest.fixture
def engine(model, redis_server, request):  # noqa: F811
    engine = replica(model, redis_server, f"kv-test:{request.node.name}")
    yield engine
    engine.prefix_cache.l3.close()


def settle(l3) -> None:
    """Every probe queued so far has run or been dropped: one thread takes them in order, so a probe
    queued last and answered means the ones before it are done."""
    assert l3.probe([b"last"]).result(timeout=10) is not None


def chain(engine, prompt_ids) -> tuple[bytes, ...]:
    return tuple(engine.prefix_cache.chain_keys(prompt_ids, "default"))


def test_a_refused_or_abandoned_requests_queued_probe_never_reaches_redis(engine):
    l3 = engine.prefix_cache.l3
    gate = GatedProbes(l3.store)
    l3.probe([b"held"])
    assert gate.holding.wait(10), "the probe thread is busy with the first probe"
    refused = []

    # refused by admission control (its tier's queue is full), the flood a rejected overload brings
    engine.admission = AdmissionController(engine.tiers, max_queued=0)
    for n in range(4):
        refused.append(prompt(n))
        with pytest.raises(RequestError) as caught:
            engine.submit(request(refused[-1], RecordingSink(), rid=f"shed-{n}"))
        assert caught.value.code == "UNAVAILABLE"
    engine.admission = None

    # cancelled while queued: the engine ends it before it takes a slot
    cancelled = RecordingSink(cancel=True)
    refused.append(prompt(10))
    engine.submit(request(refused[-1], cancelled, rid="gone"))

    # queued past its tier's max_queue_ms: expired, never run
    late = request(prompt(11), expired := RecordingSink(), rid="late")
    refused.append(prompt(11))
    late.received_ns = time.time_ns() - 3600 * 10**9
    engine.submit(late)
    engine.step()
    assert cancelled.errors and cancelled.errors[0][0] == "CANCELLED"
    assert expired.errors and expired.errors[0][0] == "UNAVAILABLE"

    # refused because the engine is shutting down
    engine._accepting = False
    refused.append(prompt(12))
    with pytest.raises(RequestError, match="shutting down"):
        engine.submit(request(refused[-1], RecordingSink(), rid="stopping"))
    engine._accepting = True

    gate.release.set()
    settle(l3)
    asked = set(gate.asked)
    wasted = [n for n, ids in enumerate(refused) if chain(engine, ids) in asked]
    assert wasted == [], f"Redis was asked about {len(wasted)} chains of requests that never ran"
    counters = cache_counters(engine.prefix_cache, None)
    assert counters[("l3", "probes_dropped")] == len(refused)


def test_a_probe_already_running_is_not_dropped(engine):
    """Only a probe still queued is dropped: one the thread has started answers as usual (not counted)."""
    l3 = engine.prefix_cache.l3
    gate = GatedProbes(l3.store)
    running = l3.probe([b"running"])
    assert gate.holding.wait(10)
    queued = l3.probe([b"queued"])
    assert not l3.drop_probe(running) and l3.drop_probe(queued) and queued.cancelled()
    gate.release.set()
    assert running.result(timeout=10) == [False]
    settle(l3)
    assert (b"queued",) not in gate.asked and l3.probes_dropped == 1


def test_a_request_that_runs_still_uses_the_probe_started_on_arrival(engine):
    """The drop touches only requests that end unrun: one that is served looks its chain up through the
    probe its arrival started (on the probe thread), as before."""
    l3 = engine.prefix_cache.l3
    names: list[str] = []
    real = l3.store.exists_each_in_redis
    l3.store.exists_each_in_redis = lambda keys: names.append(threading.current_thread().name) or real(keys)
    sink = RecordingSink()
    engine.submit(request(prompt(20), sink, rid="runs", max_tokens=2))
    settle(l3)
    for _ in range(20):
        if not engine.step():
            break
    assert sink.finished and not sink.errors
    assert names and all(name.startswith("l3-probe") for name in names), names
    assert cache_counters(engine.prefix_cache, None)[("l3", "probes_dropped")] == 0
