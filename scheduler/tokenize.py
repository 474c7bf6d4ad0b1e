"""Prompt text to token ids for the scheduler step, on the cheapest path the tokenizer offers, and
without encoding a long shared prefix again."""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cache.sightings import Sightings


PROMPT_SPECIAL_TOKENS = ("text", "parse")
# a normalizer may drop characters before tokens cover the rest (control characters, combining accents
# of decomposed text): a prompt is refused unread only past twice what the token limit can cover
DROPPED_CHARACTERS_MARGIN = 2


def treat_special_tokens(tokenizer: Any, mode: str) -> None:
    """How prompt text that spells a special token ("</s>", "<|im_start|>") is read. "text": as the
    characters it is, so a client cannot end or restart the model's input mid-prompt by typing EOS, and
    its echoed prompt keeps the tag; "parse": as the token, for clients that format a chat template
    themselves. The `<s>` the tokenizer's template adds is kept either way."""
    if mode not in PROMPT_SPECIAL_TOKENS:
        raise ValueError(
            f"prompt_special_tokens must be one of {', '.join(PROMPT_SPECIAL_TOKENS)}, got {mode!r}"
        )
    tokenizer.encode_special_tokens = mode == "text"


def max_prompt_chars(tokenizer: Any, max_prompt_tokens: int) -> int:
    """The most characters a prompt of `max_prompt_tokens` tokens can have: no token covers more than its
    vocabulary string's length (byte-level BPE: one character a byte, so never more characters), with
    `DROPPED_CHARACTERS_MARGIN`. A longer prompt is refused before tokenization: tokenizing 32 MB took
    the single scheduler instance 15 s, while every other client's request waited behind it."""
    longest = max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max_prompt_tokens * max(longest, 1) * DROPPED_CHARACTERS_MARGIN


def ids_encoder(tokenizer: Any, add_special_tokens: bool = True) -> Callable[[str], list[int]]:
    """`text -> ids` through `encode_batch_fast` where the `tokenizers` version has it: the same ids
    without tracking character offsets, which the step never reads. Measured on the CPU VM at 1800
    tokens: 1.16 ms against 1.55 ms for `encode` (2.8 against 3.2 ms when the call follows an idle gap,
    as a request does). Older versions fall back to `encode`."""
    batch = batch_encoder(tokenizer, add_special_tokens)
    return lambda text: batch([text])[0]


