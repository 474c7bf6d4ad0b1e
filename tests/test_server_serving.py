"""The serving path end to end: real tritonserver, real model repository, tritonclient gRPC streaming."""

from __future__ import annotations

import io
import json
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.generate import GenerationError, StreamingSession, generate
from client.metrics import metric_total, scrape_metrics
from scheduler.tenant_auth import token_from_env
from tests.conftest import MODEL_DIR, wait_for

GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def engine_metric(metrics_url: str, name: str, **labels: str) -> float:
    return metric_total(scrape_metrics(metrics_url), name, **labels)


def test_streaming_returns_text_piece_by_piece(grpc_url):
    streamed = generate(grpc_url, "The history of the", sampling=GREEDY, stream=True)
    whole = generate(
        grpc_url, "The history of the", sampling=GREEDY, stream=False, exclude_input_in_output=True
    )
    assert len(streamed.pieces) >= 10
    assert "".join(streamed.pieces) == streamed.text == whole.text
    assert 0 < streamed.ttft_s < streamed.total_s


def test_greedy_output_is_identical_across_runs(grpc_url):
    first = generate(grpc_url, "A function that returns", sampling=GREEDY).text
    assert first
    for _ in range(2):
        assert generate(grpc_url, "A function that returns", sampling=GREEDY).text == first


def test_seeded_sampling_is_reproducible(grpc_url):
    sampling = {
        "max_tokens": 20,
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 50,
        "seed": 1234,
        "ignore_eos": True,
    }
    first = generate(grpc_url, "Sampling check", sampling=sampling).text
    assert generate(grpc_url, "Sampling check", sampling=sampling).text == first
    assert generate(grpc_url, "Sampling check", sampling={**sampling, "seed": 99}).text != first


def test_prompt_is_prepended_unless_excluded(grpc_url):
    prompt = "Prefix test"
    included = generate(grpc_url, prompt, sampling=GREEDY, stream=False, exclude_input_in_output=False)
    excluded = generate(grpc_url, prompt, sampling=GREEDY, stream=False, exclude_input_in_output=True)
    assert included.text == prompt + excluded.text


def test_max_tokens_and_stop_strings(grpc_url):
    free = generate(grpc_url, "Stop strings", sampling={**GREEDY, "max_tokens": 30}).text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    stopped = generate(grpc_url, "Stop strings", sampling={**GREEDY, "max_tokens": 30, "stop": [stop]}).text
    assert stopped == free[: free.index(stop)]
    assert len(generate(grpc_url, "Short", sampling={**GREEDY, "max_tokens": 1}).pieces) == 1


def test_concurrent_requests_are_batched(grpc_url, metrics_url):
    multi_before = engine_metric(metrics_url, "llm_engine_multi_request_decode_steps_total")
    with StreamingSession(grpc_url) as session:
        ids = [
            session.submit(f"Concurrent request {i}", sampling={**GREEDY, "max_tokens": 40}) for i in range(4)
        ]
        assert session.wait(ids, timeout_s=120)
        results = [session.result(rid) for rid in ids]
    assert all(r.error is None and r.text for r in results)
    assert engine_metric(metrics_url, "llm_engine_max_decode_batch") >= 2
    assert engine_metric(metrics_url, "llm_engine_multi_request_decode_steps_total") > multi_before


