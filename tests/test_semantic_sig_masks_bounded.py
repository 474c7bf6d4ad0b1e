"""A tenant's in-memory matrix must not grow with the number of distinct sampling signatures looked up.

`_ranked` caches a boolean row mask per signature on the tenant's `_TenantMatrix` (`sig_masks`) and never
drops one until the tenant's version moves. A signature holds the seed, temperature, top_p/top_k and the
stop strings, all client-chosen: lookups that do not store (a cancelled or rejected request, any run of
lookups between two stores of the tenant) each add a mask of one byte per entry. At the default bound
(10,000 entries) that is 10 KB per distinct seed, held for every one of up to 64 cached tenants, and a
repeated prompt's lookup costs no MiniLM pass (the recent vectors), so it grows fast."""

from __future__ import annotations

import uuid


from cache.semantic_cache import SemanticResponseCache
from scheduler.messages import EngineRequestParams
from tests.conftest import answer
from tests.test_semantic_versions import NoEmbedder, vec


def test_signature_masks_held_for_a_tenant_are_bounded(redis_server):
    cache = SemanticResponseCache(redis_server, f"fp-{uuid.uuid4().hex[:8]}", NoEmbedder(), verifier=None)
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(50):
            assert cache.store(
                f"How do I configure option {i}?",
                tenant,
                EngineRequestParams(),
                answer(f"a{i}"),
                embedding=vec(i),
            )
        for seed in range(2000):  # seeded sampling is cacheable; every seed is another signature
            params = EngineRequestParams(max_tokens=16, temperature=0.7, seed=seed)
            assert cache.lookup("How do I configure option 3?", tenant, params, embedding=vec(3)) is None
        tm = cache._matrices[tenant]
        held = sum(mask.nbytes for mask in tm.sig_masks.values())
        assert len(tm.sig_masks) <= 64, (
            f"{len(tm.sig_masks)} signature masks ({held} bytes) held for one tenant"
        )
        # still correct for the common signature after the flood
        hit = cache.lookup("How do I configure option 3?", tenant, EngineRequestParams(), embedding=vec(3))
        assert hit is not None and hit.answer == answer("a3")
    finally:
        cache.close()
