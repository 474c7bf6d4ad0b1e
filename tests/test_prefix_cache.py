"""L1 prefix cache: stable keys, tenant isolation, eviction order, and exact reuse in the engine."""

from __future__ import annotations

import subprocess
import time
import sys
import uuid

import pytest
import torch

from cache.cost_model import LoadCostModel
from cache.response_cache import ExactResponseCache
from engine.cache_stats import cache_counters
from engine.engine import Engine
from engine.l2_pool import HostBlockPool
from engine.model_runner import KVShape, ModelRunner
from engine.prefix_cache import PrefixCache, block_keys
from engine.response_tier import ResponseTier
from engine.warmup import run_warmup
from tests.conftest import wait_for
from tests.test_engine_batching import BUCKETS, EOS, RecordingSink, model, request, run_until_idle  # noqa: F401

PREFIX = [1] + list(range(40, 88))  # 49 tokens: three full blocks of 16


def make_engine(model, capacity=16) -> Engine:  # noqa: F811
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    engine.prefix_cache = PrefixCache(runner, capacity, 16, "fingerprint")
    return engine


def run(engine, prompt, tenant="default", **params) -> list[int]:
    sink = RecordingSink()
    engine.submit(request(prompt, sink, max_tokens=6, tenant=tenant, **params))
    run_until_idle(engine)
    return sink.tokens


def test_block_keys_are_identical_in_another_process():
    code = "from engine.prefix_cache import block_keys;print(block_keys(list(range(50)), 16, b's')[-1].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == block_keys(list(range(50)), 16, b"s")[-1].hex()
    assert len(block_keys(list(range(50)), 16, b"s")) == 3
    assert block_keys(list(range(16)), 16, b"a") != block_keys(list(range(16)), 16, b"b")


def test_a_chain_continued_from_its_hashed_head_equals_the_whole_chain():
    tokens = list(range(100))
    whole = block_keys(tokens, 16, b"salt")
    head = whole[:3]
    assert head + block_keys(tokens[48:], 16, b"salt", parent=head[-1]) == whole


def test_reused_prefix_gives_the_same_tokens_as_a_full_prefill(model):  # noqa: F811
    plain = make_engine(model)
    plain.prefix_cache = None
    expected = run(plain, PREFIX + [5, 6, 7])
    engine = make_engine(model)
    run(engine, PREFIX + [9, 9])  # fills the cache with PREFIX's full blocks
    assert engine.stats.prefix_reused_tokens == 0
    assert run(engine, PREFIX + [5, 6, 7]) == expected
    assert engine.stats.prefix_reused_tokens == 48


def test_a_prompt_is_kept_during_the_next_decode_step_not_before_its_first_token_leaves(model):  # noqa: F811
    """The store waits for the next decode launch (a GPU then hides its host work), its slot's release,
    or the next lookup; a request admitted in the same step as an earlier one sharing its prefix still
    reuses it, and one that ends at its first token still leaves it."""
    engine = make_engine(model, capacity=32)
    first, second = RecordingSink(), RecordingSink()
    engine.submit(request(PREFIX + [5], first, rid="a", max_tokens=4, tenant="burst"))
    engine.submit(request(PREFIX + [6], second, rid="b", max_tokens=4, tenant="burst"))
    engine._admit()  # both start in one step: the second's lookup stores the first's prompt first
    assert engine.stats.prefix_reused_tokens == 48 and len(first.tokens) == len(second.tokens) == 1
    assert list(engine._pending_stores) == [1], "the second prompt waits for the decode step"
    engine._decode()
    assert not engine._pending_stores
    run_until_idle(engine)
    single = RecordingSink()
    engine.submit(request([1] + list(range(100, 140)), single, rid="c", max_tokens=1, tenant="one"))
    run_until_idle(engine)
    assert len(single.tokens) == 1 and not engine._pending_stores
    run(engine, [1] + list(range(100, 140)) + [7], tenant="one")
    assert engine.stats.prefix_reused_tokens == 48 + 32, "a request done at its first token kept its prompt"


