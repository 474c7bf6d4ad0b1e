"""The exact response key names what the engine generates, not how the request spelled it: stop strings
in another order, repeated, or one that begins with another listed one, and a sampled top_k of at least
the vocabulary (the sampler then applies no top-k) generate the same tokens, and now share one key.
Keyed as sent, each spelling missed the others' answers (a needless recompute). Found in review. Before
the fix the keys kept apart and the engine's order independence (what must not change) held; the rest
failed."""

from __future__ import annotations

import itertools
import json
import struct
import uuid
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from tests.conftest import MODEL_DIR
from cache.response_cache import canonical_json, exact_key, exact_namespace, sha256_hex, tenant_tag
from engine.config import EngineConfig
from engine.detokenize import TokenDecoder
from engine.engine import Engine
from engine.loader import build_response_tier
from engine.model_runner import ModelRunner
from scheduler.messages import EngineRequestParams
from scheduler.step import SchedulerStep
from scheduler.tiers import TierTable
from scheduler.validation import Limits
from tests.test_engine_batching import RecordingSink, request, run_until_idle

PROMPT = [0, 2119, 317, 2745, 261, 664, 15]
V = 6796  # models/tiny-llama: config.json's vocab_size, its lm_head's outputs
SEEDED = EngineRequestParams(max_tokens=8, temperature=0.8, seed=3)


def key(params: EngineRequestParams, vocab_size: int | None = None) -> str:
    if vocab_size is None:  # as a caller that does not know the vocabulary (the code before the fix: all)
        return exact_key("fp", PROMPT, params)
    return exact_key("fp", PROMPT, params, vocab_size=vocab_size)


def old_key(params: EngineRequestParams) -> str:
    """The key as the code before the fix hashed it (stop strings and top_k as sent), with a sampled
    request's device type, which the key holds since (`sampling_signature`: a CPU and a CUDA generator
    draw apart for one seed, so seeded entries written before, of no known device, are not read)."""
    greedy = params.temperature == 0.0
    sampling = {
        "temperature": float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0 if greedy else int(params.top_k),
        "seed": None if greedy or params.seed is None else int(params.seed),
        "stop": list(params.stop),
        "ignore_eos": bool(params.ignore_eos),
    }
    if not greedy:
        sampling["rng"] = "cpu"
    doc = {"fp": "fp", "tenant": params.tenant, "sampling": sampling}
    digest = sha256_hex(canonical_json(doc), struct.pack(f"<{len(PROMPT)}q", *PROMPT))
    return f"{exact_namespace('fp')}:{tenant_tag(params.tenant)}:{digest}"


# -- the key -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("a", "b"), ("b", "a")),  # order
        (("a", "b"), ("a", "b", "a")),  # a repeat
        (("x",), ("x", "x")),
        (("\n",), ("\n\n", "\n")),  # "\n\n" begins with "\n": never complete before it, never earlier
        (("END", "\n"), ("\n", "END", "\n\n", "ENDING", "END")),
    ],
)
def test_stop_lists_the_engine_treats_alike_share_a_key(a, b):
    for base in (EngineRequestParams(max_tokens=8), SEEDED):
        assert key(replace(base, stop=a)) == key(replace(base, stop=b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("a",), ("a", "b")),  # another stop string: another answer
        (("b",), ("ab", "b")),  # "ab" holds "b" but not at its start: "xab" is cut before "a", not "b"
        (("b",), ("ba",)),  # begins with "b", alone: cut later
        (("ab",), ("abc",)),
        ((), ("a",)),
    ],
)
def test_stop_lists_that_cut_differently_keep_their_own_keys(a, b):
    assert key(replace(SEEDED, stop=a)) != key(replace(SEEDED, stop=b))


def test_a_top_k_of_at_least_the_vocabulary_is_keyed_as_no_top_k():
    def wide(params):
        return key(params, vocab_size=V)

    assert wide(replace(SEEDED, top_k=V)) == wide(replace(SEEDED, top_k=V + 1000)) == wide(SEEDED)
    assert wide(replace(SEEDED, top_k=V - 1)) != wide(SEEDED), "V - 1 drops the least likely token"
    assert wide(replace(SEEDED, top_k=50)) != wide(SEEDED)
    assert key(replace(SEEDED, top_k=V)) != key(SEEDED), "a caller not told the vocabulary keys top_k as sent"
    assert wide(SEEDED) == key(SEEDED) and wide(EngineRequestParams(top_k=V)) == key(EngineRequestParams())


