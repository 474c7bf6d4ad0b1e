"""The warmup's L3 prefetch of hot prefixes: concurrent with kernel warmup, exact, tenant-salted, and
harmless when Redis is down or holds damaged values (real redis-server, small random Llama)."""

from __future__ import annotations

import threading
import time

import pytest

from cache.cost_model import LoadCostModel
from deploy.launch import find_free_port
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.warmup import run_warmup
from tests.test_engine_batching import BUCKETS, EOS, model  # noqa: F401
from tests.test_kv_tiers import PROMPT, replica, serve

OTHER = [1] + list(range(150, 198))  # another 49-token hot prefix: three full blocks of 16
TEMPLATES = [(PROMPT, "default"), (OTHER, "default")]


def seeded(model, redis_url, namespace, templates=TEMPLATES) -> None:  # noqa: F811
    """A replica that computed the templates and wrote their blocks to Redis (flushed)."""
    first = replica(model, redis_url, namespace)
    for prompt, tenant in templates:
        first.prefill_template(prompt, tenant)
    first.prefix_cache.l3.close()


def scratch(model) -> Engine:  # noqa: F811
    """No prefix cache at all: every prompt computed from scratch."""
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    return Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)


class Spy:
    """Wraps the store's calls: records the keys L3 is asked about, optionally slows the GET, or holds
    it until `gate` is set (a fetch in flight for as long as the test needs, however slow the host)."""

    def __init__(self, store, get_delay_s: float = 0.0, gate: threading.Event | None = None):
        self.asked: list[list[bytes]] = []
        self.threads: set[str] = set()
        exists, get = store.exists_chain, store.get_chain

        def exists_chain(keys):
            self.asked.append(list(keys))
            self.threads.add(threading.current_thread().name)
            return exists(keys)

        def get_chain(keys, meta):
            if gate is not None:
                assert gate.wait(60), "the test never released the fetch"
            time.sleep(get_delay_s)
            return get(keys, meta)

        store.exists_chain, store.get_chain = exists_chain, get_chain


def stage(report, name):
    return next(s for s in report.stages if s.name == name)


def test_prefetch_runs_during_kernel_warmup_and_gives_identical_outputs(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace)
    engine = replica(model, redis_server, namespace)
    # a slow Redis: each fetch outlasts the kernel warmup (0.4 s on the CI VM, 1.3 s with its two cores
    # busy elsewhere), so the first template waits for its fetch
    spy = Spy(engine.prefix_cache.l3.store, get_delay_s=1.5)
    report = run_warmup(engine, enabled=True, hot_prefixes=TEMPLATES, prefill_budget_s=5.0)

    prefetch, kernels = stage(report, "l3_prefetch"), stage(report, "prefill_buckets")
    templates = stage(report, "prefix_templates")
    assert prefetch.start_s < kernels.start_s < prefetch.end_s, "fetching while the kernels warm"
    assert prefetch.start_s < kernels.end_s
    assert prefetch.end_s > templates.start_s and report.l3_prefetch["templates_waited_s"] > 0
    assert report.l3_prefetch["outcomes"] == {"loaded": 2} and prefetch.items == 6
    assert report.l3_prefetch["blocks_used"] == 6 and report.l3_prefetch["in_flight"] == 0
    assert report.prefill_loaded == 2 and report.prefill_deferred == 0 and report.failures == []
    assert spy.asked == [engine.prefix_cache.chain_keys(p, t) for p, t in TEMPLATES], "L3 asked once each"
    assert spy.threads == {"l3-prefetch"}
    assert engine.prefix_cache.savings.totals("l3").tokens_loaded == 96, "booked as L3 reuse"
    assert engine.prefix_cache.hit_blocks == 0

    plain = scratch(model)
    for prompt, _ in TEMPLATES:
        reused = engine.stats.prefix_reused_tokens
        assert serve(engine, prompt + [5]) == serve(plain, prompt + [5])
        assert engine.stats.prefix_reused_tokens - reused == 48
    assert len(spy.asked) == 2, "served from the adopted (pinned) L1 blocks"
    engine.prefix_cache.l3.close()


