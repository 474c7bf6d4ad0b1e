"""Exact response cache in Redis: the same prompt tokens with the same sampling give the same text.

Only deterministic requests are cacheable (greedy, or sampled with an explicit seed): a cached answer
to a request that asked for randomness would silently take the randomness away.

The key is SHA-256 over a canonical JSON document of the model fingerprint, the tenant and every
parameter that changes the generated text (for a sampled request, the engine's device type too: a CPU
and a CUDA generator draw apart for one seed), then the prompt token ids packed as little-endian int64, so
two processes (or machines) with the same model compute the same key, and tenants never share an entry.
`max_tokens` is checked against the entry instead of hashed: it does not change the tokens, only where
they stop. An entry holds the answer's token ids and whether it is final (EOS, a stop string or the
model's sequence limit ended it): it serves a request allowed fewer tokens with its first ones, and one
allowed more only when final (`ExactAnswer.within`). A warmup answer of 512 tokens then serves every
client's budget up to 512, and every budget at all if final; keyed by budget, it served only clients
asking exactly 512. A write keeps an entry that serves more budgets than it would, in one atomic script.

Values are JSON with a format version and a checksum over (key, answer): never pickle, since Redis is a
shared store and unpickling its bytes would run whatever someone put there. A value that fails the
check (bit rot, truncation, a value copied under another tenant's key) is deleted and counted.

Redis trouble never reaches the caller: short socket timeouts, no retries, and a circuit breaker that
skips Redis for a while after consecutive failures, so a dead Redis costs a request nothing.

Every SET is announced on the namespace's channel (cache/key_directory.py); with a `KeyDirectory`, a
key no replica has written is a miss without a round trip, so uncached requests pay no GET.

A tenant quota (`tenant_max_entries`, off by default) keeps each tenant's answers in a sorted set of its
own, trimmed in the write's round trip: past the quota the tenant's least recently used answers go, so
a bounded Redis (`volatile-lru`) is not emptied of every other tenant's answers by one tenant's.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cache.circuit_breaker import CircuitBreaker
from cache.redis_full import FullGate
from cache.wrong_type import DELETE_IF_UNCHANGED, DROP_OTHER_TYPE, is_wrong_type
from cache.key_directory import INDEX_DROPPED, KeyDirectory, adds_stamp, Setter, renew_listed, write_announced
from scheduler.messages import EngineRequestParams

FORMAT_VERSION = 2  # 2: token ids, how many were sent, trim and final (1: the text)
# v3: max_tokens out of the key; v2 (ids packed, not in the JSON) and v1 entries are never read, expire by TTL
KEY_PREFIX = "llm:resp:exact:v3"
MAX_TOKEN_ID = (1 << 31) - 1
_UNREAD = object()  # `_read`: the breaker is open or the GET failed
_WRONG_TYPE = object()  # `_read`: another Redis type under the key
INDEX_PREFIX = "llm:resp:exact-index:v2"  # a tenant quota's index: under no model's namespace, any fp


def exact_namespace(fingerprint: str) -> str:
    """One model's exact-cache keys: what a replica's key directory follows (not other models')."""
    return f"{KEY_PREFIX}:{fingerprint}"


@dataclass
class ExactCacheStats:
    """Counters since start; ``snapshot()`` returns a consistent copy for metrics."""

    hits: int = 0
    misses: int = 0
    errors: int = 0  # Redis unreachable, slow or failing, or skipped while the breaker is open
    local_misses: int = 0  # misses the key directory answered without asking Redis
    corrupt: int = 0  # values that failed version/checksum validation (deleted)
    uncacheable: int = 0  # lookups (and get/put calls) of non-deterministic requests
    shorter: int = 0  # misses on an entry that stopped at a smaller max_tokens (counted in misses too)
    kept: int = 0  # writes of the entry already there, which served more budgets, instead of the answer
    stores: int = 0
    quota_evictions: int = 0  # answers the tenant quota deleted (the tenant's least recently used)
    renewals: int = 0  # hits told to Redis, so that the quota trims by last use (only with a quota)
    bad_indexes: int = 0  # tenant indexes that held another type: deleted, rebuilt by the next write


def is_deterministic(params: EngineRequestParams) -> bool:
    """Greedy, or sampled with a fixed seed: the only requests whose answer can be replayed."""
    return params.greedy or params.seed is not None


def rng_device(device: str) -> str:
    """The device type whose generator a sampled request draws from ("cpu", "cuda"; the engine's
    `device`, "cuda:N" included): a CPU torch.Generator and a CUDA one seeded alike give other streams
    (engine/sampling.py), so a seeded answer is the answer of one device type only."""
    return str(device).split(":", 1)[0]


def sampling_signature(
    params: EngineRequestParams, vocab_size: int | None = None, *, rng: str = "cpu"
) -> dict[str, Any]:
    """Every request parameter that changes the generated text, in canonical (JSON-stable) form.

    A greedy request's top_p, top_k and seed are left out (argmax ignores them), and so is
    exclude_input_in_output: the caches hold the generated tokens only, and a hit puts the prompt in front
    as the request asks. Either would only split one answer over several keys. The tenant is not in
    here; callers that key by tenant add it separately. A top_k of at least `vocab_size` (the model's
    logits width, when the caller knows it) is keyed as 0: the sampler skips top-k for both
    (engine/sampling.py); the stop strings as `canonical_stops`. A sampled request's `rng` (`rng_device`)
    is in: a replica on another device type would draw another answer for the same seed; a greedy one's
    is not (argmax draws nothing), so greedy answers stay shared by a fleet of CPU and CUDA replicas and
    keep the keys they had.
    """
    greedy = params.greedy
    no_top_k = greedy or (vocab_size is not None and params.top_k >= vocab_size)
    signature = {
        "max_tokens": int(params.max_tokens),
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0 if no_top_k else int(params.top_k),
        "seed": None if greedy or params.seed is None else int(params.seed),
        "stop": canonical_stops(params.stop),
        "ignore_eos": bool(params.ignore_eos),
    }
    if not greedy:
        signature["rng"] = rng_device(rng)
    return signature


def canonical_stops(stops: Sequence[str]) -> list[str]:
    """The stop strings as a sorted set, less each one that begins with another: what the engine's
    `StopMatcher` depends on. It ends at the first token that completes any of them and cuts at the
    earliest start of any (a min over the set, so neither order nor repeats count), and a string that
    begins with another is never complete before that other one, nor starts before it. A string that
    holds another elsewhere is kept: "xab" with stops "b" and "ab" is cut at "ab", not at "b"."""
    unique = sorted({str(s) for s in stops if s})
    return [s for s in unique if not any(s != t and s.startswith(t) for t in unique)]


def exact_signature(
    params: EngineRequestParams, vocab_size: int | None = None, *, rng: str = "cpu"
) -> dict[str, Any]:
    """What the exact key holds of the sampling: all but `max_tokens`, which the entry is checked against."""
    signature = sampling_signature(params, vocab_size, rng=rng)
    del signature["max_tokens"]
    return signature


@dataclass(frozen=True)
class ExactAnswer:
    """An answer as the engine computed it: every token it generated (EOS not among them), the raw bytes a
    stop string trimmed off the end of what it sent, whether it is final (no larger budget gets more
    tokens: it met EOS, a stop string, or the model's sequence limit) and how many of the tokens its
    final response sent (`sent`, None: all; fewer when a stop string began in earlier tokens)."""

    ids: tuple[int, ...]
    trim: int = 0
    final: bool = False
    sent: int | None = None

    def __post_init__(self) -> None:
        if self.sent is None:
            object.__setattr__(self, "sent", len(self.ids))

    @property
    def response(self) -> tuple[list[int], int]:
        """The ids and trim a hit sends: what the final response of the computed request sent."""
        return list(self.ids[: self.sent]), self.trim

    def within(self, max_tokens: int) -> ExactAnswer | None:
        """The answer of the same request allowed `max_tokens` new tokens, or None when this one stopped
        at a smaller limit. A smaller budget gets the first `max_tokens` tokens, all sent, untrimmed: the
        engine looks for a stop string after every token, so one this answer met later was not in them,
        and seeded sampling draws from the request's own generator, token by token."""
        if max_tokens < len(self.ids):
            return ExactAnswer(self.ids[:max_tokens])
        if self.final or max_tokens == len(self.ids):
            return self
        return None

    def serves_more_than(self, other: ExactAnswer) -> bool:
        """Whether some budget gets this answer from `within` and not `other`'s: `other` is not final, and
        this one is, or holds more tokens."""
        return not other.final and (self.final or len(self.ids) > len(other.ids))

    def document(self) -> list[Any]:
        return [list(self.ids), self.sent, self.trim, self.final]

    @classmethod
    def from_document(cls, doc: Any) -> ExactAnswer | None:
        """The answer `document()` wrote, or None for anything else: a wrong type, an id out of range, or
        a stop string's trim or cut on an answer that is not final (only a stop string makes either)."""
        if not (isinstance(doc, list) and len(doc) == 4):
            return None
        ids, sent, trim, final = doc
        if not (isinstance(ids, list) and isinstance(final, bool) and _small_int(trim, 1 << 20)):
            return None
        if not (_small_int(sent, len(ids)) and all(_small_int(i, MAX_TOKEN_ID) for i in ids)):
            return None
        if not final and (trim or sent < len(ids)):
            return None
        return cls(tuple(ids), trim, final, sent)


def _small_int(value: Any, most: int) -> bool:
    return type(value) is int and 0 <= value <= most


# `ExactAnswer.serves_more_than` in Lua, for the scripts that decide in Redis whether a write of an answer
# that is not final keeps the one already there: `serves_more(raw, version, count)`, whether `raw` is a
# JSON document of format `version` whose `answer` is final or holds more ids than `count`. Lua cannot
# check the SHA-256: a value that parses as an answer but fails its checksum may keep one write out, until
# the next read deletes it as corrupt.
SERVES_MORE_LUA = """
local function serves_more(raw, version, count)
  if type(raw) ~= 'string' then return false end
  local ok, doc = pcall(cjson.decode, raw)
  if not (ok and type(doc) == 'table' and doc.v == tonumber(version) and type(doc.answer) == 'table') then
    return false
  end
  local ids = doc.answer[1]
  return type(ids) == 'table' and (doc.answer[4] == true or #ids > tonumber(count))
end
"""

# Write an exact answer (KEYS[1], ARGV[1], TTL ARGV[2]) unless the value there serves a budget it does not:
# the new answer is not final (ARGV[3] '0') and the stored one, a format ARGV[5] value, serves more than
# its ARGV[4] ids (`SERVES_MORE_LUA`); that one is kept with a fresh TTL (reply 0). Atomic, so neither a
# racing writer nor a key directory that missed an announcement cuts it down.
_KEEP_OR_SET = (
    SERVES_MORE_LUA
    + """
if ARGV[3] == '0' and serves_more(redis.pcall('GET', KEYS[1]), ARGV[5], ARGV[4]) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
)


def _keep_or_set(answer: ExactAnswer) -> Setter:
    """`write_announced`'s setter for `answer`: `_KEEP_OR_SET` with the answer's coverage. EVAL, not
    EVALSHA: from a pipeline redis-py would ask SCRIPT EXISTS first (a second round trip)."""
    final, count = int(answer.final), len(answer.ids)

    def queue(pipe: Any, name: str, value: bytes, ttl_s: int) -> None:
        pipe.eval(_KEEP_OR_SET, 1, name, value, ttl_s, final, count, FORMAT_VERSION)

    return queue


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def load_json_object(raw: bytes) -> dict | None:
    """A JSON object read from Redis, or None for anything else: bytes that are not UTF-8 or not JSON, a
    nesting too deep for the parser (RecursionError), or strings that cannot be written back as UTF-8 (a
    lone surrogate escape such as "\\ud800", on which the checksum's encode would raise into the request)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict):
            return None
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except (UnicodeError, ValueError, RecursionError):
        return None
    return doc


def redis_ttl(ttl_s: float) -> int:
    """Whole seconds for SET ... EX, at least 1: a sub-second TTL truncated to EX 0 is refused by Redis,
    and every refused write would count against the circuit breaker."""
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, math.ceil(ttl_s))


def sha256_hex(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no ambiguity between parts
        h.update(part)
    return h.hexdigest()


def exact_key(
    fingerprint: str,
    prompt_ids: Sequence[int],
    params: EngineRequestParams,
    vocab_size: int | None = None,
    *,
    rng: str = "cpu",
) -> str:
    """The exact cache's key of a prompt; the scheduler step hashes it on arrival, the engine to check it.
    Both pass the same `vocab_size` (cache/fingerprint.py `model_vocab_size`) and `rng` (the engine's
    device, `sampling_signature`): a key of either that the other does not hash is a forged one to the
    engine, and its answer is not written."""
    sampling = exact_signature(params, vocab_size, rng=rng)
    doc = {"fp": fingerprint, "tenant": params.tenant, "sampling": sampling}
    ids = struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)
    digest = sha256_hex(canonical_json(doc), ids)
    return f"{exact_namespace(fingerprint)}:{tenant_tag(params.tenant)}:{digest}"


def tenant_tag(tenant: str) -> str:
    """A fixed-width, key-safe form of the tenant (tenants are free text set by the server)."""
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]


SECRET_QUERY_ARGS = ("password", "ssl_password")  # redis-py's from_url takes any keyword from the query


def redact_url(url: str) -> str:
    """`url` with its password (and user) replaced by `***`, for messages and logs: a Redis URL may
    carry credentials (`redis://:secret@host:6379/0`, `rediss://user:secret@...`, `...?password=secret`)."""
    from urllib.parse import unquote_plus

    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The credentials end at the URL's last '@': a password holding '/', '?' or '#' not percent-encoded
    # (a base64 one) puts its '@' past where a URL parser ends the authority, and was shown whole. A query
    # value holding '@' hides more than it must, never less.
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    rest, mark, query = rest.partition("?")
    if mark:
        pairs = [pair.partition("=") for pair in query.split("&")]
        query = "&".join(  # names as redis-py reads them (decoded): `pass%77ord` is a password too
            f"{name}{eq}{'***' if unquote_plus(name) in SECRET_QUERY_ARGS and eq else value}"
            for name, eq, value in pairs
        )
    return f"{scheme}://{rest}{mark}{query}"


def _url_secrets(url: str) -> list[str]:
    """The pieces of `url` that `redact_url` hides: what comes before its last '@' (split where a URL
    parser may cut it) and the values of SECRET_QUERY_ARGS."""
    from urllib.parse import unquote_plus

    scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    pieces = re.split(r"[:/?#@&=]", rest.rpartition("@")[0]) if "@" in rest else []
    for pair in rest.partition("?")[2].split("&"):
        name, eq, value = pair.partition("=")
        if unquote_plus(name) in SECRET_QUERY_ARGS and eq:
            pieces.append(value)
    return [piece for piece in pieces if piece]


def url_error(url: str, exc: Exception) -> ValueError:
    """A ValueError for a Redis URL redis-py cannot read, without its credentials: urllib quotes what it
    took for the port (`Port could not be cast to integer value as 'PASSWORD'` for a password with an
    unencoded '/', '?' or '#'), which reached tritonserver.log (a model-load error) and the client's
    output."""
    message = str(exc)
    for piece in sorted(_url_secrets(url), key=len, reverse=True):
        message = message.replace(piece, "***")
    return ValueError(
        f"redis_url {redact_url(url)} cannot be read: {message} (percent-encode '/', '?', '#' and '@' in a "
        "user name or password)"
    )


def make_redis_client(redis_url: str, timeout_s: float):
    """redis-py client that fails fast: one attempt, short connect and socket timeouts (which the URL's
    query may not override: `cache.redis_url.redis_from_url`)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from cache.redis_url import redis_from_url

    return redis_from_url(
        redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )


class RedisCacheBase:
    """What every Redis-backed response cache shares: a fail-fast client, its circuit breaker, and
    counters (`stats`, a dataclass with an ``errors`` field) that metrics read with `snapshot`."""

    def __init__(self, redis_url: str, timeout_s: float, breaker: CircuitBreaker | None, stats: Any):
        import redis

        self.client = make_redis_client(redis_url, timeout_s)
        self._redis_errors = (redis.RedisError, OSError)
        self.breaker = breaker or CircuitBreaker()
        self.full = FullGate()  # a full or read-only Redis refuses writes, not reads: not a breaker failure
        self.stats = stats
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counters = asdict(self.stats)
        gate = self.full
        refusals = {"full_refusals": gate.refusals, "readonly_refusals": gate.readonly_refusals}
        return {**counters, **refusals, "full_skips": gate.skips}

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis_errors:
            pass

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _fail(self) -> None:
        self.breaker.record_failure()
        self._count("errors")

    def _may_write(self) -> bool:
        """Whether a write may be sent: not while a full Redis pauses writes (counted by the gate; asked
        first, so that a write not sent never takes the breaker's half-open probe) nor while the breaker
        is open (counted as an error)."""
        if not self.full.allow():
            return False
        if not self.breaker.allow():
            self._count("errors")
            return False
        return True

    def _write_failed(self, exc: BaseException) -> None:
        """A write's error: Redis out of memory or read-only pauses writes, and tells the breaker Redis
        answered; anything else is a breaker failure."""
        if self.full.refused(exc):
            self.breaker.record_success()
        else:
            self._fail()


class ExactResponseCache(RedisCacheBase):
    """get/put of generated answers keyed by (fingerprint, tenant, prompt ids, sampling but max_tokens)."""

    vocab_size: int | None = None  # the model's logits width, for `exact_key` (None: top_k keyed as sent)
    rng = "cpu"  # `rng_device` of the engine's device: the constructor's `device`

    def __init__(
        self,
        redis_url: str,
        fingerprint: str,
        ttl_s: int = 86400,
        timeout_s: float = 0.05,
        max_value_bytes: int = 1 << 20,
        breaker: CircuitBreaker | None = None,
        directory: KeyDirectory | None = None,
        tenant_max_entries: int = 0,
        vocab_size: int | None = None,
        device: str = "cpu",
    ):
        """`device`: the engine's, whose generator a seeded answer drew from (`sampling_signature`)."""
        if tenant_max_entries < 0:
            raise ValueError(f"tenant_max_entries must be >= 0 (0: no quota), got {tenant_max_entries}")
        super().__init__(redis_url, timeout_s, breaker, ExactCacheStats())
        self.directory = directory
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.rng = rng_device(device)
        self.namespace = exact_namespace(fingerprint)
        self.ttl_s = redis_ttl(ttl_s)
        self.max_value_bytes = max_value_bytes
        self.tenant_max_entries = int(tenant_max_entries)
        self._delete_if_unchanged = self.client.register_script(DELETE_IF_UNCHANGED)
        self._drop_other_type = self.client.register_script(DROP_OTHER_TYPE)

    # -- keys and values -------------------------------------------------------------------------

    def cacheable(self, params: EngineRequestParams) -> bool:
        return is_deterministic(params)

    def key(self, prompt_ids: Sequence[int], params: EngineRequestParams) -> str:
        return exact_key(self.fingerprint, prompt_ids, params, self.vocab_size, rng=self.rng)

    def tenant_index(self, tenant: str) -> str:
        """The sorted set of the tenant's answers that the quota trims: outside every model's namespace
        (no key directory lists it, no lookup's key can name it), found by `forget-tenant` by its tag."""
        return f"{INDEX_PREFIX}:{self.fingerprint}:{tenant_tag(tenant)}"

    def claimed(self, params: EngineRequestParams) -> str | None:
        """The key the scheduler step hashed for this request, if it is one of this model's (same
        fingerprint): unverified, so good for a miss; a hit or a write checks it (`key`)."""
        key = params.response_key
        return key if key.startswith(self.namespace + ":") else None

    @staticmethod
    def _checksum(key: str, answer: ExactAnswer) -> str:
        return sha256_hex(key.encode("utf-8"), canonical_json(answer.document()))

    def encode_value(self, key: str, answer: ExactAnswer) -> bytes:
        return canonical_json(
            {"v": FORMAT_VERSION, "answer": answer.document(), "sum": self._checksum(key, answer)}
        )

    def decode_value(self, key: str, raw: bytes) -> ExactAnswer | None:
        """The answer, or None when the value is not one we wrote for this key."""
        doc = load_json_object(raw)
        if doc is None or doc.get("v") != FORMAT_VERSION:
            return None
        answer = ExactAnswer.from_document(doc.get("answer"))
        if answer is None or doc.get("sum") != self._checksum(key, answer):
            return None
        return answer

    # -- operations ------------------------------------------------------------------------------

    def get(
        self,
        prompt_ids: Sequence[int],
        params: EngineRequestParams,
        key: str | None = None,
        count_hit: bool = True,
    ) -> ExactAnswer | None:
        """The answer for `params.max_tokens` (`ExactAnswer.within`); an entry that stopped at a smaller
        budget without ending is a miss (`shorter`), and the answer computed for this one replaces it.
        `key`: `key(prompt_ids, params)` when the caller has it already (hashing 2000 ids takes ~21 us).
        `count_hit` off: a hit is left for the caller to count (`count_hit`) once it checked the key: a
        counter taken back would run backwards, which Prometheus counters never do."""
        if not self.cacheable(params):
            self._count("uncacheable")
            return None
        key = key or self.key(prompt_ids, params)
        if self.directory is not None and self.directory.contains(key) is False:
            self._count("misses")
            self._count("local_misses")
            return None
        adds = adds_stamp(self.directory)
        raw = self._read(key)
        if raw is _UNREAD:
            return None
        if raw is _WRONG_TYPE:  # another type under our key: a bad value
            return self._reject(key, raw)
        if raw is None:  # unless another replica's write of it was announced since the GET
            self._forget(key, unless_added_since=adds)
            self._count("misses")
            return None
        stored = self.decode_value(key, raw)
        if stored is None:
            return self._reject(key, raw)
        answer = stored.within(params.max_tokens)
        if answer is None:
            self._count("misses")
            self._count("shorter")
        elif count_hit:
            self._count("hits")
        return answer

    def count_uncacheable(self) -> None:
        """A lookup of a request no cache may answer (sampled without a seed), which asks Redis nothing."""
        self._count("uncacheable")

    def count_hit(self) -> None:
        """A hit `get(count_hit=False)` returned, counted once its key was found to be the prompt's."""
        self._count("hits")

    def _reject(self, key: str, raw: bytes | object) -> None:
        """A value that is not one we wrote for `key` (`raw`, or `_WRONG_TYPE`): a miss, counted as
        corrupt, and deleted while it is still what was read: another replica may have written the
        answer over it since the GET."""
        self._count("corrupt")
        self._count("misses")
        script, args = (
            (self._drop_other_type, ["string"]) if raw is _WRONG_TYPE else (self._delete_if_unchanged, [raw])
        )
        adds = adds_stamp(self.directory)  # a write after the DEL stays listed
        try:
            deleted = script(keys=[key], args=args) == 1
        except self._redis_errors as exc:  # a read-only replica refuses the delete: not a Redis failure
            self._write_failed(exc)
            return
        if deleted:
            self._forget(key, unless_added_since=adds)

    def put(
        self,
        prompt_ids: Sequence[int],
        params: EngineRequestParams,
        answer: ExactAnswer,
        key: str | None = None,
    ) -> bool:
        """`key`: as for `get`. The write is a script that keeps an entry serving a budget `answer` does
        not (`_KEEP_OR_SET`; counted `kept`, False is returned) and renews its TTL, so that a warmup run
        with a small `max_tokens` (`cache=refresh` reads nothing before), a write after a failed lookup,
        another replica's write racing this one, or an entry whose announcement this replica's key
        directory missed never cut the answers clients are served down to its budget. Either way the key
        is announced and listed in a quota's index, as Redis holds it. One round trip, no GET."""
        if not self.cacheable(params):
            self._count("uncacheable")
            return False
        key = key or self.key(prompt_ids, params)
        value = self.encode_value(key, answer)
        if len(value) > self.max_value_bytes:
            return False
        if not self._may_write():
            return False
        index = self.tenant_index(params.tenant) if self.tenant_max_entries else None
        adds = adds_stamp(self.directory)  # before the trim: see below
        try:
            written = write_announced(
                self.client,
                self.namespace,
                [(key, value)],
                self.ttl_s,
                index,
                self.tenant_max_entries,
                setter=_keep_or_set(answer),
            )
        except self._redis_errors as exc:
            self._write_failed(exc)
            return False
        self.breaker.record_success()
        for name in written.evicted:  # unless written again (and announced) since: still there
            self._forget(name, unless_added_since=adds)
        self._count("quota_evictions", len(written.evicted))
        self._count("bad_indexes", int(written.repaired_index))
        if written.trim_error is not None:  # the write took; the next write trims
            self._count("errors")
        if key in written.evicted:  # a quota of 1 and an answer renewed a moment later (a clock ahead)
            return False
        if self.directory is not None:
            self.directory.add([key])
        stored = written.stored[0]
        self._count("stores" if stored else "kept")
        return stored

    def _read(self, key: str) -> bytes | None | object:
        """`get`'s GET of `key` through the breaker: its value, None when absent, `_WRONG_TYPE` when another
        type sits under it (Redis answered), or `_UNREAD` when the breaker is open (counted an error) or
        the GET failed (a breaker failure)."""
        if not self.breaker.allow():
            self._count("errors")
            return _UNREAD
        try:
            raw = self.client.get(key)
        except self._redis_errors as exc:
            if not is_wrong_type(exc):
                self._fail()
                return _UNREAD
            raw = _WRONG_TYPE
        self.breaker.record_success()
        return raw

    def renew(self, keys: Sequence[str], tenant: str) -> bool:
        """With a tenant quota: mark the tenant's answers `keys` (hits) as just used, with a fresh TTL, so
        the quota trims answers used longer ago first (LRU by use, not by write); one round trip. False
        without a quota, with no keys, or when Redis is unavailable."""
        if not self.tenant_max_entries or not keys or not self._may_write():
            return False
        try:
            reply = renew_listed(self.client, self.tenant_index(tenant), list(keys), self.ttl_s)
        except self._redis_errors as exc:
            self._write_failed(exc)
            return False
        self.breaker.record_success()
        if reply == INDEX_DROPPED:
            self._count("bad_indexes")
        elif reply:  # 0: none of `keys` listed (another tenant's, or written before the quota)
            self._count("renewals")
        return reply != INDEX_DROPPED

    # -- internals -------------------------------------------------------------------------------

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        super().close()

    def _forget(self, key: str, unless_added_since: int | None = None) -> None:
        if self.directory is not None:
            self.directory.discard(key, unless_added_since)