def test_tier_and_tenant_as_inputs_and_request_parameters(grpc_url, metrics_url):
    before = engine_metric(metrics_url, "llm_engine_requests_finished_total", tier="critical")
    assert generate(grpc_url, "Critical", sampling=GREEDY, tier="critical", tenant="acme").text
    assert engine_metric(metrics_url, "llm_engine_requests_finished_total", tier="critical") == before + 1

    client = grpcclient.InferenceServerClient(grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Parameters"], dtype=np.object_))
    client.async_stream_infer("llm", [text], request_id="p1", parameters={"slo_tier": "gold"})
    _, error = results.get(timeout=60)
    client.stop_stream()
    assert error is not None and "unknown slo_tier 'gold'" in str(error)


BAD_REQUESTS = [
    ("", None, None, "empty"),
    ("   ", None, None, "empty"),
    ("x " * 3000, None, None, "at most 2047"),
    ("hi", "{not json", None, "JSON"),
    ("hi", json.dumps({"temperature": 5}), None, "temperature"),
    ("hi", json.dumps({"max_tokens": 0}), None, "max_tokens"),
    ("hi", json.dumps({"max_tokens": True}), None, "max_tokens"),
    ("hi", json.dumps({"top_p": 0}), None, "top_p"),
    ("hi", json.dumps({"best_of": 2}), None, "allowed"),
    ("hi", json.dumps([1, 2]), None, "object"),
    ("hi", "[" * 100_000, None, "not valid JSON: nested too deep"),  # was INTERNAL: RecursionError
    ("hi", '{"seed": ' + "9" * 5000 + "}", None, "not valid JSON: Exceeds the limit"),  # was INTERNAL
    ("x" * 4_000_000, None, None, "characters cannot fit"),  # refused before tokenization
    ("hi", None, "gold", "allowed: critical, warmup, standard, batch"),
]


@pytest.mark.parametrize(("prompt", "sampling_json", "tier", "expected"), BAD_REQUESTS)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    grpc_url, prompt, sampling_json, tier, expected
):
    client = grpcclient.InferenceServerClient(grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = [_bytes_input("text_input", prompt.encode())]
    if sampling_json is not None:
        inputs.append(_bytes_input("sampling_parameters", sampling_json.encode()))
    if tier is not None:
        inputs.append(_bytes_input("slo_tier", tier.encode()))
    client.async_stream_infer("llm", inputs, request_id="bad")
    _, error = results.get(timeout=60)
    client.stop_stream()
    assert error is not None, "a bad request must fail"
    assert expected.lower() in str(error).lower()
    assert generate(grpc_url, "still serving", sampling={"max_tokens": 3}).text


@pytest.mark.parametrize(
    ("name", "array", "dtype", "expected"),
    [
        ("text_input", np.array([7], dtype=np.int32), "INT32", "expects 'BYTES'"),
        ("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES", "shape"),
    ],
)
def test_wrong_input_type_or_shape_is_rejected(grpc_url, name, array, dtype, expected):
    client = grpcclient.InferenceServerClient(grpc_url)
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("llm", [tensor], request_id="wrong")
    _, error = results.get(timeout=60)
    client.stop_stream()
    assert error is not None and expected.lower() in str(error).lower()
    assert generate(grpc_url, "still serving", sampling={"max_tokens": 3}).text


def test_prompt_text_that_spells_a_special_token_is_text_to_the_model(grpc_url):
    """ "</s>" typed in a prompt became the EOS token mid-input, and the echoed prompt lost the tag."""
    client = grpcclient.InferenceServerClient(grpc_url)
    prompt = "Quote the tag </s> literally, and <s> too"
    ids = client.infer("slo_scheduler", [_bytes_input("text_input", prompt.encode())]).as_numpy("input_ids")
    assert 1 not in ids.tolist() and 0 not in ids.tolist()[1:], f"user text became control tokens: {ids}"
    echoed = generate(
        grpc_url,
        prompt,
        sampling={"max_tokens": 3, "temperature": 0},
        stream=False,
        exclude_input_in_output=False,
    )
    assert echoed.text.startswith(prompt), repr(echoed.text)


def _detokenizer_inputs(read_offset: int, request_key: list[int]) -> list[grpcclient.InferInput]:
    arrays = {
        "token_ids": (np.array([5, 6, 7], np.int64), "INT64"),
        "read_offset": (np.array([read_offset], np.int32), "INT32"),
        "is_final": (np.array([False]), "BOOL"),
        "trim_bytes": (np.array([0], np.int32), "INT32"),
        "request_key": (np.array(request_key, np.int64), "INT64"),
    }
    tensors = []
    for name, (array, dtype) in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(array.shape), dtype))
        tensors[-1].set_data_from_numpy(array)
    return tensors


