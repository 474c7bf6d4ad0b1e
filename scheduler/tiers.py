"""SLO tiers and the table that resolves a request's `slo_tier` to one.

The table is immutable: a feedback controller that adjusts targets builds a new table with
`replace_tier` instead of mutating shared state under the serving threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scheduler.errors import RequestError

DEFAULT_CONFIG_PATH = Path(__file__).with_name("tiers.yaml")
DEFAULT_TIER_NAME = "standard"
WARMUP_TIER = "warmup"  # the engine writes this tier's KV and answers to the caches at once
DEFAULT_CPU_SCALE = 10.0
_TIER_KEYS = ("priority", "ttft_target_ms", "percentile", "sheddable", "max_queue_ms", "restricted")


MAX_TIME_MS = 1e9  # ~11.6 days: a longer target is none (a scaled one is cut to it); its ns fit int64
MAX_CPU_SCALE = 1000.0
MAX_PRIORITY = 2**31 - 1  # the scheduler step's priority output is int32


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a mapping naming a key twice is refused: PyYAML keeps the last one
    silently, so a tier (or a tier's field) written twice replaced the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base constructor explains it
                break
            if duplicate:
                problem = f"found duplicate key {key!r}"
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, problem, key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _positive_number(value: object, high: float) -> bool:
    """In (0, high]: infinity (YAML's `.inf`) and NaN are refused at load, not by int() per request."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= high


@dataclass(frozen=True)
class Tier:
    """One service class. `priority` 1 is the highest precedence (Triton's convention)."""

    name: str
    priority: int
    ttft_target_ms: float
    percentile: float = 95.0
    sheddable: bool = False
    max_queue_ms: float = 10_000.0
    # with a tenant secret, only requests carrying a valid tenant token may use it (scheduler/tenant_auth.py);
    # None: the table decides (TierTable: the warmup tier and the highest-precedence ones, never the default)
    restricted: bool | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tier name must be non-empty")
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not 1 <= self.priority <= MAX_PRIORITY
        ):
            raise ValueError(
                f"tier {self.name!r}: priority must be an int in 1..{MAX_PRIORITY}, got {self.priority!r}"
            )
        if not _positive_number(self.ttft_target_ms, MAX_TIME_MS):
            target = self.ttft_target_ms
            raise ValueError(
                f"tier {self.name!r}: ttft_target_ms must be in (0, {MAX_TIME_MS:g}], got {target!r}"
            )
        if not _positive_number(self.percentile, 100):
            raise ValueError(f"tier {self.name!r}: percentile must be in (0, 100], got {self.percentile!r}")
        if not isinstance(self.sheddable, bool):
            raise TypeError(f"tier {self.name!r}: sheddable must be a bool, got {self.sheddable!r}")
        if not _positive_number(self.max_queue_ms, MAX_TIME_MS):
            raise ValueError(
                f"tier {self.name!r}: max_queue_ms must be in (0, {MAX_TIME_MS:g}], got {self.max_queue_ms!r}"
            )
        if self.restricted is not None and not isinstance(self.restricted, bool):
            raise TypeError(f"tier {self.name!r}: restricted must be a bool, got {self.restricted!r}")

    @property
    def ttft_target_ns(self) -> int:
        return int(self.ttft_target_ms * 1_000_000)

    @property
    def max_queue_ns(self) -> int:
        return int(self.max_queue_ms * 1_000_000)

    def scaled(self, factor: float) -> Tier:
        """The same tier with time targets multiplied (GPU-scale targets are unreachable on CPU), at most
        MAX_TIME_MS each."""
        return dataclasses.replace(
            self,
            ttft_target_ms=min(self.ttft_target_ms * factor, MAX_TIME_MS),
            max_queue_ms=min(self.max_queue_ms * factor, MAX_TIME_MS),
        )


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("critical", 1, 120.0, 99.0, False, 2_000.0, restricted=True),
    Tier("warmup", 2, 250.0, 95.0, False, 10_000.0, restricted=True),
    Tier("standard", 3, 500.0, 95.0, False, 10_000.0),
    Tier("batch", 4, 5_000.0, 90.0, True, 60_000.0),
)


