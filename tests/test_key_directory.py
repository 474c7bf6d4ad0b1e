"""The key directory against real redis-servers: scan, announcements, stale keys, restarts, its cap,
and the round trips it saves the exact response cache and the L3 store."""

from __future__ import annotations

import hashlib
import subprocess
import uuid
from pathlib import Path

import pytest
import redis
import torch

from cache.kv_format import KVBlockMeta
from cache.key_directory import KeyDirectory, announce_channel
from cache.redis_kv_store import RedisKVStore
from cache.response_cache import ExactAnswer, ExactResponseCache, exact_namespace
from deploy.launch import find_free_port, start_redis_server
from engine.kv_tiers import LAYOUT, L3Tier
from scheduler.messages import EngineRequestParams
from tests.conftest import wait_for, answer

EXACT_NS = exact_namespace("fp-dir")
GREEDY = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="tenant-a")
META = KVBlockMeta("fp", "float32", (1, 2, 1, 4, 2), 4, LAYOUT)


@pytest.fixture
def raw(redis_server):
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    return f"test:dir:{uuid.uuid4().hex[:8]}"


def started(url: str, namespace: str, **options) -> KeyDirectory:
    directory = KeyDirectory(url, namespace, **options).start()
    assert wait_for(lambda: directory.synced, 10), "the directory never synced"
    return directory


def gets(raw: redis.Redis) -> int:
    return raw.info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def evals(raw: redis.Redis) -> int:
    return raw.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)


def test_the_scan_finds_what_redis_already_holds_in_its_namespace_only(redis_server, raw, namespace):
    raw.set(f"{namespace}:one", b"x")
    raw.set(f"{namespace}:two", b"x")
    raw.set(f"{namespace}-other:one", b"x")
    directory = started(redis_server, namespace)
    try:
        assert directory.contains_each([f"{namespace}:one", f"{namespace}:two", f"{namespace}:three"]) == [
            True,
            True,
            False,
        ]
        assert directory.contains(f"{namespace}-other:one") is False
        assert len(directory) == 2 and directory.stats.scans == 1
    finally:
        directory.close()


def test_an_unsynced_directory_defers_to_redis():
    directory = KeyDirectory(f"redis://127.0.0.1:{find_free_port()}/0", "test:dir:dead")
    assert directory.contains("test:dir:dead:k") is None, "never started: only Redis can tell"
    directory.start()
    try:
        assert wait_for(lambda: directory.stats.disconnects >= 1, 10)
        assert directory.contains("test:dir:dead:k") is None and not directory.synced
    finally:
        directory.close()


def test_another_writers_announcement_arrives_and_a_miss_sends_no_get(redis_server, raw):
    """Replica B follows replica A's writes: B's misses cost no GET, A's answer is a hit for B."""
    writer = ExactResponseCache(redis_server, "fp-dir")
    reader = ExactResponseCache(redis_server, "fp-dir", directory=started(redis_server, EXACT_NS))
    prompt = [int(x) for x in uuid.uuid4().bytes]
    try:
        before = gets(raw)
        assert reader.get(prompt, GREEDY) is None
        assert gets(raw) == before, "a key no one wrote is a local miss"
        assert reader.stats.local_misses == 1 and reader.stats.misses == 1
        assert writer.put(prompt, GREEDY, answer("the answer"))
        key = writer.key(prompt, GREEDY)
        assert wait_for(lambda: reader.directory.contains(key), 10), "the announcement never arrived"
        assert reader.get(prompt, GREEDY) == answer("the answer")
        other_tenant = EngineRequestParams(max_tokens=8, temperature=0.0, tenant="tenant-b")
        assert reader.get(prompt, other_tenant) is None, "another tenant's key is not announced"
    finally:
        writer.close()
        reader.close()


@pytest.fixture
def written(redis_server):
    """An exact cache that follows the directory, a prompt whose answer it just wrote, and its key."""
    cache = ExactResponseCache(redis_server, "fp-dir", directory=started(redis_server, EXACT_NS))
    prompt = [int(x) for x in uuid.uuid4().bytes]
    assert cache.put(prompt, GREEDY, answer("an answer"))
    key = cache.key(prompt, GREEDY)
    assert cache.directory.contains(key), "a local write is known at once"
    yield cache, prompt, key
    cache.close()


