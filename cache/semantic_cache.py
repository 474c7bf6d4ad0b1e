"""Semantic response cache: answer a paraphrase of an earlier question from Redis, per tenant.

Embedding similarity alone is not enough to reuse an answer. Sentence embeddings put a question and
its negation or reversal closer together than many true paraphrases (all-MiniLM-L6-v2: "How do I
reset my password?" vs "How do I not reset my password?" 0.93, vs "I forgot my password, how can I
set a new one?" 0.89), and GPTCache at threshold 0.8 returns wrong answers for about 9% of its hits.
So a match must pass three checks besides the cosine threshold:

- the same sampling signature (temperature, seed, stop ..., and for a sampled request the engine's device
  type, whose generator drew it): other parameters, other answer; `max_tokens` is checked against the
  entry's answer instead (below);
- never for temperature > 0 without a seed: that request asked for a fresh sample;
- ``QuestionGuard``: rejects a pair when one question has a negation, exception or comparison-direction
  word that the other lacks or reverses, swaps a from/to or than direction, names other numbers or
  entities, asks about a price the other does not ask about, or is the other with a word or two
  swapped in place and the rest worded the same ("soft / hard yolk", "daily / weekly limit":
  ``minimal_pair`` with equal ``frame_words``). It is lexical and conservative on purpose: a rejected
  paraphrase costs one generation, an accepted negation serves a wrong answer. Word lists alone
  overfit: on pairs written after them (the "added" pairs of data/paraphrases.jsonl) the guard before
  the swap rule had a precision of only 0.56 at threshold 0.82; the swap rule, which needs no list (but
  was written after seeing those failures), closes most of that gap. A synonym swapped into the same
  frame ("cancel / end my gym membership") looks like a contrast and is turned down too; a swap with
  the rest reworded is a rewording, left to the embedding (on pairs written blind to the guard,
  data/paraphrases-fresh.jsonl, that kept the wrong hits at 5 and raised the correct ones from 25 to 41).

A would-be hit must then also pass the pair classifier (``PairCheck``, cache/pair_classifier.py): MiniLM
read as a cross-encoder over both questions, which sees the reworded reversals and same-domain topics the
guard has no words for, and may overrule three of the guard's reasons (other entities, a number on
one side only, direction) when it is sure; numbers on both sides that differ ("values") never are.

Queries are normalised before embedding (``normalize_question``: case, contractions, preambles such
as "can you tell me", one "how do i" opener, punctuation), which moves paraphrases closer. A lower
cosine band [low_threshold, threshold) is open when the shipped verifier weights load
(cache/semantic_verifier.py: a logistic regression on cosine, margin over the next entry and lexical
features, run on the top guard-passing band candidates only; without weights the band falls back to the
older rule, content-word overlap <= ``LOW_BAND_MAX_OVERLAP``, and is closed by default);
bench/semantic_cache.py fits the verifier and picks the thresholds on one half of the paraphrase set and
reports the other half.

Stored per (model fingerprint, embedder identity, tenant): the prompt, the answer as the engine computed it
(``ExactAnswer``: every generated token id, how many the final response sent, the stop string's trim,
whether it is final), the embedding (float32 bytes) and the signature, with a checksum over all of them
and the tenant; when the entry was written is its score in the tenant's age set. A tenant's lookups
read only that tenant's keys, and an entry copied under another tenant fails its checksum. Lookups are
brute-force cosine over the tenant's matrix, kept in memory and re-read only when the tenant's version
counter in Redis moves (every store, eviction or corruption cleanup bumps it).

An answer serves budgets as the exact cache's does (``ExactAnswer.within``): a request allowed fewer
tokens gets its first ones, one allowed more only a final answer (EOS or a stop string), else the lookup
is a miss (``shorter``); the signature leaves `max_tokens` out, so a warmup answer of 512 tokens serves a
paraphrase asked with 64. An answer that ran to the model's last position is not final here, as it is for
its own prompt: a paraphrase's shorter prompt leaves room for more tokens (``ResponseTier.remember``). A
store keeps an entry of the same prompt that serves more budgets (``kept``). A hit is the stored token
ids and trim, sent as an exact hit's are: no text encoded again, and with exclude_input_in_output false
the *current* prompt in front, never the stored one.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import re
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

import numpy as np

from cache.embed_memo import RecentVectors
from cache.key_directory import MAX_TRIM_PER_WRITE
from cache.circuit_breaker import CircuitBreaker
from cache.wrong_type import is_wrong_type
from cache.response_cache import (
    SERVES_MORE_LUA,
    ExactAnswer,
    RedisCacheBase,
    canonical_json,
    exact_signature,
    is_deterministic,
    load_json_object,
    redis_ttl,
    rng_device,
    sha256_hex,
    tenant_tag,
)
from cache.semantic_verifier import DEFAULT_WEIGHTS, VERIFIER_TOP_K, Verifier, pair_features
from scheduler.messages import EngineRequestParams, utf8_encodable

if TYPE_CHECKING:  # the classifier needs torch; the cache's callers choose whether to load it
    from cache.pair_classifier import PairClassifier

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the answer's token ids, how many were sent, trim and final (1: its text)
# v3: max_tokens out of the signature, format 2, ages in the age set; v2 (and v1: vectors of the raw prompt,
# which do not compare) entries are never read and expire by their TTL
KEY_PREFIX = "llm:resp:sem:v3"
# Chosen by bench/semantic_cache.py on the tuning half of data/paraphrases.jsonl and the pairs of
# data/paraphrases-fresh.jsonl, -fresh2 and -fresh3 (highest hit rate whose precision's one-sided Wilson
# lower bound is >= 0.97; bench/results/semantic-cache-cpu.md), with the pair check at DEFAULT_PAIR_MIN;
# the lower band's bottom and the verifier's cut are in cache/semantic_verifier.json.
DEFAULT_THRESHOLD = 0.82
# In the lower band a paraphrase must share at most this fraction of content words: a moderate cosine
# between differently worded questions is what a paraphrase looks like, while a moderate cosine despite
# mostly shared words means the words that differ changed the question ("cancel" / "pause" my plan).
LOW_BAND_MAX_OVERLAP = 0.3
# The pair classifier's cut and how many candidates one lookup may run through it: chosen by
# bench/semantic_cache.py with the thresholds (bench/results/semantic-cache-cpu.md).
DEFAULT_PAIR_MIN = 0.3
DEFAULT_OVERRULES: tuple[str, ...] = ("entities", "numbers", "direction")  # guard reasons it may overrule
DEFAULT_OVERRULE_MIN = 0.95
PAIR_TOP_K = 2
# Row masks a tenant's matrix keeps per sampling signature (one byte per entry each) until its version
# moves: signatures are client-chosen (seed, stop strings), so the set is bounded, not one per lookup.
MAX_SIG_MASKS = 32

_STORE_SCRIPT = (
    SERVES_MORE_LUA
    + """
local function keeps()
  if ARGV[9] ~= '0' or redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return false end
  local written = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[1]))
  if not written or written < tonumber(ARGV[7]) then return false end
  return serves_more(redis.call('HGET', KEYS[2], ARGV[1]), ARGV[11], ARGV[10])
end
-- the stamp first: an INCR that fails (a damaged stamp) must leave nothing written, and no key without TTL
if redis.call('EXISTS', KEYS[4]) == 0 then
  local now = redis.call('TIME')
  redis.call('SET', KEYS[4], now[1] .. string.format('%06d', tonumber(now[2])))
end
redis.call('INCR', KEYS[4])
local kept = keeps()
if not kept then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
local cap = tonumber(ARGV[8])
local victims = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[7], 'LIMIT', 0, cap)
local expired_victims = #victims
local excess = math.min(redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[6]), cap)
if excess > 0 then  -- the oldest, never the entry this store wrote (a tie, or a clock behind the others)
  for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, excess)) do
    if excess > 0 and id ~= ARGV[1] then
      table.insert(victims, id)
      excess = excess - 1
    end
  end