def test_a_fetch_still_in_flight_is_deferred_and_adopted_in_the_background(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace)
    engine = replica(model, redis_server, namespace)
    held = threading.Event()  # the fetches outlast the warmup: in flight when it ends
    spy = Spy(engine.prefix_cache.l3.store, gate=held)
    report = run_warmup(engine, enabled=True, hot_prefixes=TEMPLATES, prefill_budget_s=0.05)
    assert report.prefill_loaded == 0 and report.prefill_deferred == 2
    assert report.l3_prefetch["templates_waits"] == 1
    assert 0.04 < report.l3_prefetch["templates_waited_s"] < 0.5, "waited for the budget, not for the fetch"
    assert report.l3_prefetch["in_flight"] == 2 and stage(report, "l3_prefetch").end_s is None
    held.set()
    engine.ready = True
    engine.start()
    deadline = time.monotonic() + 30
    while (engine.deferred_templates or engine.template_prefetch.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.shutdown(drain_timeout_s=10)  # joins the engine thread: the last template's step is done
    assert not engine.deferred_templates
    cache = engine.prefix_cache
    for prompt, tenant in TEMPLATES:
        keys = cache.chain_keys(prompt, tenant)
        assert all(key in cache.index and key in cache.pinned for key in keys)
    assert len(spy.asked) == 2 and engine.template_prefetch.blocks_used == 6
    assert cache.savings.totals("l3").tokens_loaded == 96


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_dead_redis_ends_the_prefetch_and_warmup_completes_as_without_it(model, prefetch):  # noqa: F811
    engine = replica(model, f"redis://localhost:{find_free_port()}/0", "prefetch-dead")
    report = run_warmup(
        engine, enabled=True, hot_prefixes=TEMPLATES, prefill_budget_s=5.0, l3_prefetch=prefetch
    )
    assert report.prefill_loaded == 2 and report.failures == [], "Redis trouble is not a warmup failure"
    stats = engine.prefix_cache.l3.store.stats
    assert stats.errors + stats.breaker_rejections >= 2 and stats.hits == 0
    if prefetch:
        assert report.l3_prefetch["outcomes"] == {"error": 1} and report.l3_prefetch["given_up"] == 2
        assert report.l3_prefetch["blocks"] == 0 and report.l3_prefetch["error"] is None
    else:
        assert report.l3_prefetch == {} and "l3_prefetch" not in [s.name for s in report.stages]
    plain = scratch(model)
    assert serve(engine, PROMPT + [3]) == serve(plain, PROMPT + [3])
    assert engine.stats.prefix_reused_tokens == 48, "the templates were computed into L1"
    engine.prefix_cache.l3.close()


def test_corrupted_blocks_are_dropped_and_the_rest_computed(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace, [(PROMPT, "default")])
    engine = replica(model, redis_server, namespace)
    second_block = engine.prefix_cache.chain_keys(PROMPT, "default")[1]
    raw = engine.prefix_cache.l3.store.client
    raw.setrange(engine.prefix_cache.l3.store.redis_key(second_block), 40, b"\x00\xff\x00\xff")
    report = run_warmup(engine, enabled=True, hot_prefixes=[(PROMPT, "default")], prefill_budget_s=5.0)
    assert report.l3_prefetch["outcomes"] == {"partial": 1} and report.l3_prefetch["blocks"] == 1
    assert engine.prefix_cache.l3.store.stats.checksum_failures == 1 and report.failures == []
    assert report.prefill_loaded == 1
    assert serve(engine, PROMPT + [7]) == serve(scratch(model), PROMPT + [7])
    assert engine.stats.prefix_reused_tokens == 48
    engine.prefix_cache.l3.close()


def test_a_prefix_is_fetched_under_its_own_tenants_keys_only(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace, [(PROMPT, "acme")])
    engine = replica(model, redis_server, namespace)
    spy = Spy(engine.prefix_cache.l3.store)
    hot = [(PROMPT, "acme"), (PROMPT, "globex")]
    report = run_warmup(engine, enabled=True, hot_prefixes=hot, prefill_budget_s=5.0)
    cache = engine.prefix_cache
    acme, globex = cache.chain_keys(PROMPT, "acme"), cache.chain_keys(PROMPT, "globex")
    assert not set(acme) & set(globex)
    assert spy.asked == [acme, globex]
    assert report.l3_prefetch["outcomes"] == {"loaded": 1, "missing": 1} and report.l3_prefetch["blocks"] == 3
    assert cache.savings.totals("l3").tokens_loaded == 48, "only acme's blocks came from Redis"
    assert report.prefill_loaded == 2 and all(key in cache.index for key in acme + globex)
    cache.l3.close()  # flushes globex's computed blocks, written under globex's own keys
    store = cache.l3.store
    assert all(store.client.exists(store.redis_key(key)) for key in acme + globex)


def test_prefetch_off_or_without_hot_prefixes_changes_nothing(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace)
    for kwargs in ({"hot_prefixes": TEMPLATES, "l3_prefetch": False}, {"hot_prefixes": []}):
        engine = replica(model, redis_server, namespace, cost=LoadCostModel(prior_prefill_tokens_per_s=50.0))
        report = run_warmup(engine, enabled=True, prefill_budget_s=5.0, **kwargs)
        assert engine.template_prefetch is None and report.l3_prefetch == {}
        assert "l3_prefetch" not in [s.name for s in report.stages]
        engine.prefix_cache.l3.close()


def test_a_prefetch_bug_is_a_warmup_failure_not_a_load_failure(model, redis_server, request):  # noqa: F811
    namespace = f"prefetch-test:{request.node.name}"
    seeded(model, redis_server, namespace)
    engine = replica(model, redis_server, namespace)
    l3 = engine.prefix_cache.l3
    fetch = l3.fetch_with_outcome

    def broken(keys, present=None):
        if threading.current_thread().name == "l3-prefetch":
            raise RuntimeError("simulated prefetch bug")
        return fetch(keys, present)

    l3.fetch_with_outcome = broken
    report = run_warmup(engine, enabled=True, hot_prefixes=TEMPLATES, prefill_budget_s=5.0)
    assert report.failures == [{"stage": "l3_prefetch", "error": "RuntimeError: simulated prefetch bug"}]
    assert report.l3_prefetch["given_up"] == 2 and report.prefill_loaded == 2
    assert l3.loaded_blocks == 6, "the lookup path loaded the templates from L3 itself"
    l3.close()


def test_a_templates_tenant_is_read_as_a_requests_is(tmp_path):
    """An empty tenant is "default", as for a request; a name no request could use is a warmup failure,
    not a template pinned under a salt that never hits."""
    from engine.loader import load_templates
    from tests.conftest import MODEL_DIR

    path = tmp_path / "templates.yaml"
    path.write_text("templates:\n  - tenant:\n    text: 'You are the support assistant. Question'\n"
                    "  - tenant: ''\n    text: 'Summarize the following document. Document'\n"
                    "  - text: 'Translate into French. Text'\n", encoding="utf-8")  # fmt: skip
    prefixes, failures = load_templates(str(path), MODEL_DIR)
    assert [tenant for _, tenant in prefixes] == ["default"] * 3 and failures == []
    path.write_text("templates:\n  - tenant: 'bad tenant!'\n    text: 'A question'\n", encoding="utf-8")
    prefixes, failures = load_templates(str(path), MODEL_DIR)
    assert prefixes == [] and "invalid tenant" in failures[0]["error"]


def test_another_threads_redis_failure_does_not_end_the_prefetch(model, redis_server):  # noqa: F811
    """The prefetch gives up when its own calls fail (Redis down); a failure of another thread's call
    (the L3 writer timing out on a template's write) while a fetch finds nothing says nothing of Redis
    for the prefetch, which goes on to the next prefix."""
    import redis

    from engine.l3_prefetch import L3Prefetcher

    engine = replica(model, redis_server, "prefetch-other-thread")
    store = engine.prefix_cache.l3.store
    exists = store.exists_chain

    def failing_elsewhere() -> None:
        def refused():
            raise redis.ConnectionError("the writer's call")

        store._call(refused)

    def exists_chain(keys):
        other = threading.Thread(target=failing_elsewhere)
        other.start()
        other.join()
        return exists(keys)

    store.exists_chain = exists_chain
    prefetch = L3Prefetcher(engine.prefix_cache.l3, engine.prefix_cache.chain_keys, TEMPLATES)
    prefetch.start()
    for prompt, tenant in TEMPLATES:
        assert prefetch.wait(prompt, tenant, 60)
    assert store.stats.errors == 2, "the other thread's calls did fail"
    assert prefetch.outcomes == {"missing": 2} and prefetch.given_up == 0