@pytest.mark.parametrize(
    ("read_offset", "request_key", "named"), [(9, [0, 0], "read_offset"), (0, [0, 0, 0], "request_key")]
)
def test_the_detokenizer_answers_input_that_does_not_fit_with_invalid_arg(
    grpc_url, read_offset, request_key, named
):
    """The step is public: a window its offset lies outside of, or a key of three values, is the
    caller's mistake (INVALID_ARG naming the input), not the server's (INTERNAL)."""
    client = grpcclient.InferenceServerClient(grpc_url)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("detokenizer", _detokenizer_inputs(read_offset, request_key))
    assert "INVALID_ARG" in str(caught.value.status()) and named in caught.value.message()
    assert client.infer("detokenizer", _detokenizer_inputs(0, [0, 0])).as_numpy("text_output") is not None
    assert generate(grpc_url, "still serving", sampling={"max_tokens": 3}).text


def test_cancelled_stream_frees_its_slot(grpc_url, metrics_url):
    cancelled_before = engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cancelled")
    session = StreamingSession(grpc_url)
    started: queue.Queue = queue.Queue()
    session.submit("A long answer", sampling={"max_tokens": 500, "ignore_eos": True}, on_piece=started.put)
    started.get(timeout=60)
    assert wait_for(lambda: engine_metric(metrics_url, "llm_engine_active_requests") == 1)
    session.cancel()
    assert wait_for(
        lambda: (
            engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cancelled")
            == cancelled_before + 1
        )
    )
    assert wait_for(lambda: engine_metric(metrics_url, "llm_engine_active_requests") == 0)
    assert generate(grpc_url, "after cancel", sampling={"max_tokens": 3}).text


def test_warmup_left_no_new_shapes_for_served_lengths(grpc_url, metrics_url):
    for words in (3, 40, 300):
        generate(grpc_url, "word " * words, sampling={"max_tokens": 4})
    assert engine_metric(metrics_url, "llm_engine_new_shapes_after_ready_total") == 0
    assert engine_metric(metrics_url, "llm_engine_warmup_seconds") > 0


def test_errors_raise_generation_error(grpc_url):
    with pytest.raises(GenerationError, match="unknown slo_tier"):
        generate(grpc_url, "hi", tier="platinum")


def _bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
    return tensor


def test_a_repeated_greedy_request_is_answered_from_the_response_cache(grpc_url, metrics_url):
    prompt, sampling = "Response cache probe: the same question twice", {"max_tokens": 12, "ignore_eos": True}
    first = generate(grpc_url, prompt, sampling=sampling, tenant="rc-a")
    cached_before = engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")

    def served_from_cache() -> bool:  # the answer is written in the background: poll until the hit shows
        again = generate(grpc_url, prompt, sampling=sampling, tenant="rc-a")
        hits = engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")
        return again.text == first.text and hits > cached_before

    assert wait_for(served_from_cache)
    after_hit = engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")
    other_tenant = generate(grpc_url, prompt, sampling=sampling, tenant="rc-b")
    sampled = generate(grpc_url, prompt, sampling={**sampling, "temperature": 0.7}, tenant="rc-a")
    assert other_tenant.text == first.text and sampled.text
    assert engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached") == after_hit, (
        "another tenant and unseeded sampling are never served from the cache"
    )


