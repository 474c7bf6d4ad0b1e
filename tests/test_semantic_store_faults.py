"""The semantic cache's store script, tenant bound and counters, found in review (2026-12-07): a bad entry
whose cleanup another replica's store refused is counted once, the bound never evicts the entry just
written, and a stamp INCR cannot move leaves no key without TTL and no breaker failure."""

from __future__ import annotations

import uuid

import pytest

import cache.semantic_cache as sc
from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_semantic_versions import NoEmbedder, vec

GREEDY = EngineRequestParams(max_tokens=32)
RESET, DARK, TRACK = "How do I reset my password?", "Is there a dark mode?", "How do I track my package?"


@pytest.fixture
def pair(redis_server):
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    caches = [
        SemanticResponseCache(redis_server, fp, NoEmbedder(), verifier=None, timeout_s=0.5) for _ in range(2)
    ]
    yield *caches, f"t-{uuid.uuid4().hex[:8]}"
    for c in caches:
        c.close()


def test_a_bad_entry_whose_cleanup_was_refused_is_counted_once(pair):
    """Replica A reads a tenant with one bad entry; B stores before A's cleanup (which is then refused);
    A's next read finds the same bad entry and deletes it: one bad entry, one count."""
    a, b, tenant = pair
    assert b.store(RESET, tenant, GREEDY, answer("reset"), embedding=vec(0))
    emb_key, doc_key, _, _ = b._keys(tenant)
    entry = next(iter(b.client.hkeys(doc_key)))
    b.client.hset(doc_key, entry, b"{}")  # corrupt document
    b.client.incr(b._keys(tenant)[3])
    real = a._delete_script

    def other_replica_first(keys, args):
        assert b.store(TRACK, tenant, GREEDY, answer("track"), embedding=vec(7))
        return real(keys=keys, args=args)

    a._delete_script = other_replica_first
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)) is None
    a._delete_script = real
    assert a.lookup(RESET, tenant, GREEDY, embedding=vec(0)) is None
    assert not a.client.hexists(doc_key, entry)  # deleted by now
    stats = a.snapshot()
    assert stats["corrupt"] + stats["incomplete"] == 1, stats


def test_the_bound_evicts_the_older_entry_not_the_one_just_written(pair, monkeypatch):
    """max 1 entry: two stores within one millisecond share an age score; the one written first must go."""
    a, _, tenant = pair
    a.max_entries = 1
    monkeypatch.setattr(sc.time, "time", lambda: 1_800_000_000.0)
    sig = a.signature(GREEDY)
    first, second = sorted([RESET, DARK, TRACK], key=lambda p: a.entry_id(sig, p), reverse=True)[:2]
    assert a.entry_id(sig, second) < a.entry_id(sig, first)
    assert a.store(first, tenant, GREEDY, answer("first"), embedding=vec(1))
    assert a.store(second, tenant, GREEDY, answer("second"), embedding=vec(2))
    hit = a.lookup(second, tenant, GREEDY, embedding=vec(2))
    assert hit is not None and hit.answer == answer("second"), "the entry just written was evicted"


def test_a_stamp_that_cannot_be_incremented_leaves_no_key_without_ttl_and_no_breaker_failure(pair):
    """A damaged stamp (at INCR's limit) is a bad value of one tenant, like a non-integer one."""
    a, _, tenant = pair
    keys = a._keys(tenant)
    a.client.set(keys[3], str(2**63 - 1))
    a.store(RESET, tenant, GREEDY, answer("reset"), embedding=vec(0))
    for k in keys:
        assert a.client.ttl(k) != -1, f"{k} left with no TTL"
    assert a.snapshot()["errors"] == 0
