"""Engine logic on a small random Llama, driven step by step (no Triton, no threads)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import engine.engine as engine_module
from conftest import wait_for
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.requests import EngineRequest
from engine.warmup import run_warmup
from scheduler.errors import RequestError
from scheduler.messages import EngineRequestParams
from scheduler.tiers import TierTable
from tests.conftest import answer

BUCKETS = (8, 16, 32, 64)
EOS = 2


@dataclass
class RecordingSink:
    windows: list[tuple[list[int], int, bool]] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    cancel: bool = False
    trim: int = 0

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        self.windows.append((list(token_ids), read_offset, final))
        self.trim += trim_bytes

    def fail(self, code, message):
        self.errors.append((code, message))

    def cancelled(self):
        return self.cancel

    @property
    def tokens(self) -> list[int]:
        return [t for ids, offset, _ in self.windows for t in ids[offset:]]

    @property
    def finished(self) -> bool:
        return bool(self.errors) or any(final for *_, final in self.windows)


class OrderSink(RecordingSink):
    """Notes its name in `order` when its first window comes: the order requests were served in."""

    def __init__(self, name: str, order: list[str]):
        super().__init__()
        self.name, self.order = name, order

    def send(self, token_ids, read_offset, final, trim_bytes=0):
        if not self.windows:
            self.order.append(self.name)
        super().send(token_ids, read_offset, final, trim_bytes)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        eos_token_id=EOS,
    )
    return LlamaForCausalLM(config).eval()


def make_engine(model, slots=4) -> Engine:
    runner = ModelRunner(model, slots=slots, max_len=128, kv_buckets=BUCKETS)
    return Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)


def request(prompt, sink, rid="r", priority=3, deadline=0, **params) -> EngineRequest:
    defaults = {"max_tokens": 8, "ignore_eos": True, "stream": True}
    return EngineRequest(
        rid, list(prompt), EngineRequestParams(**{**defaults, **params}), priority, deadline, sink
    )


def run_until_idle(engine: Engine, limit=500) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("engine did not go idle")


def generate(engine, prompt, **params) -> list[int]:
    sink = RecordingSink()
    engine.submit(request(prompt, sink, **params))
    run_until_idle(engine)
    return sink.tokens


def test_runner_matches_transformers_forward(model):
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    prompt = [1, 5, 9, 33, 7]
    reference = model(torch.tensor([prompt + [11]])).logits[0]
    prefill = runner.prefill(1, prompt, 8)
    torch.testing.assert_close(prefill, reference[len(prompt) - 1], atol=1e-4, rtol=1e-4)
    decode = runner.decode(torch.tensor([0, 11]), torch.tensor([0, len(prompt)]), 8)
    torch.testing.assert_close(decode[1], reference[-1], atol=1e-4, rtol=1e-4)


def test_concurrent_requests_share_decode_steps(model):
    engine = make_engine(model)
    sinks = [RecordingSink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.submit(request([1, 4 + i, 9], sink, rid=f"r{i}", max_tokens=6))
    run_until_idle(engine)
    assert all(len(s.tokens) == 6 and s.finished for s in sinks)
    assert engine.stats.max_decode_batch == 3
    assert engine.stats.multi_request_decode_steps >= 4


def test_greedy_output_does_not_depend_on_batch_neighbours(model):
    alone = generate(make_engine(model), [1, 10, 20, 30], max_tokens=10)
    engine = make_engine(model)
    target, other = RecordingSink(), RecordingSink()
    engine.submit(request([1, 50, 60], other, rid="other", max_tokens=20))
    engine.step()
    engine.submit(request([1, 10, 20, 30], target, rid="target", max_tokens=10))
    run_until_idle(engine)
    assert target.tokens == alone


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    params = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    first = generate(make_engine(model), [1, 3, 5], seed=7, **params)
    again = generate(make_engine(model), [1, 3, 5], seed=7, **params)
    other = generate(make_engine(model), [1, 3, 5], seed=8, **params)
    assert first == again
    assert first != other


def test_max_tokens_and_eos(model):
    engine = make_engine(model)
    assert len(generate(engine, [1, 2, 3], max_tokens=5)) == 5
    greedy = generate(engine, [1, 2, 3], max_tokens=20)
    eos_engine = Engine(engine.runner, engine.token_bytes, {greedy[3]}, BUCKETS)
    assert generate(eos_engine, [1, 2, 3], max_tokens=20, ignore_eos=False) == greedy[:3]


def test_stop_string_ends_before_the_match(model):
    engine = make_engine(model)
    free = generate(engine, [1, 7, 7], max_tokens=12)
    text = bytes(97 + t % 26 for t in free).decode()
    stop = text[5:7]
    sink = RecordingSink()
    engine.submit(request([1, 7, 7], sink, max_tokens=12, stop=(stop,)))
    run_until_idle(engine)
    stopped = bytes(97 + t % 26 for t in sink.tokens).decode()
    assert stopped[: len(stopped) - sink.trim] == text[: text.index(stop)]


def test_cancelled_request_frees_its_slot_for_a_queued_one(model):
    engine = make_engine(model, slots=1)
    running, waiting = RecordingSink(), RecordingSink()
    engine.submit(request([1, 2], running, rid="a", max_tokens=50))
    engine.submit(request([1, 3], waiting, rid="b", max_tokens=3))
    engine.step()
    assert engine.load() == (1, 1)
    running.cancel = True
    run_until_idle(engine)
    assert running.errors and running.errors[0][0] == "CANCELLED"
    assert len(waiting.tokens) == 3
    assert engine.stats.finished == {"cancelled": 1, "length": 1}


def tiers_with_max_queue(ms: float) -> TierTable:
    return TierTable(tuple(replace(tier, max_queue_ms=ms) for tier in TierTable.defaults().tiers))


def test_a_request_queued_past_its_tiers_max_queue_ms_is_refused_not_run(model):
    """Its client has most likely given up; running it late spends a prefill on nobody."""
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, tiers=tiers_with_max_queue(300))
    running, stale, fresh = RecordingSink(), RecordingSink(), RecordingSink()
    engine.submit(request([1, 2], running, rid="a", max_tokens=40))
    engine.step()
    arrived_earlier = request([1, 3], stale, rid="b", max_tokens=3, arrival_ns=time.time_ns() - 400_000_000)
    engine.submit(arrived_earlier)  # waited 400 ms upstream (the scheduler step's arrival time)
    engine.submit(request([1, 4], fresh, rid="c", max_tokens=3))
    engine.step()
    assert stale.errors and stale.errors[0][0] == "UNAVAILABLE" and "max_queue_ms" in stale.errors[0][1]
    assert not stale.windows and not fresh.errors and engine.load()[0] == 1
    running.cancel = True  # the slot frees at once: the fresh request, not yet 300 ms old, runs
    run_until_idle(engine)
    assert len(fresh.tokens) == 3
    assert engine.stats.finished == {"expired": 1, "cancelled": 1, "length": 1}


def test_an_arrival_claimed_long_ago_counts_from_one_hop_before_receipt(model):
    """llm_engine's arrival_ns is an input anyone may send: one an hour old neither expires the request at
    once (it counts from MAX_HOP_NS before receipt, as its priority does) nor shows in its log as an hour."""
    from engine.engine import MAX_HOP_NS

    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    tiers = tiers_with_max_queue(3 * MAX_HOP_NS / 1e6)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, tiers=tiers)
    sink = RecordingSink()
    long_ago = request([1, 3], sink, rid="b", max_tokens=3, arrival_ns=time.time_ns() - 3600 * 10**9)
    engine.submit(long_ago)
    assert long_ago.received_ns - long_ago.arrived_ns == MAX_HOP_NS
    run_until_idle(engine)
    assert len(sink.tokens) == 3 and not sink.errors
    future = request([1, 4], RecordingSink(), rid="c", max_tokens=3, arrival_ns=time.time_ns() + 3600 * 10**9)
    engine.submit(future)  # nor does one from the future wait forever
    assert future.arrived_ns == future.received_ns


def test_a_request_still_queued_when_its_max_queue_ms_passes_expires(model):
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, tiers=tiers_with_max_queue(10))
    running, waiting = RecordingSink(), RecordingSink()
    engine.submit(request([1, 2], running, rid="a", max_tokens=120))
    submitted = time.monotonic()
    engine.submit(request([1, 3], waiting, rid="b", max_tokens=3))
    while not waiting.errors and time.monotonic() - submitted < 5:
        engine.step()
    waited = time.monotonic() - submitted
    assert waiting.errors[0][0] == "UNAVAILABLE" and not waiting.windows
    assert waited >= 0.01 and not running.finished  # not before its time; the running request goes on


def test_non_streaming_sends_one_final_window_with_prompt(model):
    engine = make_engine(model)
    sink = RecordingSink()
    engine.submit(request([1, 2, 3], sink, stream=False, max_tokens=4))
    run_until_idle(engine)
    *keepalives, last = sink.windows  # empty keep-alives on a slow machine
    assert all(not ids and not final for ids, _, final in keepalives)
    ids, offset, final = last
    assert final and offset == 0 and ids[:3] == [1, 2, 3] and len(ids) == 7


def test_prompt_limits_raise_clear_errors(model):
    engine = make_engine(model)
    with pytest.raises(Exception, match="at most 127"):
        engine.submit(request(list(range(200)), RecordingSink()))
    with pytest.raises(Exception, match="empty"):
        engine.submit(request([], RecordingSink()))


def test_warmup_leaves_no_new_shape_for_any_length(model):
    cold = make_engine(model)
    cold.ready = True
    for length in (3, 12, 40):
        generate(cold, [1] * length, max_tokens=3)
    assert cold.stats.new_shapes_after_ready > 0

    warm = make_engine(model)
    report = run_warmup(warm, enabled=True)
    warm.ready = True
    assert [s.name for s in report.stages] == [
        "prefill_buckets",
        "decode_kv_buckets",
        "connections",
        "sampling",
        "prefix_templates",
        "requests",
    ]
    assert warm.stats.finished == {} and warm.load() == (0, 0)
    for length in (3, 12, 40, 100):
        generate(warm, [1] * length, max_tokens=3)
    assert warm.stats.new_shapes_after_ready == 0


def test_shutdown_drains_running_requests(model):
    engine = make_engine(model)
    engine.start()
    sink = RecordingSink()
    engine.submit(request([1, 2, 3], sink, max_tokens=20))
    engine.shutdown(drain_timeout_s=30)
    assert sink.finished and len(sink.tokens) == 20 and not sink.errors
    with pytest.raises(Exception, match="shutting down"):
        engine.submit(request([1, 2], RecordingSink()))


def test_cancellation_noticed_elsewhere_frees_running_and_queued_requests(model):
    notices: set[str] = set()
    engine = make_engine(model, slots=1)
    engine.cancelled_elsewhere = lambda: set(notices)
    running, queued = RecordingSink(), RecordingSink()
    engine.submit(request([1, 2], running, rid="run", max_tokens=50))
    engine.submit(request([1, 3], queued, rid="wait", max_tokens=50))
    engine.step()
    notices.update({"run", "wait"})
    engine.step()
    assert running.errors[0][0] == "CANCELLED" and queued.errors[0][0] == "CANCELLED"
    assert engine.load() == (0, 0)
    assert engine.stats.finished == {"cancelled": 2}


def test_budget_defers_shapes_that_the_idle_engine_warms_in_the_background(model):
    engine = make_engine(model)
    report = run_warmup(engine, enabled=True, budget_s=1e-9)
    assert len(report.deferred) == 2 * len(engine.prompt_buckets) and report.failures == []
    engine.ready = True
    engine.start()
    deadline = time.monotonic() + 30
    while engine.deferred_shapes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.deferred_shapes
    generate_threaded = RecordingSink()
    engine.submit(request([1] * 40, generate_threaded, max_tokens=3))
    engine.shutdown(drain_timeout_s=30)
    assert len(generate_threaded.tokens) == 3
    assert engine.stats.new_shapes_after_ready == 0


def test_a_failing_warmup_step_is_reported_and_left_to_lazy_warmup(model):
    engine = make_engine(model)
    original = engine.runner.warm_shape

    def broken(kind, bucket):
        if kind == "prefill" and bucket == 32:
            raise RuntimeError("simulated kernel failure")
        original(kind, bucket)

    engine.runner.warm_shape = broken
    report = run_warmup(engine, enabled=True)
    assert report.failures == [{"stage": "prefill:32", "error": "RuntimeError: simulated kernel failure"}]
    engine.ready = True
    assert len(generate(engine, [1] * 20, max_tokens=2)) == 2
    assert engine.stats.new_shapes_after_ready == 1


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("fifo", ["batch", "std-late", "std-early", "crit"]),
        ("priority", ["crit", "std-late", "std-early", "batch"]),
        ("edf", ["batch", "std-early", "std-late", "crit"]),
        ("slo", ["crit", "std-early", "std-late", "batch"]),
    ],
)
def test_queue_policies_order_the_same_arrivals_differently(model, policy, expected):
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, queue_policy=policy)
    order: list[str] = []
    engine.submit(request([1, 2], OrderSink("blocker", order), rid="blocker", max_tokens=2))
    engine.step()
    # deadlines past every tier's own (arrival + ttft_target_ms, which the engine bounds them by), in the
    # order the test needs: EDF alone would serve the batch request first
    base = time.time_ns() + 10_000_000_000
    arrivals = (
        ("batch", "batch", 4, 10), ("std-late", "standard", 3, 900), ("std-early", "standard", 3, 100),
        ("crit", "critical", 1, 5000),
    )  # fmt: skip
    for received, (rid, tier, priority, deadline) in enumerate(arrivals, start=1):
        due = base + deadline
        item = request([1, 2], OrderSink(rid, order), rid=rid, priority=priority, deadline=due, tier=tier)
        item.received_ns = time.time_ns() + received  # in this order, and not expired (max_queue_ms)
        engine.submit(item)
    run_until_idle(engine)
    assert order == ["blocker", *expected]


def test_prefill_after_a_reused_prefix_matches_a_whole_prefill(model):
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    prompt = list(range(1, 60))
    whole = runner.prefill(0, prompt, 64)
    runner.write_blocks(1, runner.read_blocks(0, 5, 8))
    suffix = runner.prefill(1, prompt, 32, start=40)
    torch.testing.assert_close(suffix, whole, atol=1e-4, rtol=1e-4)


def test_prefill_graphs_past_their_budget_are_captured_in_the_background(model):
    """The capture itself needs CUDA (tests/test_engine_cuda.py); here the budget and the order."""
    engine = make_engine(model)
    engine.runner.use_prefill_graphs = True
    captured: list[int] = []

    def warm_shape(kind, bucket):
        if kind == "prefill_graph":
            captured.append(bucket)

    engine.runner.warm_shape = warm_shape
    histogram = {60: 100, 30: 10}  # bucket 64 is the most used, then 32
    report = run_warmup(engine, enabled=True, histogram=histogram, graph_budget_s=0.0)
    assert captured == [] and report.failures == []
    assert [b for kind, b in engine.deferred_shapes if kind == "prefill_graph"][:2] == [64, 32]
    assert next(s for s in report.stages if s.name == "prefill_graphs").items == 0
    assert next(s for s in report.stages if s.name == "prefill_buckets").items == 5  # warm eager instead
    engine.deferred_shapes.clear()
    report = run_warmup(engine, enabled=True, histogram=histogram)
    assert captured == [64, 32, 8, 16, 128] and not engine.deferred_shapes


def test_a_prefill_graph_capture_is_its_buckets_warmup_and_a_failed_one_falls_back_to_eager(model):
    engine = make_engine(model)
    engine.runner.use_prefill_graphs = True
    calls: list[tuple[str, int]] = []

    def warm_shape(kind, bucket):
        calls.append((kind, bucket))
        if kind == "prefill_graph" and bucket == 32:
            raise RuntimeError("capture failed")

    engine.runner.warm_shape = warm_shape
    report = run_warmup(engine, enabled=True)
    prefill_calls = [call for call in calls if call[0] != "decode"]
    assert prefill_calls == [
        ("prefill_graph", 8),
        ("prefill_graph", 16),
        ("prefill_graph", 32),
        ("prefill", 32),
        ("prefill_graph", 64),
        ("prefill_graph", 128),
    ]
    assert [f["stage"] for f in report.failures] == ["prefill_graph:32"]
    assert engine.deferred_shapes == [("prefill_graph", 32)]  # retried while idle
    stages = {s.name: s.items for s in report.stages}
    assert stages["prefill_graphs"] == 4 and stages["prefill_buckets"] == 1
    assert {("prefill", bucket) for bucket in (8, 16, 32, 64, 128)} <= engine.stats.shapes_seen


def test_a_token_id_outside_the_vocabulary_fails_only_its_own_request(model):
    """Direct `llm_engine` clients send ids, not text: an id the embedding cannot look up is rejected at
    submit, instead of failing the prefill and with it every request running beside it."""
    engine = make_engine(model)
    running = RecordingSink()
    engine.submit(request([5, 6, 7], running, rid="ok", max_tokens=6))
    engine.step()
    for bad in ([1, 300, 4], [-1, 4]):
        with pytest.raises(RequestError) as info:
            engine.submit(request(bad, RecordingSink(), rid="bad"))
        assert info.value.code == "INVALID_ARG" and "token ids are 0 to 299" in info.value.message
    run_until_idle(engine)
    assert not running.errors and len(running.tokens) == 6


def test_a_request_that_raises_as_it_starts_fails_alone_and_frees_its_slot(model, monkeypatch):
    """A stop string that could not be matched (a lone surrogate, which `submit` now refuses) raised in
    the request's first token; the engine loop's catch-all then failed every running request and the slot
    was lost. Here the stop matcher raises for one request's stop string instead."""
    real_matcher = engine_module.StopMatcher

    def matcher(stops):
        if "boom" in stops:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return real_matcher(stops)

    monkeypatch.setattr(engine_module, "StopMatcher", matcher)
    engine = make_engine(model, slots=2)
    engine.start()
    try:
        bystander, victim, after = RecordingSink(), RecordingSink(), RecordingSink()
        engine.submit(request([1, 5, 6, 7], bystander, "a", max_tokens=60))
        assert wait_for(lambda: len(bystander.windows) >= 2, 20), "the bystander is decoding"
        engine.submit(request([1, 8, 9], victim, "b", temperature=0.7, stop=("boom",)))
        assert wait_for(lambda: victim.finished and bystander.finished, 30)
        assert (
            victim.errors and victim.errors[0][0] == "INTERNAL" and "failed to start" in victim.errors[0][1]
        )
        victim.errors[0][1].encode("utf-8")  # the message goes back to the client
        assert not bystander.errors and len(bystander.tokens) == 60
        engine.submit(request([1, 10, 11], after, "c"))
        assert wait_for(lambda: after.finished, 20) and not after.errors
        assert wait_for(lambda: sorted(engine._free) == [0, 1], 5), "a slot was lost"
        assert engine.stats.finished["error"] == 1
    finally:
        engine.shutdown(1.0)