def test_a_lookup_stores_only_the_pending_prompts_that_begin_with_its_first_block(model):  # noqa: F811
    """A pending prompt with another first block (or of another tenant) holds no block of the chain
    looked up, so it is left for later: on the CPU, the next decode step."""
    engine = make_engine(model, capacity=32)
    other = [1] + list(range(200, 248))
    engine.submit(request(other, RecordingSink(), rid="a", max_tokens=4, tenant="burst"))
    engine.submit(request(PREFIX + [5], RecordingSink(), rid="b", max_tokens=4, tenant="burst"))
    engine.submit(request(PREFIX + [6], RecordingSink(), rid="c", max_tokens=4, tenant="other"))
    engine._admit()
    assert sorted(engine._pending_stores) == [0, 1], "neither prompt is stored at its first token"
    assert engine.prefix_cache.lookup(other, "burst") == [], "not stored by the second request's lookup"
    engine._decode()
    assert not engine._pending_stores
    assert len(engine.prefix_cache.lookup(other + [9], "burst")) == 3
    run_until_idle(engine)
    assert engine.stats.prefix_reused_tokens == 0, "another tenant's request reused nothing"


def test_tenants_never_share_cached_prefixes(model):  # noqa: F811
    engine = make_engine(model)
    run(engine, PREFIX + [9], tenant="acme")
    run(engine, PREFIX + [9], tenant="globex")
    assert engine.stats.prefix_reused_tokens == 0
    run(engine, PREFIX + [9], tenant="acme")
    assert engine.stats.prefix_reused_tokens == 48


def test_a_bypass_request_neither_reuses_nor_leaves_a_prefix(model):  # noqa: F811
    engine = make_engine(model)
    expected = run(engine, PREFIX + [5, 6, 7], cache="bypass")
    assert not engine.prefix_cache.index, "a bypass request stored its blocks"
    run(engine, PREFIX + [9])  # an ordinary request fills the cache
    assert run(engine, PREFIX + [5, 6, 7], cache="bypass") == expected
    assert engine.stats.prefix_reused_tokens == 0, "a bypass request reused a cached prefix"
    run(engine, PREFIX + [5, 6, 7])
    assert engine.stats.prefix_reused_tokens == 48


def test_a_kv_only_request_reuses_and_keeps_prefixes_but_no_response(model, redis_server):  # noqa: F811
    """kv-only: the KV prefix tiers as for `use`, but the exact response cache is neither read nor
    written (its counters and the engine's "cached" finishes tell), so the answer is always generated."""
    engine = make_engine(model)
    exact = ExactResponseCache(redis_server, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)

    def letters(ids: list[int], trim_bytes: int = 0) -> bytes:  # the engine's token_bytes, for an answer
        data = bytes(97 + t % 26 for t in ids)
        return data[: len(data) - trim_bytes]

    engine.responses = ResponseTier(exact, letters)
    try:
        expected = run(engine, PREFIX + [5, 6, 7], cache="kv-only")
        assert engine.prefix_cache.index, "a kv-only request left no prefix behind"
        assert run(engine, PREFIX + [5, 6, 7]) == expected
        assert engine.stats.prefix_reused_tokens == 48, "use reused the prefix kv-only stored"
        assert wait_for(lambda: exact.snapshot()["stores"] == 1), "use kept no response"
        run(engine, PREFIX + [5, 6, 7])
        assert engine.stats.finished.get("cached") == 1 and exact.snapshot()["hits"] == 1
        assert run(engine, PREFIX + [5, 6, 7], cache="kv-only") == expected
        assert engine.stats.finished.get("cached") == 1, "a kv-only request was answered from the cache"
        assert engine.stats.prefix_reused_tokens == 96, "a kv-only request reused no prefix"
        run(engine, PREFIX + [8], cache="kv-only")
        engine.responses.close()  # drains the write-behind queue: every write has landed
        stats = exact.snapshot()
        assert (stats["hits"], stats["misses"]) == (1, 1), "a kv-only request read the response cache"
        assert stats["stores"] == 1, "a kv-only request wrote the response cache"
    finally:
        exact.close()


