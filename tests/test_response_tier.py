"""The response tier's write policy against a real redis-server: an exact answer is written on its
prompt's second sighting, at once for warmup traffic or with `first_use`."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

from cache.response_cache import ExactAnswer, ExactResponseCache, exact_key
from engine.cache_stats import cache_counters
from engine.response_tier import ResponseKey, ResponseTier
from tests.conftest import answer
from tests.test_redis_kv_store import FakeClock
from scheduler.messages import EngineRequestParams

GREEDY = EngineRequestParams(max_tokens=4, temperature=0.0, tenant="tier-test")


def spelled(text: str) -> ExactAnswer:
    """The answer `letters` spells as `text`, as the tier writes it (ended)."""
    return ExactAnswer(tuple(ord(c) - 97 for c in text), 0, True)


def letters(ids: list[int], trim_bytes: int = 0) -> bytes:
    data = bytes(97 + t % 26 for t in ids)
    return data[: len(data) - trim_bytes]


def tier(redis_url: str, first_use: bool) -> tuple[ResponseTier, ExactResponseCache]:
    exact = ExactResponseCache(redis_url, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    return ResponseTier(exact, letters, first_use=first_use), exact


def test_an_answer_is_written_on_its_prompts_second_sighting(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    once, twice = [5, 6, 7], [8, 9]
    responses.remember(once, GREEDY, [0, 1], 0, final=True)
    responses.remember(twice, GREEDY, [2, 3], 0, final=True)
    responses.remember(twice, GREEDY, [2, 3], 0, final=True)
    responses.close()  # drains the writer: every decision has been made
    assert exact.snapshot()["stores"] == 1 and responses.first_sightings == 2
    assert exact.get(twice, GREEDY) == spelled("cd") and exact.get(once, GREEDY) is None


def test_warmup_answers_and_first_use_are_written_at_once(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    warmup = EngineRequestParams(max_tokens=4, temperature=0.0, tenant="tier-test", tier="warmup")
    responses.remember([1, 2], warmup, [0], 0, final=True)
    responses.close()
    assert exact.get([1, 2], warmup) == spelled("a") and responses.first_sightings == 0
    eager, eager_exact = tier(redis_server, first_use=True)
    eager.remember([3, 4], GREEDY, [1], 0, final=True)
    eager.close()
    assert eager_exact.get([3, 4], GREEDY) == spelled("b")


def test_sampled_answers_are_never_sighted_or_written(redis_server):
    responses, exact = tier(redis_server, first_use=False)
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, tenant="tier-test")
    for _ in range(2):
        responses.remember([1, 2, 3], sampled, [0], 0, final=True)
    responses.close()
    assert exact.snapshot()["stores"] == 0 and responses.first_sightings == 0


def test_the_key_a_lookup_hashed_is_the_one_the_write_uses_and_is_not_hashed_again(redis_server, monkeypatch):
    responses, exact = tier(redis_server, first_use=True)
    prompt = [3, 1, 4, 1, 5]
    found = responses.lookup(prompt, GREEDY)
    assert found.tokens is None and found.key == ResponseKey(exact.key(prompt, GREEDY), checked=True)
    hashed = []
    real_key = exact.key
    monkeypatch.setattr(exact, "key", lambda *args: hashed.append(args) or real_key(*args))
    responses.remember(prompt, GREEDY, [7, 8], 0, found.key, final=True)
    responses.close()
    assert hashed == [], "neither the admission nor the write hashed the prompt again"
    monkeypatch.undo()
    assert exact.get(prompt, GREEDY) == spelled("hi")
    sampled = EngineRequestParams(max_tokens=4, temperature=0.7, tenant="tier-test")
    assert responses.lookup(prompt, sampled).key is None, "an uncacheable request has no key"


def test_answers_the_writer_cannot_keep_up_with_are_dropped_without_waiting_and_counted(redis_server):
    """A slow Redis: the engine thread never waits for the writer; what overflows its backlog is given up
    and shows in the metrics (`llm_engine_cache_total{tier="exact", counter="writes_dropped"}`)."""
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, letters, backlog=1, first_use=True)
    release, writing = threading.Event(), threading.Event()
    real_put = exact.put
    exact.put = lambda *args, **kwargs: writing.set() or release.wait(5) and real_put(*args, **kwargs)
    responses.remember([1], GREEDY, [0], 0, final=True)
    assert writing.wait(5), "the writer took the first answer"
    started = time.monotonic()
    for prompt in ([2], [3], [4], [5]):
        responses.remember(prompt, GREEDY, [0], 0, final=True)
    assert time.monotonic() - started < 0.5, "remember never waits for a busy writer"
    assert responses.writes_dropped == 3, "one waits in the backlog of 1, the other three are dropped"
    assert cache_counters(None, responses)[("exact", "writes_dropped")] == 3
    release.set()
    responses.close()
    assert (
        exact.get([1], GREEDY) == spelled("a")
        and exact.get([2], GREEDY) == spelled("a")
        and exact.get([5], GREEDY) is None
    )


def test_an_answer_whose_write_raises_is_counted_and_later_answers_are_still_written(redis_server):
    """A write that raises (here the exact cache's put; in practice a bad value or a bug) must not end the
    writer thread, or every later answer would be dropped and the shutdown would wait on a full queue."""
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, letters, backlog=4, first_use=True)
    real_put = exact.put

    def put(prompt_ids, *args, **kwargs):
        if prompt_ids == [1]:
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "a bad answer")
        return real_put(prompt_ids, *args, **kwargs)

    exact.put = put
    for prompt in ([1], [2]):
        responses.remember(prompt, GREEDY, [0], 0, final=True)
    responses.close()
    assert exact.get([1], GREEDY) is None and exact.get([2], GREEDY) == spelled("a")
    assert responses.writes_failed == 1 and cache_counters(None, responses)[("exact", "writes_failed")] == 1


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
    responses.remember(prompt, GREEDY, [0], 0, key, final=True)
    assert submitted == [] and responses.first_sightings == 1
    responses.remember(prompt, GREEDY, [0], 0, key, final=True)
    assert [item.exact for item in submitted] == [True], "the second sighting goes to the writer, admitted"
    responses.remember([9, 9], GREEDY, [1], 0, final=True)  # no key hashed: the writer hashes and admits it
    assert [item.exact for item in submitted] == [True, None]
    responses.close()
    assert exact.get(prompt, GREEDY) == spelled("a") and exact.get([9, 9], GREEDY) is None
    assert responses.first_sightings == 2
    spent = cache_counters(None, responses)[("exact", "request_seconds")]
    assert 0 < spent < 1, "the lookup and the three admissions are timed on the callers' threads"


def claiming(params: EngineRequestParams, key: str) -> EngineRequestParams:
    """`params` as the scheduler step sends them with the key it hashed (or a forger with another)."""
    return replace(params, response_key=key)


def test_a_key_the_scheduler_step_hashed_is_used_as_it_came_and_the_engine_hashes_nothing_on_a_miss(
    redis_server, monkeypatch
):
    responses, exact = tier(redis_server, first_use=False)
    prompt = [4, 4, 2]
    params = claiming(GREEDY, exact_key(exact.fingerprint, prompt, GREEDY))
    hashed = []
    real_key = exact.key
    monkeypatch.setattr(exact, "key", lambda *args: hashed.append(args) or real_key(*args))
    found = responses.lookup(prompt, params)
    responses.remember(
        prompt, params, [0], 0, found.key, final=True
    )  # a first sighting: admitted on this thread
    assert found.tokens is None and found.key == ResponseKey(params.response_key, checked=False)
    assert hashed == [] and responses.claimed_keys == 1
    responses.remember(prompt, params, [0], 0, responses.lookup(prompt, params).key, final=True)
    responses.close()
    assert len(hashed) == 1, "the second sighting's write checked the key once, on the writer"
    monkeypatch.undo()
    assert exact.get(prompt, GREEDY) == spelled("a")
    found = responses.lookup(prompt, params)
    assert found.tokens == [0] and found.key.checked, "a hit is served only after its key is checked"


def test_a_forged_key_reads_and_overwrites_no_other_prompts_or_tenants_answer(redis_server):
    responses, exact = tier(redis_server, first_use=True)
    victim, victim_params = [7, 7, 7], replace(GREEDY, tenant="victim")
    assert exact.put(victim, victim_params, answer("secret"))
    victim_key = exact.key(victim, victim_params)
    attacker = claiming(replace(GREEDY, tenant="attacker"), victim_key)
    found = responses.lookup([1, 2], attacker)
    assert found.tokens is None, "another tenant's answer is never served for a forged key"
    assert found.key == ResponseKey(exact.key([1, 2], replace(GREEDY, tenant="attacker")), checked=True)
    responses.remember([1, 2], attacker, [3], 0, ResponseKey(victim_key, checked=False), final=True)
    responses.close()
    assert exact.get(victim, victim_params) == answer("secret"), "nor is it overwritten"
    assert responses.forged_keys == 2 and cache_counters(None, responses)[("exact", "forged_keys")] == 2


def test_after_a_forged_key_the_prompts_own_answer_is_served_and_only_it_counts(redis_server):
    responses, exact = tier(redis_server, first_use=True)
    victim_params, own = replace(GREEDY, tenant="victim"), replace(GREEDY, tenant="attacker")
    assert exact.put([7, 7, 7], victim_params, answer("secret")) and exact.put(
        [1, 2], own, answer("my own answer")
    )
    found = responses.lookup([1, 2], claiming(own, exact.key([7, 7, 7], victim_params)))
    responses.close()
    assert found.tokens == list(answer("my own answer").ids)[: own.max_tokens] and found.key.checked
    assert (exact.snapshot()["hits"], exact.snapshot()["misses"]) == (1, 0)


def test_a_key_of_another_fingerprint_is_not_used_is_counted_and_logged_once(redis_server):
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    logged: list[str] = []
    responses = ResponseTier(exact, letters, log=logged.append)
    prompt = [5, 5]
    foreign = claiming(GREEDY, exact_key("another-model", prompt, GREEDY))
    for _ in range(3):
        found = responses.lookup(prompt, foreign)
    assert found.key == ResponseKey(exact.key(prompt, GREEDY), checked=True)
    assert responses.foreign_keys == 3 and responses.claimed_keys == 0
    assert len(logged) == 1 and "scheduler step's dtype, max_seq_len and response_cache" in logged[0]
    responses.close()


def test_an_answer_that_spells_a_special_token_is_served_as_generated(redis_server):
    """The cache keeps an answer as text and turns it back into ids on a hit: "<s>old</s>" (an HTML
    strikethrough the model wrote in ordinary byte tokens) must not come back as the <s> and </s>
    tokens, which decode to nothing."""
    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier
    from tests.conftest import MODEL_DIR

    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    config = EngineConfig(redis_url=redis_server, response_cache_first_use=True, redis_key_directory=False)
    responses = build_response_tier(config, f"fp-{uuid.uuid4().hex[:8]}", MODEL_DIR, decoder, print)
    output = [decoder.tokenizer.token_to_id(ch) for ch in "<s>old</s>"]
    assert decoder.delta(output, 0, True) == b"<s>old</s>"  # what generation sends the client
    params = EngineRequestParams(max_tokens=16, exclude_input_in_output=True, tenant="t1")
    responses.remember(
        [5, 6, 7, 8], params, output, 0, responses.lookup([5, 6, 7, 8], params).key, final=True
    )
    responses.close()
    found = responses.lookup([5, 6, 7, 8], params)
    assert decoder.delta(found.tokens, 0, True) == b"<s>old</s>"


def test_with_a_sentencepiece_tokenizer_a_hit_decodes_as_generation_did(redis_server, tmp_path):
    """Metaspace and byte fallback (Llama-style): the answer is kept as the detokenizer's text, not raw
    token bytes whose leading space a re-encode would double."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    corpus = ["The capital of France is Paris.", "Paris is a city in France."] * 50
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=280, special_tokens=special))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    decoder = TokenDecoder.from_model_dir(tmp_path)
    assert not decoder.byte_level
    config = EngineConfig(redis_url=redis_server, response_cache_first_use=True, redis_key_directory=False)
    responses = build_response_tier(config, f"fp-{uuid.uuid4().hex[:8]}", tmp_path, decoder, print)
    prompt, output = tokenizer.encode("The capital of France is").ids, tokenizer.encode("Paris").ids
    params = EngineRequestParams(max_tokens=16, tenant="t1")
    responses.remember(prompt, params, output, 0, responses.lookup(prompt, params).key, final=True)
    responses.close()
    served = responses.lookup(prompt, params).tokens
    assert decoder.delta(served, 0, True) == decoder.delta(output, 0, True) == b"Paris"
    assert decoder.delta(prompt + served, 0, True) == decoder.delta(prompt + output, 0, True)


