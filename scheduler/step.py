"""The scheduler step's logic: validate, tokenize, classify the tier, set priority and deadline, and
hash the exact response-cache key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cache.response_cache import exact_key, is_deterministic
from scheduler.messages import EngineRequestParams
from scheduler.priority import assign
from scheduler.tenant_auth import TenantAuth
from scheduler.tiers import TierTable
from scheduler.validation import (
    Limits,
    build_request,
    validate_prompt,
    validate_prompt_size,
    validate_tenant,
    validate_tier,
)


@dataclass(frozen=True)
class PreparedRequest:
    input_ids: list[int]
    params: EngineRequestParams
    priority: int
    deadline_ns: int


@dataclass(frozen=True)
class SchedulerStep:
    encode: Callable[[str, str], list[int]]  # (prompt, tenant): token ids
    limits: Limits
    tiers: TierTable
    # The engine's serving fingerprint when its exact response cache is on: the step then hashes each
    # cacheable request's key here, in its own process, so that the engine's (the bottleneck under load,
    # its Python threads sharing one GIL) does not; the engine checks a key before a hit or a write.
    exact_fingerprint: str | None = None
    device: str = "cpu"  # the engine's: a seeded answer's key names its generator's device type
    tenant_auth: TenantAuth = field(default_factory=TenantAuth)  # disabled unless given a secret
    vocab_size: int | None = None  # the engine's, for the key (cache/fingerprint.py `model_vocab_size`)

    def prepare(
        self,
        text: str | bytes | None,
        sampling_json: str | bytes | None,
        stream: bool | None,
        exclude_input_in_output: bool | None,
        tier: str | bytes | None,
        tenant: str | bytes | None,
        now_ns: int,
        cache: str | bytes | None = None,
        tenant_token: str | bytes | None = None,
        own: bool = False,
    ) -> PreparedRequest:
        """Raises RequestError (INVALID_ARG) naming what was wrong and what is allowed. The tenant is
        checked before the prompt is tokenized: the tokenizer's prefix cache is kept by tenant, and a
        request that claims another tenant's name must not learn from its timing what that tenant sent.
        `own`: the step's warmup requests (its own and Triton's samples), which need no token for
        `default` (a named tenant's is checked all the same)."""
        prompt = validate_prompt(text)
        tenant_name = validate_tenant(tenant)
        tier_of_request = self.tiers.get(validate_tier(tier, self.tiers))
        # the engine checks it again: Triton serves llm_engine directly too
        token = self.tenant_auth.check(tenant_name, tenant_token, None if own else tier_of_request)
        validate_prompt_size(prompt, self.limits)
        ids = self.encode(prompt, tenant_name)
        params = build_request(
            text,
            sampling_json,
            stream,
            exclude_input_in_output,
            tier,
            tenant,
            prompt_token_count=len(ids),
            limits=self.limits,
            tiers=self.tiers,
            now_ns=now_ns,
            cache=cache,
        )
        if token:
            params = replace(params, tenant_token=token)
        if self.exact_fingerprint and params.reads_response_cache and is_deterministic(params):
            key = exact_key(self.exact_fingerprint, ids, params, self.vocab_size, rng=self.device)
            params = replace(params, response_key=key)
        priority, deadline_ns = assign(tier_of_request, now_ns)
        return PreparedRequest(ids, params, priority, deadline_ns)