def test_a_bypass_request_is_neither_answered_from_nor_kept_in_any_cache(grpc_url, metrics_url):
    prompt = "Bypass probe: a long enough question to fill a few prefix blocks of sixteen tokens each"
    sampling = {"max_tokens": 8, "ignore_eos": True}

    def counters() -> tuple[float, float]:
        m = scrape_metrics(metrics_url)
        return (
            metric_total(m, "llm_engine_requests_finished_total", status="cached"),
            metric_total(m, "llm_engine_prefix_cache_tokens_total", result="reused"),
        )

    before = counters()
    first = generate(grpc_url, prompt, sampling=sampling, tenant="bypass", cache="bypass")
    again = generate(grpc_url, prompt, sampling=sampling, tenant="bypass", cache="bypass")
    assert again.text == first.text and counters() == before, "a bypass request read a cache"
    ordinary = generate(grpc_url, prompt, sampling=sampling, tenant="bypass")
    assert ordinary.text == first.text and counters() == before, "a bypass request left an entry behind"
    with pytest.raises(GenerationError, match="invalid cache 'off'; allowed: use, bypass, kv-only"):
        generate(grpc_url, prompt, sampling=sampling, cache="off")


def test_a_kv_only_request_reuses_the_prefix_but_is_never_answered_from_the_response_cache(
    grpc_url, metrics_url
):
    prompt = "KV-only probe: a long enough question to fill a few prefix blocks of sixteen tokens each, twice"
    sampling = {"max_tokens": 8, "ignore_eos": True}  # greedy: cacheable when the request uses the caches

    def counters() -> tuple[float, float]:
        m = scrape_metrics(metrics_url)
        return (
            metric_total(m, "llm_engine_requests_finished_total", status="cached"),
            metric_total(m, "llm_engine_prefix_cache_tokens_total", result="reused"),
        )

    first = generate(grpc_url, prompt, sampling=sampling, tenant="kv-only")
    cached_before = counters()[0]
    # the answer is written in the background: poll until an identical `use` request is a hit
    assert wait_for(lambda: generate(grpc_url, prompt, sampling=sampling, tenant="kv-only").text == first.text
                    and counters()[0] > cached_before)  # fmt: skip
    # the engine publishes prefix counters at most once a second: the baseline is taken once two readings
    # a publish period apart (a request in between, which makes it publish) agree
    readings: list[float] = []

    def settled() -> bool:
        generate(grpc_url, "flush", sampling={"max_tokens": 1}, tenant="kv-only-flush")
        readings.append(counters()[1])
        return len(readings) > 1 and readings[-1] == readings[-2]

    assert wait_for(settled, 30, interval_s=1.1)
    cached, reused = counters()

    def reuses_without_the_response_cache() -> bool:  # prefix counters are published once a second
        again = generate(grpc_url, prompt, sampling=sampling, tenant="kv-only", cache="kv-only")
        assert again.text == first.text and counters()[0] == cached, "answered from the response cache"
        return counters()[1] > reused

    assert wait_for(reuses_without_the_response_cache), "a kv-only request reused no cached prefix"
    other = "KV-only probe, never asked with the response cache: another question of several prefix blocks"
    kv_only = generate(grpc_url, other, sampling=sampling, tenant="kv-only", cache="kv-only")
    ordinary = generate(grpc_url, other, sampling=sampling, tenant="kv-only")
    assert ordinary.text == kv_only.text and counters()[0] == cached, "a kv-only request kept its response"


def engine_reply(grpc_url: str, prompt_ids: list[int], params: dict) -> tuple[list[int], str | None]:
    """(tokens, error message or None) of a request sent to the engine step directly, as a client could,
    bypassing the scheduler step."""
    client = grpcclient.InferenceServerClient(grpc_url)
    results: queue.Queue = queue.Queue()
    raw = np.frombuffer(json.dumps(params).encode(), dtype=np.uint8)
    inputs = []
    tensors = (
        ("input_ids", np.array(prompt_ids, dtype=np.int64), "INT64"),
        ("request_params", raw, "UINT8"),
        ("priority", np.array([3], np.int32), "INT32"),
        ("deadline_ns", np.array([0], np.int64), "INT64"),
    )
    for name, value, dtype in tensors:
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("llm_engine", inputs)
        tokens: list[int] = []
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                return tokens, error.message()
            tokens = result.as_numpy("token_ids").tolist()  # not streamed: the final window holds them all
            if result.as_numpy("is_final")[0]:
                return tokens, None
    finally:
        client.stop_stream()
        client.close()