@dataclass(frozen=True)
class TierTable:
    """The configured tiers, ordered by precedence, plus the tier used when a request names none."""

    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    default_name: str = DEFAULT_TIER_NAME
    cpu_scale: float = DEFAULT_CPU_SCALE

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a tier table needs at least one tier")
        ordered = tuple(sorted(self.tiers, key=lambda t: (t.priority, t.name)))
        object.__setattr__(self, "tiers", ordered)
        names = [t.name for t in ordered]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate tier names: {', '.join(dupes)}")
        if self.default_name not in names:
            raise ValueError(
                f"default tier {self.default_name!r} is not defined; defined: {', '.join(names)}"
            )
        if not _positive_number(self.cpu_scale, MAX_CPU_SCALE):
            raise ValueError(f"cpu_scale must be in (0, {MAX_CPU_SCALE:g}], got {self.cpu_scale!r}")
        if self.get(self.default_name).restricted:
            raise ValueError(
                f"default tier {self.default_name!r} is restricted: requests that name no tier, the "
                "scheduler's own warmup among them, would need a tenant token"
            )
        object.__setattr__(self, "tiers", tuple(self._resolved(t) for t in ordered))

    def _resolved(self, tier: Tier) -> Tier:
        """A tier whose file says nothing about `restricted`: restricted when it is the warmup tier (the
        engine lets warmup traffic write the caches at once) or of the highest precedence, unless it is
        the default tier. A tiers file written before the key existed stays closed to anonymous traffic."""
        if tier.restricted is not None:
            return tier
        top = min(t.priority for t in self.tiers)
        closed = tier.name != self.default_name and (tier.name == WARMUP_TIER or tier.priority == top)
        return dataclasses.replace(tier, restricted=closed)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    @property
    def default(self) -> Tier:
        return self.get(self.default_name)

    def get(self, name: str | None) -> Tier:
        """Resolve a requested tier name; None or empty means the default tier."""
        if name is None or name == "":
            name = self.default_name
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise RequestError.invalid(f"unknown slo_tier {name!r}; allowed: {', '.join(self.names)}")

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def for_device(self, device: str) -> TierTable:
        """Targets for the device the engine runs on: CPU ones are scaled by `cpu_scale`."""
        if device.split(":", 1)[0] != "cpu":
            return self
        scaled = tuple(t.scaled(self.cpu_scale) for t in self.tiers)
        return dataclasses.replace(self, tiers=scaled, cpu_scale=1.0)

    def replace_tier(self, tier: Tier) -> TierTable:
        """A new table with one tier swapped (by name), e.g. after the controller adjusted its target."""
        self.get(tier.name)
        return dataclasses.replace(self, tiers=tuple(tier if t.name == tier.name else t for t in self.tiers))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TierTable:
        """Build from the parsed YAML shape: {default_tier, cpu_scale, tiers: {name: {fields}}}."""
        if not isinstance(data, Mapping):
            raise TypeError(f"tier config must be a mapping, got {type(data).__name__}")
        allowed_top = ("default_tier", "cpu_scale", "tiers")
        unknown = sorted(set(data) - set(allowed_top))
        if unknown:
            raise ValueError(f"unknown tier config keys {unknown}; allowed: {', '.join(allowed_top)}")
        raw_tiers = data.get("tiers")
        if not isinstance(raw_tiers, Mapping) or not raw_tiers:
            raise ValueError("tier config needs a non-empty 'tiers' mapping of name -> fields")
        cpu_scale = data.get("cpu_scale", DEFAULT_CPU_SCALE)
        if isinstance(cpu_scale, bool) or not isinstance(cpu_scale, (int, float)):
            raise ValueError(f"cpu_scale must be a number in (0, {MAX_CPU_SCALE:g}], got {cpu_scale!r}")
        return cls(
            tiers=tuple(_tier_from_mapping(str(name), fields) for name, fields in raw_tiers.items()),
            default_name=str(data.get("default_tier", DEFAULT_TIER_NAME)),
            cpu_scale=float(cpu_scale),
        )

    @classmethod
    def load(cls, path: str | Path | None = None) -> TierTable:
        """Load from a YAML file; None loads the packaged default `scheduler/tiers.yaml`."""
        path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
        try:
            with path.open("r", encoding="utf-8") as fh:
                data = yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
            return cls.from_mapping(data)
        except yaml.constructor.ConstructorError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from exc

    @classmethod
    def defaults(cls) -> TierTable:
        """The built-in tiers (same values as the packaged tiers.yaml), without touching the disk."""
        return cls()


def _tier_from_mapping(name: str, fields: Any) -> Tier:
    if not isinstance(fields, Mapping):
        raise TypeError(f"tier {name!r} must map to a mapping of fields, got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(_TIER_KEYS))
    if unknown:
        raise ValueError(f"tier {name!r}: unknown keys {unknown}; allowed: {', '.join(_TIER_KEYS)}")
    if "priority" not in fields or "ttft_target_ms" not in fields:
        raise ValueError(f"tier {name!r}: 'priority' and 'ttft_target_ms' are required")
    return Tier(name=name, **dict(fields))
