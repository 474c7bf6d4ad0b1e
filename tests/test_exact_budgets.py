"""The exact cache without max_tokens in its key (`ExactAnswer`): what each budget is served must be what
that budget's own run sends. The stop-string, slot-cut, TTL and failed-lookup cases were found in review
(each of these tests failed against the first version)."""

from __future__ import annotations

import uuid

import pytest
import redis

from cache.key_directory import KeyDirectory
from cache.response_cache import ExactAnswer, ExactResponseCache, exact_namespace
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.response_tier import ResponseTier
from engine.stop_strings import StopMatcher
from scheduler.messages import EngineRequestParams
from tests.conftest import wait_for
from tests.test_engine_batching import (
    BUCKETS,
    EOS,
    RecordingSink,
    make_engine,
    model,
    request,
    run_until_idle,
)

__all__ = ["model"]  # the module fixture, used by name


def run_alone(token_bytes: list[bytes], stop: str, max_tokens: int) -> tuple[bytes, ExactAnswer]:
    """A run of these tokens, as Engine._accept_token/_emit finish it: the text its final response sends,
    and the entry it writes (tokens here are positions in `token_bytes`)."""
    matcher, done, count = StopMatcher((stop,)), None, 0
    for count, piece in enumerate(token_bytes, 1):
        if matcher.push(piece):
            done = "stop"
        elif count >= max_tokens:
            done = "length"
        if done:
            break
    ready, trim = matcher.releasable(finished=True)
    data = b"".join(token_bytes[:ready])
    return data[: len(data) - trim], ExactAnswer(tuple(range(count)), trim, done == "stop", ready)


def served(token_bytes: list[bytes], entry: ExactAnswer, max_tokens: int) -> bytes | None:
    answer = entry.within(max_tokens)
    if answer is None:
        return None
    ids, trim = answer.response
    data = b"".join(token_bytes[i] for i in ids)
    return data[: len(data) - trim]


def test_a_stop_string_over_several_tokens_cuts_no_smaller_budget_short():
    """The final response sends only the tokens before the stop string; a budget that ends inside the stop
    string's tokens gets them all, untrimmed."""
    pieces = [b"Hello", b"\n", b"User", b":", b" more"]
    whole, entry = run_alone(pieces, "User:", max_tokens=10)
    assert whole == b"Hello\n" and entry.final and (len(entry.ids), entry.sent) == (4, 2)
    for budget in range(1, 11):
        own, _ = run_alone(pieces, "User:", max_tokens=budget)
        assert served(pieces, entry, budget) == own, f"budget {budget}"


def test_a_stop_string_beginning_inside_a_token_trims_only_the_budgets_that_met_it():
    pieces = [b"xa", b"b", b"c"]
    whole, entry = run_alone(pieces, "ab", max_tokens=10)
    assert whole == b"x" and entry.trim == 1
    for budget in range(1, 11):
        own, _ = run_alone(pieces, "ab", max_tokens=budget)
        assert served(pieces, entry, budget) == own, f"budget {budget}"


def _engine_with_cache(engine: Engine, redis_url: str) -> ExactResponseCache:
    exact = ExactResponseCache(redis_url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"", first_use=True)
    return exact


def _run(engine: Engine, prompt: list[int], **params) -> RecordingSink:
    sink = RecordingSink()
    engine.submit(
        request(prompt, sink, temperature=0.0, stream=False, exclude_input_in_output=True, **params)
    )
    run_until_idle(engine)
    assert not sink.errors
    return sink


def _text(sink: RecordingSink, token_bytes) -> bytes:
    data = b"".join(token_bytes(t) for t in sink.tokens)
    return data[: len(data) - sink.trim]


def test_the_engine_serves_a_budget_ending_inside_a_stop_string_what_its_own_run_sends(model, redis_server):
    engine = make_engine(model)
    letter = lambda t: bytes([97 + t % 26])  # noqa: E731  (make_engine's token bytes)
    _engine_with_cache(engine, redis_server)
    prompt = [1, 5, 9, 33, 7]
    try:
        text = _text(_run(engine, prompt, max_tokens=12, cache="kv-only"), letter)
        stop = text[4:6].decode()
        assert text.find(stop.encode()) == 4, text
        _run(engine, prompt, max_tokens=12, stop=(stop,))  # kept: ended on the stop string
        assert engine.responses.drain_writes()
        for budget in (3, 5, 6, 12):
            own = _run(engine, prompt, max_tokens=budget, stop=(stop,), cache="kv-only")
            cached = engine.stats.finished.get("cached", 0)
            hit = _run(engine, prompt, max_tokens=budget, stop=(stop,))
            assert engine.stats.finished.get("cached", 0) == cached + 1
            assert (_text(hit, letter), hit.trim) == (_text(own, letter), own.trim), f"budget {budget}"
    finally:
        engine.responses.close()