@pytest.mark.parametrize(
    "params",
    [
        EngineRequestParams(),
        SEEDED,
        replace(SEEDED, top_k=40, top_p=0.9, stop=("\n", "END"), ignore_eos=True),
        replace(SEEDED, top_k=V - 1, stop=("ab", "b")),
        EngineRequestParams(top_k=V + 5, stop=("x",)),  # greedy: top_k was never keyed
    ],
)
def test_keys_of_requests_already_spelled_canonically_did_not_change(params):
    """Entries written before the fix are still read: no key version bump."""
    assert key(params, vocab_size=V) == old_key(params)


def test_the_scheduler_step_and_the_engine_hash_the_same_key():
    """The engine counts a key the step hashed that it does not hash itself as forged, and writes its
    answer under neither: both read the vocabulary from the same config.json."""
    from cache.fingerprint import model_vocab_size
    from cache.response_cache import ExactResponseCache

    assert model_vocab_size(MODEL_DIR) == V
    step = SchedulerStep(
        encode=lambda text, tenant: [ord(c) for c in text],
        limits=Limits(max_prompt_tokens=100, max_new_tokens=64),
        tiers=TierTable.defaults(),
        exact_fingerprint="fp-1",
        vocab_size=model_vocab_size(MODEL_DIR),
    )

    def prepared(sampling):
        return step.prepare("hello", json.dumps(sampling), True, None, None, "t", now_ns=1)

    base = {"temperature": 0.8, "seed": 3, "stop": ["b", "a"]}
    plain = prepared(base)
    wide = prepared({**base, "top_k": V, "stop": ["a", "b", "a"]})
    assert wide.params.response_key == plain.params.response_key != ""
    engine_side = ExactResponseCache.__new__(ExactResponseCache)
    engine_side.fingerprint, engine_side.namespace = "fp-1", exact_namespace("fp-1")
    engine_side.vocab_size = model_vocab_size(MODEL_DIR)
    assert engine_side.key(wide.input_ids, wide.params) == wide.params.response_key


def test_a_temperature_the_sampler_treats_as_greedy_is_keyed_and_cached_as_greedy():
    """A direct llm_engine request may send a temperature under MIN_TEMPERATURE (the scheduler step
    rounds it to 0): the sampler takes the argmax, so the answer is replayable and is greedy's."""
    from cache.response_cache import is_deterministic

    tiny = replace(EngineRequestParams(max_tokens=8), temperature=1e-7, top_k=5)
    assert tiny.greedy and is_deterministic(tiny)
    assert key(tiny) == key(EngineRequestParams(max_tokens=8))
    assert key(replace(tiny, temperature=1e-5)) != key(tiny)  # MIN_TEMPERATURE itself samples


# -- the engine (tiny model, its tokenizer, real Redis): what the merged keys claim --------------------