end
-- an entry past its TTL is expired, not evicted; one listed twice (expired and oldest) is deleted once
local evicted, expired = 0, 0
for i, id in ipairs(victims) do
  local removed = redis.call('ZREM', KEYS[3], id)
  if i <= expired_victims then expired = expired + removed else evicted = evicted + removed end
  redis.call('HDEL', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return {evicted, kept and 1 or 0, expired}
"""
)
# ARGV: the entry's id, embedding and document, when it is written (its score in the age set: what
# lookups age it by), the TTL, the tenant's bound, the oldest time still served, the most one store may
# evict, the new answer's final flag (1/0) and token count, and the documents' format.
# An answer that is not final keeps the entry already under its id when that one serves more budgets
# (`SERVES_MORE_LUA`, the rule of `ExactAnswer.serves_more_than`) and is still served (its embedding there,
# its age within the TTL): its embedding and document stay, its time in the age set is renewed as the
# write's would have been. An entry of the right shape that fails its checksum (Lua has no SHA-256) is
# kept, then deleted by the next read, and the next store writes.
# A version stamp that went away (an erasure, a TTL, an eviction) starts again from the clock, not from 1:
# a replica holding the entries it read at stamp N must never see N again for other entries.

_DELETE_SCRIPT = """
local read = redis.call('GET', KEYS[4])
if (read or '') ~= ARGV[1] then return 0 end
for i = 2, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i])
end
if not read then return -1 end
return redis.call('INCR', KEYS[4])
"""
# ARGV[1]: the stamp the entries were read at ('' for none). The entries are deleted only when nothing
# moved it since: another replica may have stored a good entry under a bad one's id meanwhile, which must
# stay. Then the new stamp is returned (the entries less the deleted ones are what Redis holds), or -1
# when there is none (an erasure, after which no stamp is created: re-read next time). 0: nothing deleted,
# the stamp moved; the caller re-reads next time and finds, and counts, what is still bad.


class Embedder(Protocol):
    # and, optionally, `identity`: a str naming what its vectors depend on (`embedder_tag`)
    def embed(self, texts: list[str]) -> np.ndarray: ...

    def fits(self, texts: list[str]) -> list[bool]: ...  # embedded whole, not truncated


def embedder_tag(embedder: Embedder) -> str:
    """A fixed-width, key-safe form of the embedder's `identity` (MiniLMEmbedder: its checkpoint and
    recipe, cache/embedder.py; a CoalescingEmbedder: its inner one's): in the keys, so entries written
    with other vectors are never read, let alone compared. One that names none (tests' stand-ins)
    shares the tag of "unnamed"."""
    identity = str(getattr(embedder, "identity", None) or "unnamed")
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Query normalisation (what gets embedded) and content words
# ---------------------------------------------------------------------------------------------------

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'", "\u02bc": "'"})


def fold(text: str) -> str:
    """One spelling of what reads alike, before the normaliser and the guard both: NFKC (full-width
    letters and digits, "½" and "²" as digits, a letter and its combining accent as one letter) and one
    apostrophe, so that "doesn`t" is a negation to the guard as it is "does not" to the embedding."""
    return unicodedata.normalize("NFKC", text).translate(_APOSTROPHES)


_CONTRACTIONS = (
    (re.compile(r"\bcan't\b"), "cannot"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'d\b"), " would"),
    (re.compile(r"\b(it|that|what|there|here|who|where|how|when|why|he|she)'s\b"), r"\1 is"),
    (re.compile(r"'s\b"), ""),  # a possessive: "the router's password" -> "the router password"
)
# Politeness and preambles that carry no question ("can you tell me how ...", "hi, ...").
_FILLERS = re.compile(
    r"^(?:(?:hi|hello|hey|quick question|question)\b[\s,:!.-]*)?"
    r"(?:(?:please|kindly)\s+)?"
    r"(?:(?:can|could|would) you (?:please )?(?:tell|show) me|(?:i want|i would like|i need) to know|"
    r"do you know|tell me|i was wondering)?\s*"
)
# Ways of asking "how do I": MiniLM scores two phrasings of one question lower when only one of them
# says "what's the best way to"; one canonical opener moves paraphrases closer, not other questions
# ("the quickest way" and "the easiest way" ask for different answers, so they keep their words).
_OPENERS = re.compile(
    r"^(?:how can i|how could i|how would i|how should i|how do you|how does one|how to|"
    r"what is the (?:best |right )?way to|what are the steps to|is there a way to)\b"
)
_PUNCTUATION = re.compile(r"[^\w\s-]+|(?<!\w)-|-(?!\w)")
_SPACES = re.compile(r"\s+")

# Words that shape a question rather than say what it is about; the rest are its content words.
FRAME_WORDS = frozenset(
    "a an the i me my mine we us our you your it its is are was were be been being am do does did doing "
    "can could would should will shall may might must have has had how what why when where which who "
    "whom whose there here this that these those to of in on at for with by from about as and or but if "
    "so then into onto any some all each just also please get got way ways best steps process possible "
    "able need know usually typically normally generally really actually exactly anything something "
    "someone one".split()
)


# Frame words that say little about how a question is put: "the daily limit" / "my weekly limit" is
# still the same frame with one word swapped
LOOSE_FRAME_WORDS = frozenset(
    "a an the my your our its this that these those please just also really actually".split()
)


def normalize_question(text: str) -> str:
    """Lower case, contractions expanded, preambles dropped, one "how do i" opener, no punctuation."""
    s = fold(text).lower().strip()
    for pattern, replacement in _CONTRACTIONS:
        s = pattern.sub(replacement, s)
    s = _FILLERS.sub("", s, count=1)
    s = _OPENERS.sub("how do i", s, count=1)
    s = _PUNCTUATION.sub(" ", s)
    return _SPACES.sub(" ", s).strip()


def _stem(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def content_words(text: str) -> tuple[str, ...]:
    """The normalised question's words that are not frame words, plural -s stripped, in order."""
    return _content(normalize_question(text).split())


def frame_words(text: str) -> tuple[str, ...]:
    """The normalised question's frame words in order, less the loose ones: how it is asked, not what
    about. Two questions with the same frame and a content word swapped are a template with one slot
    changed; a different frame is a rewording."""
    return _frame(normalize_question(text).split())


def _content(words: list[str]) -> tuple[str, ...]:
    return tuple(_stem(w) for w in words if w not in FRAME_WORDS)


def _frame(words: list[str]) -> tuple[str, ...]:
    return tuple(w for w in words if w in FRAME_WORDS and w not in LOOSE_FRAME_WORDS)


# ---------------------------------------------------------------------------------------------------
# The lexical guard
# ---------------------------------------------------------------------------------------------------


def _forms(*stems: str) -> frozenset[str]:
    """A verb or adjective with its common inflections (over-generation is harmless here)."""
    out: set[str] = set()
    for s in stems:
        out |= {s, s + "s", s + "es", s + "d", s + "ed", s + "ing"}
        if s.endswith("e"):
            out.add(s[:-1] + "ing")
    return frozenset(out)


NEGATIONS = frozenset(
    {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "cannot", "without", "non"}
    | {"dont", "doesnt", "didnt", "cant", "wont", "isnt", "arent", "wasnt", "shouldnt", "couldnt"}
    | _forms("avoid")  # "should I avoid X" asks the opposite of "should I X"
    # negated adjectives: "unused months" is "months I didn't use"; "is it unsafe" is not "is it safe"
    | {"unused", "unpaid", "unread", "unsafe", "unhealthy", "unable", "unavailable", "unnecessary"}
    | {"unauthorized", "unverified", "unsupported", "unwanted", "unusual", "unlimited", "invalid"}
)
EXCEPTIONS = frozenset({"except", "excepting", "excluding", "besides"})
# What a question asks about, when one side asks it and the other does not ("How do I cancel my
# booking?" vs "Is there a fee for cancelling my booking?"): a different question about the same thing.
ASPECTS: dict[str, frozenset[str]] = {
    "price": frozenset(
        {"fee", "fees", "cost", "costs", "costing", "price", "prices", "priced", "pricing", "cheap"}
        | {"cheaper", "cheapest", "expensive", "free"}
    ),
}


@dataclass(frozen=True)
class Axis:
    """Two opposite poles. ``strict``: one side naming a pole the other lacks is already a reject
    (comparisons and time order change the question even when only one side states them); otherwise
    only opposite poles reject (action verbs, whose absence usually means a synonym was used)."""

    name: str
    plus: frozenset[str]
    minus: frozenset[str]
    strict: bool


AXES: tuple[Axis, ...] = (
    Axis(
        "quantity",
        _forms("increase", "raise", "grow", "boost", "exceed")
        | frozenset(
            {"more", "higher", "greater", "larger", "bigger", "above", "go_up", "goes_up", "went_up"}
        ),
        _forms("decrease", "reduce", "shrink", "lessen")
        | frozenset({"less", "fewer", "lower", "lowered", "lowering", "smaller", "below", "go_down"})
        | frozenset({"goes_down", "went_down"}),
        strict=True,
    ),
    Axis(
        "time",
        frozenset({"before", "beforehand", "earlier", "prior"}),
        frozenset({"after", "afterwards", "afterward", "later"}),
        strict=True,
    ),
    Axis("speed", frozenset({"faster", "quicker", "sooner"}), frozenset({"slower"}), strict=True),
    Axis(
        "level",
        frozenset({"high", "highest", "max", "maximum", "most"}),
        frozenset({"low", "lowest", "min", "minimum", "least"}),
        strict=False,
    ),
    Axis(
        "order",
        frozenset({"ascending", "first", "earliest", "oldest"}),
        frozenset({"descending", "last", "latest", "newest", "final"}),
        strict=False,
    ),
    Axis(
        "quality", frozenset({"good", "better", "best"}), frozenset({"bad", "worse", "worst"}), strict=False
    ),
    Axis(
        "switch",
        _forms("enable", "activate") | frozenset({"turn_on", "switch_on", "turned_on"}),
        _forms("disable", "deactivate") | frozenset({"turn_off", "switch_off", "turned_off"}),
        strict=False,
    ),
    Axis(
        "inout",
        frozenset({"in", "checkin", "login", "signin"}),
        frozenset({"out", "checkout", "logout", "signout"}),
        strict=False,
    ),
    Axis(
        "transfer",
        _forms("import", "upload", "push", "send", "deposit"),
        _forms("export", "download", "pull", "receive", "withdraw"),
        strict=False,
    ),
    Axis(
        "codec",
        _forms("encode", "encrypt", "compress", "serialize"),
        _forms("decode", "decrypt", "decompress", "deserialize"),
        strict=False,
    ),
    Axis(
        "membership",
        _forms("add", "include", "join", "subscribe"),
        _forms("remove", "exclude", "leave", "unsubscribe"),
        strict=False,
    ),
    Axis("plan", _forms("upgrade", "buy"), _forms("downgrade", "sell"), strict=False),
    Axis(
        "travel",
        _forms("arrive") | frozenset({"arrival", "arrivals", "inbound"}),
        _forms("depart", "leave") | frozenset({"departure", "departures", "outbound"}),
        strict=False,
    ),
    Axis("state", _forms("open", "start"), _forms("close", "stop"), strict=False),
    Axis("mutability", frozenset({"mutable"}), frozenset({"immutable"}), strict=False),
)

# "un-" verbs: "lock" vs "unlock" is a reversal; a side naming neither is fine.
UN_VERBS = frozenset(
    {"lock", "mute", "install", "pin", "block", "follow", "hide", "archive", "link", "freeze", "pause"}
    | {"select", "check", "subscribe", "publish", "share", "star", "tag", "zip", "pack"}
)
PHRASAL_PARTICLES = {"on", "off", "in", "out", "up", "down"}
PHRASAL_VERBS = frozenset({"turn", "turned", "turning", "switch", "switched", "go", "goes", "went", "going"})
INOUT_VERBS = frozenset(
    {"log", "logged", "logging", "sign", "signed", "signing", "check", "checked", "checking", "zoom"}
    | {"zoomed", "zooming", "opt", "opted", "plug", "plugged", "clock", "cash"}
)
SKIP_AFTER_MARKER = frozenset(
    {"the", "a", "an", "my", "your", "our", "their", "his", "her", "its", "this", "that", "on", "in", "at"}
)
NUMBER_WORDS = {
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "eleven": "11",
    "twelve": "12",
    "thirteen": "13",
    "fourteen": "14",
    "fifteen": "15",
    "sixteen": "16",
    "seventeen": "17",
    "eighteen": "18",
    "nineteen": "19",
    "twenty": "20",
    "thirty": "30",
    "forty": "40",
    "fifty": "50",
    "sixty": "60",
    "seventy": "70",
    "eighty": "80",
    "ninety": "90",
    "zero": "0",
    "hundred": "100",
    "thousand": "1000",
    "million": "1000000",
    "billion": "1000000000",
}  # "one" is left out: mostly a pronoun ("the mobile one")
_WORD = re.compile(r"[^\W_]+(?:'[^\W\d_]+)?")  # letters and digits of any script, after `fold`
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SENTENCE_END = re.compile(r"[.?!:;]\s+|^\s*")
_PRONOUN_I = frozenset({"i", "i'm", "i'd", "i've", "i'll"})


@dataclass(frozen=True)
class QuestionFeatures:
    """What the guard compares, extracted once per text (cached with the tenant's matrix)."""

    words: frozenset[str]
    negated: bool
    excepted: bool
    aspects: frozenset[str]
    poles: tuple[tuple[frozenset[str], frozenset[str]], ...]  # per AXES entry: (plus hits, minus hits)
    un_verbs: frozenset[str]  # "lock" for "unlock"
    plain_verbs: frozenset[str]  # "lock" for "lock"
    sources: frozenset[str]  # words in a "from X" / "X to" role
    targets: frozenset[str]  # words in a "to X" / "into X" role
    than_objects: frozenset[str]
    numbers: frozenset[str]
    entities: frozenset[str]
    content: tuple[str, ...]  # content_words(text)
    frame: tuple[str, ...]  # frame_words(text)
    symbols: frozenset[str] = frozenset()  # emoji and other symbols: the normaliser drops them


@dataclass(frozen=True)
class GuardVerdict:
    ok: bool
    reason: str = ""


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text)