def test_a_stale_key_costs_one_get_then_is_forgotten(written, raw):
    cache, prompt, key = written
    raw.delete(key)  # expired, or deleted by another replica as corrupt
    before = gets(raw)
    assert cache.get(prompt, GREEDY) is None and gets(raw) == before + 1
    assert cache.directory.contains(key) is False and cache.directory.stats.stale == 1
    assert cache.get(prompt, GREEDY) is None and gets(raw) == before + 1, "no second GET"


def test_a_write_sends_no_get(written, raw):
    """A write keeps an entry that serves more budgets in Redis itself (one script), so no write, whatever
    the directory says, sends a GET of its own (the script's own reads count as GETs, hence the counter
    of scripts run beside it)."""
    cache, _, _ = written
    prompt = [int(x) for x in uuid.uuid4().bytes]
    before, scripts = gets(raw), evals(raw)
    assert cache.put(prompt, GREEDY, ExactAnswer((1, 2))) and gets(raw) - before == evals(raw) - scripts
    assert not cache.put(prompt, GREEDY, ExactAnswer((1,))), "kept"
    assert gets(raw) - before == evals(raw) - scripts == 2


def test_a_corrupt_value_is_forgotten_with_its_key(written, raw):
    cache, prompt, key = written
    raw.set(key, b'{"v":1,"text":"tampered","sum":"0"}')
    assert cache.get(prompt, GREEDY) is None and cache.stats.corrupt == 1
    assert cache.directory.contains(key) is False and raw.get(key) is None


@pytest.fixture
def kv_pair(redis_server, namespace):
    """A KV store that follows a directory (`reader`), another replica's store (`writer`), one block key."""
    directory = started(redis_server, namespace)
    reader = RedisKVStore(redis_server, namespace, timeout_s=0.5, directory=directory)
    writer = RedisKVStore(redis_server, namespace, timeout_s=0.5)
    key = hashlib.sha256(uuid.uuid4().bytes).digest()
    yield reader, writer, key, reader.redis_key(key)
    reader.close()
    writer.close()


def test_a_damaged_value_another_replica_rewrote_stays_listed(kv_pair, raw):
    """The delete of a damaged value spares a good one written meanwhile; so must the directory."""
    reader, writer, key, name = kv_pair
    raw.set(name, b"damaged value")
    assert writer.put(key, torch.ones(1, 2, 1, 4, 2), META)
    assert wait_for(lambda: reader.directory.contains(name) is True, 5)
    assert reader.discard(name, b"damaged value") is False and raw.exists(name) == 1
    assert reader.directory.contains(name) is True


def test_a_miss_that_races_a_write_does_not_hide_the_key(kv_pair):
    """A write of the block lands (and is announced) between a reader's MGET that missed it and the
    reader's discard of the name: the directory must not answer "absent" for it afterwards."""
    reader, writer, key, name = kv_pair
    real_mget = reader._mget

    def mget_then_a_write_lands(names):
        values = real_mget(names)
        assert writer.put(key, torch.ones(1, 2, 1, 4, 2), META)
        assert wait_for(lambda: reader.directory.contains(name) is True, 5)
        return values

    reader._mget = mget_then_a_write_lands
    assert reader.get(key, META) is None
    reader._mget = real_mget
    assert reader.directory.contains(name) is True and reader.exists_chain([key]) == 1


def test_past_its_cap_the_directory_stops_answering(redis_server, raw, namespace):
    for i in range(3):
        raw.set(f"{namespace}:{i}", b"x")
    directory = KeyDirectory(redis_server, namespace, max_keys=2).start()
    try:
        assert wait_for(lambda: directory.stats.overflows >= 1, 10)
        assert not directory.synced and directory.contains(f"{namespace}:9") is None
        assert len(directory) == 0, "an overflowed directory holds nothing"
    finally:
        directory.close()