def test_an_empty_cached_answer_is_served_not_generated_again(model, redis_server):
    """An answer whose first token ended it is cached as ""; the engine took the [] it read back for a
    miss, so the prompt was generated again on every request while the hit counter grew. Found in review."""
    import uuid

    from cache.response_cache import ExactResponseCache
    from engine.response_tier import ResponseTier

    engine = make_engine(model)
    exact = ExactResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", timeout_s=0.5)
    engine.responses = ResponseTier(exact, lambda ids, trim: b"")
    try:
        sink = RecordingSink()
        req = request([1, 5, 6], sink, temperature=0.0, stream=False)
        assert exact.put(req.prompt_ids, req.params, answer(""))
        engine.submit(req)
        run_until_idle(engine)
        assert engine.stats.finished.get("cached") == 1 and engine.stats.prefill_steps == 0
        assert sink.windows == [([1, 5, 6], 0, True)] and exact.snapshot()["hits"] == 1
    finally:
        engine.responses.close()


def test_a_temperature_too_small_to_divide_by_samples_greedily_and_fails_nobody(model):
    """A request sent to llm_engine directly is not validated by the scheduler step: temperature 1e-300
    made the step's sampling raise, and the loop failed every running request. Found in review."""
    engine = make_engine(model, slots=2)
    engine.start()
    try:
        bystander, tiny = RecordingSink(), RecordingSink()
        engine.submit(request([1, 5, 6, 7], bystander, "a", max_tokens=40))
        assert wait_for(lambda: len(bystander.windows) >= 2, 20)
        engine.submit(request([1, 8, 9], tiny, "b", temperature=1e-300, seed=1, max_tokens=6))
        assert wait_for(lambda: tiny.finished and bystander.finished, 30)
        assert not bystander.errors and not tiny.errors and len(tiny.tokens) == 6
    finally:
        engine.shutdown(1.0)
    assert tiny.tokens == generate(make_engine(model), [1, 8, 9], max_tokens=6)  # greedy