def _next_content(words: list[str], i: int) -> str | None:
    for w in words[i + 1 :]:
        if w not in SKIP_AFTER_MARKER:
            return w
    return None


def extract_features(text: str) -> QuestionFeatures:
    text = fold(text)
    normalized = normalize_question(text).split()  # once, for the content and the frame words
    raw = _tokens(text)
    words = [w.lower() for w in raw]
    negated = any(w in NEGATIONS or w.endswith("n't") for w in words)
    excepted = any(w in EXCEPTIONS for w in words) or " other than " in f" {' '.join(words)} "
    aspects = frozenset(name for name, cues in ASPECTS.items() if cues.intersection(words))

    # phrasal verbs become one token so "turn off" and "log in" can sit on an axis
    joined: list[str] = list(words)
    for i in range(len(words) - 1):
        w, nxt = words[i], words[i + 1]
        if nxt in PHRASAL_PARTICLES and w in PHRASAL_VERBS:
            base = {"turned": "turned", "turning": "turn", "switched": "switch"}.get(w, w)
            base = "go" if base in {"goes", "went", "going"} and nxt in {"up", "down"} else base
            joined.append(f"{base}_{nxt}")
    bag = set(joined)
    poles = []
    for axis in AXES:
        plus, minus = axis.plus & bag, axis.minus & bag
        if axis.name == "inout":  # a bare "in"/"out" only counts after a log/sign/check-style verb
            plus = (plus - {"in"}) | (
                {"in"}
                if any(words[i] in INOUT_VERBS and words[i + 1] == "in" for i in range(len(words) - 1))
                else set()
            )
            minus = (minus - {"out"}) | (
                {"out"}
                if any(words[i] in INOUT_VERBS and words[i + 1] == "out" for i in range(len(words) - 1))
                else set()
            )
        poles.append((frozenset(plus), frozenset(minus)))

    un_verbs = set()
    for w in words:
        for v in UN_VERBS:
            if w in (f"un{v}", f"un{v}s", f"un{v}ed", f"un{v}ing", f"un{v}ped", f"un{v}ping"):
                un_verbs.add(v)
    plain = {v for v in UN_VERBS if any(w in (v, v + "s", v + "ed", v + "ing") for w in words)}

    sources: set[str] = set()
    targets: set[str] = set()
    than: set[str] = set()
    for i, w in enumerate(words):
        if w == "from":
            nxt = _next_content(words, i)
            if nxt:
                sources.add(nxt)
        elif w in {"to", "into"}:
            nxt = _next_content(words, i)
            if nxt:
                targets.add(nxt)
            if i > 0 and words[i - 1] not in SKIP_AFTER_MARKER:
                sources.add(words[i - 1])
        elif w == "than":
            nxt = _next_content(words, i)
            if nxt:
                than.add(nxt)
    pure_sources, pure_targets = sources - targets, targets - sources

    numbers = set(_NUMBER.findall(text)) | {NUMBER_WORDS[w] for w in words if w in NUMBER_WORDS}
    numbers |= {NUMBER_WORDS[p] for w in words for p in w.split("-") if p in NUMBER_WORDS}

    sentence_starts = {m.end() for m in _SENTENCE_END.finditer(text)}
    entities = set()
    for m in _WORD.finditer(text):
        tok = m.group(0)
        low = tok.lower()
        if low in _PRONOUN_I or not any(c.isupper() for c in tok):
            continue
        special = (
            (tok.isupper() and len(tok) > 1)
            or any(c.isupper() for c in tok[1:])
            or any(c.isdigit() for c in tok)
        )
        if m.start() in sentence_starts and not special:
            continue  # a capital at the start of a sentence says nothing
        entities.add(low)

    return QuestionFeatures(
        words=frozenset(words),
        negated=negated,
        excepted=excepted,
        aspects=aspects,
        poles=tuple(poles),
        un_verbs=frozenset(un_verbs),
        plain_verbs=frozenset(plain),
        sources=frozenset(pure_sources),
        targets=frozenset(pure_targets),
        than_objects=frozenset(than),
        numbers=frozenset(numbers),
        entities=frozenset(entities),
        content=_content(normalized),
        frame=_frame(normalized),
        symbols=frozenset(c for c in text if unicodedata.category(c) == "So"),
    )