def test_a_tenant_flooding_one_off_prompts_does_not_delay_another_tenants_second_sighting(redis_server):
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, letters, first_use=False, sightings=64)
    quiet, flood = replace(GREEDY, tenant="quiet"), replace(GREEDY, tenant="flood")
    responses.remember([1, 2, 3], quiet, [4], 0, final=True)
    for n in range(500):  # one-off prompts, far past the 64 sightings kept
        responses.remember([n, n + 1, 7, 7], flood, [0], 0, final=True)
    responses.remember([1, 2, 3], quiet, [4], 0, final=True)
    responses.close()
    assert exact.get([1, 2, 3], quiet) == spelled("e"), "the quiet tenant's second sighting was admitted"
    assert exact.snapshot()["stores"] == 1 and responses.first_sightings == 501


def test_an_exact_hit_sends_the_ids_and_trim_it_stored_without_encoding(redis_server):
    """An exact hit is what the engine sent when it computed the answer: its token ids and stop-string
    trim, with no tokenizer pass on the request path (a text encoded again may split into other ids)."""
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, letters)
    try:
        assert exact.put([3, 1, 4], GREEDY, ExactAnswer((0, 1, 2), 2, True))
        found = responses.lookup([3, 1, 4], GREEDY)
        assert (found.tokens, found.trim) == ([0, 1, 2], 2)
        assert responses.request_seconds > 0
    finally:
        responses.close()


