"""The cancel mailbox that carries ensemble cancellations from the detokenizer to the engine."""

from engine.cancel_mailbox import CancelMailbox


def test_notices_reach_only_their_engine_and_are_taken_once(tmp_path):
    mailbox = CancelMailbox(tmp_path)
    mailbox.open_inbox(100)
    mailbox.open_inbox(200)
    assert mailbox.post(100, 7) and mailbox.post(100, 8) and mailbox.post(200, 9)
    assert mailbox.collect(100) == {"7", "8"}
    assert mailbox.collect(100) == set()
    assert mailbox.collect(200) == {"9"}


def test_posting_to_an_unknown_engine_is_refused(tmp_path):
    mailbox = CancelMailbox(tmp_path)
    assert not mailbox.post(12345, 1)
    assert mailbox.collect(12345) == set()


def test_reopening_an_inbox_drops_stale_notices(tmp_path):
    mailbox = CancelMailbox(tmp_path)
    mailbox.open_inbox(1)
    mailbox.post(1, 5)
    mailbox.open_inbox(1)
    assert mailbox.collect(1) == set()


def test_request_keys_cannot_be_guessed_from_one_another():
    """A detokenizer request cancels the engine request its key names, and anyone may send one: a key
    must not tell the next. Found in review (the keys were a counter)."""
    from engine.cancel_mailbox import request_keys

    keys = request_keys()
    sample = [next(keys) for _ in range(2000)]
    assert len(set(sample)) == len(sample) and all(0 < k < 2**63 for k in sample)
    steps = {b - a for a, b in zip(sample, sample[1:])}
    assert len(steps) > 1990  # no constant stride, as a counter has
    assert sum(k >= 2**62 for k in sample) > 800  # spread over the range