def engine_tokens(grpc_url: str, prompt_ids: list[int], params: dict) -> list[int]:
    tokens, error = engine_reply(grpc_url, prompt_ids, params)
    assert error is None, error
    return tokens


def test_a_direct_engine_request_is_held_to_the_scheduler_steps_limits(grpc_url):
    """Found in review: llm_engine generated max_tokens 600 in full (the step's cap is 512), failed top_p 0
    as INTERNAL and took any number of stop strings. Its cap is the step's own LLM_MAX_NEW_TOKENS."""
    with pytest.raises(GenerationError) as step:
        generate(grpc_url, "cap probe", sampling={"max_tokens": 513})
    assert "max_tokens must be an integer 1..512" in str(step.value)
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "exclude_input_in_output": True}
    for override, refusal in (
        ({"max_tokens": 513}, "request_params.max_tokens must be an integer 1..512, got 513"),
        ({"temperature": 0.8, "top_p": 0}, "request_params.top_p must be a number in (0, 1], got 0"),
        ({"stop": ["s"] * 9}, "request_params.stop has 9 entries"),
    ):
        tokens, error = engine_reply(grpc_url, [1, 200, 300, 400], {**params, **override})
        assert error is not None and refusal in error, f"{override}: {error or f'{len(tokens)} tokens'}"
    assert len(engine_tokens(grpc_url, [1, 200, 300, 400], params)) == 4


def test_a_key_forged_in_a_direct_engine_request_reads_no_other_tenants_answer(
    grpc_url, metrics_url, redis_url
):
    """Keys come hashed from the scheduler step; the engine checks one before serving its entry."""
    import redis

    from cache.response_cache import KEY_PREFIX, tenant_tag

    prompt, sampling = (
        "Forged key probe: a question only the victim asked",
        {"max_tokens": 6, "ignore_eos": True},
    )
    first = generate(grpc_url, prompt, sampling=sampling, tenant="victim")
    assert wait_for(
        lambda: (
            generate(grpc_url, prompt, sampling=sampling, tenant="victim").text == first.text
            and engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached") > 0
        )
    )
    store = redis.Redis.from_url(redis_url)
    (victim_key,) = [k.decode() for k in store.scan_iter(f"{KEY_PREFIX}:*:{tenant_tag('victim')}:*")]
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "tenant": "attacker",
              "exclude_input_in_output": True, "tenant_token": token_from_env("attacker")}  # fmt: skip
    honest = engine_tokens(grpc_url, [1, 200, 300, 400], params)
    cached_before = engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")
    forged = engine_tokens(grpc_url, [1, 200, 300, 400], {**params, "response_key": victim_key})
    assert forged == honest, "the forged key changed the answer"
    assert engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached") == cached_before

    def counted() -> bool:  # cache counters are published about once a second while serving
        generate(grpc_url, "forged key flush", sampling={"max_tokens": 1}, tenant="attacker-flush")
        return engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="forged_keys") >= 1

    assert wait_for(counted)
    assert generate(grpc_url, prompt, sampling=sampling, tenant="victim").text == first.text


def test_long_prompts_that_share_a_prefix_reuse_its_tokenization(grpc_url, metrics_url):
    shared = "The quick brown fox jumps over the lazy dog near the river bank. " * 40  # > 2048 chars
    sampling = {"max_tokens": 4, "ignore_eos": True}
    before = engine_metric(metrics_url, "llm_scheduler_prefix_tokenizer_total", result="hits")
    asked = iter(range(1000))

    def reused() -> bool:  # the step publishes at most once a second, carried by its next request
        assert generate(grpc_url, shared + f"Question {next(asked)}?", sampling=sampling, tenant="tok").text
        return engine_metric(metrics_url, "llm_scheduler_prefix_tokenizer_total", result="hits") > before

    assert wait_for(reused, timeout_s=60, interval_s=0.3)
    assert engine_metric(metrics_url, "llm_scheduler_prefix_tokenizer_total", result="mismatches") == 0


