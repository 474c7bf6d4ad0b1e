"""Load-or-recompute decisions for L3 (Redis) KV: load only when it is predicted to beat prefill.

A remote KV tier is often slower than recomputing (LMCache's Redis tier is a known example), and which
one wins depends on the network, the value size, the model and the device. So the decision is made
from measurements on this replica: the engine reports every load (bytes, seconds) and every prefill
(tokens, seconds), and `should_load` compares the two predicted times with a margin that covers load
variance and the copy into the KV slot. The priors only matter until the first measurements arrive.

Averages are kept as seconds per unit (not units per second): the mean of per-unit cost predicts a
time without bias, the mean of rates would favour fast outliers.

What a reuse saves is the *marginal* prefill time of the reused tokens: the rest of the prompt is
computed either way, so the prefill's fixed cost (launches, sampling) is paid either way. Once
prefills of clearly different lengths have been seen, the per-token cost is the slope of a line
fitted to (tokens, seconds); before that, the plain mean cost per token. (On the H200 the mean was
dominated by the fixed ~3 ms of short prefills, predicted 512 reused tokens at ~25 ms instead of
~2 ms, and chose 50-ms Redis loads over 11-ms recomputes.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class _Ewma:
    """An exponentially weighted mean whose prior counts as one observation.

    Early measurements are averaged with weight 1/(n+1) until that falls to `alpha`, so one noisy
    first sample does not fully replace the prior and the prior does not linger.
    """

    def __init__(self, prior: float, alpha: float):
        self.value = prior
        self.alpha = alpha
        self.count = 0

    def update(self, sample: float, weight: float | None = None) -> None:
        """`weight`: this sample's, instead of the schedule's (1.0: the sample replaces the mean)."""
        self.count += 1
        weight = max(self.alpha, 1.0 / (self.count + 1)) if weight is None else weight
        self.value += weight * (sample - self.value)


class _LineFit:
    """Least squares of y = a + b*x over exponentially forgotten observations (weight decays by
    1 - alpha per update); `slope` is None until the x values spread enough to separate a from b."""

    def __init__(self, alpha: float, min_spread: float = 0.25):
        self.alpha = alpha
        self.min_spread = min_spread  # std(x) / mean(x) needed before the slope is trusted
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def update(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha
        self.w = keep * self.w + 1.0
        self.sx = keep * self.sx + x
        self.sy = keep * self.sy + y
        self.sxx = keep * self.sxx + x * x
        self.sxy = keep * self.sxy + x * y

    def slope(self) -> float | None:
        if self.w < 2.0:
            return None
        mean_x = self.sx / self.w
        var_x = self.sxx / self.w - mean_x * mean_x
        if var_x <= (self.min_spread * mean_x) ** 2:
            return None
        cov = self.sxy / self.w - mean_x * self.sy / self.w
        return cov / var_x if cov > 0 else None


@dataclass(frozen=True)
class CostEstimates:
    load_bytes_per_s: float
    prefill_tokens_per_s: float
    load_observations: int
    prefill_observations: int


class LoadCostModel:
    def __init__(
        self,
        prior_load_bytes_per_s: float = 500e6,
        prior_prefill_tokens_per_s: float = 20_000.0,
        load_overhead_s: float = 0.001,
        margin: float = 1.25,
        alpha: float = 0.2,
        explore_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Priors: ~500 MB/s is a conservative Redis GET + verify + copy on a LAN; 20k tokens/s is a
        mid-range prefill (a ~1B model on a GPU does more, a CPU far less), so measurements decide.
        `load_overhead_s` is the per-load round trip; `margin` > 1 means a load must win clearly.
        `explore_every_s`: see `should_load` (0: never explore)."""
        if prior_load_bytes_per_s <= 0 or prior_prefill_tokens_per_s <= 0:
            raise ValueError("priors must be positive rates")
        if margin < 1.0 or not 0.0 < alpha <= 1.0 or load_overhead_s < 0 or explore_every_s < 0:
            raise ValueError(
                "need margin >= 1, 0 < alpha <= 1, load_overhead_s >= 0 and explore_every_s >= 0"
            )
        self.load_overhead_s = load_overhead_s
        self.margin = margin
        self.explore_every_s = explore_every_s
        self.clock = clock
        self._last_load_at = clock()  # a measured load, or an exploration
        self._exploring = False  # an exploration's load is out: its measurement replaces the mean
        self._lock = threading.Lock()
        self._load_s_per_byte = _Ewma(1.0 / prior_load_bytes_per_s, alpha)
        self._prefill_s_per_token = _Ewma(1.0 / prior_prefill_tokens_per_s, alpha)
        self._prefill_line = _LineFit(alpha / 4)  # a slope needs more samples than a mean
        self.decisions: dict[str, int] = {"load": 0, "recompute": 0, "explore": 0}

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A finished L3 load; ignored when it carries no information (empty or non-positive time)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                # an exploration's load is a fresh look at a Redis the mean has not seen for a period: it
                # replaces the mean. Optimism is cheap here: a load chosen on it is measured again, and
                # a wrong one corrects itself within a few loads, while a pessimistic mean sees nothing
                self._load_s_per_byte.update(seconds / nbytes, 1.0 if self._exploring else None)
                self._exploring = False
                self._last_load_at = self.clock()

    def observe_failed_load(self, nbytes: int, seconds: float) -> bool:
        """An L3 load of `nbytes` that went out and failed after `seconds` (a socket timeout): it cost at
        least that and delivered nothing. Measured like a load when slower than predicted; a connection
        refused at once says nothing of the bandwidth. Without this, chain GETs that time out while the
        small probes answer (whose successes keep the breaker closed) cost every request a timeout, the
        model deciding "load" on estimates it never revises. True when it was measured."""
        if nbytes <= 0 or seconds <= self.predict_load_s(nbytes):
            return False
        self.observe_load(nbytes, seconds)
        return True

    def explored_nothing(self) -> None:
        """An exploration loaded nothing (the blocks gone, Redis unavailable): the next load measured is
        an ordinary one, weighed into the mean, not a replacement of it."""
        with self._lock:
            self._exploring = False

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A finished prefill of `tokens` prompt tokens (computed, not loaded)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._prefill_s_per_token.update(seconds / tokens)
                self._prefill_line.update(tokens, seconds)

    def predict_load_s(self, nbytes: int) -> float:
        with self._lock:
            return self.load_overhead_s + nbytes * self._load_s_per_byte.value

    def predict_prefill_s(self, tokens: int) -> float:
        """Marginal time to compute `tokens` more prompt tokens (see the module docstring)."""
        with self._lock:
            return tokens * self._per_token_s()

    def _per_token_s(self) -> float:
        slope = self._prefill_line.slope()
        mean = self._prefill_s_per_token.value
        return mean if slope is None else min(slope, mean)

    def should_load(self, tokens: int, nbytes: int) -> bool:
        """Whether to load (`decide` says load or explore)."""
        return self.decide(tokens, nbytes) != "recompute"

    def decide(self, tokens: int, nbytes: int) -> str:
        """ "load" when loading `nbytes` of KV is predicted to beat recomputing `tokens` by the margin, else
        "recompute", or "explore": a model that chooses to recompute measures no more loads, so one slow
        spell of Redis would turn L3 off on this replica for good. When no load has been measured for
        `explore_every_s`, one load goes anyway (the caller bounds its size, `L3Tier`): at most one
        request a period pays for it, and its measurement replaces the mean, so a Redis fast again wins
        the next decision."""
        load = tokens > 0 and self.predict_load_s(nbytes) * self.margin < self.predict_prefill_s(tokens)
        with self._lock:
            now = self.clock()
            explore = (
                not load and tokens > 0 and self.explore_every_s > 0
                and now - self._last_load_at >= self.explore_every_s
            )  # fmt: skip
            if explore:
                self._last_load_at = now  # one exploration a period, however many callers race here
                self._exploring = True
            decision = "explore" if explore else "load" if load else "recompute"
            self.decisions[decision] += 1
        return decision

    @property
    def estimates(self) -> CostEstimates:
        with self._lock:
            return CostEstimates(
                load_bytes_per_s=1.0 / self._load_s_per_byte.value,
                prefill_tokens_per_s=1.0 / self._per_token_s(),
                load_observations=self._load_s_per_byte.count,
                prefill_observations=self._prefill_s_per_token.count,
            )