def _variant(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """One word against one word that is a form of it ("dict" / "dictionary", "convert" / "conversion")."""
    if len(a) != 1 or len(b) != 1:
        return False
    x, y = sorted((a[0], b[0]), key=len)
    prefix = len(os.path.commonprefix([x, y]))
    return y.startswith(x) or prefix >= max(4, 0.7 * len(x))


MINIMAL_PAIR_MAX_MIDDLE = 64  # content words between the common head and tail that difflib aligns


def minimal_pair(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two questions worded alike except for a word or two swapped in place.

    That is how contrasting questions are made: "boil an egg for a soft / hard yolk", "the daily / weekly
    limit", "convert grams to cups / cups to grams", "if I fail / pass". The swapped words are often
    antonyms or co-hyponyms, which embeddings place close together, and no word list can name them all;
    a synonym swap ("merge / combine two dicts") looks the same, so it is turned down too (one generation
    instead of a wrong answer). Words only added on one side ("my router" / "my wireless router") and
    another form of the same word ("convert" / "conversion") are not a swap; moved words are. The guard
    counts a minimal pair as a contrast only when the frames match too (`frame_words`).
    """
    if abs(len(a) - len(b)) > 2:  # at most two words differ on either side
        return False
    # the common head and tail are shared as they are; difflib (quadratic) sees only the middle, which a
    # word or two swapped keeps short: a 10,000-word prompt took 7.5 s a guard check on the whole of it
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    middle_a, middle_b = a[head : len(a) - tail], b[head : len(b) - tail]
    if max(len(middle_a), len(middle_b)) > MINIMAL_PAIR_MAX_MIDDLE:
        return False  # swaps that far apart are not one slot of a template
    shared, only_a, only_b = head + tail, 0, 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, middle_a, middle_b, autojunk=False).get_opcodes():
        if op == "equal":
            shared += i2 - i1
        elif not (op == "replace" and _variant(middle_a[i1:i2], middle_b[j1:j2])):
            only_a, only_b = only_a + i2 - i1, only_b + j2 - j1
    return shared >= 2 and 0 < only_a <= 2 and 0 < only_b <= 2


def content_overlap(a: QuestionFeatures, b: QuestionFeatures) -> float:
    """Jaccard overlap of the two questions' content words (1.0 when neither has any)."""
    sa, sb = set(a.content), set(b.content)
    union = sa | sb
    return len(sa & sb) / len(union) if union else 1.0


class QuestionGuard:
    """Decides whether two similar questions may share an answer (see the module docstring)."""

    def check(self, a: QuestionFeatures, b: QuestionFeatures) -> GuardVerdict:
        if a.negated != b.negated:
            return GuardVerdict(False, "negation")
        if a.excepted != b.excepted:
            return GuardVerdict(False, "exception")
        if a.aspects != b.aspects:
            return GuardVerdict(False, "aspect:" + ",".join(sorted(a.aspects ^ b.aspects)))
        for axis, (pa, ma), (pb, mb) in zip(AXES, a.poles, b.poles):
            a_dir = (bool(pa), bool(ma))
            b_dir = (bool(pb), bool(mb))
            if a_dir == b_dir:
                continue
            if axis.strict or (any(a_dir) and any(b_dir)):
                return GuardVerdict(False, f"direction:{axis.name}")
        if (a.un_verbs & b.plain_verbs - b.un_verbs) or (b.un_verbs & a.plain_verbs - a.un_verbs):
            return GuardVerdict(False, "reversal:un-verb")
        if (a.sources & b.targets) or (a.targets & b.sources):
            return GuardVerdict(False, "reversal:from-to")
        # "X faster than Y" vs "Y faster than X": one side's than-object appears on the other side elsewhere
        if ((a.than_objects - b.than_objects) & b.words) or ((b.than_objects - a.than_objects) & a.words):
            return GuardVerdict(False, "reversal:than")
        if a.numbers != b.numbers:  # "question 0" / "question 2": another value, never overruled
            return GuardVerdict(False, "numbers" if not (a.numbers and b.numbers) else "values")
        if a.symbols != b.symbols:  # "what does 👍 mean" / "what does 👎 mean" normalise alike
            return GuardVerdict(False, "symbols")
        missing = {e for e in a.entities if e not in b.words} | {e for e in b.entities if e not in a.words}
        if missing:
            return GuardVerdict(False, "entities")
        if minimal_pair(a.content, b.content) and a.frame == b.frame:
            return GuardVerdict(False, "contrast:swapped-words")
        return GuardVerdict(True)

    def compatible(self, a: str, b: str) -> GuardVerdict:
        return self.check(extract_features(a), extract_features(b))


# ---------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------


T = TypeVar("T")


@dataclass
class SemanticCacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0  # Redis unreachable/slow/failing, or skipped while the breaker is open
    corrupt: int = 0  # entries that failed validation (deleted)
    incomplete: int = 0  # entries with one of their two values gone (a bounded Redis evicted it): deleted
    uncacheable: int = 0  # temperature > 0 without a seed; a prompt with an empty normal form
    too_long: int = 0  # stores and lookups of prompts longer than the embedder's window: not compared
    guard_rejections: int = 0  # candidates above the threshold that the guard or signature turned down
    low_band_rejections: int = 0  # lower-band candidates turned down without scoring (overlap rule, too
    # few entries for the verifier, or past its top-k)
    verifier_rejections: int = 0  # lower-band candidates the verifier scored below its cut
    pair_rejections: int = 0  # would-be hits the pair classifier scored below its cut (or past its top-k)
    pair_errors: int = 0  # lookups whose pair classifier raised: a miss
    embed_errors: int = 0  # lookups whose embedding raised (a failed MiniLM pass): a miss
    guard_overrules: int = 0  # candidates the guard turned down and the pair classifier let through
    shorter: int = 0  # misses on a best match that stopped at a smaller max_tokens (counted in misses too)
    kept: int = 0  # stores that kept the entry already there, which served more budgets, and renewed it
    stores: int = 0
    evictions: int = 0  # entries a store deleted for the tenant's bound (`max_entries_per_tenant`)
    expired: int = 0  # entries past their TTL a store deleted: never served again, no eviction


@dataclass(frozen=True)
class SemanticHit:
    prompt: str  # the stored question that matched
    answer: ExactAnswer  # its answer for the request's max_tokens (`ExactAnswer.within`): generated ids only
    score: float  # cosine similarity
    entry_id: str
    band: str = "high"  # "verified" / "low": accepted below `threshold` by the verifier / overlap rule


@dataclass(frozen=True)
class _HeldAnswer:
    """An entry's answer as a tenant's matrix holds it in memory: its ids as int32, since a tuple of Python
    ints takes ~9x the bytes of the text entries held before (18.6 against 2.1 MB per 1,000 answers of 512
    tokens) and a replica keeps up to 64 tenants of up to 10,000 entries; an `ExactAnswer` again when
    served."""

    ids: np.ndarray
    trim: int
    final: bool
    sent: int

    @classmethod
    def of(cls, answer: ExactAnswer) -> _HeldAnswer:
        return cls(np.asarray(answer.ids, dtype=np.int32), answer.trim, answer.final, answer.sent)

    def exact(self) -> ExactAnswer:
        return ExactAnswer(tuple(self.ids.tolist()), self.trim, self.final, self.sent)


@dataclass
class _TenantMatrix:
    version: bytes | None
    ids: list[str]
    prompts: list[str]
    answers: list[_HeldAnswer]
    sigs: list[str]
    written: np.ndarray  # when each entry was last written: its score in the age set
    matrix: np.ndarray  # (n, dim) float32, unit rows
    features: dict[int, QuestionFeatures] = field(default_factory=dict)  # filled lazily
    sig_masks: dict[str, np.ndarray] = field(default_factory=dict)  # signature -> rows with it
    rows: dict[str, int] = field(default_factory=dict)  # entry id -> row, built on first use
    # per row, a digest of its id, embedding and document bytes: the next read re-validates only entries
    # whose bytes changed (validation is a function of them; ~0.3 ms an entry, seconds at 10,000)
    digests: list[bytes] = field(default_factory=list)

    def row_of(self, entry_id: str) -> int | None:
        if not self.rows and self.ids:
            self.rows = {entry: i for i, entry in enumerate(self.ids)}
        return self.rows.get(entry_id)


@dataclass(frozen=True)
class _Record:
    """An entry's document, checked."""

    prompt: str
    answer: ExactAnswer
    sig: str


class _Query:
    """The query's guard features and normal form, computed once and only when a candidate needs them."""

    def __init__(self, prompt: str, normalized: str | None = None):
        self.prompt = prompt
        self._features: QuestionFeatures | None = None
        self._normalized = normalized

    @property
    def features(self) -> QuestionFeatures:
        if self._features is None:
            self._features = extract_features(self.prompt)
        return self._features

    @property
    def normalized(self) -> str:
        if self._normalized is None:
            self._normalized = normalize_question(self.prompt)
        return self._normalized


_GUARD = QuestionGuard()


def _entry_digest(raw_id: bytes | str, emb: bytes, raw_doc: bytes) -> bytes:
    """What an entry's validation depends on besides the tenant and the cache: its id and its two values."""
    h = hashlib.blake2b(digest_size=16)
    for part in (raw_id.encode() if isinstance(raw_id, str) else raw_id, emb, raw_doc):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _folded(text: str) -> str:
    return " ".join(text.lower().split())


class Candidate:
    """One eligible stored entry for a query: its cosine, its margin over the best other eligible entry,
    and (lazily) the guard's verdict and the verifier's features."""

    __slots__ = ("index", "score", "margin", "query", "matrix", "_verdict", "_x", "_pair")

    def __init__(self, index: int, score: float, margin: float, query: _Query, matrix: _TenantMatrix):
        self.index, self.score, self.margin, self.query, self.matrix = index, score, margin, query, matrix
        self._verdict: GuardVerdict | None = None
        self._x: np.ndarray | None = None
        self._pair: float | None = None

    @property
    def prompt(self) -> str:
        return self.matrix.prompts[self.index]

    def entry_features(self) -> QuestionFeatures:
        feats = self.matrix.features.get(self.index)
        if feats is None:
            feats = self.matrix.features[self.index] = extract_features(self.prompt)
        return feats

    def verdict(self) -> GuardVerdict:
        if self._verdict is None:
            self._verdict = _GUARD.check(self.query.features, self.entry_features())
        return self._verdict

    def features(self) -> np.ndarray:
        if self._x is None:
            self._x = pair_features(
                self.score,
                self.margin,
                self.query.features.content,
                self.entry_features().content,
                self.query.normalized,
                normalize_question(self.prompt),
            )
        return self._x

    def same_text(self) -> bool:
        """The stored question is the query up to case and spacing: served without the model."""
        return _folded(self.prompt) == _folded(self.query.prompt)

    def pair_probability(self, classifier: PairClassifier) -> float:
        """The cross-encoder's probability that the stored question's answer serves the query."""
        if self._pair is None:
            score_pairs([self], classifier)
        return self._pair


def score_pairs(cands: list[Candidate], classifier: PairClassifier) -> None:
    """Fills in the pair probability of the candidates that have none, in one classifier pass: a pass over
    two pairs costs about what one does (17.0 against 16.8 ms on 2 CPU threads). The same text up to case
    and spacing is 1 without the model; not up to ``normalize_question``, which drops operators and signs:
    "What is 2*3?" and "What is 2/3?" have one normal form."""
    need = []
    for cand in cands:
        if cand._pair is None:
            if cand.same_text():
                cand._pair = 1.0
            else:
                need.append(cand)
    if need:
        probabilities = classifier.probability([(cand.prompt, cand.query.prompt) for cand in need])
        for cand, probability in zip(need, probabilities):
            cand._pair = float(probability)


@dataclass(frozen=True)
class PairCheck:
    """The last check on a would-be hit (cache/pair_classifier.py): a candidate the guard, the bands and
    the verifier would serve is served only at ``probability >= min_probability``; a rejected one passes
    the turn to the next candidate. It may also overrule the guard: a candidate the guard turned down for
    a reason in ``overrules`` (its part before ":", e.g. "entities") goes on as if it had passed when the
    model gives it at least ``overrule_min``. The guard's word rules also turn down rewordings ("Mac" /
    "MacBook", a synonym in the same frame) that the model, reading both questions, tells apart. At most
    ``max_scored`` model passes per lookup, each of at most two candidates (the one judged and the next it
    may judge: ``_PairScorer.judge``), which bounds a lookup's cost."""

    classifier: PairClassifier
    min_probability: float = DEFAULT_PAIR_MIN
    max_scored: int = PAIR_TOP_K
    overrules: tuple[str, ...] = DEFAULT_OVERRULES
    overrule_min: float = DEFAULT_OVERRULE_MIN

    def __post_init__(self):
        if not 0.0 <= self.min_probability <= 1.0 or self.max_scored < 1:
            raise ValueError("pair check: min_probability in [0, 1] and max_scored >= 1")
        if not 0.0 <= self.overrule_min <= 1.0:
            raise ValueError("pair check: overrule_min in [0, 1]")

    def may_overrule(self, reason: str) -> bool:
        return reason.split(":", 1)[0] in self.overrules


class _PairScorer:
    """One lookup's use of the pair check, within its budget of ``max_scored`` model runs."""

    def __init__(self, check: PairCheck, count):
        self.check, self.count, self.used = check, count, 0

    def judge(self, cand: Candidate, cut: float, after: Sequence[Candidate] = (), floor: float = 0.0) -> str:
        """ "yes" (probability >= cut), "no", "spent" (the budget is used up: not run) or "error" (the model
        raised; counted and logged: a cache must never fail a request, so the lookup is a miss). With budget
        left, the next candidate of ``after`` this lookup may score (at ``floor`` or above, past the guard
        or one it may overrule) is scored in the same pass: when this one is turned down, the next costs
        no second pass."""
        if self.used >= self.check.max_scored:
            return "spent"
        self.used += 1
        try:
            together = [cand]
            if cand._pair is None and self.used < self.check.max_scored and not cand.same_text():
                later = next((c for c in after if c.score < floor or self._may_score(c)), None)
                together += [later] if later is not None and later.score >= floor else []
            score_pairs(together, self.check.classifier)
            probability = cand.pair_probability(self.check.classifier)
        except Exception:
            logger.exception("semantic cache: the pair classifier failed; served as a miss")
            self.count("pair_errors")
            return "error"
        return "yes" if probability >= cut else "no"

    def _may_score(self, cand: Candidate) -> bool:
        verdict = cand.verdict()
        return verdict.ok or self.check.may_overrule(verdict.reason)


def select(
    candidates,
    high: float,
    low: float,
    verifier: Verifier | None,
    n_eligible: int,
    use_guard: bool = True,
    count=lambda name, n=1: None,
    pair_check: PairCheck | None = None,
) -> tuple[Candidate, str] | None:
    """The lookup decision over candidates in descending cosine: the first one that passes the guard and
    has cosine >= ``high`` ("high"), or lies in [``low``, ``high``) and is accepted by the verifier
    ("verified"; only the first ``VERIFIER_TOP_K`` band candidates are scored, and only when the tenant
    has at least ``verifier.min_entries`` eligible entries) or, without a verifier, shares at most
    ``LOW_BAND_MAX_OVERLAP`` of its content words ("low"). With ``pair_check``, a candidate chosen so is
    served only if the pair classifier accepts it too (``PairCheck``). ``use_guard=False`` (ablation):
    ``high`` only."""
    scored = 0
    scorer = None if pair_check is None else _PairScorer(pair_check, count)
    candidates = list(candidates)
    floor = min(low, high)
    for position, cand in enumerate(candidates):
        if not use_guard:
            if cand.score >= high:
                return cand, "high"
            continue
        if cand.score < floor:
            break
        overruled = False
        if not cand.verdict().ok:
            judged = "no"
            if scorer is not None and pair_check.may_overrule(cand.verdict().reason):
                # never a lower cut than a candidate the guard passed must reach
                cut = max(pair_check.overrule_min, pair_check.min_probability)
                judged = scorer.judge(cand, cut, candidates[position + 1 :], floor)
            if judged == "error":
                return None
            if judged != "yes":
                count("guard_rejections")
                continue
            count("guard_overrules")
            overruled = True
        if cand.score >= high:
            band = "high"
        elif verifier is not None:
            if n_eligible < verifier.min_entries or scored >= VERIFIER_TOP_K:
                count("low_band_rejections")
                continue
            scored += 1
            if not verifier.accepts(cand.features()):
                count("verifier_rejections")
                continue
            band = "verified"
        elif content_overlap(cand.query.features, cand.entry_features()) > LOW_BAND_MAX_OVERLAP:
            count("low_band_rejections")
            continue
        else:
            band = "low"
        if scorer is None or overruled:  # an overruled candidate was scored above the higher cut
            return cand, band
        judged = scorer.judge(cand, pair_check.min_probability, candidates[position + 1 :], floor)
        if judged in ("yes", "error"):
            return (cand, band) if judged == "yes" else None
        count("pair_rejections")
        if judged == "spent":
            break
    return None


class SemanticResponseCache(RedisCacheBase):
    def __init__(
        self,
        redis_url: str,
        fingerprint: str,
        embedder: Embedder,
        threshold: float = DEFAULT_THRESHOLD,
        low_threshold: float | None = None,
        max_entries_per_tenant: int = 10000,
        ttl_s: int = 86400,
        timeout_s: float = 0.1,
        use_guard: bool = True,
        max_cached_tenants: int = 64,
        dim: int = 384,
        breaker: CircuitBreaker | None = None,
        verifier: Verifier | None | str = "default",
        pair_check: PairCheck | None = None,
        recent_vectors: int = 1024,
        device: str = "cpu",
    ):
        """``use_guard=False`` exists for the benchmark's ablation only; never serve without it (the
        lower band needs the guard, so without it only ``threshold`` counts).

        ``verifier``: "default" loads the shipped weights (``cache/semantic_verifier.json``; if they are
        missing or of another version the band falls back to the overlap rule); None disables it.
        ``low_threshold`` None: the verifier's own band bottom, or ``threshold`` (band closed) without one.
        ``pair_check``: the cross-encoder every would-be hit must also pass (``PairCheck``); None serves on
        the cosine, guard and verifier alone. ``recent_vectors``: how many (tenant, prompt) vectors are
        kept so that a missed prompt's store reuses its lookup's (``cache/embed_memo.py``); 0: none.
        ``device``: the engine's, whose generator a seeded answer drew from (`sampling_signature`)."""
        super().__init__(redis_url, timeout_s, breaker, SemanticCacheStats())
        self.rng = rng_device(device)
        self.recent = RecentVectors(recent_vectors) if recent_vectors else None
        self.last_embed_error: str | None = None
        self.fingerprint = fingerprint
        self.embedder = embedder
        self.threshold = float(threshold)
        if verifier == "default":
            try:
                verifier = Verifier.load(DEFAULT_WEIGHTS)
            except (OSError, ValueError) as exc:
                logger.warning("semantic cache: verifier weights not loaded (%s); lower band closed", exc)
                verifier = None
        self.verifier: Verifier | None = verifier
        self.pair_check = pair_check
        if low_threshold is None:
            low_threshold = verifier.low_threshold if verifier is not None else self.threshold
        self.low_threshold = min(float(low_threshold), self.threshold)
        self.max_entries = int(max_entries_per_tenant)
        self.ttl_s = redis_ttl(ttl_s)
        self.use_guard = use_guard
        self.dim = dim
        self.guard = QuestionGuard()
        self._store_script = self.client.register_script(_STORE_SCRIPT)
        self._delete_script = self.client.register_script(_DELETE_SCRIPT)
        self._matrices: OrderedDict[str, _TenantMatrix] = OrderedDict()
        self._max_cached_tenants = max_cached_tenants

    @property
    def embedder(self) -> Embedder:
        return self._embedder

    @embedder.setter
    def embedder(self, embedder: Embedder) -> None:
        """Another embedder (the benchmark swaps them) starts with no recent vectors: they were its
        predecessor's; one of another identity reads and writes under its own keys (`embedder_tag`), and
        the matrices read under the old ones are dropped."""
        space = f"{self.fingerprint}:{embedder_tag(embedder)}"
        with self._lock:
            if space != getattr(self, "_space", space):
                self._matrices.clear()
            self._space = space
            self._embedder = embedder
        if self.recent is not None:
            self.recent.clear()

    def snapshot(self) -> dict[str, int]:
        """The cache's counters and, as ``embed_<name>``, the embedder's when it keeps any (a
        ``CoalescingEmbedder``'s passes and texts: how many lookups each forward pass served); as
        ``pair_model_<name>``, the pair classifier's the same way (``pair_model_texts``: pairs scored)."""
        counters = super().snapshot()
        embedder_counters = getattr(self.embedder, "snapshot", None)
        if callable(embedder_counters):  # its `errors` (failed passes) is not ours (lookups that missed)
            renamed = {"errors": "failed_passes"}
            counters.update({f"embed_{renamed.get(k, k)}": v for k, v in embedder_counters().items()})
        if self.recent is not None:
            counters.update({f"embed_recent_{name}": value for name, value in self.recent.snapshot().items()})
        classifier_counters = getattr(getattr(self.pair_check, "classifier", None), "snapshot", None)
        if callable(classifier_counters):  # a CoalescingPairClassifier's: how many lookups a pass served
            counters.update({f"pair_model_{name}": value for name, value in classifier_counters().items()})
        return counters

    # -- keys and records ------------------------------------------------------------------------

    def _keys(self, tenant: str) -> list[str]:
        # one hash tag per (model, embedder, tenant): the store/delete scripts touch all four keys, which
        # Redis Cluster allows only within one slot
        p = f"{KEY_PREFIX}:{{{self._space}:{tenant_tag(tenant)}}}"
        return [f"{p}:emb", f"{p}:doc", f"{p}:age", f"{p}:ver"]

    def signature(self, params: EngineRequestParams, variant: str = "") -> str:
        """Parameters that change the completion but `max_tokens`, which is checked against the entry
        (`exact_signature`, with this engine's device type for a sampled request), and the prompt's
        `variant`: what its text leaves out but must match too (its special tokens: the caller's)."""
        sig = exact_signature(params, rng=self.rng)
        if variant:
            sig["variant"] = variant
        return hashlib.sha256(canonical_json(sig)).hexdigest()[:32]

    @staticmethod
    def entry_id(sig: str, prompt: str) -> str:
        """A prompt's own entry under a signature: a store of the same prompt writes over it."""
        return hashlib.sha256(canonical_json([sig, prompt])).hexdigest()[:24]

    @staticmethod
    def _checksum(entry_id: str, tenant: str, prompt: str, answer: ExactAnswer, sig: str, emb: bytes) -> str:
        head = canonical_json([entry_id, tenant, prompt, answer.document(), sig])
        return sha256_hex(head, emb)

    # -- public API ------------------------------------------------------------------------------

    def store(
        self,
        prompt: str,
        tenant: str,
        params: EngineRequestParams,
        answer: ExactAnswer,
        embedding: np.ndarray | None = None,
        variant: str = "",
    ) -> bool:
        """Keep `answer` for `prompt` and its paraphrases; False when not written. An answer that is not
        final leaves an entry of the same prompt and signature that serves more budgets in its place,
        renewed (`kept`; see ``_STORE_SCRIPT``): a warmup run with a small `max_tokens` or a write after a
        failed lookup does not cut clients' answers down."""
        if not is_deterministic(params) or not utf8_encodable(prompt):  # a lone surrogate: no key
            self._count("uncacheable")
            return False
        normalized = self._guard_embedder(lambda: self._within_window(prompt))
        if normalized is None:
            return False
        if embedding is not None:
            vec = self._normalize(embedding)
        elif (vec := self._guard_embedder(lambda: self._embed(normalized, tenant))) is None:
            return False
        if not self._may_write():  # after what may raise: a call the breaker allowed must report back
            return False
        emb = vec.astype("<f4").tobytes()
        sig = self.signature(params, variant)
        entry_id = self.entry_id(sig, prompt)
        written = round(time.time(), 3)
        doc = {
            "v": FORMAT_VERSION,
            "tenant": tenant,
            "prompt": prompt,
            "answer": answer.document(),
            "sig": sig,
            "sum": self._checksum(entry_id, tenant, prompt, answer, sig, emb),
        }
        try:
            evicted, kept, expired = self._store_script(
                keys=self._keys(tenant),
                args=[
                    entry_id,
                    emb,
                    canonical_json(doc),
                    written,
                    self.ttl_s,
                    self.max_entries,
                    written - self.ttl_s,
                    MAX_TRIM_PER_WRITE,
                    int(answer.final),
                    len(answer.ids),
                    FORMAT_VERSION,
                ],
            )
        except self._redis_errors as exc:
            if is_wrong_type(exc):  # one of the tenant's keys holds a bad value: all four are deleted
                self._read_failed(exc, self._keys(tenant))
            else:
                self._write_failed(exc)
            return False
        self.breaker.record_success()
        self._count("kept" if kept else "stores")
        self._count("evictions", int(evicted or 0))
        self._count("expired", int(expired or 0))
        return not kept

    def lookup(
        self,
        prompt: str,
        tenant: str,
        params: EngineRequestParams,
        embedding: np.ndarray | None = None,
        threshold: float | None = None,
        low_threshold: float | None = None,
        variant: str = "",
    ) -> SemanticHit | None:
        """The best entry of this tenant with the same signature that passes the guard and either has
        cosine >= threshold or, in the lower band [low_threshold, threshold), is accepted by the verifier
        (or, without one, shares few content words): see ``select``; its answer for `params.max_tokens`
        (`ExactAnswer.within`). When that entry stopped at a smaller budget without ending, the lookup is
        a miss (`shorter`): no lower-ranked entry is served instead, since the best match is the one the
        thresholds were tuned to trust, and which stored question answers a prompt must not depend on how
        many tokens the client asked for. The answer computed then is stored for this prompt.

        ``embedding``, when given, is the query's embedding as ``embed_queries`` makes it; ``variant``: as
        for ``store``, only entries stored with the same one compare."""
        ranked = self._ranked(prompt, tenant, params, embedding, threshold, low_threshold, variant)
        if ranked is None:
            return None
        candidates, n_eligible, high, low = ranked
        chosen = select(
            candidates,
            high,
            low,
            self.verifier if self.use_guard else None,
            n_eligible,
            self.use_guard,
            self._count,
            self.pair_check if self.use_guard else None,
        )
        if chosen is None:
            self._count("misses")
            return None
        cand, band = chosen
        tm = cand.matrix
        answer = tm.answers[cand.index].exact().within(params.max_tokens)
        if answer is None:
            self._count("misses")
            self._count("shorter")
            return None
        self._count("hits")
        return SemanticHit(tm.prompts[cand.index], answer, cand.score, tm.ids[cand.index], band)

    def candidates(
        self,
        prompt: str,
        tenant: str,
        params: EngineRequestParams,
        embedding: np.ndarray | None = None,
        low_threshold: float = 0.0,
    ) -> tuple[list[Candidate], int]:
        """Every eligible entry at or above ``low_threshold`` in the order ``lookup`` sees them, guard
        verdicts and verifier features filled in, and the number of eligible entries: what the benchmark
        replays through ``select`` for many settings without a lookup each."""
        ranked = self._ranked(prompt, tenant, params, embedding, 1.0, low_threshold)
        if ranked is None:
            return [], 0
        cands = list(ranked[0])
        for c in cands:
            c.verdict(), c.features()
        return cands, ranked[1]

    def _guard_embedder(self, call: Callable[[], T]) -> T | None:
        """The embedder's answer, or None (a miss, counted) when it raised: a failed MiniLM pass (out of
        memory; the coalescer's EmbeddingFailed for every caller of that pass) must cost a lookup, as a
        failing Redis does, never the request its answer."""
        try:
            return call()
        except Exception as exc:
            self._count("embed_errors")
            self.last_embed_error = f"{type(exc).__name__}: {exc}"
            return None

    def _ranked(self, prompt, tenant, params, embedding, threshold, low_threshold, variant=""):
        if not is_deterministic(params) or not utf8_encodable(prompt):  # as `store` turns them away
            self._count("uncacheable")
            return None
        normalized = self._guard_embedder(lambda: self._within_window(prompt))
        if normalized is None:
            return None
        if not self.breaker.allow():
            self._count("errors")
            return None
        tm = self._tenant_matrix(tenant)
        if tm is None:
            return None
        if not tm.ids:
            return iter(()), 0, 1.0, 1.0
        if embedding is not None:
            vec = self._normalize(embedding)
        elif (vec := self._guard_embedder(lambda: self._embed(normalized, tenant))) is None:
            return None
        high = self.threshold if threshold is None else float(threshold)
        low = self.low_threshold if low_threshold is None else float(low_threshold)
        limit = min(low, high) if self.use_guard else high
        scores = tm.matrix @ vec
        sig = self.signature(params, variant)
        mask = tm.sig_masks.get(sig)
        if mask is None:
            mask = np.fromiter((s == sig for s in tm.sigs), bool, len(tm.sigs))
            if len(tm.sig_masks) >= MAX_SIG_MASKS:  # signatures are the clients' (seeds, stop strings)
                tm.sig_masks.clear()
            tm.sig_masks[sig] = mask
        eligible = mask & (tm.written >= time.time() - self.ttl_s)
        n_eligible = int(eligible.sum())
        masked = np.where(eligible, scores, -np.inf)
        top2 = np.argsort(-masked)[:2]
        order = [int(i) for i in np.argsort(-masked) if masked[i] >= limit]
        own = tm.row_of(self.entry_id(sig, prompt))
        if own is not None and own in order:
            # the prompt's own answer first: prompts that normalise alike embed alike, so its equals tie with
            # it at the top, in an order that differs between processes, and the best match decides the
            # budget (an equal that stopped short would be a miss where the prompt's own answer serves)
            order.remove(own)
            order.insert(0, own)
        query = _Query(prompt, normalized)

        def gen():
            for i in order:
                if i == top2[0]:
                    other = masked[top2[1]] if len(top2) > 1 else -np.inf
                else:
                    other = masked[top2[0]]
                yield Candidate(i, float(scores[i]), float(scores[i] - other), query, tm)

        return gen(), n_eligible, high, low

    # -- internals -------------------------------------------------------------------------------

    def embed_queries(self, texts: list[str]) -> np.ndarray:
        """Unit embeddings of the normalised texts (``normalize_question``): what store/lookup compare."""
        vecs = np.asarray(self.embedder.embed([normalize_question(t) for t in texts]), dtype=np.float32)
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        return vecs / np.where(norms > 0, norms, 1.0)

    def _embed(self, normalized: str, tenant: str) -> np.ndarray:
        """The unit embedding of a text already in normal form (`normalize_question`), kept a while for
        the tenant: a missed lookup's store follows it."""
        if self.recent is not None and (vec := self.recent.get(tenant, normalized)) is not None:
            return vec
        vec = self._normalize(self.embedder.embed([normalized])[0])
        if self.recent is not None:
            self.recent.put(tenant, normalized, vec)
        return vec

    def _within_window(self, prompt: str) -> str | None:
        """The prompt's normal form, which is what gets embedded, or None when it is past the embedder's
        window: neither stored nor looked up then, since its vector is its head's and a long document
        with another question at its end would match at cosine 1.0 (the guard's word checks are no match
        for a document). The exact cache still serves it."""
        normalized = normalize_question(prompt)
        if not normalized:  # a greeting, a preamble or punctuation only: every such prompt embeds as ""
            self._count("uncacheable")
            return None
        if self.embedder.fits([normalized])[0]:
            return normalized
        self._count("too_long")
        return None

    def _normalize(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise ValueError(f"embedding has {v.shape[0]} dimensions, this cache holds {self.dim}")
        n = float(np.linalg.norm(v))
        return v / n if n > 0 else v

    def _tenant_matrix(self, tenant: str) -> _TenantMatrix | None:
        """The tenant's entries, from memory when Redis's version stamp has not moved; None on errors."""
        keys = self._keys(tenant)
        try:
            version = self.client.get(keys[3])
        except self._redis_errors as exc:
            return self._read_failed(exc, keys)
        with self._lock:
            cached = self._matrices.get(tenant)
            previous = cached
            # a copy read with no stamp in Redis is reused only while it is empty: entries read then
            # could be erased and the stamp missing again, which would look unchanged
            if cached is not None and cached.version == version and (version is not None or not cached.ids):
                self._matrices.move_to_end(tenant)
                self.breaker.record_success()
                return cached
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.get(keys[3])
                pipe.hgetall(keys[0])
                pipe.hgetall(keys[1])
                pipe.zrange(keys[2], 0, -1, withscores=True)
                version, embs, docs, ages = pipe.execute()
        except self._redis_errors as exc:
            return self._read_failed(exc, keys)
        self.breaker.record_success()
        tm, bad, incomplete = self._build_matrix(tenant, version, embs, docs, dict(ages), previous)
        if bad:
            try:
                stamp = int(self._delete_script(keys=keys, args=[version or b"", *bad]))
            except self._redis_errors as exc:  # refused by a read-only replica: not a Redis failure
                self._write_failed(exc)
                stamp = 0
            if stamp:  # deleted: counted once (a refused delete is found, and counted, by the next read)
                self._count("incomplete", incomplete)
                self._count("corrupt", len(bad) - incomplete)
            tm.version = str(stamp).encode() if stamp > 0 else None  # None: re-read next time
        with self._lock:
            self._matrices[tenant] = tm
            self._matrices.move_to_end(tenant)
            while len(self._matrices) > self._max_cached_tenants:
                self._matrices.popitem(last=False)
        return tm

    def _read_failed(self, exc: BaseException, keys: list[str]) -> None:
        """A tenant's keys that hold another type (WRONGTYPE, or a stamp that is not an integer) are bad
        values under our names: deleted and counted as corrupt, as one entry is, whether a read or a store
        met them; any other error is a Redis failure for the breaker."""
        if not is_wrong_type(exc):
            self._fail()
            return None
        self.breaker.record_success()  # Redis answered
        self._count("corrupt")
        try:
            self.client.delete(*keys)
        except self._redis_errors as exc:
            self._write_failed(exc)
        return None

    def _build_matrix(
        self,
        tenant: str,
        version: bytes | None,
        embs: dict,
        docs: dict,
        ages: dict,
        previous: _TenantMatrix | None = None,
    ) -> tuple[_TenantMatrix, list[bytes | str], int]:
        """The tenant's entries, the ids of those to delete (as Redis names them: a field name that is not
        UTF-8 is deleted by its bytes), and how many of these had lost some of their three values (the
        embedding, the document or the age: a bounded Redis evicts keys, not entries)."""
        ids, prompts, answers, sigs, written, rows, bad, digests = [], [], [], [], [], [], [], []
        incomplete = 0
        known = {} if previous is None else {d: i for i, d in enumerate(previous.digests)}
        for raw_id in set(embs) | set(docs) | set(ages):
            entry_id = raw_id.decode("utf-8", "replace") if isinstance(raw_id, bytes) else str(raw_id)
            emb, raw_doc, age = embs.get(raw_id), docs.get(raw_id), ages.get(raw_id)
            if age is None or emb is None or raw_doc is None:
                bad.append(raw_id)
                incomplete += 1
                continue
            digest = _entry_digest(raw_id, emb, raw_doc)
            row = known.get(digest)
            if row is not None:  # the same bytes validated before (same tenant, same cache): the same entry
                entry = previous.prompts[row], previous.answers[row], previous.sigs[row], previous.matrix[row]
            elif (record := self._validate(entry_id, tenant, emb, raw_doc)) is not None:
                entry = record.prompt, _HeldAnswer.of(record.answer), record.sig, np.frombuffer(emb, "<f4")
            else:
                bad.append(raw_id)
                continue
            prompt, answer, sig, vec = entry
            ids.append(entry_id)
            prompts.append(prompt)
            answers.append(answer)
            sigs.append(sig)
            rows.append(vec)
            written.append(float(age))
            digests.append(digest)
        matrix = np.stack(rows).astype(np.float32) if rows else np.zeros((0, self.dim), np.float32)
        tm = _TenantMatrix(version, ids, prompts, answers, sigs, np.asarray(written, np.float64), matrix)
        tm.digests = digests
        return tm, bad, incomplete

    def _validate(
        self, entry_id: str, tenant: str, emb: bytes | None, raw_doc: bytes | None
    ) -> _Record | None:
        """The entry, or None unless it is one this cache wrote for this tenant: shape as well as checksum
        (`ExactAnswer.from_document`), since a checksum is no signature and a hit's ids go to the
        detokenizer as they come."""
        if emb is None or raw_doc is None or len(emb) != self.dim * 4:
            return None
        doc = load_json_object(raw_doc)
        if doc is None or doc.get("v") != FORMAT_VERSION or doc.get("tenant") != tenant:
            return None
        prompt, sig, answer = doc.get("prompt"), doc.get("sig"), ExactAnswer.from_document(doc.get("answer"))
        if not (isinstance(prompt, str) and isinstance(sig, str)) or answer is None:
            return None
        expected = self._checksum(entry_id, tenant, prompt, answer, sig, emb)
        if doc.get("sum") != expected or not np.all(np.isfinite(np.frombuffer(emb, dtype="<f4"))):
            return None
        return _Record(prompt, answer, sig)
