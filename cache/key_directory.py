"""Which keys of one Redis namespace exist, known locally, so a miss costs no round trip.

At 0% hits every lookup in Redis (the exact response cache's GET, the L3 probe of a prompt's block
chain) is a round trip that finds nothing and sits on a request's path. Writers announce each key
they SET on a pub/sub channel in the same pipeline; this directory subscribes to it, lists the
namespace with SCAN after every (re)subscription, and so answers "is it there?" from a local set.

The answer is one-sided, which is what keeps it safe:
- "absent" is trusted only while the directory is synced (subscribed, scan done, under its size cap).
  Otherwise `contains` answers None and the caller asks Redis, as it would without a directory.
- "present" may be stale (a TTL expired, a value was deleted as corrupt, Redis was flushed): the
  caller's GET then finds nothing and `discard`s it. A periodic rescan also drops expired keys.

A missed announcement (pub/sub is at most once) can only cost a hit, never return a wrong value; every
disconnect marks the directory unsynced until a fresh subscription and scan, and the periodic rescan
bounds how long a lost message can hide a key.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cache.wrong_type import DROP_OTHER_TYPE, is_wrong_type

ANNOUNCE_SEPARATOR = "\n"
# The subscription is PINGed this often, and dropped when its PONG has not come back by the next PING:
# redis-py's health check only sends its PING, so a peer gone silent (a partition, a lost conntrack entry)
# went unnoticed until TCP gave up (~15 minutes), every announcement meanwhile lost while "synced".
PING_EVERY_S = 5.0
PING_MESSAGE = b"key-directory"


def adds_stamp(directory: KeyDirectory | None) -> int | None:
    """`directory.adds`, taken before a round trip whose misses or deletes are then `discard`ed with it
    (`unless_added_since`); None without a directory."""
    return None if directory is None else directory.adds


INDEX_CLOCK_MARGIN_S = 60.0  # an index name is pruned this long after its expiry by the writer's clock


def announce_channel(namespace: str) -> str:
    """The channel on which writers of `namespace` announce new keys."""
    return f"{namespace}:announce"


# Keep an index to its newest `limit` names: pop the lowest scores (the earliest to expire: the oldest
# written, and in one chain its tail) and delete them, at most ARGV[2] of them; then announce the names
# written that were kept (ARGV[5:]), so that no key directory lists a name this script deleted. Returns
# the names deleted. Sent with EVAL: one round trip (EVALSHA from a pipeline makes redis-py ask SCRIPT
# EXISTS first).
_TRIM_AND_ANNOUNCE = """
local excess = math.min(redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1]), tonumber(ARGV[2]))
local deleted, gone = {}, {}
if excess > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], excess)
  for i = 1, #popped, 2 do
    redis.call('DEL', popped[i])
    gone[popped[i]] = true
    deleted[#deleted + 1] = popped[i]
  end
end
local kept = {}
for i = 5, #ARGV do
  if not gone[ARGV[i]] then kept[#kept + 1] = ARGV[i] end
end
if #kept > 0 then redis.pcall('PUBLISH', ARGV[3], table.concat(kept, ARGV[4])) end
return deleted
"""
# seconds: a chain's later blocks score this much lower each, so trims take tails first
CHAIN_SCORE_STEP = 1e-5
# names one write's trim deletes at most, on top of what it wrote: a quota lowered under what a tenant
# holds (a config change, one replica configured lower in a rolling update) is reached over the next
# writes, instead of one script deleting the whole excess while Redis serves nobody else, past the
# writer's socket timeout (100,000 answers over a quota of 1,000: 256 ms)
MAX_TRIM_PER_WRITE = 256


@dataclass(frozen=True)
class Written:
    stored: list[bool]  # whether each value was written (a `setter` may keep the one already there)
    evicted: list[str]  # names the index's limit deleted (its owner's oldest, maybe some just written)
    trim_error: str | None = None  # the quota's script failed (the SETs took; nothing was announced)
    repaired_index: bool = False  # the index held another type: deleted, and the names listed afresh


Setter = Callable[[Any, str, bytes, int], None]  # queues the write of (name, value, ttl) on a pipeline


def set_with_ttl(pipe: Any, name: str, value: bytes, ttl_s: int) -> None:
    pipe.set(name, value, ex=ttl_s)


def write_announced(
    client: Any,
    namespace: str,
    values: Sequence[tuple[str, bytes]],
    ttl_s: int,
    index: str | None = None,
    index_limit: int = 0,
    head: Sequence[str] = (),
    setter: Setter = set_with_ttl,
) -> Written:
    """SET each (name, value) with a TTL and announce the names, in one round trip. Only the SETs decide
    what is stored: a Redis that refuses the announcement (an ACL without channel access) still stores,
    and readers' directories, which cannot subscribe there either, stay unsynced. `setter`: another
    write than a SET (a script that may keep the value already there, replying 0, and renew its TTL):
    the name is announced and listed either way, since Redis holds it.
    `index`: a sorted set that also gets the names, scored by when they expire, for keys whose names do
    not say whose they are; names expired by then (less `INDEX_CLOCK_MARGIN_S`, for replicas' clocks) are
    pruned in the same round trip, so an index stays as large as what its owner holds in Redis.
    `index_limit` (> 0): a quota; past it the index's lowest-scored names are deleted, in that round trip
    too, so one owner's writes push out its own values, never another owner's (at most
    `MAX_TRIM_PER_WRITE` more than it wrote: a larger excess goes over the next writes). `head`: with a
    quota, the names the written ones continue (a chain's earlier blocks, written before): those the index
    lists get their score and TTL renewed above the new names', so a head that newer chains keep extending is
    trimmed after them, not first (a lookup stops at the first missing block: a tail without its head is
    never read). An index that holds another type (WRONGTYPE) would list nothing again, for as long as
    its owner writes: it is deleted and the names listed afresh, in a second round trip."""
    pipe = client.pipeline(transaction=False)
    for name, value in values:
        setter(pipe, name, value, ttl_s)
    names = [name for name, _ in values]
    trims = bool(values) and index is not None and index_limit > 0
    if values and not trims:
        pipe.publish(announce_channel(namespace), ANNOUNCE_SEPARATOR.join(names))
    limit = index_limit if trims else 0
    if values and index is not None:
        _queue_index(pipe, namespace, names, ttl_s, index, limit, head)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies[: len(values)]:
        if isinstance(reply, Exception):
            raise reply
    stored = [bool(reply) for reply in replies[: len(values)]]
    index_replies = replies[len(values) :] if index is not None else []
    # the head's renewal goes first and drops a bad index itself; otherwise ZADD meets it (WRONGTYPE)
    repaired = bool(trims and head) and index_replies[0] == INDEX_DROPPED
    listed_at = len(values) + int(not trims) + int(bool(limit and head))  # the ZADD's reply (after a PUBLISH)
    if any(isinstance(reply, Exception) and is_wrong_type(reply) for reply in index_replies):
        pipe = client.pipeline(transaction=False)
        pipe.eval(DROP_OTHER_TYPE, 1, index, "zset")
        _queue_index(pipe, namespace, names, ttl_s, index, limit, head)
        replies = pipe.execute(raise_on_error=False)
        repaired, listed_at = True, 1 + int(bool(limit and head))
    if values and index is not None and isinstance(replies[listed_at], Exception):
        # the values took and the index refused them (a full Redis takes SETs just under maxmemory, then
        # refuses the ZADD): unlisted, forget-tenant could not find them. They go; the write failed.
        _delete_quietly(client, [name for name, took in zip(names, stored) if took])
        raise replies[listed_at]
    evicted: list[str] = []
    trim_error = None
    if trims and isinstance(replies[-1], Exception):  # the SETs took: the next write trims
        trim_error = f"{type(replies[-1]).__name__}: {replies[-1]}"
    elif trims:
        evicted = [name.decode() if isinstance(name, bytes) else str(name) for name in replies[-1]]
    return Written(stored, evicted, trim_error, repaired)


def _delete_quietly(client: Any, names: list[str]) -> None:
    if not names:
        return
    try:
        client.delete(*names)
    except Exception:  # Redis failing now: the values expire with their TTL
        pass


def _queue_index(
    pipe: Any, namespace: str, names: Sequence[str], ttl_s: int, index: str, limit: int, head: Sequence[str]
) -> None:
    """`write_announced`'s index commands for `names`, queued on `pipe`; `limit` > 0: the quota's trim,
    which announces the names it kept, last."""
    top, start = time.time() + ttl_s, 0
    if limit and head:
        renew_listed(pipe, index, head, ttl_s, top)
        start = len(head)
    pipe.zadd(index, {name: top - (start + i) * CHAIN_SCORE_STEP for i, name in enumerate(names)})
    pipe.zremrangebyscore(index, "-inf", top - ttl_s - INDEX_CLOCK_MARGIN_S)
    pipe.expire(index, ttl_s)
    if limit:
        channel, cap = announce_channel(namespace), MAX_TRIM_PER_WRITE + len(names)
        pipe.eval(_TRIM_AND_ANNOUNCE, 1, index, limit, cap, channel, ANNOUNCE_SEPARATOR, *names)


# Renew the names an index lists (ARGV[4:], a chain head first): a score as if written at ARGV[2] less
# ARGV[3] per position, never lower than before, a fresh TTL (ARGV[1]) for each value and for the index.
# Names it does not list (deleted, expired, another owner's) are left alone: a value must never outlive
# the index that lets `forget-tenant` find it. No ZADD GT, which needs Redis 6.2. An index of another
# type is deleted (returns -1): it lists nothing, and its WRONGTYPE would read as a Redis failure.
_RENEW = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'zset' then
  if kind ~= 'none' then redis.call('DEL', KEYS[1]) return -1 end
  return 0
end
local ttl, top, step, listed = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), false
for i = 4, #ARGV do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if old then
    local score = top - (i - 4) * step
    if score > tonumber(old) then redis.call('ZADD', KEYS[1], score, ARGV[i]) end
    redis.call('EXPIRE', ARGV[i], ttl)
    listed = true
  end
end
if listed then redis.call('EXPIRE', KEYS[1], ttl) end
return listed and 1 or 0
"""


def renew_listed(target: Any, index: str, names: Sequence[str], ttl_s: int, top: float | None = None) -> Any:
    """One EVAL: the names `index` lists get a score as if written now, in chain order (the first
    highest), never lower than they had, and they and the index a fresh TTL. `target`: a pipeline, which
    queues it, or a client, which sends it at once (one round trip; a Redis error raises) and returns
    its reply: 1 renewed, 0 nothing listed, `INDEX_DROPPED` the index held another type and was deleted."""
    top = time.time() + ttl_s if top is None else top
    return target.eval(_RENEW, 1, index, int(ttl_s), repr(float(top)), repr(CHAIN_SCORE_STEP), *names)


INDEX_DROPPED = -1  # renew_listed's reply when the index held another type


def _glob_escaped(text: str) -> str:
    """`text` as a literal in a SCAN MATCH pattern (a model name may hold *, ?, [ or ])."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass
class KeyDirectoryStats:
    answered: int = 0  # lookups answered locally "absent" (a Redis round trip saved)
    deferred: int = 0  # lookups passed to Redis because the directory was not synced
    stale: int = 0  # keys the directory held that Redis no longer did (discarded)
    scans: int = 0  # completed scans (initial, after a reconnect, periodic)
    disconnects: int = 0
    overflows: int = 0  # scans or announcements that pushed the directory past its cap


class KeyDirectory:
    """A local set of the keys under ``{namespace}:`` in Redis, kept current by a background thread."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        max_keys: int = 1_000_000,
        rescan_s: float = 600.0,
        timeout_s: float = 2.0,
        log: Callable[[str], None] | None = None,
    ):
        import redis

        from cache.redis_url import redis_from_url

        self.namespace = namespace
        self.channel = announce_channel(namespace)
        self.max_keys = max_keys
        self.rescan_s = rescan_s
        self._log = log or (lambda message: None)
        # Its own connections, with room for a SCAN page: the serving clients' timeouts are
        # milliseconds. A silent dead peer is noticed by `_follow`'s own PING (PING_EVERY_S): redis-py's
        # health check sends one but never waits for its answer.
        self._client = redis_from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=5
        )
        self._timeout_s = timeout_s
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._keys: set[str] = set()
        self._scan_listeners: list[Callable[[set[str]], None]] = []
        self._adds = 0  # bumped by every add, local or announced (see `discard`)
        self._synced = False
        self._backoff = 0.2  # before the next reconnect; back to 0.2 at every completed scan
        self._stop = threading.Event()
        self._lock = threading.Lock()  # stats only: set operations are atomic under the GIL
        self.stats = KeyDirectoryStats()
        self._thread = threading.Thread(target=self._run, name=f"key-directory-{namespace}", daemon=True)

    def start(self) -> KeyDirectory:
        self._thread.start()
        return self

    def on_scan(self, listener: Callable[[set[str]], None]) -> None:
        """Call `listener` with the names each completed scan found (not to be changed), on the directory's
        thread, before the directory answers from them: what Redis lost (a restart, an eviction, a
        flush) reaches whoever remembers keys as present without asking."""
        self._scan_listeners.append(listener)

    @property
    def synced(self) -> bool:
        return self._synced

    def __len__(self) -> int:
        return len(self._keys)

    def contains(self, name: str) -> bool | None:
        """True or False from the local set, None when only Redis can tell (not synced)."""
        found = self.contains_each([name])
        return None if found is None else found[0]

    def contains_each(self, names: Sequence[str]) -> list[bool] | None:
        """Whether each name is present, or None when only Redis can tell."""
        if not self._synced:
            self._count("deferred")
            return None
        keys = self._keys
        found = [name in keys for name in names]
        if not all(found):
            self._count("answered")
        return found

    @property
    def adds(self) -> int:
        """A stamp to pass to `discard` when a miss is seen."""
        return self._adds

    def add(self, names: Iterable[str]) -> None:
        """Keys this process just wrote: known at once, before their announcement comes back. Unsynced,
        nothing is kept (nothing is answered; the next scan lists them)."""
        if self._synced:
            self._adds += 1
            self._keys.update(names)

    def discard(self, name: str, unless_added_since: int | None = None) -> None:
        """A key Redis turned out not to hold (expired, deleted as corrupt). `unless_added_since`: the
        `adds` stamp taken before Redis was asked; when anything was added since, the key may be among
        it (a write landing between the miss and this call) and stays: the directory may answer
        "present" wrongly (one GET), never "absent"."""
        if unless_added_since is not None and self._adds != unless_added_since:
            return
        if name in self._keys:
            self._keys.discard(name)
            self._count("stale")

    def close(self) -> None:
        self._stop.set()
        self._synced = False
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self._client.close()
        except self._errors:
            pass

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(vars(self.stats))
        return {**counts, "keys": len(self._keys), "synced": int(self._synced)}

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _run(self) -> None:
        self._backoff = 0.2
        while not self._stop.is_set():
            try:
                self._follow()
            except self._errors as exc:
                self._synced = False
                self._count("disconnects")
                if self._backoff == 0.2:  # the first failure of a streak; the counter tells the rest
                    self._log(f"key directory {self.namespace}: {type(exc).__name__}: {exc}; unsynced")
                self._stop.wait(self._backoff)
                self._backoff = min(10.0, self._backoff * 2)

    def _follow(self) -> None:
        """Subscribe, then scan (announcements during the scan wait in the socket), then apply them."""
        pubsub = self._client.pubsub()
        try:
            pubsub.subscribe(self.channel)
            confirm_by = time.monotonic() + 5.0
            while (message := pubsub.get_message(timeout=0.5)) is None or message["type"] != "subscribe":
                if time.monotonic() > confirm_by:
                    raise TimeoutError(f"no confirmation of the subscription to {self.channel}")
            self._rescan()
            rescan_at = time.monotonic() + self.rescan_s
            ping_at, pong_by = time.monotonic() + PING_EVERY_S, None
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.5)
                kind = None if message is None else message.get("type")
                if kind == "message":
                    self._apply(message["data"])
                elif kind == "pong" and message.get("data") == PING_MESSAGE:
                    pong_by = None
                elif kind == "subscribe":
                    # redis-py reconnected and resubscribed by itself (a URL asking for retries): what was
                    # announced while it was away is lost, so this is a reconnect, which rescans
                    raise ConnectionError(f"the subscription to {self.channel} was renewed under us")
                now = time.monotonic()
                if pong_by is not None and now > pong_by:
                    raise TimeoutError(f"no answer to a PING on the subscription to {self.channel}")
                if pong_by is None and now >= ping_at:
                    pubsub.ping(PING_MESSAGE)
                    ping_at, pong_by = now + PING_EVERY_S, now + PING_EVERY_S + self._timeout_s
                if now >= rescan_at:
                    self._rescan()
                    rescan_at = time.monotonic() + self.rescan_s
                    if pong_by is not None:  # the scan's time is not the subscription's
                        pong_by = time.monotonic() + PING_EVERY_S + self._timeout_s
        finally:
            self._synced = False
            pubsub.close()

    def _apply(self, data: bytes) -> None:
        if not self._synced:  # past the cap: kept empty until a scan finds fewer keys
            return
        self._adds += 1
        self._keys.update(data.decode("utf-8", errors="replace").split(ANNOUNCE_SEPARATOR))
        if len(self._keys) > self.max_keys:
            self._overflow()

    def _rescan(self) -> None:
        fresh: set[str] = set()
        for name in self._client.scan_iter(match=f"{_glob_escaped(self.namespace)}:*", count=1000):
            fresh.add(name.decode("utf-8", errors="replace"))
            if len(fresh) > self.max_keys:
                self._overflow()
                return
        for listener in self._scan_listeners:
            try:
                listener(fresh)
            except Exception as exc:  # a listener's bug must not stop the directory
                self._log(
                    f"key directory {self.namespace}: scan listener failed: {type(exc).__name__}: {exc}"
                )
        self._keys = fresh
        self._adds += 1  # a miss seen before the scan must not discard a key the scan found (`discard`)
        self._synced = True
        # a streak ends with a good sync: `_follow` returns only when closed, so a backoff reset there
        # never ran, and every later disconnect (an output-buffer kill, a restart, days on) waited the
        # grown backoff, up to 10 s unsynced, and went unlogged
        self._backoff = 0.2
        self._count("scans")

    def _overflow(self) -> None:
        """Too many keys to mirror: stop answering (Redis is asked) until a rescan finds fewer."""
        self._synced = False
        self._keys = set()
        self._count("overflows")
        self._log(f"key directory {self.namespace}: over {self.max_keys} keys; asking Redis instead")