def test_eviction_takes_unpinned_tails_first(model):  # noqa: F811
    engine = make_engine(model, capacity=6)
    cache = engine.prefix_cache
    engine.prefill_template(PREFIX[:33], "default")  # two pinned blocks
    first = [1] + list(range(100, 148))  # three blocks
    run(engine, first)
    assert len(cache.lookup(first, "default")) == 3  # touched tail-first: the head is now the newest
    run(engine, [1] + list(range(200, 248)))  # three more blocks, one free slot: two evictions
    assert cache.evictions == 2
    assert len(cache.lookup(first, "default")) == 1, "the shared head survives, the tails went first"
    assert len(cache.lookup(PREFIX, "default")) == 2, "pinned template blocks are never evicted"


def test_templates_load_within_budget_and_the_rest_in_the_background(model):  # noqa: F811
    engine = make_engine(model)
    templates = [(PREFIX, "default"), ([1] + list(range(90, 130)), "default")]
    report = run_warmup(engine, enabled=True, hot_prefixes=templates, prefill_budget_s=1e-9)
    assert report.prefill_loaded == 0 and report.prefill_deferred == 2
    engine.ready = True
    engine.start()
    import time

    deadline = time.monotonic() + 30
    while engine.has_background_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.prefix_cache.lookup(PREFIX + [3], "default")) == 3
    engine.shutdown(drain_timeout_s=10)


@pytest.mark.parametrize("start", [16, 32])
def test_prefill_from_an_offset_matches_transformers(model, start):  # noqa: F811
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    prompt = PREFIX[:45]
    runner.prefill(0, prompt, 64)
    reference = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(runner.prefill(0, prompt, 32, start=start), reference, atol=1e-4, rtol=1e-4)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TimedRunner:
    """Just the KV block I/O of a ModelRunner; writing blocks into a slot takes `copy_s` per block."""

    def __init__(self, clock: FakeClock, copy_s: float):
        self.shape = KVShape(layers=1, slots=1, kv_heads=1, max_len=64, head_dim=2)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.clock, self.copy_s = clock, copy_s

    def read_blocks(self, slot: int, count: int, block_size: int) -> torch.Tensor:
        return (
            torch.arange(count, dtype=torch.float32)
            .view(count, 1, 1, 1, 1, 1)
            .expand(count, 1, 2, 1, block_size, 2)
        )

    def write_blocks(self, slot: int, blocks: torch.Tensor) -> None:
        self.clock.now += self.copy_s * blocks.shape[0]


