"""Messages that cross the scheduler -> engine boundary.

They travel as UTF-8 JSON inside a UINT8 tensor, because the engine step must stay numpy-free
(DLPack only) and so cannot read BYTES tensors on the GPU image.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

# Which caches a request may read and write. "use": all of them; "kv-only": the KV prefix tiers
# (L1/L2/L3) but no response cache, so the answer is always generated afresh; "refresh": the KV tiers,
# and the response caches written but not read, so the answer is generated afresh and kept (the warmup
# job fills the response caches this way and still prefills: a read would answer it from Redis);
# "bypass": none (prompts that must not persist; the baseline when measuring what the caches cost).
CACHE_MODES: tuple[str, ...] = ("use", "bypass", "kv-only", "refresh")
# Below this a temperature is greedy (as in vLLM): logits divided by 1e-300 overflow float32 to inf, the
# softmax is NaN and torch.multinomial raises, inside a step that decodes every running request
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class EngineRequestParams:
    """Validated, normalized parameters of one generation request."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stream: bool = False
    exclude_input_in_output: bool = False
    tier: str = "standard"
    tenant: str = "default"
    arrival_ns: int = 0
    cache: str = "use"  # one of CACHE_MODES
    # The exact response cache's key, hashed by the scheduler step so that the engine's process does not
    # (cache/response_cache.py: exact_key); "" when the step did not. The engine trusts it for a miss only.
    response_key: str = ""
    # the tenant's token when the server authenticates tenants (scheduler/tenant_auth.py): the engine
    # checks it too, since Triton serves llm_engine directly; never part of a cache key
    tenant_token: str = ""

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:  # the JSON from the scheduler is checked on arrival too
            raise ValueError(f"EngineRequestParams.cache must be one of {CACHE_MODES}, got {self.cache!r}")

    @property
    def greedy(self) -> bool:
        """As the sampler decides (engine/sampling.py): a direct llm_engine request may send a temperature
        under MIN_TEMPERATURE, which the scheduler step would have rounded to 0."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_kv_tiers(self) -> bool:
        """Look up and store the prompt's KV prefix blocks (L1/L2/L3)."""
        return self.cache != "bypass"

    @property
    def reads_response_cache(self) -> bool:
        """Look the answer up in the exact and semantic response caches."""
        return self.cache == "use"

    @property
    def writes_response_cache(self) -> bool:
        """Keep the answer in the response caches (when its sampling is cacheable)."""
        return self.cache in ("use", "refresh")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> EngineRequestParams:
        """Parse and type-check: the engine model takes these bytes from whoever calls it, the scheduler
        step or a client calling llm_engine directly, and a wrong type raised inside the engine step
        (a temperature sent as a string), where it failed every running request. ValueError names it."""
        raw = json.loads(data.decode("utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("request_params must be a JSON object")
        hints = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(hints))
        if unknown:
            raise ValueError(f"request_params has unknown field(s) {unknown}")
        for name, value in raw.items():
            if not _FIELD_CHECKS[hints[name]](value):
                raise ValueError(f"request_params.{name} must be {hints[name]}, got {json.dumps(value)}")
        raw["stop"] = tuple(raw.get("stop") or ())
        return cls(**raw)


def is_int(value: object) -> bool:
    """A JSON integer (Python's bool is an int too, JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A JSON integer or a finite float."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def utf8_encodable(*texts: str) -> bool:
    """Whether every text is Unicode that UTF-8 can write: JSON's "\\ud800" escape parses to a lone
    surrogate, which raises wherever the text is later encoded (a key, a checksum, a match)."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# the annotation of each field (a string: `from __future__ import annotations`) -> its check
_FIELD_CHECKS = {
    "int": is_int,
    "float": is_number,
    "int | None": lambda v: v is None or is_int(v),
    "tuple[str, ...]": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}
