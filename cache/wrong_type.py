"""A Redis reply that names a bad value under one of our keys, not a Redis failure.

Redis refuses a command on a key that holds another type (WRONGTYPE: a hash where a string was written,
a string where an index's sorted set was) or a counter that is not an integer (INCR). Redis answered:
the value is deleted like a corrupt one and counted, and the breaker, which guards against a Redis that
is down or slow, hears a success. Counted as a breaker failure, one tenant's damaged key would stop the
reads of every tenant.
"""

from __future__ import annotations


def is_wrong_type(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command for the type or the contents of a key."""
    text = str(exc)
    return "WRONGTYPE" in text or "not an integer or out of range" in text