def test_an_exact_answer_serves_smaller_budgets_and_a_larger_budget_replaces_it(grpc_url, metrics_url):
    """max_tokens is not in the exact key: an answer of 8 tokens serves a client asking 4 with what a
    4-token run sends, a client asking 12 misses and computes, and its answer then serves 8 as well."""
    prompt = f"Budget probe {time.time_ns()}: one exact entry for every max_tokens"

    def ask(max_tokens: int, cache: str | None = None) -> str:
        sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return generate(grpc_url, prompt, sampling=sampling, tenant="budgets", cache=cache).text

    def exact(counter: str) -> float:
        return engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter=counter)

    def cached() -> float:
        return engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")

    fresh = {n: ask(n, cache="bypass") for n in (4, 8, 12)}
    assert len({fresh[4], fresh[8], fresh[12]}) == 3
    stores = exact("stores")
    assert ask(8) == ask(8) == fresh[8]  # written on its second sighting
    assert wait_for(lambda: exact("stores") > stores), "the 8-token answer was written"
    served = cached()
    assert ask(4) == fresh[4]
    assert wait_for(lambda: cached() == served + 1), "a smaller budget is served the answer's first tokens"
    shorter, stores = exact("shorter"), exact("stores")
    assert ask(12) == fresh[12]
    assert wait_for(lambda: exact("shorter") > shorter and exact("stores") > stores), (
        "computed, it replaced the entry"
    )
    assert cached() == served + 1
    assert ask(8) == fresh[8] and ask(12) == fresh[12]
    assert wait_for(lambda: cached() == served + 3)


def test_cache_tier_counters_are_exported(grpc_url, metrics_url):
    prompt, sampling = "Cache counters probe", {"max_tokens": 4, "ignore_eos": True}

    def exported() -> bool:  # the engine publishes its cache counters about once a second while serving
        generate(grpc_url, prompt, sampling=sampling, tenant="rc-counters")
        return engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="hits") >= 1

    assert wait_for(exported, timeout_s=60, interval_s=0.2)
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="stores") >= 1
    # the first request's miss was answered by the key directory, without a GET
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="local_misses") >= 1
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="directory_scans") >= 1
    # its answer was written on the prompt's second sighting, not its first
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="first_sightings") >= 1
    assert engine_metric(metrics_url, "llm_engine_cache_state", tier="exact", gauge="directory_synced") == 1
    # the scheduler step hashed the keys, with the engine's fingerprint: the engine used them as they came
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="claimed_keys") >= 1
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="foreign_keys") == 0
    assert engine_metric(metrics_url, "llm_engine_cache_state", tier="exact", gauge="directory_keys") >= 1
    assert engine_metric(metrics_url, "llm_engine_cache_state", tier="l1", gauge="blocks") >= 1
    # the tiers' sizes, as configured (the default block counts), for fill ratios on a dashboard
    capacity = engine_metric(metrics_url, "llm_engine_cache_state", tier="l1", gauge="capacity_blocks")
    assert capacity == 256
    l2_bytes = engine_metric(metrics_url, "llm_engine_cache_state", tier="l2", gauge="capacity_bytes")
    assert l2_bytes == 4 * engine_metric(
        metrics_url, "llm_engine_cache_state", tier="l1", gauge="capacity_bytes"
    )

    # sampled without a seed, so the response caches stay out of it: the second request is a prefix hit
    shared = "Prefix savings probe: a long shared system prompt that spans several KV blocks. " * 3
    sampled = {"max_tokens": 2, "temperature": 0.7, "ignore_eos": True}

    def saved() -> bool:
        generate(grpc_url, shared + "Question?", sampling=sampled, tenant="rc-savings")
        return engine_metric(metrics_url, "llm_engine_cache_total", tier="l1", counter="seconds_saved") > 0

    assert wait_for(saved, timeout_s=60, interval_s=0.2)
    assert engine_metric(metrics_url, "llm_engine_cache_total", tier="l1", counter="tokens_loaded") >= 16

    # the operator's view of the same figures: `python -m client cache`
    from client.__main__ import main

    out = io.StringIO()
    assert main(["cache", "--metrics-url", metrics_url, "--json"], out=out, err=io.StringIO()) == 0
    tiers = {row["tier"]: row for row in json.loads(out.getvalue())["tiers"]}
    assert {"l1", "l2", "l3", "exact"} <= set(tiers)
    assert tiers["l1"]["capacity"] == 256 and tiers["l1"]["hits"] >= 1 and tiers["l1"]["seconds_saved"] > 0
    assert tiers["exact"]["misses"] >= 1 and tiers["exact"]["errors"] == 0


