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

    def releasable(self, finished: bool) -> int:
        """How many tokens may be sent: all before a matched stop string, else all not held back."""
        if not self.stops:
            return len(self.token_ends)
        cut = self._match_start()
        if cut is None:
            cut = len(self.buffer) if finished else len(self.buffer) - self._pending_prefix()
        return sum(1 for end in self.token_ends if end <= cut)

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
