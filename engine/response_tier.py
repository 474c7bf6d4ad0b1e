"""Response caches on the serving path: a hit is answered from Redis without touching the model.

Exact first; then, when enabled, the semantic cache (a paraphrase of an answered question, same
tenant, same sampling signature, past the negation/entity guard).

The hit still streams through the ensemble as the token ids (and stop-string trim) the engine sent when
it computed the answer, cut to the request's max_tokens, an exact hit's and a semantic hit's alike: no
text is encoded again. The detokenizer turns them into text like any other response. Only greedy or
seeded requests are cacheable (cache/response_cache.py decides). Results are written by a background
thread so the engine loop never waits on Redis.

An exact answer is written on its prompt's second sighting (`first_use=False`, the server's default:
`response_cache_first_use`), as L3 writes blocks on reuse: at a low hit rate most prompts come once,
and their writes were most of the exact cache's cost (H200 at 0% hits, one request at a time: all
caches cost 2.05% of throughput with a write per answer, 0.71% with this policy). Warmup-tier answers
are written at once (filling the caches is that tier's job), and so are semantic entries (a
paraphrase is never the same prompt).

The key is hashed by the scheduler step, in its own process, and comes with the request
(`EngineRequestParams.response_key`): for a miss this process hashes nothing. It is checked (hashed
here) before a hit is served or an answer written: a client that calls the engine step directly can
put any key in its request, and must not read or overwrite another prompt's or tenant's entry.

The admission is decided on the caller's (engine) thread when the request's lookup has its key: a
first sighting, most answers at a low hit rate, then costs a dict update and never wakes the writer.

With a tenant quota on the exact cache, a hit is told to Redis (its score and TTL renewed, on the
writer, at most once per `renew_every_s` per answer and replica), so the quota trims by last use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from cache.response_cache import ExactAnswer, ExactResponseCache
from cache.sightings import Sightings
from cache.stamps import Stamps
from cache.semantic_cache import SemanticResponseCache
from engine.write_behind import WriteBehind
from scheduler.messages import EngineRequestParams
from scheduler.tiers import WARMUP_TIER


@dataclass(frozen=True)
class ResponseKey:
    """A prompt's exact-cache key, and whether this process checked that it is the prompt's: a key the
    scheduler step hashed (`EngineRequestParams.response_key`) is trusted for a miss, the common case,
    and checked only before a hit is served or an answer written, so that a request sent to the engine
    directly with another prompt's or tenant's key can neither read nor overwrite that entry."""

    value: str
    checked: bool


@dataclass
class ResponseLookup:
    """A lookup's answer (token ids, and the raw bytes a stop string trims off their end) or None, and
    the exact key (None: not cacheable), which the request carries to `remember` so that its write does
    not hash the prompt again."""

    tokens: list[int] | None
    key: ResponseKey | None
    trim: int = 0


@dataclass(frozen=True)
class _Answer:
    """A finished answer on its way to the writer; `exact`: whether the exact cache writes it (None:
    decided on the writer, which then hashes the key itself)."""

    prompt_ids: list[int]
    params: EngineRequestParams
    answer: ExactAnswer
    key: ResponseKey | None
    exact: bool | None
    paraphrases: bool = True  # whether the semantic cache may keep it for other prompts
    at_limit: bool = False  # it ran to the model's last position: final for its own prompt only

    @property
    def exact_answer(self) -> ExactAnswer:
        """The answer as its own prompt's entry keeps it: run to the model's last position, it is final (a
        request is never placed in a slot shorter than prompt + max_tokens or that), whatever the budget."""
        return replace(self.answer, final=True) if self.at_limit else self.answer


@dataclass(frozen=True)
class _Renewal:
    """An exact hit on its way to the writer, which tells the tenant quota it was used."""

    key: str
    tenant: str


class ResponseTier:
    def __init__(
        self,
        cache: ExactResponseCache,
        token_bytes: Callable[[list[int], int], bytes],
        backlog: int = 1024,
        prompt_text: Callable[[list[int]], tuple[str, str]] | None = None,
        semantic: SemanticResponseCache | None = None,
        first_use: bool = True,
        sightings: int = 65536,
        log: Callable[[str], None] = lambda message: None,
        renew_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cache = cache
        self._log = log
        self.first_use = first_use
        self._sightings: Sightings[str] = Sightings(sightings)
        self._lock = threading.Lock()  # the sightings and counters: engine and writer threads
        self.first_sightings = 0  # answers not written: their prompt was not seen before
        self.claimed_keys = 0  # keys the scheduler step hashed, used as they came
        self.foreign_keys = 0  # keys of another fingerprint (a scheduler configured unlike the engine)
        self.forged_keys = 0  # keys that were not their prompt's when checked: refused
        self.request_seconds = 0.0  # lookup and remember, on the callers' threads: every request's cost
        self.semantic = semantic
        # (text, variant): a prompt as the semantic cache compares it, and what only an equal one matches;
        # by default the text `token_bytes` (the detokenizer's bytes of ids, less a trim) gives, no variant
        self.prompt_text = prompt_text or (
            lambda ids: (token_bytes(ids, 0).decode("utf-8", errors="replace"), "")
        )
        self.renew_every_s = renew_every_s
        self._clock = clock
        self._renewed: Stamps[str] = Stamps(sightings)  # exact key -> when its renewal was queued
        self._writes: WriteBehind[_Answer | _Renewal] = WriteBehind(
            self._write, "response-cache-writer", backlog
        )

    @property
    def writes_dropped(self) -> int:
        """Answers not written because the writer had fallen behind (a slow Redis): never waited for."""
        return self._writes.dropped

    @property
    def writes_failed(self) -> int:
        """Writes that raised (a bug or a bad value, not Redis trouble, which the store absorbs): skipped."""
        return self._writes.failed

    def asks_semantic(self, params: EngineRequestParams) -> bool:
        """Whether a miss of the exact cache for `params` goes on to the semantic cache (slow: an
        embedding and maybe the pair classifier), which the engine may run off the submitting thread."""
        return self.semantic is not None and self.cache.cacheable(params)

    def lookup(
        self, prompt_ids: list[int], params: EngineRequestParams, semantic: bool = True
    ) -> ResponseLookup:
        """The cached answer as token ids (None: a miss, not cacheable, or Redis unavailable) and the key.
        `semantic` False: the exact cache only (then `lookup_semantic` on a miss, on another thread)."""
        if not self.cache.cacheable(params):  # neither hit nor miss: counted apart
            self.cache.count_uncacheable()
            return ResponseLookup(None, None)
        began = time.perf_counter()
        key = self._request_key(prompt_ids, params)
        answer = self.cache.get(prompt_ids, params, key.value, count_hit=key.checked)
        if answer is not None and not key.checked:
            key, matched = self._checked(key, prompt_ids, params)
            if matched:
                self.cache.count_hit()
            else:  # another prompt's answer, never served nor counted: the prompt's own is asked for
                answer = self.cache.get(prompt_ids, params, key.value)
        if answer is None and semantic:
            self._spent(began)
            return self.lookup_semantic(prompt_ids, params, key)
        if answer is not None:
            self._renew(key.value, params.tenant)
        found = _found(answer, key)
        self._spent(began)
        return found

    def lookup_semantic(
        self, prompt_ids: list[int], params: EngineRequestParams, key: ResponseKey | None
    ) -> ResponseLookup:
        """The semantic cache's answer for a prompt the exact cache missed (`key`: that lookup's)."""
        if self.semantic is None:
            return ResponseLookup(None, key)
        began = time.perf_counter()
        question, variant = self.prompt_text(prompt_ids)
        hit = self.semantic.lookup(question, params.tenant, params, variant=variant)
        found = _found(None if hit is None else hit.answer, key)
        self._spent(began)
        return found

    def _request_key(self, prompt_ids: list[int], params: EngineRequestParams) -> ResponseKey:
        """The key the scheduler step hashed when it is this model's, else hashed here."""
        claimed = self.cache.claimed(params)
        with self._lock:
            first_foreign = claimed is None and bool(params.response_key) and self.foreign_keys == 0
            if claimed is not None:
                self.claimed_keys += 1
            elif params.response_key:
                self.foreign_keys += 1
        if first_foreign:  # once: every key will be, until the scheduler step is configured like the engine
            self._log(
                f"exact response key {params.response_key[:60]!r} is not under this engine's namespace "
                f"{self.cache.namespace!r}: set the scheduler step's dtype, max_seq_len and response_cache "
                "parameters as the engine's; the engine hashes every key itself meanwhile"
            )
        if claimed is not None:
            return ResponseKey(claimed, checked=False)
        return ResponseKey(self.cache.key(prompt_ids, params), checked=True)

    def _checked(
        self, key: ResponseKey, prompt_ids: list[int], params: EngineRequestParams
    ) -> tuple[ResponseKey, bool]:
        """The prompt's own key, checked, and whether `key` was it (if not, it is counted as forged)."""
        own = ResponseKey(self.cache.key(prompt_ids, params), checked=True)
        if own.value == key.value:
            return own, True
        with self._lock:
            self.forged_keys += 1
        return own, False

    def _spent(self, began: float) -> None:
        elapsed = time.perf_counter() - began
        with self._lock:
            self.request_seconds += elapsed

    def remember(
        self,
        prompt_ids: list[int],
        params: EngineRequestParams,
        output: list[int],
        trim: int,
        key: ResponseKey | None = None,
        paraphrases: bool = True,
        *,
        final: bool,
        sent: int | None = None,
        at_limit: bool = False,
    ) -> None:
        """Write the answer behind. `output`: every token generated, of which the final response sent the
        first `sent` (None: all) trimmed by `trim` raw bytes; `final`: no larger budget would get more
        tokens for any prompt (EOS, a stop string); `at_limit`: it ran to the model's last position, so
        no larger budget gets more for this prompt, while a paraphrase's shorter prompt leaves room for
        more (final for the exact cache, not for the semantic one); `key`: the one the request's `lookup`
        returned, if any; `paraphrases`: whether it answers other wordings too (the semantic cache), not
        only this prompt."""
        if not self.cache.cacheable(params):
            return
        began = time.perf_counter()
        exact = None if key is None else self._admit(key.value, params)
        semantic = self.semantic is not None and paraphrases
        if exact is not False or semantic:  # else nothing to write: the writer sleeps on
            answer = ExactAnswer(tuple(output), trim, final, sent)
            self._writes.submit(_Answer(prompt_ids, params, answer, key, exact, paraphrases, at_limit))
        self._spent(began)

    def _admit(self, key: str, params: EngineRequestParams) -> bool:
        """Whether the exact answer is written: always on first use or for warmup, else when seen before."""
        if self.first_use or params.tier == WARMUP_TIER:
            return True
        with self._lock:
            if self._sightings.seen_before(key, params.tenant):  # a flooding tenant forgets its own
                return True
            self.first_sightings += 1
            return False

    def _renew(self, key: str, tenant: str) -> None:
        """Queue the hit's renewal when a quota reads it and none was queued within `renew_every_s`;
        dropped when the writer is behind."""
        if not self.cache.tenant_max_entries:
            return
        with self._lock:
            due = self._renewed.due([key], self._clock(), self.renew_every_s)
        if due:
            self._writes.submit(_Renewal(key, tenant))

    def drain_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until every answer handed to the writer so far is written; False on timeout."""
        return self._writes.drain(timeout_s)

    def close(self) -> None:
        self._writes.close()
        self.cache.close()
        if self.semantic is not None:
            self.semantic.close()

    def _write(self, item: _Answer | _Renewal) -> None:
        """On the writer thread; a key its lookup did not hash is hashed here (and admitted), off the engine
        thread."""
        if isinstance(item, _Renewal):
            self.cache.renew([item.key], item.tenant)
            return
        key = item.key or ResponseKey(self.cache.key(item.prompt_ids, item.params), checked=True)
        matched = True
        if not key.checked:
            key, matched = self._checked(key, item.prompt_ids, item.params)
        exact = self._admit(key.value, item.params) if item.exact is None else item.exact
        exact = exact and matched  # a forged key's answer is written under neither key
        semantic = self.semantic is not None and item.paraphrases
        if not exact and not semantic:
            return
        if exact:
            self.cache.put(item.prompt_ids, item.params, item.exact_answer, key.value)
        if semantic:
            question, variant = self.prompt_text(item.prompt_ids)
            self.semantic.store(question, item.params.tenant, item.params, item.answer, variant=variant)


def _found(answer: ExactAnswer | None, key: ResponseKey | None) -> ResponseLookup:
    """A lookup's result: a hit sends the ids and trim the computed request's final response sent."""
    if answer is None:
        return ResponseLookup(None, key)
    tokens, trim = answer.response
    return ResponseLookup(tokens, key, trim)