@dataclass
class ReuseTotals:
    """Cumulative outcome of reusing cached KV from one tier (see `ReuseLedger`)."""

    loads: int = 0
    tokens_loaded: int = 0
    load_seconds: float = 0.0
    seconds_saved: float = 0.0
    seconds_lost_slow_load: float = 0.0
    slow_loads: int = 0


class ReuseLedger:
    """Time saved by reusing cached KV instead of recomputing it, and time lost when a load was slower.

    Each reuse of `tokens` from a tier is judged against the predicted recompute time of those tokens
    (the cost model's prefill estimate at that moment): a load that took less saved the difference, one
    that took more was a slow load and lost the excess. Savings and losses are kept apart so both stay
    monotone (Prometheus counters never go down); the net time saved is their difference.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, ReuseTotals] = {}

    def record(self, tier: str, tokens: int, predicted_recompute_s: float, load_s: float) -> None:
        if tokens <= 0:
            return
        load_s = max(0.0, load_s)
        gain = predicted_recompute_s - load_s
        with self._lock:
            totals = self._tiers.setdefault(tier, ReuseTotals())
            totals.loads += 1
            totals.tokens_loaded += tokens
            totals.load_seconds += load_s
            if gain >= 0:
                totals.seconds_saved += gain
            else:
                totals.seconds_lost_slow_load -= gain
                totals.slow_loads += 1

    def totals(self, tier: str) -> ReuseTotals:
        with self._lock:
            totals = self._tiers.get(tier, ReuseTotals())
            return ReuseTotals(**vars(totals))
