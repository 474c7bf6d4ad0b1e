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
