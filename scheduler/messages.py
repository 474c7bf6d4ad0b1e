"""Messages that cross the scheduler -> engine boundary.

They travel as UTF-8 JSON inside a UINT8 tensor, because the engine step must stay numpy-free
(DLPack only) and so cannot read BYTES tensors on the GPU image.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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
    bypass_cache: bool = False  # read and write no cache tier (prefix L1/L2/L3, exact, semantic)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> EngineRequestParams:
        raw = json.loads(data.decode("utf-8"))
        raw["stop"] = tuple(raw.get("stop") or ())
        return cls(**raw)
