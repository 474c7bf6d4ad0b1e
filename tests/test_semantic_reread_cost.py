"""A tenant's re-read after one store must not re-validate every entry it already held (review).

Every store of a tenant (by any replica: each INCRs its version stamp) makes every replica's next lookup
of that tenant re-read it whole, and `_build_matrix` runs `_validate` (JSON parse, shape check of every
token id, SHA-256 over a canonical re-encoding) on every entry again. At the documented bound of 10,000
entries per tenant (256-token answers) that measured 1.8-3.7 s on the lookup thread of a 2-core VM,
after each store of a busy tenant (a write per miss), and each lookup thread that sees the move redoes it.
Deterministic check: count `_validate` calls on the re-read after one new entry."""

from __future__ import annotations

import uuid

from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_semantic_versions import NoEmbedder, vec

G = EngineRequestParams(max_tokens=32)


def test_a_reread_after_one_store_validates_only_what_changed(redis_server, monkeypatch):
    fp = f"fp-{uuid.uuid4().hex[:8]}"
    a = SemanticResponseCache(redis_server, fp, NoEmbedder(), verifier=None, timeout_s=2)
    b = SemanticResponseCache(redis_server, fp, NoEmbedder(), verifier=None, timeout_s=2)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(300):
            assert a.store(
                f"How do I set up feature {i}?", tenant, G, answer(f"answer {i}"), embedding=vec(i)
            )
        assert b.lookup("How do I set up feature 7?", tenant, G, embedding=vec(7)).answer == answer(
            "answer 7"
        )
        calls = []
        real = SemanticResponseCache._validate
        monkeypatch.setattr(
            SemanticResponseCache, "_validate", lambda self, *args: calls.append(args[0]) or real(self, *args)
        )
        assert a.store("How do I set up feature 300?", tenant, G, answer("answer 300"), embedding=vec(300))
        assert b.lookup("How do I set up feature 300?", tenant, G, embedding=vec(300)).answer == answer(
            "answer 300"
        )
        assert b.lookup("How do I set up feature 9?", tenant, G, embedding=vec(9)).answer == answer(
            "answer 9"
        )
        assert len(calls) <= 5, f"the re-read after one store validated {len(calls)} entries again"
        # an entry whose bytes changed is validated again, not reused
        bad_id = b._matrices[tenant].ids[0]
        a.client.hset(a._keys(tenant)[1], bad_id, b"{}")
        a.client.incr(a._keys(tenant)[3])
        b.lookup("How do I set up feature 1?", tenant, G, embedding=vec(1))
        assert bad_id not in b._matrices[tenant].ids and b.snapshot()["corrupt"] == 1
    finally:
        a.close()
        b.close()
