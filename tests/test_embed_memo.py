"""`RecentVectors`: a prompt's lookup and its answer's store share one embedding, per tenant
(cache/embed_memo.py)."""

from __future__ import annotations

import numpy as np
import pytest

from cache.embed_memo import RecentVectors


def test_a_kept_vector_comes_back_for_its_tenant_only():
    recent = RecentVectors(limit=8)
    vec = np.arange(4, dtype=np.float32)
    recent.put("acme", "how do i reset my password", vec)
    assert recent.get("acme", "how do i reset my password") is vec
    assert recent.get("globex", "how do i reset my password") is None, "no tenant learns another's"
    assert recent.get("acme", "how do i reset my email") is None
    assert recent.snapshot() == {"reused": 1, "embedded": 1}


def test_past_its_limit_the_least_recently_used_vector_goes():
    recent = RecentVectors(limit=2)
    for text in ("a", "b"):
        recent.put("t", text, np.zeros(2, dtype=np.float32))
    assert recent.get("t", "a") is not None  # a is now the most recent
    recent.put("t", "c", np.zeros(2, dtype=np.float32))  # b goes
    assert [recent.get("t", text) is not None for text in "abc"] == [True, False, True]


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        RecentVectors(limit=0)


def test_clear_forgets_every_vector():
    recent = RecentVectors(limit=4)
    recent.put("t", "a", np.zeros(2, dtype=np.float32))
    recent.clear()
    assert recent.get("t", "a") is None
