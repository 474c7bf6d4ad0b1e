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
