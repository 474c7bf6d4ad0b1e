"""Second-stage check for the semantic cache's lower cosine band: a tiny logistic regression.

Below the main threshold, cosine alone cannot tell a reworded paraphrase from a near miss about the
same thing ("cancel" / "pause" my subscription): on data/paraphrases.jsonl its ROC AUC inside the band
[0.55, 0.80) is only about 0.77, and lexical overlap, cosine of content words or token alignment add
nothing. What does separate them is how *distinct* the match is, the ratio test of feature matching:
a query that sits between two stored questions is a near miss of both, a reworded question is close to
one stored question and far from the rest. So the features are the cosine, its margin over the best
*other* eligible entry of the tenant, and three cheap lexical ones (content-word overlap, same question
word, content-length ratio).

The verifier runs only on the top ``VERIFIER_TOP_K`` guard-passing candidates of the band, after the
guard (negations, reversals, numbers, entities, swapped words: those stay hard rejections), and only
when the tenant holds at least ``min_entries`` eligible entries: the margin says nothing in a nearly
empty cache (a lone stored question is "distinct" from nothing), so there only the main threshold counts.

Weights live in a small JSON file (``DEFAULT_WEIGHTS``, no pickle) with a format name and version; a
file of another version or with other feature names is refused. ``bench/semantic_cache.py --write-weights``
fits them on the tuning half of the paraphrase set (never the held-out half) and picks the band and the
probability cut there.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = "semantic-cache-verifier"
VERSION = 1
FEATURES = ("cosine", "margin", "overlap", "same_question_word", "length_ratio")
DEFAULT_WEIGHTS = Path(__file__).with_name("semantic_verifier.json")
VERIFIER_TOP_K = 3
MARGIN_CAP = 0.4  # a margin above this carries no more evidence; also bounds extrapolation

_QUESTION_WORDS = (
    ("why", "why"),
    ("when", "when"),
    ("where", "where"),
    ("who", "who"),
    ("how much", "quantity"),
    ("how many", "quantity"),
    ("how long", "duration"),
    ("what", "what"),
    ("which", "what"),
    ("how", "how"),
)
_QW_PATTERNS = tuple((re.compile(rf"\b{w}\b"), cls) for w, cls in _QUESTION_WORDS)


def question_word(normalized: str) -> str:
    """The kind of question a normalised text asks (why/when/where/who/quantity/duration/what/how),
    ``yes-no`` when it names none."""
    for pattern, cls in _QW_PATTERNS:
        if pattern.search(normalized):
            return cls
    return "yes-no"


def pair_features(
    cosine: float,
    margin: float,
    query_content: tuple[str, ...],
    entry_content: tuple[str, ...],
    query_normalized: str,
    entry_normalized: str,
) -> np.ndarray:
    """The verifier's input for one (query, stored entry) pair, in ``FEATURES`` order."""
    a, b = set(query_content), set(entry_content)
    union = a | b
    overlap = len(a & b) / len(union) if union else 1.0
    same_qw = float(question_word(query_normalized) == question_word(entry_normalized))
    length_ratio = min(len(a), len(b)) / max(1, len(a), len(b))
    margin = max(-MARGIN_CAP, min(MARGIN_CAP, float(margin)))
    return np.array([cosine, margin, overlap, same_qw, length_ratio], dtype=np.float64)


@dataclass(frozen=True)
class Verifier:
    """``probability(x) = sigmoid(((x - mean) / scale) . weights + bias)``; accept at ``>= p_min``.

    ``low_threshold``: the bottom of the band it was chosen for; ``min_entries``: below this many
    eligible entries in the tenant the band stays closed."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    p_min: float
    low_threshold: float
    min_entries: int = 50
    features: tuple[str, ...] = FEATURES
    fitted_on: str = ""

    def __post_init__(self):
        n = len(self.features)
        if tuple(self.features) != FEATURES:
            raise ValueError(f"verifier features {list(self.features)} are not {list(FEATURES)}")
        if not (len(self.mean) == len(self.scale) == len(self.weights) == n):
            raise ValueError("verifier mean/scale/weights do not match its features")
        values = (*self.mean, *self.scale, *self.weights, self.bias, self.p_min, self.low_threshold)
        if not all(math.isfinite(v) for v in values) or min(self.scale) <= 0:
            raise ValueError("verifier parameters must be finite, scales positive")
        # a cut of 0 accepts every candidate of the lower band, one of 1 none
        if not 0.0 < self.p_min < 1.0 or not 0.0 <= self.low_threshold <= 1.0 or self.min_entries < 1:
            raise ValueError(
                f"verifier cut p_min in (0, 1), low_threshold in [0, 1] and min_entries >= 1, got "
                f"{self.p_min}, {self.low_threshold}, {self.min_entries}"
            )

    def probability(self, x: np.ndarray) -> float:
        z = (np.asarray(x, dtype=np.float64) - np.asarray(self.mean)) / np.asarray(self.scale)
        logit = float(z @ np.asarray(self.weights) + self.bias)
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, logit))))

    def accepts(self, x: np.ndarray) -> bool:
        return self.probability(x) >= self.p_min

    def with_cut(self, p_min: float, low_threshold: float) -> Verifier:
        return Verifier(**{**asdict(self), "p_min": float(p_min), "low_threshold": float(low_threshold)})

    # -- file ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, **asdict(self)}
        body["features"] = list(self.features)
        for key in ("mean", "scale", "weights"):
            body[key] = [round(float(v), 8) for v in body[key]]
        return json.dumps(body, indent=2) + "\n"

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_dict(cls, d: object) -> Verifier:
        if not isinstance(d, dict):
            raise ValueError(f"malformed verifier file: a JSON object expected, got {type(d).__name__}")
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(
                f"not a {FORMAT} v{VERSION} file (format {d.get('format')!r}, version {d.get('version')!r})"
            )
        try:
            return cls(
                mean=tuple(float(v) for v in d["mean"]),
                scale=tuple(float(v) for v in d["scale"]),
                weights=tuple(float(v) for v in d["weights"]),
                bias=float(d["bias"]),
                p_min=float(d["p_min"]),
                low_threshold=float(d["low_threshold"]),
                min_entries=int(d.get("min_entries", 50)),
                features=tuple(d["features"]),
                fitted_on=str(d.get("fitted_on", "")),
            )
        except (KeyError, TypeError, OverflowError) as exc:  # OverflowError: int() of 1e400 (infinity)
            raise ValueError(f"malformed verifier file: {exc}") from exc

    @classmethod
    def load(cls, path: Path = DEFAULT_WEIGHTS) -> Verifier:
        """ValueError (naming `path`) for a file that is not a verifier's; OSError when it cannot be read."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: {exc}") from exc


def fit(
    x: np.ndarray,
    y: np.ndarray,
    l2: float = 1.0,
    iterations: int = 50,
    **extra,
) -> Verifier:
    """L2-regularised logistic regression by Newton's method on standardised features (numpy only).

    ``extra`` goes to ``Verifier`` (p_min, low_threshold, min_entries, fitted_on)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need an (n >= 2, {len(FEATURES)}) feature matrix and n labels")
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    penalty = np.r_[np.full(len(FEATURES), l2), 0.0]  # the bias is not shrunk
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -60, 60)))
        grad = z.T @ (p - y) + penalty * w
        hess = (z.T * (p * (1 - p))) @ z + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    extra.setdefault("p_min", 0.5)
    extra.setdefault("low_threshold", 0.0)
    return Verifier(mean=tuple(mean), scale=tuple(scale), weights=tuple(w[:-1]), bias=float(w[-1]), **extra)
