"""The scheduler step's logic: validate, tokenize, classify the tier, set priority and deadline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.messages import EngineRequestParams
from scheduler.priority import assign
from scheduler.tiers import TierTable
from scheduler.validation import Limits, build_request, validate_prompt


@dataclass(frozen=True)
class PreparedRequest:
    input_ids: list[int]
    params: EngineRequestParams
    priority: int
    deadline_ns: int


@dataclass(frozen=True)
class SchedulerStep:
    encode: Callable[[str], list[int]]
    limits: Limits
    tiers: TierTable

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
    ) -> PreparedRequest:
        """Raises RequestError (INVALID_ARG) naming what was wrong and what is allowed."""
        ids = self.encode(validate_prompt(text))
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
        priority, deadline_ns = assign(self.tiers.get(params.tier), now_ns)
        return PreparedRequest(ids, params, priority, deadline_ns)
