"""Exact response cache against a real redis-server (tests/conftest.py ``redis_server``)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest
import redis

from cache.circuit_breaker import BreakerState, CircuitBreaker
from cache.key_directory import MAX_TRIM_PER_WRITE, KeyDirectory
from cache.response_cache import (
    ExactResponseCache,
    canonical_json,
    exact_namespace,
    is_deterministic,
    ExactAnswer,
    exact_signature,
    sha256_hex,
)
from deploy.launch import find_free_port
from engine.response_tier import ResponseTier
from scheduler.messages import EngineRequestParams
from tests.conftest import wait_for, answer
from tests.test_redis_kv_store import FakeClock

PROMPT = [1, 15, 27, 99, 3]
ONE = EngineRequestParams(max_tokens=1)  # a budget every one-token answer serves


@pytest.fixture
def cache(redis_server):
    c = ExactResponseCache(redis_server, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    yield c
    c.close()


def test_roundtrip_and_stats(cache):
    params = EngineRequestParams(max_tokens=8)
    assert cache.get(PROMPT, params) is None
    assert cache.put(PROMPT, params, answer("hello world"))
    assert cache.get(PROMPT, params) == answer("hello world")
    s = cache.snapshot()
    assert (s["hits"], s["misses"], s["stores"], s["errors"]) == (1, 1, 1, 0)


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.5},
        {"temperature": 0.0},
        {"top_p": 0.9},
        {"top_k": 5},
        {"seed": 7},
        {"stop": ("\n",)},
        {"ignore_eos": True},
        {"tenant": "other"},
    ],
)
def test_key_changes_with_every_sampling_parameter_but_max_tokens_and_with_the_tenant(cache, change):
    base = EngineRequestParams(max_tokens=8, temperature=0.7, seed=3)
    assert cache.key(PROMPT, base) != cache.key(PROMPT, dataclasses.replace(base, **change))


@pytest.mark.parametrize(
    "change", [{"top_p": 0.5}, {"top_k": 40}, {"seed": 7}, {"exclude_input_in_output": True}]
)
def test_key_ignores_what_does_not_change_a_greedy_answer_or_what_is_cached(cache, change):
    """Argmax ignores top_p, top_k and seed; the caches hold the generated text only, and a hit puts the
    prompt in front as asked. Keyed on, they split one answer over several keys (misses). Found in review."""
    base = EngineRequestParams(max_tokens=8, temperature=0.0)
    assert cache.key(PROMPT, base) == cache.key(PROMPT, dataclasses.replace(base, **change))
    sampled = dataclasses.replace(base, temperature=0.7, seed=3)
    if "exclude_input_in_output" in change:
        assert cache.key(PROMPT, sampled) == cache.key(PROMPT, dataclasses.replace(sampled, **change))


def test_key_ignores_fields_that_do_not_change_the_text(cache):
    base = EngineRequestParams(max_tokens=8)
    other = dataclasses.replace(base, stream=True, tier="critical", arrival_ns=123)
    assert cache.key(PROMPT, base) == cache.key(PROMPT, other)
    assert cache.key(PROMPT, base) != cache.key(PROMPT[:-1], base)


def test_key_is_stable_across_instances(redis_server):
    a = ExactResponseCache(redis_server, "fp")
    b = ExactResponseCache(redis_server, "fp")
    params = EngineRequestParams(max_tokens=4, stop=("x", "y"))
    assert a.key(PROMPT, params) == b.key(tuple(PROMPT), params)
    assert ExactResponseCache(redis_server, "fp2").key(PROMPT, params) != a.key(PROMPT, params)


def test_sampling_without_seed_is_not_cacheable(cache):
    sampled = EngineRequestParams(temperature=0.7)
    assert not cache.cacheable(sampled) and not is_deterministic(sampled)
    assert cache.cacheable(EngineRequestParams(temperature=0.7, seed=3))
    assert cache.cacheable(EngineRequestParams(temperature=0.0))
    assert cache.put(PROMPT, sampled, answer("x")) is False
    assert cache.get(PROMPT, sampled) is None
    assert cache.snapshot()["uncacheable"] == 2


def test_tenant_a_never_gets_tenant_b_entry(cache):
    a = EngineRequestParams(tenant="a")
    b = EngineRequestParams(tenant="b")
    assert cache.put(PROMPT, a, answer("secret of a"))
    assert cache.get(PROMPT, b) is None
    # even a value copied byte for byte under b's key is refused: the checksum covers the key
    raw = cache.client.get(cache.key(PROMPT, a))
    cache.client.set(cache.key(PROMPT, b), raw)
    assert cache.get(PROMPT, b) is None
    assert cache.snapshot()["corrupt"] == 1
    assert cache.get(PROMPT, a) == answer("secret of a")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: raw.replace(b"true", b"false"),  # flipped "final", stale checksum
        lambda raw: raw.replace(b"[[", b"[[7,").replace(b"],2,", b"],3,"),  # a token more, stale checksum
        lambda raw: b"\x80\x04\x95 not json",  # a pickle-looking blob
        lambda raw: json.dumps({**json.loads(raw), "v": 99}).encode(),  # unknown format version
        lambda raw: json.dumps({**json.loads(raw), "v": 1, "text": "hello there"}).encode(),  # format 1
        lambda raw: raw.replace(b'"sum":"', b'"sum":"\\ud800'),  # a lone surrogate: UTF-8 cannot encode it
        lambda raw: b"[" * 60000 + b"]" * 60000,  # nested too deep for the parser
    ],
)
def test_corrupted_values_are_rejected_and_deleted(cache, mangle):
    params = EngineRequestParams()
    cache.put(PROMPT, params, answer("hello there"))
    key = cache.key(PROMPT, params)
    raw = cache.client.get(key)
    assert mangle(raw) != raw, "the mangling changed nothing"
    cache.client.set(key, mangle(raw))
    assert cache.get(PROMPT, params) is None
    assert cache.client.exists(key) == 0
    assert cache.snapshot()["corrupt"] == 1


@pytest.mark.parametrize(
    "document",
    [
        [[1, "2"], 2, 0, True],  # an id that is a string
        [[1, -2], 2, 0, True],  # a negative id
        [[1, 2.0], 2, 0, True],  # a float id
        [[1, True], 2, 0, True],  # a bool id
        [[1, 1 << 31], 2, 0, True],  # an id past int32
        [[1, 2], 2, -1, True],  # a negative trim
        [[1, 2], 3, 0, True],  # more sent than generated
        [[1, 2], 2, 0, 1],  # "final" that is not a bool
        [[1, 2], 2, 1, False],  # a stop string's trim on an answer that is not final
        [[1, 2], 1, 0, False],  # a stop string's cut on an answer that is not final
        [[1, 2], 2, 0],  # a field missing
        {"ids": [1, 2]},  # not the list written
    ],
)
def test_values_of_the_wrong_shape_are_rejected_even_with_a_matching_checksum(cache, document):
    """A checksum is no signature: whoever writes to Redis can sum a bad document too. The engine sends a
    hit's ids to the detokenizer as they come, so only non-negative int32 ids, a count sent and a trim
    that fit them, and a bool pass."""
    params = EngineRequestParams()
    key = cache.key(PROMPT, params)
    summed = sha256_hex(key.encode("utf-8"), canonical_json(document))
    cache.client.set(key, canonical_json({"v": 2, "answer": document, "sum": summed}))
    assert cache.get(PROMPT, params) is None and cache.client.exists(key) == 0
    assert cache.snapshot()["corrupt"] == 1
    good = [[1, 2], 2, 0, True]
    cache.client.set(
        key, canonical_json({"v": 2, "answer": good, "sum": sha256_hex(key.encode(), canonical_json(good))})
    )
    assert cache.get(PROMPT, params) == ExactAnswer((1, 2), 0, True), "the same value, well formed, is served"


def test_an_answer_serves_every_budget_it_decides_and_none_other(cache):
    """max_tokens is not in the key: a final answer (EOS, a stop string, the model's last position) serves
    any budget, cut to its first tokens for a smaller one; one stopped by its budget serves that budget or
    a smaller one, and a larger budget misses (counted `shorter`)."""
    at = lambda n: dataclasses.replace(EngineRequestParams(), max_tokens=n)  # noqa: E731
    assert cache.key(PROMPT, at(3)) == cache.key(PROMPT, at(300))
    assert cache.put(PROMPT, at(16), ExactAnswer((5, 6, 7), 4, True))
    assert cache.get(PROMPT, at(3)) == ExactAnswer((5, 6, 7), 4, True)
    assert cache.get(PROMPT, at(500)) == ExactAnswer((5, 6, 7), 4, True)
    assert cache.get(PROMPT, at(2)) == ExactAnswer((5, 6), 0, False), "cut before its stop string: no trim"
    cache.client.delete(cache.key(PROMPT, at(3)))
    assert cache.put(PROMPT, at(3), ExactAnswer((5, 6, 7), 0, False))
    assert cache.get(PROMPT, at(3)) == ExactAnswer((5, 6, 7), 0, False)
    assert cache.get(PROMPT, ONE) == ExactAnswer((5,), 0, False)
    assert cache.get(PROMPT, at(4)) is None
    s = cache.snapshot()
    assert (s["hits"], s["misses"], s["shorter"]) == (5, 1, 1)


def test_a_write_keeps_an_entry_that_serves_more_budgets(cache):
    """The warmup job refreshes answers (`cache=refresh`, nothing read first) at its own max_tokens, and a
    write may follow a lookup that failed: neither may cut down what clients asking more are served."""
    params = EngineRequestParams(max_tokens=64)
    final, long, short = ExactAnswer((1, 2, 3), 0, True), ExactAnswer((1, 2, 3, 4)), ExactAnswer((1,))
    assert cache.put(PROMPT, params, final)
    assert not cache.put(PROMPT, params, short) and not cache.put(PROMPT, params, long)
    assert cache.get(PROMPT, params) == final and cache.snapshot()["kept"] == 2
    cache.client.delete(cache.key(PROMPT, params))
    assert cache.put(PROMPT, params, short)
    assert cache.put(PROMPT, params, long), "a longer answer replaces a shorter one"
    assert not cache.put(PROMPT, params, short)
    assert cache.put(PROMPT, params, final), "a final answer replaces one stopped at its budget"
    assert cache.get(PROMPT, params) == final and cache.snapshot()["kept"] == 3


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(lambda c, key: c.client.set(key, b"\x00not json"), id="bytes"),
        pytest.param(lambda c, key: c.client.set(key, b"[1, 2]"), id="json-not-an-object"),
        pytest.param(lambda c, key: c.client.set(key, b'{"v": 1, "text": "old", "sum": "0"}'), id="format-1"),
        pytest.param(lambda c, key: c.client.set(key, b'{"v": 2, "answer": "x", "sum": "0"}'), id="no-list"),
        pytest.param(lambda c, key: c.client.hset(key, "field", "not ours"), id="another-type"),
    ],
)
def test_a_write_replaces_what_is_not_an_answer(cache, stored):
    """The write's check runs in Redis (Lua): whatever it cannot read as an answer is no reason to keep it,
    and a value of another type neither fails the write nor opens the breaker."""
    params = EngineRequestParams(max_tokens=64)
    key = cache.key(PROMPT, params)
    stored(cache, key)
    assert cache.put(PROMPT, params, ExactAnswer((1,)))
    assert cache.get(PROMPT, ONE) == ExactAnswer((1,)) and cache.snapshot()["errors"] == 0
    assert cache.client.ttl(key) > 0


def test_a_value_that_fails_its_checksum_keeps_out_one_write_then_goes(cache):
    """Lua cannot check SHA-256: a final answer copied under another key looks final to the write, which
    keeps it; the next read finds the checksum wrong, deletes it, and the write after that lands."""
    params = EngineRequestParams(max_tokens=64)
    key, elsewhere = cache.key(PROMPT, params), cache.key([9, 9], params)
    cache.client.set(key, cache.encode_value(elsewhere, ExactAnswer((4, 4), 0, True)))
    assert not cache.put(PROMPT, params, ExactAnswer((1,)))
    assert cache.get(PROMPT, ONE) is None and cache.snapshot()["corrupt"] == 1
    assert cache.put(PROMPT, params, ExactAnswer((1,))) and cache.get(PROMPT, ONE) == ExactAnswer((1,))


def test_a_value_of_another_type_under_a_key_is_deleted_as_corrupt_without_opening_the_breaker(cache):
    """GET of a key that holds a hash fails with WRONGTYPE: one bad value, not a Redis failure."""
    params = EngineRequestParams()
    key = cache.key(PROMPT, params)
    for _ in range(6):  # more than the breaker's failure threshold
        cache.client.hset(key, "field", "not ours")
        assert cache.get(PROMPT, params) is None
        assert cache.client.exists(key) == 0
    assert cache.snapshot()["corrupt"] == 6 and cache.snapshot()["errors"] == 0
    assert cache.breaker.state is BreakerState.CLOSED
    assert cache.put(PROMPT, params, answer("hello there")) and cache.get(PROMPT, params) == answer(
        "hello there"
    )
    clock = FakeClock()  # as the half-open probe after an outage, the WRONGTYPE reply closes the breaker
    cache.breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    cache.breaker.record_failure()
    clock.now = 5.0
    cache.client.delete(key)
    cache.client.hset(key, "field", "not ours")
    assert cache.get(PROMPT, params) is None and cache.breaker.state is BreakerState.CLOSED


def test_a_sub_second_ttl_is_a_second_not_ex_0(redis_server):
    cache = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", ttl_s=0.5)
    greedy = EngineRequestParams()
    assert cache.put(PROMPT, greedy, answer("hello")) and cache.client.ttl(cache.key(PROMPT, greedy)) == 1
    assert cache.snapshot()["errors"] == 0


def test_dead_redis_returns_misses_quickly():
    port = find_free_port()  # nothing listens there
    c = ExactResponseCache(f"redis://localhost:{port}/0", "fp", timeout_s=0.05)
    params = EngineRequestParams()
    t0 = time.perf_counter()
    for _ in range(50):
        assert c.get(PROMPT, params) is None
        assert c.put(PROMPT, params, answer("x")) is False
    assert time.perf_counter() - t0 < 1.0
    assert c.snapshot()["errors"] == 100
    assert c.breaker.state is BreakerState.OPEN


def test_slow_redis_times_out_and_breaker_recovers(redis_server):
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, reset_timeout_s=5.0, clock=lambda: now[0])
    c = ExactResponseCache(redis_server, "fp-slow", timeout_s=0.05, breaker=breaker)
    params = EngineRequestParams()
    assert c.put(PROMPT, params, answer("cached"))
    admin = redis.Redis.from_url(redis_server)
    admin.execute_command("CLIENT", "PAUSE", "400", "ALL")  # the server stops answering for 0.4 s
    t0 = time.perf_counter()
    assert c.get(PROMPT, params) is None
    assert c.get(PROMPT, params) is None
    assert c.get(PROMPT, params) is None  # breaker open: not even tried
    assert time.perf_counter() - t0 < 0.4
    assert breaker.state is BreakerState.OPEN and c.snapshot()["errors"] == 3
    admin.execute_command("CLIENT", "UNPAUSE")
    assert wait_for(admin.ping, 5)  # the server answers again
    now[0] += 6.0  # past the cooldown: one probe goes through, succeeds, closes the breaker
    assert c.get(PROMPT, params) == answer("cached")
    assert breaker.state is BreakerState.CLOSED


def test_key_packs_the_ids_as_little_endian_int64_after_the_json_of_the_rest(redis_server):
    """The layout other machines must reproduce: a host of another byte order or integer type gives the
    same key (numpy ids included), and a prompt's ids never collide with a longer one's."""
    import hashlib
    import struct

    import numpy as np

    cache = ExactResponseCache(redis_server, "fp")
    params = EngineRequestParams(max_tokens=4)
    doc = {"fp": "fp", "tenant": params.tenant, "sampling": exact_signature(params)}
    digest = hashlib.sha256()
    for part in (canonical_json(doc), struct.pack("<3q", 1, 2, 70000)):
        digest.update(len(part).to_bytes(8, "little") + part)
    assert cache.key([1, 2, 70000], params).endswith(":" + digest.hexdigest())
    assert cache.key(np.array([1, 2, 70000]), params) == cache.key([1, 2, 70000], params)
    assert cache.key([1, 2], params) != cache.key([1, 2, 0], params)


def _quota_cache(redis_server, limit: int) -> ExactResponseCache:
    return ExactResponseCache(
        redis_server, fingerprint=f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_entries=limit
    )


def test_a_tenant_past_its_quota_pushes_out_its_own_oldest_answers_not_another_tenants(redis_server):
    cache = _quota_cache(redis_server, 3)
    raw = redis.Redis.from_url(redis_server)
    quiet, flood = (
        EngineRequestParams(max_tokens=8, tenant="quiet"),
        EngineRequestParams(max_tokens=8, tenant="flood"),
    )
    try:
        assert cache.put(PROMPT, quiet, answer("quiet answer"))
        for n in range(10):
            assert cache.put([n, 1, 2], flood, answer(f"flood {n}"))
        assert cache.get(PROMPT, quiet) == answer("quiet answer"), (
            "another tenant's writes never trim this one's"
        )
        held = [cache.get([n, 1, 2], flood) for n in range(10)]
        assert held == [None] * 7 + [answer("flood 7"), answer("flood 8"), answer("flood 9")], (
            "the flood keeps its newest three"
        )
        assert raw.zcard(cache.tenant_index("flood")) == 3 and raw.zcard(cache.tenant_index("quiet")) == 1
        assert cache.snapshot()["quota_evictions"] == 7 and cache.snapshot()["stores"] == 11
    finally:
        cache.close()


def test_a_renewed_answer_is_trimmed_after_answers_used_longer_ago(redis_server):
    cache = _quota_cache(redis_server, 3)
    params = EngineRequestParams(max_tokens=8, tenant="t")
    try:
        for n in range(3):
            assert cache.put([n], params, answer(f"answer {n}"))
        assert cache.renew([cache.key([0], params)], "t"), "the oldest answer was used just now"
        assert cache.put([3], params, answer("answer 3"))
        assert [cache.get([n], params) for n in range(4)] == [
            answer("answer 0"),
            None,
            answer("answer 2"),
            answer("answer 3"),
        ]
        assert cache.snapshot()["renewals"] == 1
    finally:
        cache.close()


def test_no_quota_by_default_writes_no_index_and_renews_nothing(redis_server, cache):
    raw = redis.Redis.from_url(redis_server)
    params = EngineRequestParams(max_tokens=8, tenant="t")
    assert cache.put(PROMPT, params, answer("x")) and raw.exists(cache.tenant_index("t")) == 0
    assert not cache.renew([cache.key(PROMPT, params)], "t")
    assert cache.snapshot()["renewals"] == 0
    with pytest.raises(ValueError, match="tenant_max_entries must be >= 0"):
        ExactResponseCache(redis_server, fingerprint="fp", tenant_max_entries=-1)


def test_a_renewal_leaves_names_the_index_does_not_list_alone(redis_server):
    """An answer of another tenant (or one written before the quota) must not get a TTL its index does
    not have: `forget-tenant` finds a tenant's answers by name, but the quota trims by the index."""
    cache = _quota_cache(redis_server, 3)
    raw = redis.Redis.from_url(redis_server)
    b = EngineRequestParams(max_tokens=8, tenant="b")
    try:
        assert cache.put(PROMPT, b, answer("b's"))
        raw.expire(cache.key(PROMPT, b), 100)
        assert cache.renew([cache.key(PROMPT, b)], "a")
        assert raw.ttl(cache.key(PROMPT, b)) <= 100 and raw.zcard(cache.tenant_index("a")) == 0
        assert cache.snapshot()["renewals"] == 0, "nothing listed, nothing renewed (found in review)"
    finally:
        cache.close()


def test_a_renewal_against_a_dead_redis_is_a_counted_error_not_an_exception():
    cache = ExactResponseCache(
        f"redis://127.0.0.1:{find_free_port()}/0", fingerprint="fp", timeout_s=0.05, tenant_max_entries=5
    )
    try:
        assert not cache.renew(["k"], "t")
        assert cache.snapshot()["errors"] == 1 and cache.snapshot()["renewals"] == 0
    finally:
        cache.close()


def test_a_quota_lowered_under_what_a_tenant_holds_is_reached_over_several_writes(redis_server):
    """Deleting the whole excess in one script held Redis for 256 ms at 100,000 answers over a quota of
    1,000, past every client's timeout: a write deletes at most MAX_TRIM_PER_WRITE more than it wrote."""
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    params = EngineRequestParams(max_tokens=8, tenant="t")
    raw = redis.Redis.from_url(redis_server)
    before = ExactResponseCache(redis_server, fingerprint, timeout_s=0.5, tenant_max_entries=1000)
    lowered = ExactResponseCache(redis_server, fingerprint, timeout_s=0.5, tenant_max_entries=10)
    try:
        for n in range(600):
            assert before.put([n], params, answer("a"))
        index, cap = lowered.tenant_index("t"), MAX_TRIM_PER_WRITE + 1
        held = []
        for n in range(3):
            assert lowered.put([1000 + n], params, answer("b")), "the write itself is never the casualty"
            held.append(raw.zcard(index))
        assert held == [601 - cap, 601 - 2 * cap + 1, 10]
        assert lowered.snapshot()["quota_evictions"] == 600 + 3 - 10 and lowered.snapshot()["errors"] == 0
        assert [lowered.get([1000 + n], params) for n in range(3)] == [answer("b")] * 3, "the newest stay"
    finally:
        before.close()
        lowered.close()


def test_no_models_key_directory_lists_a_quota_index_nor_can_a_lookup_key_name_one(redis_server):
    """Under `llm:resp:exact:v2:index:...`, a model whose fingerprint is "index" owned every other model's
    quota indexes: its key directory listed them, and a lookup that claimed one as its key met WRONGTYPE
    and deleted it as a corrupt value."""
    quota = _quota_cache(redis_server, 5)
    other = ExactResponseCache(redis_server, "index", timeout_s=0.5)
    raw = redis.Redis.from_url(redis_server)
    params = EngineRequestParams(max_tokens=8, tenant="t")
    directory = KeyDirectory(redis_server, exact_namespace("index")).start()
    try:
        assert quota.put(PROMPT, params, answer("answer"))
        index = quota.tenant_index("t")
        assert wait_for(lambda: directory.synced, 10) and directory.contains(index) is False
        forged = dataclasses.replace(params, response_key=index)  # sent to the engine directly
        tier = ResponseTier(other, lambda ids, trim: b"")
        assert tier.lookup([9, 9], forged).tokens is None and other.snapshot()["corrupt"] == 0
        tier.close()
        assert raw.zcard(index) == 1
    finally:
        directory.close()
        quota.close()


def test_a_tenant_index_holding_another_type_is_rebuilt_and_the_quota_holds(redis_server):
    """A string under the tenant's answer index: without the rebuild ZADD and the trim failed on every
    write while EXPIRE kept the bad key alive, so the tenant grew past its quota for good."""
    cache = _quota_cache(redis_server, 2)
    raw = redis.Redis.from_url(redis_server)
    params = EngineRequestParams(max_tokens=8, tenant="t")
    try:
        raw.set(cache.tenant_index("t"), b"garbage")
        for n in range(6):
            assert cache.put([n, 7], params, answer(f"answer {n}"))
        assert [cache.get([n, 7], params) for n in range(6)] == [None] * 4 + [
            answer("answer 4"),
            answer("answer 5"),
        ]
        snapshot = cache.snapshot()
        assert (snapshot["bad_indexes"], snapshot["errors"], raw.zcard(cache.tenant_index("t"))) == (1, 0, 2)
    finally:
        cache.close()


def test_one_tenants_damaged_index_does_not_open_the_breaker_for_the_others(redis_server):
    cache = _quota_cache(redis_server, 100)
    raw = redis.Redis.from_url(redis_server)
    a, b = EngineRequestParams(max_tokens=8, tenant="a"), EngineRequestParams(max_tokens=8, tenant="b")
    try:
        assert cache.put([1, 2], b, answer("b's answer")) and cache.put([3, 4], a, answer("a's answer"))
        raw.delete(cache.tenant_index("a"))
        raw.set(cache.tenant_index("a"), b"garbage")
        assert not cache.renew([cache.key([3, 4], a)], "a")  # the bad index is dropped, nothing renewed
        for _ in range(3):
            cache.renew([cache.key([3, 4], a)], "a")
        assert cache.get([1, 2], b) == answer("b's answer") and cache.breaker.state is BreakerState.CLOSED
        assert cache.snapshot()["bad_indexes"] == 1 and cache.snapshot()["errors"] == 0
    finally:
        cache.close()


KEEP_RULE_CASES = [
    ExactAnswer(()),
    ExactAnswer((), final=True),
    ExactAnswer((1,)),
    ExactAnswer((1,), final=True),
    ExactAnswer((1, 2, 3)),
    ExactAnswer((1, 2, 3), final=True),
    ExactAnswer((1, 2, 3), trim=1, final=True, sent=2),
]


def case_name(answer: ExactAnswer) -> str:
    cut = "-cut" if answer.sent != len(answer.ids) else ""
    return f"{len(answer.ids)}{'-final' if answer.final else ''}{cut}"


@pytest.mark.parametrize("stored", KEEP_RULE_CASES, ids=case_name)
@pytest.mark.parametrize("new", KEEP_RULE_CASES, ids=case_name)
def test_the_write_script_keeps_by_the_rule_of_serves_more_than(cache, stored, new):
    """The Lua twin of `ExactAnswer.serves_more_than` decides as it does, empty answers included (cjson
    reads [] as an empty table)."""
    params = EngineRequestParams(max_tokens=4)
    key = cache.key(PROMPT, params)
    assert cache.put(PROMPT, params, stored)
    assert cache.put(PROMPT, params, new) is not stored.serves_more_than(new)
    assert cache.decode_value(key, cache.client.get(key)) == (stored if stored.serves_more_than(new) else new)


def test_a_kept_entry_is_renewed_in_the_quota_index_and_the_next_trim_takes_another(redis_server):
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    cache = ExactResponseCache(redis_server, fp, timeout_s=0.5, tenant_max_entries=2)
    params = EngineRequestParams(max_tokens=4, tenant="t1")
    kept, other, newest = [1], [2], [3]
    try:
        assert cache.put(kept, params, ExactAnswer((1, 2, 3), final=True))
        assert cache.put(other, params, ExactAnswer((1,), final=True))
        cache.client.expire(cache.key(kept, params), 5)
        assert not cache.put(kept, params, ExactAnswer((1,)))
        assert cache.client.ttl(cache.key(kept, params)) > 100
        assert cache.put(newest, params, ExactAnswer((1,), final=True))  # trims the least recently written
        larger = dataclasses.replace(params, max_tokens=64)
        assert cache.get(kept, larger) == ExactAnswer((1, 2, 3), final=True)
        assert cache.client.get(cache.key(other, params)) is None
        stats = cache.snapshot()
        assert (stats["kept"], stats["stores"], stats["quota_evictions"]) == (1, 3, 1)
    finally:
        cache.close()