def test_a_tenant_is_taken_only_with_its_token(grpc_url, redis_url):
    """Naming a tenant is not enough to read its answers: the suite's servers authenticate tenants
    (LLM_TENANT_SECRET), through the ensemble and for requests sent to llm_engine directly."""
    from scheduler.tenant_auth import tenant_token

    prompt, sampling = "Tenant auth probe: the owner's own question", {"max_tokens": 5, "ignore_eos": True}
    owner = generate(grpc_url, prompt, sampling=sampling, tenant="owner")  # the helper sends its token
    assert owner.text and owner.error is None
    for token in (None, "", tenant_token("another secret", "owner"), token_from_env("intruder")):
        with pytest.raises(GenerationError, match="tenant_token|tenant 'owner' needs"):
            generate(
                grpc_url, prompt, sampling=sampling, tenant="owner", tenant_token=token or ""
            )  # "": none
    assert generate(grpc_url, prompt, sampling=sampling).text  # the shared default tenant needs none
    params = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "tenant": "owner"}
    with pytest.raises(AssertionError, match="tenant"):
        engine_tokens(grpc_url, [1, 200, 300], params)  # straight to the engine, no token
    assert engine_tokens(grpc_url, [1, 200, 300], {**params, "tenant_token": token_from_env("owner")})


def test_a_request_spelled_differently_is_served_the_same_exact_answer(grpc_url, metrics_url):
    """Through the real scheduler step and engine: a seeded answer written for top_k 0 and stops
    ("zq", "qz") serves top_k = the vocabulary (the sampler skips top-k for both) with the stops reordered
    and repeated. Both sides read the vocabulary from config.json; had they not, the step's key would be
    a forged one to the engine and never served."""
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    prompt = f"Spelling probe {time.time_ns()}: one exact entry for equal requests"
    base = {"max_tokens": 6, "temperature": 0.9, "seed": 11, "ignore_eos": True}

    def cached() -> float:
        return engine_metric(metrics_url, "llm_engine_requests_finished_total", status="cached")

    def stores() -> float:
        return engine_metric(metrics_url, "llm_engine_cache_total", tier="exact", counter="stores")

    def ask(**extra) -> str:
        return generate(grpc_url, prompt, sampling={**base, **extra}, tenant="spelling").text

    written = stores()
    first = ask(top_k=0, stop=["zq", "qz"])
    assert ask(top_k=0, stop=["zq", "qz"]) == first  # written on its second sighting
    assert wait_for(lambda: stores() > written), "the answer was written"
    served = cached()
    assert ask(top_k=vocab, stop=["qz", "zq", "qz"]) == first  # its first sighting: a hit or nothing
    assert wait_for(lambda: cached() == served + 1), "the other spelling was served the written answer"
