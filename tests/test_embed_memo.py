"""`RecentEmbeddings`: a prompt's lookup and its answer's store share one embedding (cache/embed_memo.py)."""

from __future__ import annotations

import numpy as np
import pytest

from cache.embed_memo import RecentEmbeddings


class CountingEmbedder:
    """A vector per text from its characters; records every batch it is asked for."""

    dim = 4

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.fail = False

    def embed(self, texts: list[str]) -> np.ndarray:
        self.batches.append(list(texts))
        if self.fail:
            raise RuntimeError("model gone")
        return np.array([[len(t), ord(t[0]), ord(t[-1]), 1.0] for t in texts], dtype=np.float32)

    def fits(self, texts: list[str]) -> list[bool]:
        return [len(t) < 10 for t in texts]

    def snapshot(self) -> dict[str, int]:
        return {"passes": len(self.batches)}


def test_a_text_embedded_before_is_answered_without_a_pass_and_with_the_same_vector():
    inner = CountingEmbedder()
    memo = RecentEmbeddings(inner, limit=8)
    first = memo.embed(["abc", "xyz"])
    again = memo.embed(["xyz", "new", "abc"])
    assert inner.batches == [["abc", "xyz"], ["new"]]
    assert np.array_equal(again[[0, 2]], first[[1, 0]]) and np.array_equal(again[1], inner.embed(["new"])[0])
    assert memo.snapshot() == {"passes": 3, "memo_reused": 2, "memo_embedded": 3}


def test_the_same_text_twice_in_one_call_is_embedded_once():
    inner = CountingEmbedder()
    out = RecentEmbeddings(inner).embed(["aa", "bb", "aa"])
    assert inner.batches == [["aa", "bb"]] and np.array_equal(out[0], out[2])


def test_past_its_limit_the_least_recently_used_text_goes():
    inner = CountingEmbedder()
    memo = RecentEmbeddings(inner, limit=2)
    memo.embed(["a", "b"])
    memo.embed(["a"])  # a is now the most recent
    memo.embed(["c"])  # b goes
    memo.embed(["a", "b"])
    assert inner.batches == [["a", "b"], ["c"], ["b"]]


def test_a_failed_pass_raises_and_keeps_nothing():
    inner = CountingEmbedder()
    memo = RecentEmbeddings(inner)
    inner.fail = True
    with pytest.raises(RuntimeError, match="model gone"):
        memo.embed(["abc"])
    inner.fail = False
    memo.embed(["abc"])
    assert inner.batches == [["abc"], ["abc"]]


def test_a_wrongly_shaped_answer_is_refused():
    inner = CountingEmbedder()
    inner.embed = lambda texts: np.zeros((len(texts) + 1, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="gave"):
        RecentEmbeddings(inner).embed(["abc"])


def test_fits_and_dim_are_the_inner_embedders_and_a_limit_below_one_is_refused():
    memo = RecentEmbeddings(CountingEmbedder())
    assert memo.dim == 4 and memo.fits(["short", "far too long"]) == [True, False]
    assert memo.embed([]).shape == (0, 4)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        RecentEmbeddings(CountingEmbedder(), limit=0)
