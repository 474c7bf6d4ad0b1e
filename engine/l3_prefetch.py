"""The L3 (Redis) blocks of the hot prefixes, fetched on a thread of their own while the kernels warm.

Fetching a long prefix from Redis is network I/O plus CPU work (checksum, copy into host tensors):
a different resource from the kernels the engine thread warms at the same time. The warmup starts
an `L3Prefetcher` before its first kernel stage; it walks the hot prefixes in priority order, computes
each one's block keys exactly as `PrefixCache.lookup` does (`PrefixCache.chain_keys`: tenant salt,
full blocks only, at least one token left to compute) and asks `L3Tier.fetch_with_outcome`, so the
cost model's load-or-recompute decision still applies. Results wait here as host tensors; only the
engine thread moves them into the device pool (`PrefixCache.adopt`, called by
`Engine.prefill_template`), in the warmup's prefix_templates stage or, for deferred templates, in the
engine's background step once their fetch has completed.

A Redis error (the store counts it, the breaker sees it) ends the prefetch: the prefixes not fetched
yet are left to the ordinary lookup path, which asks L3 itself, exactly as without a prefetch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_tiers import L3Tier

PrefixKey = tuple[tuple[int, ...], str]


@dataclass
class Prefetched:
    keys: list[bytes]  # every block key of the prefix L3 was asked about
    blocks: list[torch.Tensor]  # host tensors of the leading run it returned ([] when none or recompute)
    outcome: str  # L3Tier.fetch_with_outcome's: loaded, partial, missing, recompute
    seconds: float  # wall time of the fetch on the prefetch thread
    waited_s: float = 0.0  # time the engine thread spent waiting for this fetch


def _errors(l3: L3Tier) -> int:
    """This thread's failed Redis calls: another thread's (the L3 writer's) say nothing of this fetch."""
    count = getattr(l3.store, "failures_on_this_thread", None)
    return 0 if count is None else count()


class L3Prefetcher:
    def __init__(
        self,
        l3: L3Tier,
        chain_keys: Callable[[Sequence[int], str], list[bytes]],
        prefixes: Sequence[tuple[Sequence[int], str]],
        on_ready: Callable[[], None] | None = None,
        max_blocks: int | None = None,
    ):
        """`chain_keys` is `PrefixCache.chain_keys`; `on_ready` is called (outside this object's lock)
        whenever a fetch completes or the prefetch ends, so an idle engine re-checks its deferred work.
        `max_blocks` (None: no bound): the most fetched blocks held here untaken; the next fetch waits for
        `take` below it (the prefix cache's capacity: a long hot list must not sit in host memory whole)."""
        self.l3 = l3
        self.max_blocks = max_blocks
        self._held = 0  # blocks of completed, untaken results
        self.chain_keys = chain_keys
        self.on_ready = on_ready
        self._order: list[tuple[PrefixKey, Sequence[int], str]] = []
        self._results: dict[PrefixKey, Prefetched | None] = {}  # None: queued or in flight
        for prompt, tenant in prefixes:
            key = (tuple(prompt), tenant)
            if key not in self._results:
                self._results[key] = None
                self._order.append((key, prompt, tenant))
        self._waited: dict[PrefixKey, float] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.started_ns: int | None = None
        self.finished_ns: int | None = None
        self.outcomes: dict[str, int] = {}
        self.blocks = 0
        self.bytes = 0
        self.blocks_used = 0  # blocks handed to the engine thread (take)
        self.given_up = 0  # prefixes left to the lookup path after a Redis error
        self.error: str | None = None  # an unexpected exception that ended the prefetch

    def start(self) -> None:
        self.started_ns = time.perf_counter_ns()
        self._thread = threading.Thread(target=self._run, name="l3-prefetch", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self.finished_ns is None and self._thread is not None

    def pending(self, prompt: Sequence[int], tenant: str) -> bool:
        """True while this prefix's fetch is queued or in flight."""
        key = (tuple(prompt), tenant)
        with self._cond:
            return key in self._results and self._results[key] is None

    def wait(self, prompt: Sequence[int], tenant: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for this prefix's fetch; True when it is no longer pending."""
        key = (tuple(prompt), tenant)
        started = time.perf_counter()
        with self._cond:
            done = self._cond.wait_for(
                lambda: key not in self._results or self._results[key] is not None,
                min(max(0.0, timeout_s), threading.TIMEOUT_MAX),
            )
            self._waited[key] = self._waited.get(key, 0.0) + time.perf_counter() - started
        return done

    def take(self, prompt: Sequence[int], tenant: str) -> Prefetched | None:
        """The completed fetch of this prefix (handed over once), or None: not prefetched (given up,
        closed, already taken) or still in flight."""
        key = (tuple(prompt), tenant)
        with self._cond:
            result = self._results.get(key)
            if result is None:
                return None
            del self._results[key]
            result.waited_s = self._waited.pop(key, 0.0)
            self.blocks_used += len(result.blocks)
            self._held -= len(result.blocks)
            self._cond.notify_all()  # room for the next fetch
            return result

    def close(self) -> None:
        """Stop after the fetch in flight; untaken results are dropped, pending prefixes given up."""
        with self._cond:
            self._closed = True
            self._give_up_locked()
            self._results.clear()
            self._held = 0
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def summary(self, origin_ns: int) -> dict:
        """What the report records, with times as seconds since `origin_ns` (the load's start)."""
        now = time.perf_counter_ns()
        with self._cond:
            in_flight = sum(1 for result in self._results.values() if result is None)
            outcomes = dict(self.outcomes)
        start = self.started_ns if self.started_ns is not None else now
        end = self.finished_ns
        return {
            "prefixes": len(self._order),
            "start_s": (start - origin_ns) / 1e9,
            "end_s": None if end is None else (end - origin_ns) / 1e9,
            "seconds": ((end if end is not None else now) - start) / 1e9,
            "in_flight": in_flight,
            "outcomes": outcomes,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "blocks_used": self.blocks_used,
            "given_up": self.given_up,
            "error": self.error,
        }

    def _run(self) -> None:
        try:
            for key, prompt, tenant in self._order:
                with self._cond:
                    if self.max_blocks is not None:  # until the engine took enough of what is held
                        self._cond.wait_for(lambda: self._closed or self._held < max(1, self.max_blocks))
                    if self._closed or key not in self._results:
                        continue
                errors = _errors(self.l3)
                started = time.perf_counter()
                keys = self.chain_keys(prompt, tenant)
                blocks, outcome = self.l3.fetch_with_outcome(keys)
                failed = _errors(self.l3) > errors
                if failed and not blocks:  # Redis is down or refusing: leave the rest to the lookup path
                    with self._cond:
                        self._count_locked("error")
                        self._give_up_locked()
                    break
                result = Prefetched(keys, blocks, outcome, time.perf_counter() - started)
                with self._cond:
                    self._count_locked(outcome)
                    if key in self._results:
                        self._results[key] = result
                        self._held += len(blocks)
                        self.blocks += len(blocks)
                        self.bytes += len(blocks) * self.l3.block_bytes
                    self._cond.notify_all()
                self._notify()
        except Exception as exc:  # never raised into the warmup: the lookup path takes over
            self.error = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._give_up_locked()
        finally:
            self.finished_ns = time.perf_counter_ns()
            self._notify()

    def _count_locked(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _give_up_locked(self) -> None:
        for key in [key for key, result in self._results.items() if result is None]:
            del self._results[key]
            self.given_up += 1
        self._cond.notify_all()

    def _notify(self) -> None:
        if self.on_ready is not None:
            try:
                self.on_ready()
            except Exception:  # a wake-up is a hint; the engine re-checks on its next event anyway
                pass
