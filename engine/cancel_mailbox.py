"""Cancellation notices from the detokenizer step to the engine step of the same server.

Triton 24.10's ensemble does not cancel an in-flight step: it only marks the *next* step's
request as cancelled (core PR #263). The next step after the engine is the detokenizer, which
sees `request.is_cancelled()` and posts the engine's request key here; the engine collects the
notices between decode steps and frees the slot. One folder per engine process keeps servers
sharing a machine apart.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def request_keys() -> Iterator[int]:
    """The engine's request keys: random 63-bit numbers, not a counter. A key names the request a
    detokenizer request may cancel, and Triton serves the detokenizer to anyone: with counted keys a
    client read its own key off a direct llm_engine reply and cancelled the next ones, other tenants'
    streams (they ended short, without an error). Found in review."""
    while True:
        yield secrets.randbits(63) or 1


class CancelMailbox:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def inbox(self, namespace: int) -> Path:
        return self.root / str(namespace)

    def open_inbox(self, namespace: int) -> Path:
        """Create (empty) the engine's own inbox; stale notices of a dead process are dropped."""
        inbox = self.inbox(namespace)
        shutil.rmtree(inbox, ignore_errors=True)
        inbox.mkdir(parents=True, exist_ok=True)
        return inbox

    def close_inbox(self, namespace: int) -> None:
        """Remove the engine's inbox at unload: later posts for it are refused (`post` returns False)
        instead of piling up where no engine collects them."""
        shutil.rmtree(self.inbox(namespace), ignore_errors=True)

    def post(self, namespace: int, key: int) -> bool:
        """Leave a notice; False when no engine with that namespace has an inbox."""
        inbox = self.inbox(namespace)
        if not inbox.is_dir():
            return False
        try:
            (inbox / str(key)).touch()
        except FileNotFoundError:  # the engine unloaded meanwhile (`close_inbox`)
            return False
        return True

    def collect(self, namespace: int) -> set[str]:
        """Take every waiting notice (each is returned once)."""
        inbox = self.inbox(namespace)
        try:
            names = os.listdir(inbox)
        except FileNotFoundError:
            return set()
        for name in names:
            (inbox / name).unlink(missing_ok=True)
        return set(names)