def test_with_an_exact_quota_a_hit_is_renewed_once_a_period(redis_server):
    clock = FakeClock()
    exact = ExactResponseCache(
        redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5, tenant_max_entries=8
    )
    responses = ResponseTier(exact, letters, clock=clock)
    try:
        assert exact.put([3, 1, 4], GREEDY, spelled("abc"))
        for _ in range(3):  # three hits within a minute: one renewal
            assert responses.lookup([3, 1, 4], GREEDY).tokens == [0, 1, 2]
        assert responses.drain_writes() and exact.snapshot()["renewals"] == 1
        clock.now += 61
        assert responses.lookup([3, 1, 4], GREEDY).tokens == [0, 1, 2]
        assert responses.drain_writes() and exact.snapshot()["renewals"] == 2
        assert responses.lookup([9, 9], GREEDY).tokens is None  # a miss renews nothing
        assert responses.drain_writes() and exact.snapshot()["renewals"] == 2
    finally:
        responses.close()


def test_without_an_exact_quota_a_hit_sends_no_renewal(redis_server):
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    responses = ResponseTier(exact, letters)
    try:
        assert exact.put([3, 1, 4], GREEDY, spelled("abc"))
        assert responses.lookup([3, 1, 4], GREEDY).tokens == [0, 1, 2]
        assert responses.drain_writes() and exact.snapshot()["renewals"] == 0
    finally:
        responses.close()


def test_the_engine_configs_exact_quota_reaches_the_cache(redis_server):
    from engine.config import EngineConfig
    from engine.detokenize import TokenDecoder
    from engine.loader import build_response_tier
    from tests.conftest import MODEL_DIR

    decoder = TokenDecoder.from_model_dir(MODEL_DIR)
    config = EngineConfig(
        redis_url=redis_server,
        response_cache_first_use=True,
        redis_key_directory=False,
        exact_tenant_max_entries=2,
    )
    responses = build_response_tier(config, f"fp-{uuid.uuid4().hex[:8]}", MODEL_DIR, decoder, print)
    prompts = [[5, 6, n] for n in range(3)]
    for prompt in prompts:
        responses.remember(prompt, GREEDY, [7, 8], 0, responses.lookup(prompt, GREEDY).key, final=True)
    assert responses.drain_writes()
    assert [responses.lookup(p, GREEDY).tokens is not None for p in prompts] == [False, True, True]
    assert responses.cache.snapshot()["quota_evictions"] == 1
    responses.close()