def batch_encoder(tokenizer: Any, add_special_tokens: bool = True) -> Callable[[list[str]], list[list[int]]]:
    """`ids_encoder` for several texts in one call, which the tokenizer spreads over its threads."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is None:
        return lambda texts: [tokenizer.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
    return lambda texts: [encoding.ids for encoding in fast(texts, add_special_tokens=add_special_tokens)]


def safe_splits(text: str, every: int, scan: int = 64) -> list[int]:
    """Cut points near each multiple of `every` characters where a new word begins after a non-space
    character ("abc| def"). Byte-level BPE never merges across them (its pre-tokenizer always starts a
    token at " word"), so ids(text[:b]) + ids(text[b:]) == ids(text). A cut depends only on the text
    before it and shortly after, so two prompts that share a prefix share its cuts."""
    cuts = []
    for start in range(every, len(text) - 1, every):
        for i in range(start, min(start + scan, len(text) - 1)):
            if text[i] == " " and not text[i - 1].isspace() and text[i + 1].isalpha():
                cuts.append(i)
                break
    return cuts


def prefix_digests(text: str, cuts: list[int], tenant: str = "") -> list[bytes]:
    """SHA-256 of (`tenant`, `text[:cut]`) for each cut, in one pass over the text."""
    running, digests, start = hashlib.sha256(), [], 0
    salt = tenant.encode("utf-8", "surrogatepass")
    running.update(len(salt).to_bytes(4, "big") + salt)
    for cut in cuts:
        running.update(text[start:cut].encode("utf-8", "surrogatepass"))
        digests.append(running.copy().digest())
        start = cut
    return digests


@dataclass
class PrefixTokenStats:
    hits: int = 0  # prompts that reused the ids of a cached prefix
    misses: int = 0
    verified: int = 0  # composed results checked against a whole encode
    mismatches: int = 0  # a check that failed: the cache turned itself off


class PrefixTokenizer:
    """Tokenizes a long prompt's shared prefix once: prompts that begin with the same long text (a
    system prompt, a document) reuse the ids of that prefix and encode only the rest. Tokenization
    costs ~1 us a token on the CPU VM (3 ms at 1800 tokens after an idle gap), and a prefix-cache hit
    pays it in full otherwise.

    A prefix is remembered when it comes back: a prompt whose cuts were never seen is encoded whole
    (its cut digests are noted), so one-off prompts cost what a plain encode costs. Remembering took
    a whole encode with offsets plus slicing per cut: 4.9 ms against 2.7 for a plain encode at 3500
    tokens on the CPU VM. A prompt that repeats a noted cut is encoded as its segments between cuts,
    in one batch call, which gives each cut's prefix ids.

    Composition holds for byte-level BPE at `safe_splits`; a tokenizer for which it does not hold
    (another pre-tokenizer, a template that appends tokens) is caught by checking composed results
    against a whole encode: the first `verify_first` (`warm` spends them on synthetic documents of
    mixed scripts, so requests do not pay them twice), then one in `verify_every`. One mismatch turns
    the cache off for good and returns the whole encode's ids."""

    def __init__(
        self,
        tokenizer: Any,
        every: int = 512,
        min_chars: int = 2048,
        capacity: int = 512,
        verify_first: int = 16,
        verify_every: int = 64,
    ):
        self.fast = ids_encoder(tokenizer)
        self.plain = ids_encoder(tokenizer, add_special_tokens=False)  # the rest after a cached prefix
        self.plain_batch = batch_encoder(tokenizer, add_special_tokens=False)
        self.every, self.min_chars, self.capacity = every, min_chars, capacity
        self.verify_first, self.verify_every = verify_first, verify_every
        self.enabled = True
        self.stats = PrefixTokenStats()
        self._composed = 0  # composed results so far, warm's included: when checks are due
        # digest of a prefix -> (the ids of the prompt it was cut from, as int64: 8 bytes an id instead
        # of ~36; how many of them are the prefix's). A prompt's cuts share its one array.
        self._prefixes: OrderedDict[bytes, tuple[array, int]] = OrderedDict()
        self._noted: Sightings[bytes] = Sightings(8 * capacity)  # cut digests seen once, not remembered

    def warm(self) -> None:
        """Spend the first checks on synthetic documents (noted, remembered, then hit) and run every
        path once before traffic: each tokenizer entry point's first call costs ~0.5 ms more than
        later ones. Then forget them (the checks stay spent)."""
        for seed in range(max(1, self.verify_first // 2)):
            shared = _synthetic_document(seed, self.min_chars + self.every)
            for ending in (" first ending.", " second, longer ending!", " a third one"):
                self(shared + ending)
        self._prefixes.clear()
        self._noted.clear()
        self.stats = PrefixTokenStats()

    def __call__(self, text: str, tenant: str = "") -> list[int]:
        """`text`'s ids. Prefixes are remembered per `tenant`: whether a prompt was tokenized faster must
        not tell one tenant what another sent (the KV tiers' keys are salted by tenant for the same
        reason), and one tenant's one-off prompts forget their own sightings first."""
        if not self.enabled or len(text) < self.min_chars:
            return self.fast(text)
        cuts = safe_splits(text, self.every)
        if not cuts:
            return self.fast(text)
        digests = prefix_digests(text, cuts, tenant)
        for cut, digest in zip(reversed(cuts), reversed(digests)):
            entry = self._prefixes.get(digest)
            if entry is not None:
                self._prefixes.move_to_end(digest)
                self.stats.hits += 1
                ids, length = entry
                return self._checked(text, ids[:length].tolist() + self.plain(text[cut:]))
        self.stats.misses += 1
        if not any(self._noted.contains(digest, tenant) for digest in digests):
            self._noted.seen_many(digests, tenant)
            return self.fast(text)
        return self._checked(text, self._compose(text, cuts, digests))

    def _compose(self, text: str, cuts: list[int], digests: list[bytes]) -> list[int]:
        """The ids of the segments between cuts, joined; remembers each cut's prefix."""
        bounds = [0, *cuts, len(text)]
        pieces = self.plain_batch([text[a:b] for a, b in zip(bounds[1:-1], bounds[2:])])
        ids = array("q", self.fast(text[: cuts[0]]))
        for digest, piece in zip(digests, pieces):
            self._prefixes[digest] = (ids, len(ids))  # the prefix up to this cut: ids so far
            self._prefixes.move_to_end(digest)
            ids.extend(piece)
        while len(self._prefixes) > self.capacity:
            self._prefixes.popitem(last=False)
        return ids.tolist()

    def _checked(self, text: str, composed: list[int]) -> list[int]:
        self._composed += 1
        due = self._composed <= self.verify_first or self._composed % self.verify_every == 0
        if not due:
            return composed
        whole = self.fast(text)
        self.stats.verified += 1
        if whole != composed:
            self.stats.mismatches += 1
            self.enabled = False
            self._prefixes.clear()
            self._noted.clear()
        return whole


_WARM_WORDS = (
    "the system prompt says: answer in JSON, cite sources [1], keep it short; naïve café façade "
    "déjà-vu 東京 漢字 🚀 — 3.14159 1,000,000 2026-11-29 don't won't it's I'm e-mail x1 42% $5.00"
).split()


def _synthetic_document(seed: int, chars: int) -> str:
    """Text of mixed scripts, digits, punctuation and line breaks: what the checks run on in `warm`."""
    rng = random.Random(seed)
    parts: list[str] = []
    while sum(len(part) + 1 for part in parts) < chars:
        parts.append(rng.choice(_WARM_WORDS) + rng.choice(("", "", "", ",", ".", "!", "\n", "  ")))
    return " ".join(parts)
