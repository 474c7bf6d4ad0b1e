"""The bounded table of when keys were last marked (`cache/stamps.py`)."""

from __future__ import annotations

import pytest

from cache.stamps import Stamps


def test_past_its_limit_the_stalest_marks_go():
    stamps: Stamps[str] = Stamps(3)
    stamps.stamp(["a", "b", "c"], 1.0)
    stamps.stamp(["a"], 2.0)  # a is now the freshest
    stamps.stamp(["d"], 3.0)
    assert len(stamps) == 3 and stamps.get("b", -1.0) == -1.0
    assert (stamps.get("a", -1.0), stamps.get("c", -1.0), stamps.get("d", -1.0)) == (2.0, 1.0, 3.0)


def test_due_lets_a_key_through_once_a_period_and_marks_it():
    stamps: Stamps[str] = Stamps(10)
    assert stamps.due(["a", "b"], 100.0, 60.0) == ["a", "b"]
    assert stamps.due(["a", "b"], 130.0, 60.0) == []
    assert stamps.due(["a", "c"], 160.0, 60.0) == ["a", "c"]
    stamps.pop("a")
    assert stamps.due(["a"], 161.0, 60.0) == ["a"]


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="limit must be >= 0"):
        Stamps(-1)


def test_a_limit_of_zero_remembers_nothing():
    stamps: Stamps[str] = Stamps(0)
    stamps.stamp(["a"], 1.0)
    assert len(stamps) == 0
    assert stamps.due(["a"], 1.0, 60.0) == ["a"] and stamps.due(["a"], 1.0, 60.0) == ["a"]
