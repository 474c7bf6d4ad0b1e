"""Exact response cache on the serving path: a hit is answered from Redis without touching the model.

The hit still streams through the ensemble (the cached text goes back to token ids, which the
detokenizer turns into text like any other response). Only greedy or seeded requests are
cacheable (cache/response_cache.py decides). Results are written by a background thread so the
engine loop never waits on Redis.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from cache.response_cache import ExactResponseCache
from scheduler.messages import EngineRequestParams


class ResponseTier:
    def __init__(
        self,
        cache: ExactResponseCache,
        encode: Callable[[str], list[int]],
        token_bytes: Callable[[list[int]], bytes],
        backlog: int = 1024,
    ):
        self.cache = cache
        self.encode = encode
        self.token_bytes = token_bytes
        self._writes: queue.Queue[tuple[list[int], EngineRequestParams, list[int], int] | None] = queue.Queue(
            maxsize=backlog
        )
        self._thread = threading.Thread(target=self._write_loop, name="response-cache-writer", daemon=True)
        self._thread.start()
        self.dropped_writes = 0

    def lookup(self, prompt_ids: list[int], params: EngineRequestParams) -> list[int] | None:
        """The cached answer as token ids, or None (miss, not cacheable, or Redis unavailable)."""
        if not self.cache.cacheable(params):
            return None
        text = self.cache.get(prompt_ids, params)
        return None if text is None else self.encode(text)

    def remember(
        self, prompt_ids: list[int], params: EngineRequestParams, output: list[int], trim: int
    ) -> None:
        if not self.cache.cacheable(params):
            return
        try:
            self._writes.put_nowait((prompt_ids, params, output, trim))
        except queue.Full:
            self.dropped_writes += 1

    def close(self) -> None:
        self._writes.put(None)
        self._thread.join(timeout=10)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            prompt_ids, params, output, trim = item
            data = self.token_bytes(output)
            text = data[: len(data) - trim].decode("utf-8", errors="replace")
            self.cache.put(prompt_ids, params, text)
