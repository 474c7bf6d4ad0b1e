"""The doorkeeper that admits an entry on its second sighting."""

from __future__ import annotations

import pytest

from cache.sightings import Sightings


def test_a_second_sighting_is_told_from_a_first():
    seen = Sightings[str](limit=4)
    assert [seen.seen_before(k) for k in ("a", "b", "a", "a", "c")] == [False, False, True, True, False]
    assert "b" in seen and "z" not in seen and len(seen) == 3


def test_the_oldest_sightings_are_forgotten_first_and_a_sighting_refreshes():
    seen = Sightings[int](limit=3)
    for key in (1, 2, 3):
        seen.note(key)
    assert seen.seen_before(1)  # 1 is now the most recent
    seen.note(4)  # over the limit: 2, the oldest, goes
    assert 2 not in seen and 1 in seen and len(seen) == 3
    assert not seen.seen_before(2), "a forgotten key counts as new"


def test_clear_and_a_bad_limit():
    seen = Sightings[str](limit=2)
    seen.note("a")
    seen.clear()
    assert not seen.seen_before("a")
    with pytest.raises(ValueError, match="limit must be positive"):
        Sightings(0)


def test_many_at_once_are_told_and_kept_as_one_at_a_time_would_be():
    one, many = Sightings(8), Sightings(8)
    for batch in (["a", "b", "c"], ["b", "d", "e"], ["a", "c", "f"], ["g", "b"]):  # never past the limit
        assert many.seen_many(batch) == [one.seen_before(key) for key in batch]
        assert list(many._keys) == list(one._keys)  # the same keys kept, in the same order


def test_a_key_sighted_before_the_batch_counts_even_if_the_batch_pushes_it_out():
    seen = Sightings(3)
    seen.seen_many(["a", "b", "c"])
    assert seen.seen_many(["x", "y", "a"]) == [False, False, True]  # one at a time, x and y would evict a
    assert list(seen._keys) == ["x", "y", "a"]
