"""Continuous batching: requests join between decode steps and leave as soon as they finish.

One background thread owns the model. Each iteration it drops cancelled requests, admits queued
requests into free slots (highest tier first, earliest deadline first within a tier; each
admission is a prefill that produces the first token), then runs one decode step for every active
slot together.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.model_runner import ModelRunner
from engine.cache_stats import cache_counters, cache_gauges
from engine.detokenize import window_start
from engine.observer import GuardedObserver, EngineObserver, EngineStats
from engine.l3_prefetch import L3Prefetcher
from engine.lookup_pool import LookupPool
from engine.prefix_cache import PrefixCache, PrefixHint, block_keys
from engine.queueing import Ewma, PolicyQueue
from engine.requests import EngineRequest, check_params
from engine.sampling import Sampler, TokenPicker
from engine.stop_strings import StopMatcher
from engine.traffic_recorder import TrafficRecorder
from scheduler.errors import RequestError
from engine.response_tier import ResponseLookup, ResponseTier
from engine.slo_feedback import SloFeedbackLoop
from scheduler.admission import AdmissionController, EngineLoad
from scheduler.feedback import FeedbackController
from scheduler.preemption import Contender, PreemptionPolicy, RunningRequest
from scheduler.priority import assign
from scheduler.sampling_rules import DEFAULT_MAX_NEW_TOKENS
from scheduler.tenant_auth import TenantAuth
from scheduler.tiers import WARMUP_TIER, Tier, TierTable

NEVER = 2**63 - 1
MAX_HOP_NS = 1_000_000_000  # scheduler step to engine: an arrival claimed earlier than this is not believed
# After its last step (or a hit answered off the loop) the idle loop keeps publishing the cache counters,
# once a second, this long: the caches' asynchronous writes land after the requests that caused them.
COUNTERS_SETTLE_S = 10.0
# A running non-streaming request sends an empty, non-final window this often (not before its first
# interval): in Triton 24.10 only the detokenizer ever sees an ensemble request's cancel, and only on a
# response that reaches it, so without these a cancelled (or disconnected) non-streaming request kept its
# slot until it had generated every token. The client reads an empty text piece for each.
NON_STREAM_KEEPALIVE_S = 0.25


@dataclass
class _Active:
    request: EngineRequest
    slot: int
    sampler: Sampler
    stop: StopMatcher
    output: list[int] = field(default_factory=list)
    sent: int = 0
    last_token: int = 0
    position: int = 0
    done: str | None = None
    preemptions: int = 0
    expires_ns: int = 0  # suspended: when it expires unresumed (monotonic clock, the queue's)
    keepalive_at: float = 0.0  # non-streaming: its next empty window is due (NON_STREAM_KEEPALIVE_S)

    @property
    def tier(self) -> str:
        return self.request.params.tier


class Prefilled(NamedTuple):
    logits: torch.Tensor
    reused: int  # prompt tokens loaded from the cache tiers, not computed
    # host clock when the compute began, its lookup and load done: the prefill rate, which prices an L3
    # load against recomputing, must not count a load's wait as compute
    compute_started: float


@dataclass
class _PendingStore:
    """A computed prompt whose full blocks the prefix cache keeps once the engine gets to it
    (`Engine._keep_prefixes`); `head`: its chain keys hashed on arrival."""

    tokens: list[int]
    tenant: str
    publish: bool
    head: list[bytes] | None


def since_received_s(request: EngineRequest) -> float:
    """Seconds since the request arrived, by the wall clock its arrival was stamped with: never negative,
    though that clock may step back (NTP), since the figure feeds counters that must never decrease."""
    return max(0.0, (time.time_ns() - request.received_ns) / 1e9)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        token_bytes: Callable[[int], bytes],
        eos_ids: set[int],
        prompt_buckets: tuple[int, ...],
        observer: EngineObserver | None = None,
        cancelled_elsewhere: Callable[[], set[str]] | None = None,
        *,
        tiers: TierTable | None = None,
        queue_policy: str = "slo",
        max_queued: int | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        admission: AdmissionController | None = None,
        preemption: PreemptionPolicy | None = None,
    ):
        self.runner = runner
        self.token_bytes = token_bytes
        self.byte_run_tokens: frozenset[int] = frozenset()  # ByteFallback's <0xNN>: `window_start`; settable
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens  # the scheduler step's cap, for requests sent here directly
        self.prompt_buckets = tuple(b for b in prompt_buckets if b < runner.max_len) + (runner.max_len,)
        self.log: Callable[[str], None] = lambda message: None  # the loader's logger; settable
        self.observer = observer or EngineObserver()
        self.cancelled_elsewhere = cancelled_elsewhere or set
        self.stats = EngineStats()
        self.ready = False
        self.tiers = tiers or TierTable.defaults()
        self.policy_queue = PolicyQueue(queue_policy, self.tiers, max_queued)
        self._queue = self.policy_queue.queue
        self.admission = admission
        self.prefill_rate = Ewma()
        self.decode_step_s = Ewma()
        self.output_tokens = Ewma()
        self.feedback: SloFeedbackLoop | None = None
        self.responses: ResponseTier | None = None
        self.lookups: LookupPool | None = None  # the semantic cache's lookups, off the submitting thread
        self.tenant_auth = TenantAuth()  # the loader's reads LLM_TENANT_SECRET
        self._cache_stats_at = 0.0
        self._busy_at: float | None = None  # the last step or off-loop hit (monotonic): see COUNTERS_SETTLE_S
        self._next_expiry_ns = NEVER  # the soonest a queued request expires (max_queue_ms); a bound
        self._cache_stats_lock = threading.Lock()
        # the load is read and sent under one lock: the engine thread and the lookup threads report it, and
        # one read before another's and sent after it would stay on an idle engine's gauges
        self._load_publish_lock = threading.Lock()
        self._active: dict[int, _Active] = {}
        self._free = list(range(runner.slots))
        # a request taken off the queue and not yet running or ended (the engine thread's KV work is done
        # outside the lock): a drain and the load gauge count it, or a stop would fail it mid-admission
        self._admitting = 0
        self._lock = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_tokens = torch.zeros(runner.slots, dtype=torch.long, device=runner.device)
        self._positions = torch.zeros(runner.slots, dtype=torch.long, device=runner.device)
        self.deferred_shapes: list[tuple[str, int]] = []
        self.deferred_templates: list[tuple[list[int], str]] = []
        self.template_prefetch: L3Prefetcher | None = None  # hot prefixes' L3 blocks fetched by warmup
        self.prefix_cache: PrefixCache | None = None
        self.preemption = preemption
        self._suspended: dict[str, _Active] = {}
        self._pending_stores: dict[int, _PendingStore] = {}  # by slot
        self._picker = TokenPicker(runner.slots, runner.device)
        self.recorder: TrafficRecorder | None = None

    @property
    def max_prompt_tokens(self) -> int:
        return self.runner.max_len - 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest, own: bool = False) -> None:
        """Queue a request; raises RequestError when it can never run here. `own`: the engine's warmup
        requests (and Triton's warmup samples), which may use a restricted tier without a token; a named
        tenant's token is checked all the same."""
        tier = self.tiers.get(request.params.tier)  # an unknown tier: INVALID_ARG
        check_params(request.params, self.max_new_tokens)
        self.tenant_auth.check(request.params.tenant, request.params.tenant_token, None if own else tier)
        length = len(request.prompt_ids)
        if length == 0:
            raise RequestError.invalid("input_ids is empty; send at least one token")
        if length > self.max_prompt_tokens:
            raise RequestError.invalid(
                f"prompt has {length} tokens; this engine accepts at most {self.max_prompt_tokens}"
            )
        low, high = min(request.prompt_ids), max(request.prompt_ids)
        if low < 0 or high >= self.runner.vocab_size:  # in a prefill it would fail every active request
            raise RequestError.invalid(
                f"input_ids holds {low if low < 0 else high}; token ids are 0 to {self.runner.vocab_size - 1}"
            )
        request.received_ns = request.received_ns or time.time_ns()
        self._bound_precedence(request, tier)
        if self.recorder is not None and request.params.tier != WARMUP_TIER:  # user traffic only
            self.recorder.observe_request(length, self._reserved_len(request))
        if self.responses is not None and request.params.reads_response_cache:
            # a prompt its slot would cut short (prompt + max_tokens past max_len) gets fewer tokens than a
            # paraphrase's stored answer may hold: only its own exact answer is its text
            paraphrasable = length + request.params.max_tokens <= self.runner.max_len
            asks = paraphrasable and self.responses.asks_semantic(request.params)
            offload = asks and self.lookups is not None and not own
            found = self.responses.lookup(
                request.prompt_ids, request.params, semantic=paraphrasable and not offload
            )
            if self._answered(request, found):  # an exact hit is answered here, without waiting
                return
            if offload:  # the semantic lookup off the execute thread (warmup's own requests: inline)
                # accepted as it would be queued now: a pool shut down meanwhile runs it here, after the
                # shutdown began, and its miss is refused as any request submitted then is
                accepted = self._accepting
                self.lookups.run(
                    lambda: self._look_up_semantic_then_queue(request, accepted), request.priority
                )
                return
        self._queue_request(request)

    def _answered(self, request: EngineRequest, found: ResponseLookup) -> bool:
        if found.tokens is not None:  # [] is a hit too: an answer whose first token ended it
            self._answer_from_cache(request, found.tokens, found.trim)
            return True
        request.response_key = found.key
        return False

    def use_lookup_threads(self, threads: int) -> None:
        """Run semantic lookups on `threads` threads of their own (0: on the submitting thread)."""
        self.lookups = LookupPool(threads, on_change=self._publish_load) if threads else None

    def _look_up_semantic_then_queue(self, request: EngineRequest, accepted: bool = True) -> None:
        """`submit`'s rest on a lookup thread: what it would have raised goes to the request's sink. A
        request `accepted` before its lookup (submitted before a shutdown began) is queued all the same,
        to drain."""
        try:
            found = self.responses.lookup_semantic(request.prompt_ids, request.params, request.response_key)
            if not self._answered(request, found):
                self._queue_request(request, accepted=accepted)
        except RequestError as exc:
            request.sink.fail(exc.code, exc.message)
        except Exception as exc:  # a bug must not leave the client waiting
            request.sink.fail(
                "INTERNAL", f"request failed after its cache lookup: {type(exc).__name__}: {exc}"
            )

    def _queue_request(self, request: EngineRequest, accepted: bool = False) -> None:
        length = len(request.prompt_ids)
        if self.prefix_cache is not None and request.params.uses_kv_tiers:
            request.prefix_hint = self.prefix_cache.hint(request.prompt_ids, request.params.tenant)
        try:
            with self._lock:
                if self._stopping or not (self._accepting or accepted):
                    raise RequestError.unavailable("the engine is shutting down; retry on another replica")
                began = time.perf_counter_ns()
                if self.admission is not None:
                    arrival = request.arrived_ns
                    decision = self.admission.check(
                        request.params.tier, length, self._load_locked(), time.time_ns(), arrival_ns=arrival
                    )
                    decision.raise_if_rejected()
                expires = self.policy_queue.push(request)
                self._next_expiry_ns = min(self._next_expiry_ns, NEVER if expires is None else expires)
                request.scheduling_ns += time.perf_counter_ns() - began
                self._lock.notify()
        except BaseException:  # refused (admission, a full queue, a shutdown): its probe is for nobody
            self._drop_probe(request)
            raise

    def _drop_probe(self, request: EngineRequest) -> None:
        """A request that ends before `_start` takes its hint: its L3 probe, if still queued, is dropped
        (`L3Tier.drop_probe`). Called by the thread that owns the request then: the one refusing it, or
        the engine's (or the shutdown's) for one taken off the queue."""
        hint, request.prefix_hint = request.prefix_hint, None
        if hint is not None and hint.probe is not None and self.prefix_cache.l3 is not None:
            self.prefix_cache.l3.drop_probe(hint.probe)

    def _bound_precedence(self, request: EngineRequest, tier: Tier) -> None:
        """No more precedence than the request's tier gives: priority and deadline come as inputs of
        llm_engine, which Triton serves to anyone, and a direct request with priority 0 went before every
        tenant's critical traffic. The scheduler step's values are these already (its arrival is at most
        a hop earlier); an arrival claimed further back counts from `MAX_HOP_NS` before this one."""
        received = request.received_ns
        arrival = min(max(request.params.arrival_ns or received, received - MAX_HOP_NS), received)
        request.arrival_ns = arrival  # and its own expiry, admission and log count from there too
        priority, deadline_ns = assign(tier, arrival)
        # nor less than the lowest tier's: the queue keeps state for each priority it has seen, and a
        # client sending 2**31 distinct values grew it for good, every admission scanning it all
        lowest = max(priority, max(t.priority for t in self.tiers))
        request.priority = min(max(request.priority, priority), lowest)
        request.deadline_ns = max(request.deadline_ns, deadline_ns)

    def _answer_from_cache(self, request: EngineRequest, output: list[int], trim: int) -> None:
        """A response-cache hit: one final window, no slot, no model call."""
        params = request.params
        window = output if params.stream or params.exclude_input_in_output else request.prompt_ids + output
        request.sink.send(window, 0, True, trim)
        self.stats.count_finish("cached")
        self.observer.on_first_token(params.tier, since_received_s(request))
        self.observer.on_finish(params.tier, "cached", len(output))
        self._publish_cache_counters()
        before, self._busy_at = self._busy_at, time.monotonic()
        if before is None or self._busy_at - before > COUNTERS_SETTLE_S - 1.0:
            with self._lock:  # the idle loop may be asleep for good: it publishes what this one may not have
                self._lock.notify()

    def _publish_cache_counters(self) -> None:
        """At most once a second, from whichever thread serves (cache hits never reach the loop)."""
        now = time.monotonic()
        if now - self._cache_stats_at < 1.0 or not self._cache_stats_lock.acquire(blocking=False):
            return
        try:
            self._cache_stats_at = now
            self.observer.on_cache_counters(cache_counters(self.prefix_cache, self.responses))
            self.observer.on_cache_gauges(cache_gauges(self.prefix_cache, self.responses))
        except Exception as exc:  # reading a tier's counters must not fail a request that was served
            self._observer.report("cache_counters", exc)
        finally:
            self._cache_stats_lock.release()

    def apply_feedback(self, controller: FeedbackController) -> None:
        """Adopt the controller's tier weights in the queue (aging) and admission (thresholds)."""
        with self._lock:
            controller.apply_to(queue=self._queue, admission=self.admission)
        for event in controller.last_events:
            self.observer.on_adaptation(event.tier, event.kind, event.new)

    def _load_locked(self) -> EngineLoad:
        """The engine's state as admission control sees it (call with the lock held)."""
        tokens: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for entry in self._queue.entries():
            tokens[entry.item.params.tier] += len(entry.item.prompt_ids)
            counts[entry.item.params.tier] += 1
        active = list(self._active.values())
        remaining = [s.request.params.max_tokens - len(s.output) for s in active]
        return EngineLoad(
            slots=self.runner.slots,
            running_requests=len(active),
            prefill_tokens_per_s=self.prefill_rate.get(5000.0),
            decode_step_s=self.decode_step_s.get(0.02),
            queued_prefill_tokens=tokens,
            queued_requests=counts,
            mean_remaining_decode_steps=sum(remaining) / len(remaining) if remaining else 0.0,
            mean_output_tokens=self.output_tokens.get(32.0),
        )

    def load(self) -> tuple[int, int]:
        """(waiting, running): requests in a semantic lookup count as waiting, as they would in
        Triton's queue if the lookups ran on the submitting thread, so that a drain sees them."""
        pending = self.lookups.pending if self.lookups is not None else 0
        with self._lock:
            return len(self._queue) + pending + self._admitting, len(self._active)

    def _publish_load(self) -> int:
        """Report the load to the observer; returns the requests running."""
        with self._load_publish_lock:
            queued, active = self.load()
            with self._lock:
                positions = sum(s.position for s in self._active.values())
            self.observer.on_load(queued, active, positions)
        return active

    def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting, let queued and running requests finish, then fail whatever is left; requests
        in a semantic lookup are accepted already: they are queued (or answered) and drain with the rest."""
        deadline = time.monotonic() + drain_timeout_s
        with self._lock:
            self._accepting = False
            self._lock.notify()
        if self.lookups is not None:
            self.lookups.shutdown()
        with self._lock:
            while (self._queue or self._active or self._admitting) and time.monotonic() < deadline:
                self._lock.wait(timeout=0.05)
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.recorder is not None:
            self.recorder.stop()
        if self.feedback is not None:
            self.feedback.stop()
        if self.template_prefetch is not None:
            self.template_prefetch.close()
        if self.prefix_cache is not None and self.prefix_cache.l3 is not None:
            self.prefix_cache.l3.close()
        if self.responses is not None:
            self.responses.close()
        message = "the model was unloaded before this request finished; retry"
        for request in self._drain_queue():  # suspended ones among them
            self._end_queued(request, "error", "UNAVAILABLE", message)
        self._fail_all_active("UNAVAILABLE", message)

    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to do."""
        self._drop_cancelled()
        self._drop_expired()
        admitted = self._admit()
        decoded = self._decode() if self._active else False
        active = self._publish_load()
        self._publish_cache_counters()
        if self.recorder is not None:
            self.recorder.observe_active(active)
        return admitted or decoded

    def note_shape(self, kind: str, size: int) -> None:
        """Track first use of each kernel shape; after READY a new one is a cold-start penalty."""
        key = (kind, size)
        if key in self.stats.shapes_seen:
            return
        self.stats.shapes_seen.add(key)
        if self.ready:
            self.stats.new_shapes_after_ready += 1
            self.observer.on_new_shape(kind, size)

    def prefill_bucket(self, length: int) -> int:
        return self.runner.bucket(length, self.prompt_buckets)

    def _has_work_locked(self) -> bool:
        return bool(self._stopping or self._queue or self._active or self.has_background_work)

    def _wait_for_work_locked(self) -> bool:
        """Sleeps until there is work (True), or for a second while the counters settle (False: publish)."""
        while not self._has_work_locked():
            if self._busy_at is None or time.monotonic() - self._busy_at >= COUNTERS_SETTLE_S:
                self._lock.wait()
                continue
            self._lock.wait(timeout=1.0)
            if not self._has_work_locked():
                return False
        return True

    def _loop(self) -> None:
        while True:
            with self._lock:
                has_work = self._wait_for_work_locked()
                if self._stopping:
                    return
                idle = not self._queue and not self._active
            if not has_work:
                self._publish_cache_counters()
                continue
            try:
                if idle:
                    self._background_step()
                else:
                    self.step()
                self._busy_at = time.monotonic()  # either may have changed counters: see COUNTERS_SETTLE_S
            except Exception as exc:  # a broken step must not kill the engine thread
                self.stats.step_failures += 1
                self.log(json.dumps({"event": "engine_step_failed", "error": f"{type(exc).__name__}: {exc}"}))
                try:
                    self._fail_all_active("INTERNAL", f"engine step failed: {type(exc).__name__}: {exc}")
                    self._publish_load()  # the step's own publish never ran: the gauges held its batch
                except Exception as again:  # the thread must outlive even this: every later request needs it
                    self.log(
                        json.dumps(
                            {"event": "engine_fail_all_failed", "error": f"{type(again).__name__}: {again}"}
                        )
                    )
            with self._lock:
                self._lock.notify_all()

    @property
    def observer(self) -> EngineObserver:
        return self._observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        """Kept behind a guard: see GuardedObserver (what the observer raises never reaches a request)."""
        inner = observer.inner if isinstance(observer, GuardedObserver) else observer  # put back: unwrapped
        self._observer = GuardedObserver(inner, lambda message: self.log(message))

    @property
    def has_background_work(self) -> bool:
        return bool(self.deferred_shapes) or self._next_template() is not None

    def _next_template(self) -> int | None:
        """The first deferred template whose L3 prefetch is not still in flight (its wake-up comes later)."""
        for index, (prompt, tenant) in enumerate(self.deferred_templates):
            if self.template_prefetch is None or not self.template_prefetch.pending(prompt, tenant):
                return index
        return None

    def wake(self) -> None:
        """Make the idle loop re-check for background work (a deferred template's prefetch completed)."""
        with self._lock:
            self._lock.notify_all()

    def _background_step(self) -> None:
        """Warmup left over after READY: one shape or one template at a time, only while idle."""
        if self.deferred_shapes:
            kind, bucket = self.deferred_shapes.pop(0)
            self.runner.warm_shape(kind, bucket)
            self.stats.shapes_seen.add((kind, bucket))
        elif (index := self._next_template()) is not None:
            self.prefill_template(*self.deferred_templates.pop(index))

    def prefill_template(self, prompt: list[int], tenant: str) -> int:
        """Load a hot prefix into the prefix cache (pinned) through slot 0; returns how many of its full
        blocks the cache holds now, head first (0: nothing a request could reuse).

        Blocks the warmup's L3 prefetch fetched for it are adopted first (L3 is not asked again)."""
        if self.prefix_cache is None or len(prompt) < 2:
            return 0
        fetched = None if self.template_prefetch is None else self.template_prefetch.take(prompt, tenant)
        if fetched is not None:
            self.prefix_cache.adopt(fetched.keys, fetched.blocks, fetched.waited_s)
        slot = self.runner.widest_slot
        self.prefill(slot, prompt, tenant)
        cache = self.prefix_cache
        cache.store(slot, prompt, tenant, pin=True)
        keys = block_keys(prompt, cache.block_size, cache.salt(tenant))
        return sum(1 for _ in itertools.takewhile(cache.index.__contains__, keys))

    def _drain_queue(self) -> list[EngineRequest]:
        with self._lock:
            drained = []
            while self._queue:
                drained.append(self._queue.pop())
            return drained

    def _drop_cancelled(self) -> None:
        noticed = self.cancelled_elsewhere()
        for state in list(self._active.values()):
            if state.request.request_id in noticed or state.request.sink.cancelled():
                self._send_error(state.request, "CANCELLED", "the client cancelled this request")
                self._finish(state, "cancelled", notify=False)
        for request_id in noticed:
            with self._lock:
                queued = self._queue.remove(request_id)
            if queued is not None:
                self._cancel_queued(queued)

    def _drop_expired(self) -> None:
        """Refuse the queued requests past their tier's `max_queue_ms` (engine/queueing.py). The queue is
        scanned only once the soonest expiry known has come (it may belong to a request admitted since)."""
        now = time.monotonic_ns()
        if now < self._next_expiry_ns:
            return
        with self._lock:
            expired = [entry.item for entry in self._queue.pop_expired(now)]
            soonest = self._queue.earliest_expiry_ns()
            self._next_expiry_ns = NEVER if soonest is None else soonest
        for request in expired:
            tier = request.params.tier or self.tiers.default_name
            if request.request_id in self._suspended:
                message = (
                    f"preempted by more urgent requests and not resumed within tier {tier!r}'s "
                    "max_queue_ms: ended rather than left waiting; retry on another replica or later"
                )
            else:
                waited_ms = (time.time_ns() - request.arrived_ns) / 1e6
                message = (
                    f"queued {waited_ms:.0f} ms, past tier {tier!r}'s max_queue_ms: refused rather than run "
                    "late; retry on another replica or later"
                )
            self._end_queued(request, "expired", "UNAVAILABLE", message)

    def _cancel_queued(self, request: EngineRequest) -> None:
        self._end_queued(request, "cancelled", "CANCELLED", "the client cancelled this request")

    def _end_queued(self, request: EngineRequest, status: str, code: str, message: str) -> None:
        """End a request that never got (back) a slot: its error, its finish counted under `status`."""
        self._suspended.pop(request.request_id, None)
        self._drop_probe(request)
        self._send_error(request, code, message)
        self.stats.count_finish(status)
        self.observer.on_finish(request.params.tier, status, 0)

    def _admit(self) -> bool:
        admitted = False
        while True:
            with self._lock:
                began, now = time.perf_counter_ns(), time.monotonic_ns()
                if not self._queue:
                    break
                head = self._queue.peek(now)
                need = self._reserved_len(head)
                # asked once: a throttled check (TritonSink's) may say False the next time it is asked
                if gone := head.sink.cancelled():  # it must not take a slot, let alone preempt for one
                    request = self._queue.pop(now)
                elif (slot := self._fitting_slot(need)) is not None:
                    request = self._queue.pop(now)
                elif (victim := self._victim_locked(head, need)) is not None:
                    request = self._queue.pop(now)
                    self._suspend(victim)
                    slot = self._fitting_slot(need)
                elif (backfill := self._backfill_locked()) is not None:
                    request, slot = backfill
                else:
                    break
                request.scheduling_ns += time.perf_counter_ns() - began  # the decision, not the KV work
                self._admitting = 1
            try:
                if gone or request.sink.cancelled():
                    self._cancel_queued(request)
                    continue
                self._free.remove(slot)
                suspended = self._suspended.pop(request.request_id, None)
                try:
                    if suspended is not None:
                        self._resume(suspended, slot)
                    else:
                        self._start(request, slot)
                except Exception as exc:  # this request's own fault (its parameters): the others run on
                    self._fail_start(request, slot, exc)
                admitted = True
            finally:
                self._admitting = 0  # running (in `_active`) or ended by now
        return admitted

    def _fail_start(self, request: EngineRequest, slot: int, exc: Exception) -> None:
        """End a request whose prefill or first token raised, and free its slot, its KV untrusted. The
        engine loop's catch-all would have failed every running request instead, and lost the slot."""
        state = self._active.get(slot)
        if state is not None and state.request is request:
            self._release(state, keep_prefix=False)
        elif slot not in self._free:
            self._free.append(slot)
        message = f"request failed to start: {type(exc).__name__}: {exc}"
        self._end_queued(request, "error", "INTERNAL", message.encode("utf-8", "backslashreplace").decode())

    def _reserved_len(self, request: EngineRequest) -> int:
        """KV positions the request can reach: its prompt plus every token it may generate."""
        return min(len(request.prompt_ids) + request.params.max_tokens, self.runner.max_len)

    def _fitting_slot(self, need: int) -> int | None:
        """The free slot of the smallest capacity that holds `need` positions (lowest number on ties)."""
        fitting = [(self.runner.slot_capacity(slot), slot) for slot in self._free]
        best = min((entry for entry in fitting if entry[0] >= need), default=None)
        return None if best is None else best[1]

    def _backfill_locked(self, scan: int = 64) -> tuple[EngineRequest, int] | None:
        """The head fits no free slot (its length class is busy): a later request that fits a free
        slot takes it (returned with that slot). Every free slot is then shorter than the head needs,
        so the head loses nothing."""
        if not self._free:
            return None
        for entry in itertools.islice(self._queue.entries(), scan):
            if (slot := self._fitting_slot(self._reserved_len(entry.item))) is not None:
                return self._queue.take(entry.key), slot  # served: charged to its tenant, as a pop is
        return None

    def _victim_locked(self, head: EngineRequest, need: int) -> _Active | None:
        """The running request to suspend because the queue's head would miss its deadline waiting;
        only a slot that can hold the head (`need` positions) is a candidate."""
        if self.preemption is None or not self._active:
            return None
        running = [
            RunningRequest(
                s.slot, s.request.priority, s.request.params.max_tokens - len(s.output), s.preemptions
            )
            for s in self._active.values()
            if self.runner.slot_capacity(s.slot) >= need
        ]
        if not running:
            return None
        prefill_s = len(head.prompt_ids) / self.prefill_rate.get(5000.0)
        deadline_ns = head.deadline_ns
        if (suspended := self._suspended.get(head.request_id)) is not None:
            # its first token went long ago: what it can still miss is its expiry, not that deadline (past,
            # it made every resuming head preempt the next lower tier, one urgent arrival a chain of them)
            deadline_ns = time.time_ns() + max(0, suspended.expires_ns - time.monotonic_ns())
        slot = self.preemption.victim(
            Contender(head.priority, deadline_ns, prefill_s),
            running,
            self.decode_step_s.get(0.02),
            time.time_ns(),
        )
        return None if slot is None else self._active[slot]

    def _suspend(self, state: _Active) -> None:
        """Give the slot up and requeue the request; it resumes from its tokens (first token already sent)."""
        # park what the slot computed so resuming mostly copies blocks; never for a request that bypasses
        # the caches (its resume does not read them either)
        if self.prefix_cache is not None and state.request.params.uses_kv_tiers:
            pending = self._pending_stores.pop(state.slot, None)  # the prompt's blocks are among these
            publish = pending is not None and pending.publish  # warmup traffic: to L3 at once, as it would
            self.prefix_cache.store(
                state.slot, self._computed_tokens(state), state.request.params.tenant, publish=publish
            )
        state.preemptions += 1
        self.stats.preemptions += 1
        self.observer.on_preemption(state.tier)
        self._release(state)
        self._suspended[state.request.request_id] = state
        state.expires_ns = expires = self.policy_queue.push(state.request, requeue=True)
        self._next_expiry_ns = min(self._next_expiry_ns, expires)

    @staticmethod
    def _computed_tokens(state: _Active) -> list[int]:
        """Tokens whose KV the slot holds: the prompt and every output token but the last (not yet fed)."""
        return state.request.prompt_ids + state.output[:-1]

    def _resume(self, state: _Active, slot: int) -> None:
        state.slot = slot
        self._active[slot] = state
        started = time.perf_counter()
        params = state.request.params
        self.prefill(slot, self._computed_tokens(state), params.tenant, use_cache=params.uses_kv_tiers)
        self.stats.resumes += 1
        self.observer.on_step("prefill", 1, time.perf_counter() - started)

    def _start(self, request: EngineRequest, slot: int) -> None:
        params = request.params
        state = _Active(
            request=request,
            slot=slot,
            sampler=Sampler(params.temperature, params.top_p, params.top_k, params.seed, self.runner.device),
            stop=StopMatcher(params.stop),
            position=len(request.prompt_ids),
        )
        self._active[slot] = state
        started = time.perf_counter()
        use_cache = params.uses_kv_tiers
        hint, request.prefix_hint = request.prefix_hint, None  # a resume has more tokens: hashed anew
        logits, reused, computing = self.prefill(slot, request.prompt_ids, params.tenant, use_cache, hint)
        picks = self._picker.launch(logits.unsqueeze(0), {0: state.sampler})
        if picks.in_flight:  # earlier prompts the lookup left pending are stored while the device computes
            self._keep_prefixes()
        token = picks.result()[0]  # waits for the device
        computed, seconds = len(request.prompt_ids) - reused, max(time.perf_counter() - computing, 1e-6)
        self.prefill_rate.update(computed / seconds)
        if self.prefix_cache is not None:  # prices reuse (time saved) and L3's load-or-recompute
            self.prefix_cache.cost.observe_prefill(computed, seconds)
        self.stats.prefill_steps += 1
        ttft_s = since_received_s(request)
        if self.prefix_cache is not None and use_cache:  # the slot keeps the prompt's KV until released
            head = None if hint is None else hint.keys  # hashed on arrival: the store hashes only the rest
            publish = params.tier == WARMUP_TIER
            self._pending_stores[slot] = _PendingStore(request.prompt_ids, params.tenant, publish, head)
        self._accept_token(state, token)  # the first token leaves before any metrics round trip
        self.observer.on_step("prefill", 1, time.perf_counter() - started)
        self.observer.on_first_token(params.tier, ttft_s)
        self.observer.on_scheduling(params.tier, request.scheduling_ns / 1e9)
        if self.feedback is not None:
            self.feedback.window.observe(params.tier, ttft_s * 1000.0)
        self.observer.on_prefix(reused, len(request.prompt_ids))

    def prefill(
        self,
        slot: int,
        prompt: list[int],
        tenant: str,
        use_cache: bool = True,
        hint: PrefixHint | None = None,
    ) -> Prefilled:
        """Prefill `slot`, reusing this tenant's longest cached prefix unless `use_cache` is off.
        `hint`: the prefix work started when `prompt` arrived."""
        reused = 0
        if self.prefix_cache is not None and use_cache:
            self._keep_prefixes(sharing=(prompt, tenant))  # a lookup sees every prefix computed before it
            hits = self.prefix_cache.lookup(prompt, tenant, hint)
            if hits:
                reused = self.prefix_cache.load(slot, hits)
        padded = self.prefill_bucket(len(prompt) - reused)
        self.note_shape("prefill", padded)
        self.stats.prefix_reused_tokens += reused
        self.stats.prompt_tokens += len(prompt)
        computing = time.perf_counter()
        return Prefilled(self.runner.prefill(slot, prompt, padded, reused), reused, computing)

    def _decode(self) -> bool:
        states = list(self._active.values())
        for state in states:
            self._last_tokens[state.slot] = state.last_token
            self._positions[state.slot] = state.position
        kv_len = self.runner.bucket(max(s.position for s in states) + 1)
        self.note_shape("decode", kv_len)
        started = time.perf_counter()
        logits = self.runner.decode(self._last_tokens, self._positions, kv_len)
        picks = self._picker.launch(logits, {s.slot: s.sampler for s in states})
        self._keep_prefixes()  # on a GPU, while the step runs there
        tokens, faults = picks.settle()  # a pick that raises (NaN/inf probabilities) is its request's
        self.stats.decode_steps += 1
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(states))
        if len(states) > 1:
            self.stats.multi_request_decode_steps += 1
        seconds = time.perf_counter() - started
        self.decode_step_s.update(seconds)
        for state in states:
            if (fault := faults.get(state.slot)) is not None:  # it alone ends; its KV is not trusted
                message = f"sampling the next token failed: {type(fault).__name__}: {fault}"
                self._end_active(state, "INTERNAL", message, keep_prefix=False)
                continue
            state.position += 1
            try:
                self._accept_token(state, tokens[state.slot])
            except Exception as exc:  # its response failed to send: it alone ends, the batch decodes on
                self._response_failed(state, exc)
        self.observer.on_step("decode", len(states), seconds)
        return True

    def _accept_token(self, state: _Active, token: int) -> None:
        params = state.request.params
        self.stats.generated_tokens += 1
        state.last_token = token
        if token in self.eos_ids and not params.ignore_eos:
            state.done = "stop"
        else:
            state.output.append(token)
            if state.stop.push(self.token_bytes(token)):
                state.done = "stop"
            elif len(state.output) >= params.max_tokens:
                state.done = "length"
            elif state.position >= self.runner.slot_capacity(state.slot):
                state.done = "length"
        if state.done is not None:
            self._finish(state, state.done)
        elif params.stream:
            self._emit(state, final=False)
        else:
            self._keep_alive(state)

    def _keep_alive(self, state: _Active) -> None:
        """An empty window for a running non-streaming request, once per NON_STREAM_KEEPALIVE_S: the
        detokenizer asks Triton about it and posts the key to the cancel mailbox if its client is gone."""
        now = time.monotonic()
        if state.keepalive_at == 0.0:
            state.keepalive_at = now + NON_STREAM_KEEPALIVE_S
        elif now >= state.keepalive_at:
            state.keepalive_at = now + NON_STREAM_KEEPALIVE_S
            state.request.sink.send([], 0, False, 0)

    def _emit(self, state: _Active, final: bool) -> None:
        params = state.request.params
        ready, trim = state.stop.releasable(finished=final)
        keep = final and state.done in ("stop", "length") and params.writes_response_cache
        if keep and self.responses is not None:
            request = state.request
            # an answer its slot cut short ("length" before max_tokens: prompt + max_tokens > max_len) is
            # what this prompt gets again (the exact key holds it), not what a paraphrase with a shorter
            # prompt would: the semantic cache does not keep it
            cut = state.done == "length" and len(state.output) < params.max_tokens
            self.responses.remember(
                request.prompt_ids,
                params,
                state.output,
                trim,
                request.response_key,
                paraphrases=not cut,
                # a larger budget gets no more: after EOS or a stop string; at the model's last position
                # (a request is never placed in a slot shorter than prompt + max_tokens or that), for this
                # prompt only
                final=state.done == "stop",
                at_limit=state.position >= self.runner.max_len,
                sent=ready,
            )
        if params.stream:
            if ready <= state.sent and not final:
                return
            # see engine.detokenize
            start = window_start(state.output, state.sent, self.token_bytes, self.byte_run_tokens)
            window, offset = state.output[start:ready], state.sent - start
        elif params.exclude_input_in_output:
            window, offset = state.output[:ready], 0
        else:
            window, offset = state.request.prompt_ids + state.output[:ready], 0
        state.sent = max(state.sent, ready)
        state.request.sink.send(window, offset, final, trim)

    def _finish(self, state: _Active, status: str, notify: bool = True) -> None:
        if notify:
            self._emit(state, final=True)
        self.stats.count_finish(status)
        self.output_tokens.update(len(state.output))
        self.observer.on_finish(state.tier, status, len(state.output))
        self._release(state)

    def _keep_prefixes(self, slot: int | None = None, sharing: tuple[list[int], str] | None = None) -> None:
        """Store the prompts computed since the last call (every slot's, one, or those `sharing` a
        prompt's first block for a tenant). A store is not run when its prompt's first token leaves:
        it waits for the launch of the next step (a decode, or on a GPU another request's prefill), so
        that on a GPU its host work (~0.5 ms a request on the H200, 0.6 on the CPU VM) runs while the
        device computes, or for its slot's release, whichever comes first. A lookup first stores the
        prompts that begin with its first block, as a burst of requests sharing a prefix needs; no
        other prompt can hold a block of its chain. Under load, storing every pending prompt there
        ran each store with the device idle, before the next request's prefill."""
        for key in list(self._pending_stores) if slot is None else [slot]:
            pending = self._pending_stores.get(key)
            if pending is None or (sharing is not None and not self._shares_first_block(pending, *sharing)):
                continue
            del self._pending_stores[key]
            self.prefix_cache.store(
                key, pending.tokens, pending.tenant, publish=pending.publish, head=pending.head
            )

    def _shares_first_block(self, pending: _PendingStore, prompt: list[int], tenant: str) -> bool:
        """Whether `pending` may hold blocks of `prompt`'s chain: chained keys match only from the first
        block on, and only for one tenant. A prompt with no full block before its last token looks up
        nothing."""
        size = self.prefix_cache.block_size
        return pending.tenant == tenant and len(prompt) > size and pending.tokens[:size] == prompt[:size]

    def _release(self, state: _Active, keep_prefix: bool = True) -> None:
        """Free the slot; its prompt's blocks are stored first unless the slot's KV is not to be
        trusted (a failed step) or the cache is going away (shutdown)."""
        if keep_prefix:
            self._keep_prefixes(state.slot)
        else:
            self._pending_stores.pop(state.slot, None)
        if self._active.pop(state.slot, None) is not None:
            self._free.append(state.slot)
            self._positions[state.slot] = 0

    def _send_error(self, request: EngineRequest, code: str, message: str) -> None:
        """End a request with an error; a sink that raises (its sender broke) is logged, never raised: it
        aborted whatever loop was ending requests (the rest never answered) or failed a whole step."""
        try:
            request.sink.fail(code, message)
        except Exception as exc:
            self._log_response_failed(exc)

    def _log_response_failed(self, exc: Exception) -> None:
        self.log(json.dumps({"event": "response_failed", "error": f"{type(exc).__name__}: {exc}"}))

    def _response_failed(self, state: _Active, exc: Exception) -> None:
        """A running request whose response raised: it ends alone (INTERNAL), its slot freed."""
        if self._active.get(state.slot) is not state:  # ended already: its final response went
            self._log_response_failed(exc)
            return
        message = f"sending a response failed: {type(exc).__name__}: {exc}"
        self._end_active(state, "INTERNAL", message, keep_prefix=True)

    def _fail_all_active(self, code: str, message: str) -> None:
        for state in list(self._active.values()):
            self._end_active(state, code, message, keep_prefix=False)

    def _end_active(self, state: _Active, code: str, message: str, keep_prefix: bool) -> None:
        """A running request ends with an error: answered, counted, its slot freed."""
        self._send_error(state.request, code, message)
        self.stats.count_finish("error")
        self.observer.on_finish(state.tier, "error", len(state.output))
        self._release(state, keep_prefix=keep_prefix)
