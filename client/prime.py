"""Prime the serving path end to end before a replica takes traffic.

The engine's warmup (in `initialize()`) and Triton's `model_warmup` warm each step alone; nothing
sends a request through the ensemble over gRPC. The first requests that did paid a server-side
first-use cost: on the CPU the first two requests after READY took 12.8 / 12.9 ms against 7.8 steady,
5.5 / 7.6 ms of it outside the engine, while four requests sent first on *another* connection removed
it (`python -m bench.ttft_breakdown --prime 4`: 7.9 ms, and 8.8 against 8.8 in a second run). So a
replica takes traffic once it is READY and primed: the launcher primes before it reports the stack
up, and `python -m client prime` is the container's readiness check (exit 0 once primed).

Priming requests use the warmup tier, their own tenant (no entry of a real tenant's caches) and
unseeded sampling (never kept by the response caches); their prompts are fixed, so a restarted
replica's priming finds the same prefix-cache keys instead of adding new ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from client.generate import StreamingSession
from scheduler.validation import PROMPT_TOO_LONG

PRIME_TENANT = "prime"
_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge every box".split()


@dataclass(frozen=True)
class PrimeConfig:
    url: str = "localhost:8001"
    model: str = "llm"
    lengths: tuple[int, ...] = (8, 48, 200)  # words, about as many tokens: short, medium, longer prompts
    rounds: int = 2  # the first two requests after READY were the slow ones
    max_tokens: int = 2
    timeout_s: float = 60.0
    tenant_token: str | None = None  # PRIME_TENANT's, for a server that authenticates tenants


@dataclass
class PrimeResult:
    requests: int = 0
    failed: int = 0
    shortened: int = 0  # prompts halved because the deployment's prompt limit is lower
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.requests > 0 and self.failed == 0


def prime_prompt(words: int) -> str:
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def prime(config: PrimeConfig) -> PrimeResult:
    """Send `rounds` x `lengths` requests one at a time on one stream; errors are collected, not raised
    (a replica that cannot answer them is not ready, which the caller decides). A prompt over the
    deployment's limit (a small `max_seq_len`) is halved until it fits: that is not a failure."""
    result = PrimeResult()
    started = time.perf_counter()
    with StreamingSession(config.url, model=config.model) as session:
        for _ in range(config.rounds):
            for words in config.lengths:
                error = _send(session, config, words, result)
                while error is not None and PROMPT_TOO_LONG in error and words > 1:
                    words //= 2
                    result.shortened += 1
                    error = _send(session, config, words, result)
                if error is not None:
                    result.failed += 1
                    result.errors.append(f"{words} words: {error}")
    result.seconds = time.perf_counter() - started
    return result


def _send(session: StreamingSession, config: PrimeConfig, words: int, result: PrimeResult) -> str | None:
    """One priming request; its error, or None."""
    sampling = {"max_tokens": config.max_tokens, "temperature": 1.0, "ignore_eos": True}
    rid = session.submit(
        prime_prompt(words),
        sampling=sampling,
        tier="warmup",
        tenant=PRIME_TENANT,
        tenant_token=config.tenant_token,
    )
    result.requests += 1
    if not session.wait([rid], timeout_s=config.timeout_s):
        return f"no answer within {config.timeout_s:g} s"
    return session.result(rid).error or None


def prime_once(config: PrimeConfig, marker: Path) -> PrimeResult | None:
    """`prime` unless `marker` says this replica was primed already (readiness probes repeat); None then."""
    if marker.exists():
        return None
    result = prime(config)
    if result.ok:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{result.requests} requests in {result.seconds:.3f} s\n")
    return result
