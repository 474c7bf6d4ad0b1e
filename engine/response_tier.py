"""Response caches on the serving path: a hit is answered from Redis without touching the model.

Exact first; then, when enabled, the semantic cache (a paraphrase of an answered question, same
tenant, same sampling signature, past the negation/entity guard).

The hit still streams through the ensemble (the cached text goes back to token ids, which the
detokenizer turns into text like any other response). Only greedy or seeded requests are
cacheable (cache/response_cache.py decides). Results are written by a background thread so the
engine loop never waits on Redis.

An exact answer is written on its prompt's second sighting (`first_use=False`, the server's default:
`response_cache_first_use`), as L3 writes blocks on reuse: at a low hit rate most prompts come once,
and their writes were most of the exact cache's cost (H200 at 0% hits, one request at a time: all
caches cost 2.05% of throughput with a write per answer, 0.71% with this policy). Warmup-tier answers
are written at once (filling the caches is that tier's job), and so are semantic entries (a
paraphrase is never the same prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cache.response_cache import ExactResponseCache
from cache.sightings import Sightings
from cache.semantic_cache import SemanticResponseCache
from engine.write_behind import WriteBehind
from scheduler.messages import EngineRequestParams


@dataclass
class ResponseLookup:
    """A lookup's answer (token ids) or None, and the exact key it hashed (None: not cacheable),
    which the request carries to `remember` so that its write does not hash the prompt again."""

    tokens: list[int] | None
    key: str | None


class ResponseTier:
    def __init__(
        self,
        cache: ExactResponseCache,
        encode: Callable[[str], list[int]],
        token_bytes: Callable[[list[int]], bytes],
        backlog: int = 1024,
        semantic: SemanticResponseCache | None = None,
        first_use: bool = True,
        sightings: int = 65536,
    ):
        self.cache = cache
        self.first_use = first_use
        self._sightings: Sightings[str] = Sightings(sightings)  # writer thread only
        self.first_sightings = 0  # answers not written: their prompt was not seen before
        self.semantic = semantic
        self.encode = encode
        self.token_bytes = token_bytes
        self._writes: WriteBehind[tuple[list[int], EngineRequestParams, list[int], int, str | None]] = (
            WriteBehind(self._write, "response-cache-writer", backlog)
        )

    @property
    def writes_dropped(self) -> int:
        """Answers not written because the writer had fallen behind (a slow Redis): never waited for."""
        return self._writes.dropped

    def lookup(self, prompt_ids: list[int], params: EngineRequestParams) -> ResponseLookup:
        """The cached answer as token ids (None: a miss, not cacheable, or Redis unavailable) and the key."""
        if not self.cache.cacheable(params):
            return ResponseLookup(None, None)
        key = self.cache.key(prompt_ids, params)
        text = self.cache.get(prompt_ids, params, key)
        if text is None and self.semantic is not None:
            hit = self.semantic.lookup(self._prompt_text(prompt_ids), params.tenant, params)
            text = None if hit is None else hit.answer
        return ResponseLookup(None if text is None else self.encode(text), key)

    def _prompt_text(self, prompt_ids: list[int]) -> str:
        return self.token_bytes(prompt_ids).decode("utf-8", errors="replace")

    def remember(
        self,
        prompt_ids: list[int],
        params: EngineRequestParams,
        output: list[int],
        trim: int,
        key: str | None = None,
    ) -> None:
        """Write the answer behind; `key`: the one the request's `lookup` returned, if any."""
        if not self.cache.cacheable(params):
            return
        self._writes.submit((prompt_ids, params, output, trim, key))

    def _admit(self, key: str, params: EngineRequestParams) -> bool:
        """Whether the exact answer is written: always on first use or for warmup, else when seen before."""
        if self.first_use or params.tier == "warmup":
            return True
        if self._sightings.seen_before(key):
            return True
        self.first_sightings += 1
        return False

    def close(self) -> None:
        self._writes.close()
        self.cache.close()
        if self.semantic is not None:
            self.semantic.close()

    def _write(self, item: tuple[list[int], EngineRequestParams, list[int], int, str | None]) -> None:
        """On the writer thread, admission included; a key its lookup did not hash is hashed here, off the
        engine thread."""
        prompt_ids, params, output, trim, key = item
        key = key or self.cache.key(prompt_ids, params)
        exact = self._admit(key, params)
        if not exact and self.semantic is None:
            return
        data = self.token_bytes(output)
        answer = data[: len(data) - trim].decode("utf-8", errors="replace")
        if exact:
            self.cache.put(prompt_ids, params, answer, key)
        if self.semantic is not None:
            self.semantic.store(self._prompt_text(prompt_ids), params.tenant, params, answer)