def test_announcements_past_the_cap_unsync_it(redis_server, raw, namespace):
    directory = started(redis_server, namespace, max_keys=2)
    try:
        raw.publish(announce_channel(namespace), "\n".join(f"{namespace}:{i}" for i in range(3)))
        assert wait_for(lambda: directory.stats.overflows == 1, 10)
        assert directory.contains(f"{namespace}:0") is None
        directory._apply(f"{namespace}:later".encode())  # what its thread does with an announcement
        directory.add([f"{namespace}:mine"])
        assert len(directory) == 0, "past its cap it keeps nothing until a scan finds fewer keys"
    finally:
        directory.close()


class OwnRedis:
    """A redis-server of one test's own on a free port, which the test may stop and start again."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.port = run_dir, find_free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc, _ = start_redis_server("redis-server", self.run_dir, self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def directories():
    """Starts key directories that are closed after the test, whatever it asserted."""
    made: list[KeyDirectory] = []

    def start(url: str, namespace: str) -> KeyDirectory:
        made.append(KeyDirectory(url, namespace).start())
        return made[-1]

    yield start
    for directory in made:
        directory.close()


def test_a_redis_restart_unsyncs_then_resyncs_with_what_the_new_redis_holds(
    own_redis, directories, namespace
):
    redis.Redis.from_url(own_redis.url).set(f"{namespace}:before", b"x")
    directory = directories(own_redis.url, namespace)
    assert wait_for(lambda: directory.synced, 10)
    assert directory.contains(f"{namespace}:before")
    own_redis.stop()
    assert wait_for(lambda: not directory.synced, 20), "a dead Redis must unsync the directory"
    assert directory.contains(f"{namespace}:before") is None
    own_redis.start()  # empty: no persistence
    assert wait_for(lambda: directory.synced, 30), "it must resync by itself"
    assert directory.contains(f"{namespace}:before") is False, "the new Redis does not hold it"
    writer = RedisKVStore(own_redis.url, namespace)
    key = hashlib.sha256(b"after").digest()
    assert writer.put(key, torch.zeros(1, 2, 1, 4, 2), META)
    assert wait_for(lambda: directory.contains(writer.redis_key(key)), 10)
    writer.close()


def test_blocks_remembered_as_held_are_forgotten_when_a_scan_no_longer_finds_them(own_redis, namespace):
    """L3 remembers for half the TTL which blocks Redis holds, and skips writing them again. After Redis
    restarted empty, the resynced directory's scan tells it they are gone: the next reuse writes them
    again instead of leaving every other replica to recompute them for up to 12 h."""
    directory = KeyDirectory(own_redis.url, namespace, timeout_s=0.5).start()
    store = RedisKVStore(own_redis.url, namespace, timeout_s=0.5, directory=directory)
    l3 = L3Tier(store, META)
    keys = [hashlib.sha256(f"{namespace}{i}".encode()).digest() for i in range(3)]
    try:
        assert wait_for(lambda: directory.synced, 10)
        l3.publish(keys[:2], torch.ones(2, 1, 2, 1, 4, 2), "t")
        assert wait_for(lambda: store.exists_each(keys) == [True, True, False], 10)
        assert l3.unknown(keys) == [2]
        own_redis.stop()
        assert wait_for(lambda: not directory.synced, 20)
        own_redis.start()  # empty
        assert wait_for(lambda: directory.synced, 30)
        assert l3.unknown(keys) == [0, 1, 2], "the tier still believes Redis holds the blocks"
    finally:
        l3.close()


def test_the_l3_probe_is_answered_locally_without_a_round_trip(redis_server, namespace):
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, directory=started(redis_server, namespace))
    l3 = L3Tier(store, META)
    keys = [hashlib.sha256(f"{namespace}{i}".encode()).digest() for i in range(3)]
    try:
        assert store.put_chain(keys[:2], [torch.ones(1, 2, 1, 4, 2)] * 2, META) == 2
        probe = l3.probe(keys)
        assert probe.done(), "answered at once, without the probe thread"
        assert l3.wait_probe(probe) == [True, True, False]
        stats = store.stats
        assert stats.local_probes == 1 and stats.probes == 0
        blocks, outcome = l3.fetch_with_outcome(keys, None)
        assert store.stats.probes == 0, "the prefill's own check is local too"
        assert outcome in ("loaded", "recompute") and len(blocks) in (0, 2)
    finally:
        l3.close()


def test_a_redis_that_refuses_channels_still_stores_and_its_directories_defer(
    own_redis, directories, namespace
):
    """An ACL without channel access (Redis 7's default for new users): announcements fail, SETs do
    not, so the caches keep working; a directory there never syncs and defers every lookup."""
    url = own_redis.url
    admin = redis.Redis.from_url(url)
    admin.execute_command("ACL", "SETUSER", "default", "resetchannels")
    with pytest.raises(redis.ResponseError, match="no permissions"):
        admin.publish(announce_channel(namespace), "x")
    exact = ExactResponseCache(url, "fp-acl", timeout_s=0.5)
    prompt = [int(x) for x in uuid.uuid4().bytes]
    assert exact.put(prompt, GREEDY, answer("stored anyway")) and exact.get(prompt, GREEDY) == answer(
        "stored anyway"
    )
    assert exact.stats.errors == 0 and exact.breaker.allow(), "a refused announcement is no failure"
    store = RedisKVStore(url, namespace, timeout_s=0.5)
    assert store.put_chain([b"k1", b"k2"], [torch.zeros(1, 2, 1, 4, 2)] * 2, META) == 2
    directory = directories(url, namespace)
    assert wait_for(lambda: directory.stats.disconnects >= 1, 10)
    assert not directory.synced and directory.contains(store.redis_key(b"k1")) is None
    exact.close()
    store.close()


def test_a_namespace_with_glob_characters_is_matched_literally(redis_server, raw):
    base = f"test:dir:{uuid.uuid4().hex[:8]}"
    namespace = f"{base}:m*[x]?"
    raw.set(f"{namespace}:mine", b"x")
    raw.set(f"{base}:mQQxZ:other", b"x")  # what m*[x]? would match, unescaped
    directory = started(redis_server, namespace)
    try:
        assert len(directory) == 1 and directory.contains(f"{namespace}:mine")
    finally:
        directory.close()


def test_an_unsynced_directory_is_asked_once_per_probe(redis_server, namespace):
    """A probe the directory cannot answer goes to Redis without asking the directory a second time."""
    directory = KeyDirectory(redis_server, namespace)  # never started: never synced
    store = RedisKVStore(redis_server, namespace, timeout_s=0.5, directory=directory)
    l3 = L3Tier(store, META)
    try:
        probe = l3.probe([hashlib.sha256(namespace.encode()).digest()])
        assert l3.wait_probe(probe) == [False]
        assert directory.stats.deferred == 1 and store.stats.probes == 1
    finally:
        l3.close()


def test_a_key_a_resync_scan_found_is_not_hidden_by_an_older_miss(redis_server):
    """A key a (re)scan found after a reader's stamp is not discarded with that stale stamp (review)."""
    namespace = f"test:dirF:{uuid.uuid4().hex[:8]}"
    name = f"{namespace}:k"
    raw = redis.Redis.from_url(redis_server)
    directory = KeyDirectory(redis_server, namespace).start()
    try:
        assert wait_for(lambda: directory.synced, 10)
        # a reader: stamp, then its GET misses (the key is not written yet)
        stamp = directory.adds
        assert raw.get(name) is None
        # meanwhile the directory's connection drops, another replica writes the key (its
        # announcement is lost while unsubscribed), and the directory resyncs with a scan that finds it
        disconnects = directory.stats.disconnects
        raw.set(name, b"v", ex=600)
        raw.client_kill_filter(_type="pubsub")
        assert wait_for(lambda: directory.stats.disconnects > disconnects, 10)
        assert wait_for(lambda: directory.synced and directory.contains(name) is True, 10)
        # the reader now reports its (older) miss
        directory.discard(name, unless_added_since=stamp)
        assert raw.exists(name) == 1
        assert directory.contains(name) is not False, "the directory answers 'absent' for a key Redis holds"
    finally:
        directory.close()
        raw.delete(name)
        raw.close()