class TimedHostPool(HostBlockPool):
    def __init__(self, clock: FakeClock, get_s: float, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.get_s = clock, get_s

    def take_run(self, keys: list[bytes], count_hits: bool = True) -> list[int]:
        """Fetching each block takes `get_s`."""
        slots = super().take_run(keys, count_hits)
        self.clock.now += self.get_s * len(slots)
        return slots


def test_an_l1_hit_books_the_predicted_recompute_minus_the_copy():
    clock = FakeClock()
    cache = PrefixCache(
        TimedRunner(clock, copy_s=0.001),
        8,
        4,
        "fp",
        clock=clock,
        cost=LoadCostModel(prior_prefill_tokens_per_s=1000),
    )
    prompt = list(range(1, 10))  # two full blocks of 4 plus one token
    cache.store(0, prompt, "t")
    hits = cache.lookup(prompt, "t")
    assert cache.load(0, hits) == 8
    l1 = cache.savings.totals("l1")
    assert (l1.loads, l1.tokens_loaded, l1.slow_loads) == (1, 8, 0)
    assert l1.seconds_saved == pytest.approx(8 / 1000 - 2 * 0.001)  # 8 tokens at 1000/s minus two copies
    assert l1.load_seconds == pytest.approx(0.002)
    counters = cache_counters(cache, None)
    assert counters[("l1", "seconds_saved")] == pytest.approx(0.006)
    assert counters[("l1", "tokens_loaded")] == 8 and counters[("l1", "slow_loads")] == 0
    assert ("l2", "seconds_saved") not in counters and ("l3", "seconds_saved") not in counters


def test_hits_are_booked_per_tier_with_that_tiers_fetch_time():
    clock = FakeClock()
    runner = TimedRunner(clock, copy_s=0.001)
    cache = PrefixCache(runner, 2, 4, "fp", clock=clock, cost=LoadCostModel(prior_prefill_tokens_per_s=1000))
    cache.l2 = TimedHostPool(clock, 0.002, 8, (1, 2, 1, 4, 2), torch.float32, pin=False)
    prompt = list(range(1, 10))
    cache.store(0, prompt, "t")  # two blocks fill L1
    cache.store(0, list(range(50, 59)), "t")  # two other blocks push them down to L2
    assert cache.evictions == 2
    cache.lookup(list(range(50, 59)), "t")  # an L1 lookup without a load is not booked
    hits = cache.lookup(prompt, "t")
    assert len(hits) == 2
    cache.load(0, hits)
    l2 = cache.savings.totals("l2")
    assert (l2.loads, l2.tokens_loaded) == (1, 8)
    assert l2.seconds_saved == pytest.approx(0.008 - (2 * 0.002 + 2 * 0.001))  # 2 fetched, 2 copied
    assert cache.savings.totals("l1").loads == 0
    cache.l2.get_s = 0.010  # an L2 slower than recomputing: booked as a loss, not as a saving
    cache.store(0, list(range(50, 59)), "t")
    cache.load(0, cache.lookup(prompt, "t"))
    l2 = cache.savings.totals("l2")
    assert (l2.loads, l2.slow_loads) == (2, 1)
    assert l2.seconds_lost_slow_load == pytest.approx(2 * 0.010 + 2 * 0.001 - 0.008)
    assert cache_counters(cache, None)[("l2", "slow_loads")] == 1


def test_engine_prefix_hits_report_time_saved(model):  # noqa: F811
    engine = make_engine(model)
    runner = engine.prefix_cache.runner
    engine.prefix_cache = PrefixCache(
        runner, 16, 16, "fp", cost=LoadCostModel(prior_prefill_tokens_per_s=100)
    )
    run(engine, PREFIX + [9, 9])
    assert cache_counters(engine.prefix_cache, None)[("l1", "seconds_saved")] == 0
    predicted = engine.prefix_cache.cost.predict_prefill_s(48)
    assert predicted != pytest.approx(0.48), "the engine's measured prefill replaced the 100 tokens/s prior"
    run(engine, PREFIX + [5, 6, 7])
    l1 = engine.prefix_cache.savings.totals("l1")
    assert l1.tokens_loaded == 48 and 0 < l1.load_seconds
    assert l1.seconds_saved - l1.seconds_lost_slow_load == pytest.approx(predicted - l1.load_seconds)


def test_eviction_skips_pinned_blocks_and_never_the_chain_being_stored():
    cache = PrefixCache(TimedRunner(FakeClock(), copy_s=0.0), 4, 4, "fp")
    cache.store(0, list(range(1, 10)), "t", pin=True)  # two blocks, pinned (room: half the pool)
    cache.store(0, [7, 7, 7, 7, 7], "t")  # one evictable block
    assert cache.store(0, list(range(20, 29)), "t") == 2  # one free slot, one eviction
    assert cache.evictions == 1 and len(cache.pinned) == 2 and cache.pinned <= set(cache.index)
    assert cache.store(0, list(range(40, 49)), "t") == 2  # evicts the previous prompt, not the pins
    assert cache.evictions == 3 and cache.pinned <= set(cache.index)


def test_a_store_counts_its_cpu_time_apart_from_its_wall_time():
    """The store's timer under load read 3-4x its cost in isolation; its CPU time, exported beside it,
    tells what it computed from what it waited."""
    clock = FakeClock()
    cache = PrefixCache(TimedRunner(clock, copy_s=0.0), 64, 4, "fp", clock=clock)
    real = cache._store

    def stalled(*args):  # a store whose thread is held up: wall time passes, no CPU time
        clock.now += 0.25
        return real(*args)

    cache._store = stalled
    for start in range(0, 400, 40):
        cache.store(0, list(range(start, start + 33)), "t")
    assert cache.store_seconds == pytest.approx(2.5)
    assert 0 < cache.store_cpu_seconds < 0.5
    counters = cache_counters(cache, None)
    assert counters[("prefix", "store_cpu_seconds")] == cache.store_cpu_seconds


def held_pattern(cache: PrefixCache, prompt: list[int], tenant: str = "t") -> list[bool]:
    return [key in cache.index for key in cache.chain_keys(prompt, tenant)]


def rows_accounted(cache: PrefixCache) -> bool:
    """Every L1 row is either free or indexed, once."""
    return sorted(list(cache.free) + list(cache.index.values())) == list(range(cache.capacity))


@pytest.mark.parametrize("pin", [False, True])
def test_a_store_never_evicts_the_head_of_its_own_chain(pin):
    """With L1 full but for the chain's cached head, a longer prompt's store keeps the head and stores
    what fits after it; evicting the head would leave the stored blocks unreachable (and, for a template,
    pinned: unevictable too)."""
    cache = PrefixCache(TimedRunner(FakeClock(), copy_s=0.0), 3, 4, "fp")
    prompt = list(range(1, 18))  # four full blocks
    cache.store(0, prompt[:5], "t")
    assert cache.lookup(prompt, "t") == [cache.index[cache.chain_keys(prompt, "t")[0]]]
    assert cache.store(0, prompt, "t", pin=pin) == 2
    assert held_pattern(cache, prompt) == [True, True, True, False]
    assert cache.pinned <= set(cache.index) and rows_accounted(cache)


def test_l1_rows_are_never_lost_through_the_engine_with_l2(model):  # noqa: F811
    """Long prompts through a small L1 with L2 behind it, as the review found them leaking rows: a store
    that evicted its own head left blocks that a later promotion from L2 entered again at new rows."""
    engine = make_engine(model, capacity=3)
    cache = engine.prefix_cache
    cache.l2 = HostBlockPool(8, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    a = [1] + list(range(40, 104))  # 65 tokens: 4 full blocks + 1
    b = [1] + list(range(150, 182))
    for prompt in (a[:17], a, b, a, a[:33]):
        run(engine, prompt)
        assert rows_accounted(cache), f"free {sorted(cache.free)}, indexed {sorted(cache.index.values())}"


class DemotionRecorder:
    """Stands in for L2: records what each `put_many` demotes (keys, their L1 rows, the kept keys)."""

    def __init__(self):
        self.demoted: list[tuple[list[bytes], list[int], frozenset[bytes]]] = []

    def put_many(self, keys, blocks, keep, rows, oldest_first=()):
        self.demoted.append((keys, rows, keep))
        self.aging = list(oldest_first)


def scan_one_victim_at_a_time(index, free, pinned, protected, count):
    """The allocation `_allocate` replaced: a scan from the oldest block per victim, moving pinned and
    protected blocks met on the way to the recent end; returns (rows, evicted (row, key) by row)."""
    rows = [free.pop() for _ in range(min(count, len(free)))]
    evicted = []
    while len(rows) < count:
        victim = None
        for _ in range(len(index)):
            if (key := next(iter(index))) not in pinned and key not in protected:
                victim = key
                break
            index.move_to_end(key)
        if victim is None:
            break
        evicted.append((index.pop(victim), victim))
        rows.append(evicted[-1][0])
    return sorted(rows), sorted(evicted)


def test_allocation_evicts_and_reorders_as_a_scan_per_victim_did():
    """`_allocate` takes all its victims in one pass over the LRU order: the same rows, the same blocks
    demoted in the same order, the same LRU order left behind, with any pinned and protected blocks."""
    import random
    from collections import OrderedDict

    rng = random.Random(0)
    cache = PrefixCache(TimedRunner(FakeClock(), copy_s=0.0), 10, 4, "fp")
    for _ in range(400):
        rows = rng.sample(range(10), 10)
        held = rng.randint(0, 10)
        index = OrderedDict((b"b%d" % row, row) for row in rows[:held])
        pinned = set(rng.sample(sorted(index), rng.randint(0, held)))
        protected = set(rng.sample(sorted(index), rng.randint(0, held // 2)))
        keep = frozenset({b"kept"})
        cache.index, cache.free, cache.evictions = OrderedDict(index), rows[held:], 0
        cache.pinned, cache._protected, cache.l2 = pinned, protected, DemotionRecorder()
        count = rng.randint(1, 12)
        expected_rows, evicted = scan_one_victim_at_a_time(index, rows[held:], pinned, protected, count)
        assert cache._allocate(count, keep) == expected_rows
        assert list(cache.index.items()) == list(index.items())
        assert cache.evictions == len(evicted)
        demoted = [([key for _, key in evicted], [row for row, _ in evicted], keep)] if evicted else []
        assert cache.l2.demoted == demoted


class ContentRunner(TimedRunner):
    """Every block read from the slot holds `base` + its position: stored and demoted rows can be checked."""

    base = 0.0

    def read_blocks(self, slot: int, count: int, block_size: int) -> torch.Tensor:
        values = self.base + torch.arange(count, dtype=torch.float32)
        return values.view(count, 1, 1, 1, 1, 1).expand(count, 1, 2, 1, block_size, 2)


@pytest.mark.parametrize("max_run_copies", [0, 4], ids=["one-scatter", "copies-per-run"])
def test_stored_and_demoted_blocks_hold_their_own_content_in_a_fragmented_pool(monkeypatch, max_run_copies):
    """A full pool hands a new prompt the rows it evicts, in several runs; each block must land in its
    own row, and each evicted block in its L2 slot, whichever way the rows are copied."""
    monkeypatch.setattr("engine.block_rows.MAX_RUN_COPIES", max_run_copies)
    runner = ContentRunner(FakeClock(), copy_s=0.0)
    cache = PrefixCache(runner, 7, 4, "fp")
    cache.l2 = HostBlockPool(32, tuple(cache.pool.shape[1:]), cache.pool.dtype, pin=False)
    expected: dict[bytes, float] = {}
    for n in range(12):
        runner.base = 100.0 * (n + 1)
        prompt = [n + 1] * (9 if n % 2 else 13)  # 2 or 3 full blocks of 4 (one token left to compute)
        keys = cache.chain_keys(prompt, "t")
        cache.store(0, prompt[: len(keys) * 4], "t")
        expected.update({key: runner.base + i for i, key in enumerate(keys)})
    assert cache.evictions > 0 and len(cache.l2.index) > 0
    for key, row in cache.index.items():
        assert torch.all(cache.pool[row] == expected[key])
    for key, slot in cache.l2.index.items():
        assert torch.all(cache.l2.pool[slot] == expected[key])


def test_a_warmed_template_stays_reusable_through_l2_under_one_off_traffic():
    """Past L1's pin room (half the pool) a warmed template's blocks are demoted like any other; they
    were unpinned in L2 too, and one-off traffic evicted them there (spec: "warmed prefixes can be
    pinned"; found by a spec review). Pinned in L2, up to half of it, the whole template stays."""
    clock = FakeClock()
    cache = PrefixCache(TimedRunner(clock, copy_s=0.0), 4, 4, "fp", clock=clock)
    cache.l2 = HostBlockPool(4, tuple(cache.pool.shape[1:]), torch.float32, pin=False)
    template = list(range(1, 18))  # 4 full blocks of 4, and 1 token to compute
    assert cache.store(0, template, "t", pin=True) == 4  # as the warmup's prefill_template
    for i in range(6):  # one-off prompts of 4 blocks each: they cycle through L1 and L2
        cache.store(0, list(range(1000 + 100 * i, 1017 + 100 * i)), "t")
    demoted = [key for key in cache.chain_keys(template, "t") if key not in cache.index]
    assert demoted and all(key in cache.l2.pinned for key in demoted)
    assert len(cache.l2.pinned) <= 2, "at most half of L2 pinned"
    assert len(cache.lookup(template, "t")) == 4, "the warmed template lost its tail to one-off traffic"


def test_l1_and_l2_count_the_blocks_they_missed_and_the_bytes_they_served():
    """Per tier hits and misses (spec, metrics): L1 and L2 counted only hits, so their hit rates could not
    be read (found by a spec review). A miss is a block a lookup asked the tier for, past what it held."""
    clock = FakeClock()
    cache = PrefixCache(TimedRunner(clock, copy_s=0.0), 4, 4, "fp", clock=clock)
    cache.l2 = HostBlockPool(8, tuple(cache.pool.shape[1:]), torch.float32, pin=False)
    a = list(range(1, 14))  # 3 full blocks of 4, and 1 token to compute
    cache.store(0, a, "t")
    assert len(cache.lookup(a + [50, 51, 52, 53], "t")) == 3  # 4 blocks asked: L1 has 3, L2 none
    assert (cache.hit_blocks, cache.miss_blocks, cache.l2.hits, cache.l2_miss_blocks) == (3, 1, 0, 1)
    cache.store(0, list(range(100, 117)), "t")  # 4 blocks of another prompt push `a` down to L2
    assert len(cache.lookup(a, "t")) == 3  # from L2 now
    assert (cache.hit_blocks, cache.miss_blocks, cache.l2.hits, cache.l2_miss_blocks) == (3, 4, 3, 1)
    counters = cache_counters(cache, None)
    block_bytes = cache.pool[0].numel() * cache.pool.element_size()
    assert counters[("l1", "miss_blocks")] == 4 and counters[("l2", "miss_blocks")] == 1
    assert counters[("l1", "bytes_loaded")] == 3 * block_bytes == counters[("l2", "bytes_loaded")]


def test_l2_counts_what_it_served_and_what_it_lacked_not_what_l1_could_not_take():
    """L2 held a 4-block chain, but L1 (2 of its 4 rows pinned) took 2: L2 counted 4 hits, 2 misses and
    4 blocks' bytes. A hit is a block served, a miss one L2 did not hold (found by a review)."""
    clock = FakeClock()
    cache = PrefixCache(TimedRunner(clock, copy_s=0.0), 4, 4, "fp", clock=clock)
    cache.l2 = HostBlockPool(16, tuple(cache.pool.shape[1:]), torch.float32, pin=False)
    chain = list(range(1, 18))  # 4 full blocks
    assert cache.store(0, chain, "t") == 4
    assert cache.store(0, list(range(500, 509)), "t", pin=True) == 2  # pinned: half of L1
    cache.store(0, list(range(900, 909)), "t")  # the rest of `chain` goes to L2 too
    assert all(key in cache.l2 for key in cache.chain_keys(chain, "t"))
    assert len(cache.lookup(chain, "t")) == 2  # room for 2
    assert (cache.l2.hits, cache.l2_miss_blocks) == (2, 0)
    block_bytes = cache.pool[0].numel() * cache.pool.element_size()
    assert cache_counters(cache, None)[("l2", "bytes_loaded")] == 2 * block_bytes


def test_the_idle_engine_publishes_counters_that_change_after_its_last_step(model):  # noqa: F811
    """The caches' asynchronous writes land after the requests that made them, when the engine no longer
    steps: the idle loop publishes the counters again for COUNTERS_SETTLE_S, then sleeps for good."""
    from engine import engine as engine_module
    from engine.observer import EngineObserver

    published: list[dict] = []

    class Recorder(EngineObserver):
        def on_cache_counters(self, counters):
            published.append(dict(counters))

    engine = make_engine(model)
    engine.observer = Recorder()
    engine.start()
    try:
        sink = RecordingSink()
        engine.submit(request(PREFIX + [5], sink, max_tokens=3))
        assert wait_for(lambda: sink.finished)
        engine.prefix_cache.tier_errors += 7  # as a write finishing after the last step would count
        assert wait_for(lambda: published and published[-1][("prefix", "tier_errors")] == 7, timeout_s=5)
        engine._busy_at = time.monotonic() - engine_module.COUNTERS_SETTLE_S  # settled: no more wake-ups
        count = len(published)
        engine.prefix_cache.tier_errors += 1
        # the wait under way ends in one more publish; polling on would make three in 3.5 s
        assert not wait_for(lambda: len(published) > count + 1, timeout_s=3.5)
        sink = RecordingSink()
        engine.submit(request(PREFIX + [6], sink, max_tokens=3))  # work wakes it, and it publishes again
        assert wait_for(lambda: sink.finished)
        assert wait_for(lambda: published[-1][("prefix", "tier_errors")] == 8, timeout_s=5)
    finally:
        engine.shutdown(drain_timeout_s=10)
