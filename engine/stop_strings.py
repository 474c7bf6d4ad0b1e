"""Stop-string detection on the bytes of generated tokens, with hold-back for streaming.

Tokens whose bytes could begin a stop string are held back until it is clear whether the stop
string completes, so a client never receives text that is later retracted.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s.encode("utf-8") for s in stops if s)
        self.buffer = bytearray()
        self.token_ends: list[int] = []

    def push(self, token_bytes: bytes) -> bool:
        """Add one token's bytes; True when a stop string is now complete."""
        start = len(self.buffer)
        self.buffer += token_bytes
        self.token_ends.append(len(self.buffer))
        return any(self._find(stop, start) >= 0 for stop in self.stops)

    def releasable(self, finished: bool) -> tuple[int, int]:
        """(tokens that may be sent, bytes to trim off their end).

        After a match: every token that starts before the stop string, trimmed to end exactly where
        it begins, and every token of no bytes at its start (a special token, released when it came:
        a count below what was sent would take text back). Otherwise: every token not held back as a
        possible stop-string start.
        """
        if not self.stops:
            return len(self.token_ends), 0
        cut = self._match_start()
        if cut is not None:
            starts = [0, *self.token_ends[:-1]]
            count = sum(1 for start, end in zip(starts, self.token_ends) if start < cut or end <= cut)
            return count, (self.token_ends[count - 1] - cut) if count else 0
        cut = len(self.buffer) if finished else len(self.buffer) - self._pending_prefix()
        return sum(1 for end in self.token_ends if end <= cut), 0

    def _find(self, stop: bytes, new_from: int) -> int:
        return self.buffer.find(stop, max(0, new_from - len(stop) + 1))

    def _match_start(self) -> int | None:
        found = [pos for pos in (self.buffer.find(stop) for stop in self.stops) if pos >= 0]
        return min(found) if found else None

    def _pending_prefix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(stop[:size]):
                    best = size
                    break
        return best
