"""Last check before the semantic cache serves a hit: all-MiniLM-L6-v2 as a cross-encoder over both questions.

The embedding cache compares two questions as two vectors made apart, and among the candidates that pass
its cosine cut that is worse than a coin: on pairs written blind to it (data/paraphrases-fresh.jsonl) the
ROC AUC of cosine above 0.7 is under 0.5 (docs/INTERNALS.md), because a question's negation, reversal or
near-miss sits closer to it than a reworded paraphrase does. A cross-encoder reads "[CLS] a [SEP] b [SEP]"
in one pass, so attention can line the words of one question up with the other's and see which one
changed roles.

The model is the packaged MiniLM checkpoint (nothing can be downloaded here) with a low-rank (LoRA) delta on
its linear layers and a linear head over the mean-pooled output, fitted by ``cache.pair_training`` on
data/pair-train/ (question pairs in domains no paraphrase test set uses). The file holds only the delta and
the head (safetensors: no pickle), with a format, version and the SHA-256 of the base weights and of the
tokenizer files it was fitted on; a file of another format, base or tokenizer is refused. At load the delta
is merged into the weights, so a check is one plain BERT forward pass over the pair in both orders (the
mean of the two probabilities: the cache asks "may a's answer serve b", which the training data labels
symmetrically).
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache.embedder import load_checkpoint, mean_pool

FORMAT = "semantic-cache-pair-classifier"
VERSION = 1
DEFAULT_WEIGHTS = Path(__file__).with_name("pair_classifier.safetensors")
# The linear layers of every BERT block that carry a delta, by their name inside ``encoder.layer.<i>``.
LORA_TARGETS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # what a fit writes (torch is imported lazily)
MAX_PAIR_TOKENS = 512  # BERT's position table; each question is within the embedder's 256


def base_fingerprint(model_dir: Path) -> str:
    """SHA-256 of the base checkpoint's weights: a delta fitted on other weights means nothing."""
    digest = hashlib.sha256()
    with open(Path(model_dir) / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def tokenizer_fingerprint(model_dir: Path) -> str:
    """SHA-256 of the base checkpoint's tokenizer files (name and bytes of each present): the same
    weights read through another vocabulary or casing would see other token ids, and the delta and
    head were fitted on these."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()


def lora_targets(model) -> dict[str, object]:
    """``{name: nn.Linear}`` of the layers ``LORA_TARGETS`` names, in every encoder block."""
    out = {}
    for i, layer in enumerate(model.encoder.layer):
        for target in LORA_TARGETS:
            out[f"encoder.layer.{i}.{target}"] = layer.get_submodule(target)
    return out


def encode_pairs(tokenizer, firsts: list[str], seconds: list[str]):
    return tokenizer(
        firsts,
        seconds,
        padding=True,
        truncation=True,
        max_length=MAX_PAIR_TOKENS,
        return_tensors="pt",
    )


@dataclass(frozen=True)
class PairClassifierFile:
    """What ``cache.pair_training`` writes: per target layer ``<name>.lora_a`` (r, in) and ``<name>.lora_b``
    (out, r), the head's ``head.weight`` (1, hidden) and ``head.bias`` (1,), and how to read them."""

    tensors: dict
    rank: int
    alpha: float
    base_sha256: str
    fitted_on: str = ""
    tokenizer_sha256: str = ""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "version": str(VERSION),
            "rank": str(self.rank),
            "alpha": repr(float(self.alpha)),
            "base_sha256": self.base_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "targets": ",".join(LORA_TARGETS),
            "fitted_on": self.fitted_on,
        }

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path), metadata=self.metadata())

    @classmethod
    def load(cls, path: Path) -> PairClassifierFile:
        import torch
        from safetensors import SafetensorError, safe_open

        try:  # a truncated file, an LFS pointer, garbage: SafetensorError, which is neither of the callers'
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
                    raise ValueError(
                        f"{path}: not a {FORMAT} v{VERSION} file "
                        f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
                    )
                if meta.get("targets") != ",".join(LORA_TARGETS):
                    raise ValueError(f"{path}: fitted on layers {meta.get('targets')!r}, not {LORA_TARGETS}")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from exc
        try:
            rank, alpha = int(meta["rank"]), float(meta["alpha"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{path}: malformed rank/alpha metadata ({exc})") from exc
        if rank <= 0 or not math.isfinite(alpha):
            raise ValueError(f"{path}: rank must be positive and alpha finite, got {rank}, {alpha}")
        # the dtypes a fit writes, checked before isfinite (which float8 does not implement)
        bad = [
            k
            for k, t in tensors.items()
            if str(t.dtype).removeprefix("torch.") not in WEIGHT_DTYPES or not bool(torch.isfinite(t).all())
        ]
        if bad:
            raise ValueError(f"{path}: tensors {bad[:3]} are not finite float32/float16/bfloat16 values")
        return cls(
            tensors,
            rank,
            alpha,
            meta.get("base_sha256", ""),
            meta.get("fitted_on", ""),
            meta.get("tokenizer_sha256", ""),
        )


class PairClassifier:
    """``probability([(a, b), ...])``: how likely a's answer also answers b, for each pair.

    Thread-safe the way ``MiniLMEmbedder`` is: one lock around each forward pass."""

    def __init__(self, weights: PairClassifierFile, model_dir: Path | None = None):
        import torch

        self._torch = torch
        self.tokenizer, self.model, model_dir = load_checkpoint(model_dir)
        if weights.base_sha256 != base_fingerprint(model_dir):
            raise ValueError(
                f"pair classifier was fitted on base weights {weights.base_sha256[:12]}, "
                f"not on {model_dir}'s; refit it with python -m cache.pair_training"
            )
        if weights.tokenizer_sha256 != tokenizer_fingerprint(model_dir):
            named = weights.tokenizer_sha256[:12] or "(not named)"
            raise ValueError(
                f"pair classifier was fitted with tokenizer {named}, not with {model_dir}'s; "
                "refit it with python -m cache.pair_training"
            )
        tensors = weights.tensors
        with torch.no_grad():
            for name, linear in lora_targets(self.model).items():
                try:
                    a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
                except KeyError as exc:
                    raise ValueError(f"pair classifier file lacks {exc.args[0]}") from exc
                if a.shape != (weights.rank, linear.in_features) or b.shape != (
                    linear.out_features,
                    weights.rank,
                ):
                    raise ValueError(
                        f"pair classifier delta for {name} has shapes {tuple(a.shape)}, {tuple(b.shape)}"
                    )
                linear.weight += weights.scale * (b.float() @ a.float())
            head_w, head_b = tensors.get("head.weight"), tensors.get("head.bias")
            hidden = self.model.config.hidden_size
            if head_w is None or head_b is None or head_w.shape != (1, hidden) or head_b.shape != (1,):
                raise ValueError("pair classifier file lacks a head of weight (1, hidden) and bias (1,)")
            self.head_weight, self.head_bias = head_w.float(), head_b.float()
        self.fitted_on = weights.fitted_on
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path = DEFAULT_WEIGHTS, model_dir: Path | None = None) -> PairClassifier:
        return cls(PairClassifierFile.load(path), model_dir)

    def probability(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """Mean over both orders of sigmoid(head(mean-pooled cross-encoding)); (0,) for no pairs."""
        if not pairs:
            return np.zeros(0, dtype=np.float64)
        torch = self._torch
        firsts = [a for a, _ in pairs] + [b for _, b in pairs]
        seconds = [b for _, b in pairs] + [a for a, _ in pairs]
        with self._lock, torch.inference_mode():
            enc = encode_pairs(self.tokenizer, firsts, seconds)
            pooled = mean_pool(self.model(**enc).last_hidden_state, enc["attention_mask"])
            probs = torch.sigmoid(pooled @ self.head_weight.T + self.head_bias).squeeze(-1)
        probs = probs.double().numpy()
        return (probs[: len(pairs)] + probs[len(pairs) :]) / 2


class _PairsAsRows:
    """The classifier seen as a one-column embedder, so that CoalescingEmbedder's group commit (its
    queueing, leader hand-off and interrupt handling) serves it unchanged."""

    dim = 1

    def __init__(self, classifier: PairClassifier):
        self.classifier = classifier

    def embed(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return self.classifier.probability(pairs).reshape(-1, 1)

    def fits(self, pairs: list[tuple[str, str]]) -> list[bool]:
        return [True] * len(pairs)


class CoalescingPairClassifier:
    """A PairClassifier whose concurrent ``probability`` calls share one model pass: semantic lookups run
    on several threads, the model one pass at a time (its lock), and a pass over two pairs costs about
    what one does (17.0 against 16.8 ms on 2 CPU threads; 4 pairs 28.6 ms). A lone call runs at once."""

    def __init__(self, classifier: PairClassifier, max_pairs: int = 8):
        from cache.embed_coalescer import CoalescerConfig, CoalescingEmbedder

        self.classifier = classifier
        config = CoalescerConfig(max_pairs, "pair scoring", np.float64)
        self._group = CoalescingEmbedder(_PairsAsRows(classifier), config)

    def probability(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """As PairClassifier.probability; a failed shared pass raises EmbeddingFailed (its cause chained)."""
        return self._group.embed(list(pairs))[:, 0]

    def snapshot(self) -> dict[str, int]:
        """calls, queued, passes, texts (pairs) and errors: how many lookups each model pass served."""
        return self._group.snapshot()