@pytest.fixture(scope="module")
def tiny():
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip("make setup builds models/tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    assert model.lm_head.out_features == V  # the sampler's scores.numel()
    return model, TokenDecoder.from_model_dir(MODEL_DIR)


@pytest.fixture
def engine(tiny, redis_server):
    model, decoder = tiny
    runner = ModelRunner(model, slots=2, max_len=96, kv_buckets=(16, 32, 64))
    eng = Engine(runner, lambda t: decoder.raw_bytes([t]), {1}, (16, 32, 64))
    config = EngineConfig(
        model_dir=str(MODEL_DIR),
        redis_url=redis_server,
        response_cache_first_use=True,
        redis_key_directory=False,
    )  # the loader's response tier: its exact cache as a server builds it
    eng.responses = build_response_tier(
        config, f"fp-{uuid.uuid4().hex[:8]}", MODEL_DIR, decoder, lambda m: None
    )
    assert eng.responses is not None and eng.responses.semantic is None
    yield eng
    eng.responses.close()
    eng.shutdown(1.0)


def serve(eng: Engine, prompt: list[int], **params) -> RecordingSink:
    sink = RecordingSink()
    params.setdefault("max_tokens", 40)
    eng.submit(request(prompt, sink, **params))
    run_until_idle(eng)
    assert not sink.errors and sink.finished
    return sink


def text(eng: Engine, sink: RecordingSink) -> bytes:
    data = b"".join(eng.token_bytes(t) for t in sink.tokens)
    return data[: len(data) - sink.trim]


def prompt_ids() -> list[int]:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode("Once upon a time, there was").ids


def cached(eng: Engine) -> int:
    return eng.stats.finished.get("cached", 0)


def stops_in(data: bytes) -> tuple[str, str, str]:
    """From generated text: `whole`, a string whose first occurrence starts before that of its own
    suffix `tail`, both completed by the same byte (the engine sees both in one token, and cuts at the
    earlier start), and `head`, a prefix of `whole` that is a stop string the engine meets first."""
    for start in range(12, len(data) - 6):  # past the first tokens
        for size in (6, 5, 4):
            whole = data[start : start + size]
            tail, head = whole[2:], whole[:3]
            if data.find(whole) == start and data.find(tail) == start + 2 and data.find(head) == start:
                try:
                    return whole.decode(), tail.decode(), head.decode()
                except UnicodeDecodeError:
                    continue
    raise AssertionError(f"no stop strings found in {data!r}")


def test_stop_lists_in_any_order_generate_the_same_answer_and_share_the_cache(engine):
    prompt = prompt_ids()
    free = text(engine, serve(engine, prompt, cache="kv-only"))
    whole, tail, head = stops_in(free)
    expected = free[: free.find(whole.encode())]
    answers = {
        order: serve(engine, prompt, stop=order, cache="kv-only")
        for order in itertools.permutations((whole, tail, whole))
    }
    assert len({(tuple(s.tokens), s.trim) for s in answers.values()}) == 1
    assert text(engine, answers[(tail, whole, whole)]) == expected
    only_tail = serve(engine, prompt, stop=(tail,), cache="kv-only")
    assert text(engine, only_tail) == free[: free.find(tail.encode())] != expected, (
        "a stop string that holds another one past its start is not redundant: it stays keyed"
    )
    with_prefix = serve(engine, prompt, stop=(head, whole), cache="kv-only")
    prefix_alone = serve(engine, prompt, stop=(head,), cache="kv-only")
    assert (with_prefix.tokens, with_prefix.trim) == (prefix_alone.tokens, prefix_alone.trim)

    computed = serve(engine, prompt, stop=(whole, tail))
    assert engine.responses.drain_writes() and cached(engine) == 0
    hit = serve(engine, prompt, stop=(tail, whole, tail))
    assert cached(engine) == 1, "the same stop strings in another order missed the answer"
    assert (hit.tokens, hit.trim) == (computed.tokens, computed.trim)
    serve(engine, prompt, stop=(head,))
    assert engine.responses.drain_writes()
    hit = serve(engine, prompt, stop=(whole, head))
    assert cached(engine) == 2, f"{whole!r} begins with {head!r}: the engine never stops at it first"
    assert (hit.tokens, hit.trim) == (prefix_alone.tokens, prefix_alone.trim)


def test_a_top_k_of_the_vocabulary_samples_as_no_top_k_and_shares_the_cache(engine):
    prompt = prompt_ids()
    seeded = {"temperature": 1.0, "seed": 11, "top_p": 0.95}
    answers = [serve(engine, prompt, top_k=k, cache="kv-only", **seeded).tokens for k in (0, V, V + 123)]
    assert answers[0] == answers[1] == answers[2]
    assert serve(engine, prompt, top_k=20, cache="kv-only", **seeded).tokens != answers[0]

    serve(engine, prompt, top_k=0, **seeded)
    assert engine.responses.drain_writes() and cached(engine) == 0
    hit = serve(engine, prompt, top_k=V, **seeded)
    assert cached(engine) == 1, "top_k = vocabulary size (no top-k) missed the top_k = 0 answer"
    assert hit.tokens == answers[0]


def test_engine_output_does_not_depend_on_stop_order_with_a_shared_start(engine):
    """Two stop strings that begin at the same byte (one the other's prefix) and two that overlap: the
    engine's cut is the earliest start over the set, whichever string is listed first."""
    prompt = prompt_ids()
    free = text(engine, serve(engine, prompt, cache="kv-only"))
    whole, tail, head = stops_in(free)
    for stops in [(whole, head), (tail, head), (whole, tail, head)]:
        outs = {
            (tuple(s.tokens), s.trim)
            for s in (serve(engine, prompt, stop=p, cache="kv-only") for p in itertools.permutations(stops))
        }
        assert len(outs) == 1, stops