def test_a_direct_request_gets_no_more_precedence_than_its_tier(model):
    """llm_engine takes priority and deadline as inputs, and Triton serves it to anyone: a request with
    priority 0 and deadline 0 in the batch tier went before every tenant's critical request. The engine
    bounds both by the tier's own (scheduler/priority.assign). Found in review."""
    runner = ModelRunner(model, slots=1, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS)
    first: list[str] = []
    engine.submit(request([1, 2], OrderSink("blocker", first), rid="blocker", max_tokens=2))
    engine.step()
    jumper = request([1, 3], OrderSink("jumper", first), rid="jumper", priority=0, deadline=0, tier="batch")
    engine.submit(jumper)
    due = time.time_ns() + 120_000_000
    critical = request([1, 4], OrderSink("crit", first), "crit", priority=1, deadline=due, tier="critical")
    engine.submit(critical)
    assert jumper.priority == 4 and jumper.deadline_ns >= jumper.received_ns + 5_000_000_000
    run_until_idle(engine)
    assert first == ["blocker", "crit", "jumper"]
    with pytest.raises(RequestError):
        engine.submit(request([1, 5], RecordingSink(), rid="odd", tier="gold"))


def test_a_direct_request_outside_the_scheduler_steps_ranges_is_refused_at_submit(model):
    """llm_engine is served to anyone, and `request_params` were only type-checked: max_tokens past the
    deployment's cap ran in full, top_p 0 failed as INTERNAL in its first token, and hundreds of long stop
    strings slowed every tenant's decode steps. Found in review. The bystander runs on unaffected."""
    runner = ModelRunner(model, slots=2, max_len=128, kv_buckets=BUCKETS)
    engine = Engine(runner, lambda t: bytes([97 + t % 26]), {EOS}, BUCKETS, max_new_tokens=20)
    bystander = RecordingSink()
    engine.submit(request([1, 5, 6], bystander, "a", max_tokens=20))
    engine.step()
    bad = [({"max_tokens": 21}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
           ({"temperature": 0.8, "top_p": 0.0}, "top_p"), ({"temperature": 0.8, "top_k": -1}, "top_k"),
           ({"temperature": 50.0}, "temperature"), ({"stop": ("q" * 20000,) * 300}, "stop")]  # fmt: skip
    for params, named in bad:
        sink = RecordingSink()
        with pytest.raises(RequestError) as info:
            engine.submit(request([1, 8, 9], sink, "bad", **params))
        assert info.value.code == "INVALID_ARG" and info.value.message.startswith(f"request_params.{named} ")
        assert not sink.windows
    run_until_idle(engine)
    assert not bystander.errors and len(bystander.tokens) == 20
    assert engine.stats.prefill_steps == 1, "a refused request reached the model"
