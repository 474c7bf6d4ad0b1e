"""The response tier's write policy against a real redis-server: an exact answer is written on its
prompt's second sighting, at once for warmup traffic or with `first_use`."""

from __future__ import annotations

import threading
import time
import uuid

from cache.response_cache import ExactResponseCache
from engine.cache_stats import cache_counters
from engine.response_tier import ResponseTier
from scheduler.messages import EngineRequestParams

GREEDY = EngineRequestParams(max_tokens=4, temperature=0.0, tenant="tier-test")


def letters(ids: list[int]) -> bytes:
    return bytes(97 + t % 26 for t in ids)


def tier(redis_url: str, first_use: bool) -> tuple[ResponseTier, ExactResponseCache]:
    exact = ExactResponseCache(redis_url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    return ResponseTier(exact, lambda text: [ord(c) - 97 for c in text], letters, first_use=first_use), exact


def test_an_answer_is_written_on_its_prompts_second_sighting(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    once, twice = [5, 6, 7], [8, 9]
    responses.remember(once, GREEDY, [0, 1], 0)
    responses.remember(twice, GREEDY, [2, 3], 0)
    responses.remember(twice, GREEDY, [2, 3], 0)
    responses.close()  # drains the writer: every decision has been made
    assert exact.snapshot()["stores"] == 1 and responses.first_sightings == 2
    assert exact.get(twice, GREEDY) == "cd" and exact.get(once, GREEDY) is None


def test_warmup_answers_and_first_use_are_written_at_once(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    warmup = EngineRequestParams(max_tokens=4, temperature=0.0, tenant="tier-test", tier="warmup")
    responses.remember([1, 2], warmup, [0], 0)
    responses.close()
    assert exact.get([1, 2], warmup) == "a" and responses.first_sightings == 0
    eager, eager_exact = tier(redis_server, first_use=True)
    eager.remember([3, 4], GREEDY, [1], 0)
    eager.close()
    assert eager_exact.get([3, 4], GREEDY) == "b"


def test_sampled_answers_are_never_sighted_or_written(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, tenant="tier-test")
    for _ in range(2):
        responses.remember([1, 2, 3], sampled, [0], 0)
    responses.close()
    assert exact.snapshot()["stores"] == 0 and responses.first_sightings == 0


def test_the_key_a_lookup_hashed_is_the_one_the_write_uses_and_is_not_hashed_again(redis_server, monkeypatch):
    responses, exact = tier(redis_server, first_use=True)
    prompt = [3, 1, 4, 1, 5]
    found = responses.lookup(prompt, GREEDY)
    assert found.tokens is None and found.key == exact.key(prompt, GREEDY)
    hashed = []
    real_key = exact.key
    monkeypatch.setattr(exact, "key", lambda *args: hashed.append(args) or real_key(*args))
    responses.remember(prompt, GREEDY, [7, 8], 0, found.key)
    responses.close()
    assert hashed == [], "neither the admission nor the write hashed the prompt again"
    monkeypatch.undo()
    assert exact.get(prompt, GREEDY) == "hi"
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, tenant="tier-test")
    assert responses.lookup(prompt, sampled).key is None, "an uncacheable request has no key"


def test_answers_the_writer_cannot_keep_up_with_are_dropped_without_waiting_and_counted(redis_server):
    """A slow Redis: the engine thread never waits for the writer; what overflows its backlog is given up
    and shows in the metrics (`llm_engine_cache_total{tier="exact", counter="writes_dropped"}`)."""
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, lambda text: [0], letters, backlog=1, first_use=True)
    release, writing = threading.Event(), threading.Event()
    real_put = exact.put
    exact.put = lambda *args: writing.set() or release.wait(5) and real_put(*args)
    responses.remember([1], GREEDY, [0], 0)
    assert writing.wait(5), "the writer took the first answer"
    started = time.monotonic()
    for prompt in ([2], [3], [4], [5]):
        responses.remember(prompt, GREEDY, [0], 0)
    assert time.monotonic() - started < 0.5, "remember never waits for a busy writer"
    assert responses.writes_dropped == 3, "one waits in the backlog of 1, the other three are dropped"
    assert cache_counters(None, responses)[("exact", "writes_dropped")] == 3
    release.set()
    responses.close()
    assert exact.get([1], GREEDY) == "a" and exact.get([2], GREEDY) == "a" and exact.get([5], GREEDY) is None


def test_a_first_sighting_is_decided_on_the_callers_thread_and_never_wakes_the_writer(
    redis_server, monkeypatch
):
    """At a low hit rate most answers are first sightings: they cost a dict update, not a writer wake-up."""
    responses, exact = tier(redis_server, first_use=False)
    submitted = []
    real_submit = responses._writes.submit
    monkeypatch.setattr(responses._writes, "submit", lambda item: submitted.append(item) or real_submit(item))
    prompt = [2, 7, 1, 8]
    key = responses.lookup(prompt, GREEDY).key
    responses.remember(prompt, GREEDY, [0], 0, key)
    assert submitted == [] and responses.first_sightings == 1
    responses.remember(prompt, GREEDY, [0], 0, key)
    assert [item.exact for item in submitted] == [True], "the second sighting goes to the writer, admitted"
    responses.remember([9, 9], GREEDY, [1], 0)  # no key hashed: the writer hashes and admits it
    assert [item.exact for item in submitted] == [True, None]
    responses.close()
    assert exact.get(prompt, GREEDY) == "a" and exact.get([9, 9], GREEDY) is None
    assert responses.first_sightings == 2
    spent = cache_counters(None, responses)[("exact", "request_seconds")]
    assert 0 < spent < 1, "the lookup and the three admissions are timed on the callers' threads"