def test_the_engine_trims_only_budgets_whose_own_run_met_the_stop_string(model, redis_server):
    two = lambda t: bytes([97 + t % 26, 97 + (t // 26) % 26])  # noqa: E731
    engine = Engine(ModelRunner(model, slots=4, max_len=128, kv_buckets=BUCKETS), two, {EOS}, BUCKETS)
    _engine_with_cache(engine, redis_server)
    prompt = [1, 5, 9, 33, 7]
    try:
        text = _text(_run(engine, prompt, max_tokens=12, cache="kv-only"), two)
        stop = text[5:7].decode()  # the 3rd token's second byte and the 4th token's first
        assert text.find(stop.encode()) == 5, text
        _run(engine, prompt, max_tokens=12, stop=(stop,))
        assert engine.responses.drain_writes()
        for budget in (3, 4, 12):
            own = _run(engine, prompt, max_tokens=budget, stop=(stop,), cache="kv-only")
            hit = _run(engine, prompt, max_tokens=budget, stop=(stop,))
            assert (_text(hit, two), hit.trim) == (_text(own, two), own.trim), f"budget {budget}"
    finally:
        engine.responses.close()


def test_an_answer_cut_at_the_models_last_position_serves_every_larger_budget(model, redis_server):
    """prompt + max_tokens past max_len: the run stops at max_len whatever the budget, so its answer is
    final; kept as one that stopped at its budget, every repeat missed and computed it again."""
    engine = Engine(
        ModelRunner(model, slots=2, max_len=16, kv_buckets=(8, 16)), lambda t: b"a", {EOS}, (8, 16)
    )
    exact = _engine_with_cache(engine, redis_server)
    prompt = [1, 5, 9, 33, 7]
    try:
        runs = []
        for budget in (30, 30, 50):
            runs.append(_run(engine, prompt, max_tokens=budget, cache="use").tokens)
            assert engine.responses.drain_writes()
        assert len(runs[0]) < 30 and runs[0] == runs[1] == runs[2]
        assert engine.stats.finished.get("cached", 0) == 2, exact.snapshot()
        assert exact.snapshot()["shorter"] == 0
    finally:
        engine.responses.close()


def test_a_write_after_a_failed_lookup_does_not_cut_a_longer_entry_down(redis_server, monkeypatch):
    cache = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    tier = ResponseTier(cache, lambda ids, trim: b"", first_use=True)
    prompt = [1, 2, 3]
    long = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="cut")
    short = EngineRequestParams(max_tokens=2, temperature=0.0, tenant="cut")
    try:
        assert cache.put(prompt, long, ExactAnswer(tuple(range(8))))
        real_get, calls = cache.client.get, []

        def slow_once(key):
            calls.append(key)
            if len(calls) == 1:
                raise redis.TimeoutError("Timeout reading from socket")
            return real_get(key)

        monkeypatch.setattr(cache.client, "get", slow_once)
        found = tier.lookup(prompt, short)
        assert found.tokens is None and cache.snapshot()["errors"] == 1
        tier.remember(prompt, short, [0, 1], 0, found.key, final=False)  # Engine._emit on "length"
        assert tier.drain_writes()
        assert cache.get(prompt, long) == ExactAnswer(tuple(range(8))), cache.snapshot()
        assert cache.snapshot()["kept"] == 1
    finally:
        tier.close()


def test_a_write_that_lands_after_its_timeout_keeps_a_final_entry(redis_server, monkeypatch):
    """Redis stalls past the timeout (a fork, a long quota trim): the lookup's GET times out, and so does
    the write's reply, but the write itself runs once the stall ends. A 2-token answer must not replace a
    final one then (every budget over 2 would miss again): the write decides in Redis, when it runs."""
    cache = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    tier = ResponseTier(cache, lambda ids, trim: b"", first_use=True)
    prompt = [1, 2, 3]
    long = EngineRequestParams(max_tokens=64, temperature=0.0, tenant="stall")
    short = EngineRequestParams(max_tokens=2, temperature=0.0, tenant="stall")
    final = ExactAnswer(tuple(range(8)), final=True)  # ended (EOS) after 8 tokens
    try:
        assert cache.put(prompt, long, final)
        real_get, real_pipeline = cache.client.get, cache.client.pipeline

        def stalled_get(key):
            monkeypatch.setattr(cache.client, "get", real_get)
            raise redis.TimeoutError("Timeout reading from socket")

        def late_pipeline(*args, **kwargs):
            pipe = real_pipeline(*args, **kwargs)
            execute = pipe.execute

            def landed_late(*a, **kw):
                execute(*a, **kw)
                raise redis.TimeoutError("Timeout reading from socket")

            pipe.execute = landed_late
            return pipe

        monkeypatch.setattr(cache.client, "get", stalled_get)
        monkeypatch.setattr(cache.client, "pipeline", late_pipeline)
        found = tier.lookup(prompt, short)
        assert found.tokens is None
        tier.remember(prompt, short, [0, 1], 0, found.key, final=False)  # Engine._emit on "length"
        assert tier.drain_writes()
        assert cache.snapshot()["errors"] == 2, "the lookup's timeout and the write's"
        assert cache.get(prompt, long) == final, cache.snapshot()
    finally:
        tier.close()


def test_a_write_keeps_an_entry_its_key_directory_never_heard_of(redis_server):
    """Another replica's longer answer whose announcement this replica missed (pub/sub delivers at most
    once; or it landed between this replica's lookup and its write): the directory says "absent", and a
    write that trusted it without asking Redis cut the entry down to its own budget."""
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    directory = KeyDirectory(redis_server, exact_namespace(fp)).start()
    cache = ExactResponseCache(redis_server, fp, timeout_s=0.5, directory=directory)
    other = ExactResponseCache(redis_server, fp, timeout_s=0.5)
    raw = redis.Redis.from_url(redis_server)
    prompt = [7, 8, 9]
    client = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="dir")
    short = EngineRequestParams(max_tokens=2, temperature=0.0, tenant="dir")
    try:
        assert wait_for(lambda: directory.synced, 10), "the directory never synced"
        key = cache.key(prompt, client)
        raw.set(key, other.encode_value(key, ExactAnswer(tuple(range(8)))))  # written, never announced
        assert directory.contains(key) is False
        assert not cache.put(prompt, short, ExactAnswer((0, 1)))
        assert cache.snapshot()["kept"] == 1 and cache.snapshot()["stores"] == 0
        assert other.get(prompt, client) == ExactAnswer(tuple(range(8)))
        assert directory.contains(key), "kept, so Redis holds it: known at once"
    finally:
        cache.close()
        other.close()
        raw.close()


@pytest.mark.parametrize("quota", [0, 8])
def test_a_kept_entry_is_written_again_listed_and_with_a_fresh_ttl(redis_server, quota):
    """A warmup refresh that keeps a client's longer answer writes that answer again in its place: the job
    runs before the peak, and an entry a client wrote 23 h earlier must not expire during it. With a quota
    (the second writer's, the first had none: written before the quota was turned on, or by a replica
    without it in a rolling update) the entry is listed in the tenant's index too; renewing it through
    the index left an entry the index did not list alone (found in review)."""
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    plain = ExactResponseCache(redis_server, fp, timeout_s=0.5, ttl_s=86400)
    warmer = ExactResponseCache(redis_server, fp, timeout_s=0.5, ttl_s=86400, tenant_max_entries=quota)
    raw = redis.Redis.from_url(redis_server)
    prompt = [4, 5, 6]
    client = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="q")
    warmup = EngineRequestParams(max_tokens=4, temperature=0.0, tenant="q", cache="refresh", tier="warmup")
    try:
        assert plain.put(prompt, client, ExactAnswer(tuple(range(8))))
        key = warmer.key(prompt, client)
        raw.expire(key, 3600)
        assert not warmer.put(prompt, warmup, ExactAnswer(tuple(range(4))))
        assert warmer.snapshot()["kept"] == 1 and raw.ttl(key) > 3600
        assert warmer.get(prompt, client) == ExactAnswer(tuple(range(8)))
        listed = raw.zscore(warmer.tenant_index("q"), key) is not None
        assert listed == bool(quota)
    finally:
        plain.close()
        warmer.close()
        raw.close()
