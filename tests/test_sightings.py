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
        assert list(many._owned[""]) == list(one._owned[""])  # the same keys kept, in the same order


def test_a_key_sighted_before_the_batch_counts_even_if_the_batch_pushes_it_out():
    seen = Sightings(3)
    seen.seen_many(["a", "b", "c"])
    assert seen.seen_many(["x", "y", "a"]) == [False, False, True]  # one at a time, x and y would evict a
    assert list(seen._owned[""]) == ["x", "y", "a"]


def test_a_flooding_owner_forgets_its_own_sightings_not_another_owners():
    seen = Sightings[str](limit=10)
    seen.seen_many(["q1", "q2", "q3"], owner="quiet")
    for n in range(1000):  # one-off keys, far past the limit
        assert not seen.seen_before(f"flood-{n}", owner="flood")
    assert seen.owners() == {"quiet": 3, "flood": 7} and len(seen) == 10
    assert seen.seen_many(["q1", "q2", "q3"], owner="quiet") == [True, True, True]
    assert seen.contains("flood-999", "flood") and not seen.contains("flood-992", "flood")


def test_the_largest_holder_pays_and_equal_holders_take_turns():
    seen = Sightings[int](limit=6)
    seen.seen_many([1, 2, 3], owner="a")
    seen.seen_many([1, 2], owner="b")
    seen.note(1, owner="c")
    seen.note(4, owner="c")  # 7 > 6: a holds the most (3) and forgets its least recent, 1
    assert seen.owners() == {"a": 2, "b": 2, "c": 2} and not seen.contains(1, "a")
    seen.note(2, owner="b")  # a refresh: order of last change is c (its 4), a (its forgetting), b
    seen.note(9, owner="d")  # a, b, c hold 2: c changed least recently and forgets its 1
    assert seen.owners() == {"a": 2, "b": 2, "c": 1, "d": 1} and seen.contains(4, "c")
    seen.note(8, owner="d")  # a, b, d hold 2; a changed least recently: it forgets 2
    assert seen.owners() == {"a": 1, "b": 2, "c": 1, "d": 2} and seen.contains(3, "a")


def test_owners_are_apart_and_an_owner_that_holds_nothing_is_dropped():
    seen = Sightings[str](limit=2)
    assert not seen.seen_before("k", owner="a")
    assert not seen.seen_before("k", owner="b"), "another owner's sighting of the same key does not count"
    assert seen.seen_before("k", owner="a")  # a is now the most recently active
    seen.seen_many(["x", "y"], owner="c")  # 4 > 2: c holds the most and forgets x; then all hold 1 and
    assert seen.owners() == {"a": 1, "c": 1}  # b, the least recently changed, forgets k and is dropped
    assert seen.contains("y", "c") and seen.contains("k", "a") and len(seen) == 2
