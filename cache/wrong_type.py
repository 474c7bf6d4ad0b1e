"""A Redis reply that names a bad value under one of our keys, not a Redis failure.

Redis refuses a command on a key that holds another type (WRONGTYPE: a hash where a string was written,
a string where an index's sorted set was) or a counter that is not an integer (INCR). Redis answered:
the value is deleted like a corrupt one and counted, and the breaker, which guards against a Redis that
is down or slow, hears a success. Counted as a breaker failure, one tenant's damaged key would stop the
reads of every tenant.
"""

from __future__ import annotations


def holds_another_type(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command because the key holds another type (WRONGTYPE)."""
    return "WRONGTYPE" in str(exc)


def is_wrong_type(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command for the type or the contents of a key."""
    message = str(exc)
    return (
        holds_another_type(exc) or "not an integer or out of range" in message or "would overflow" in message
    )


# Delete KEYS[1] when it holds a type other than ARGV[1] ('string', 'zset', ...): a value damaged or
# overwritten by hand under one of our names. Returns 1 when it deleted, else 0 (absent, or the type).
DROP_OTHER_TYPE = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= ARGV[1] and kind ~= 'none' then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Delete KEYS[1] only while it still holds ARGV[1], the bad value a reader found: another replica may have
# written a good one over it since, which must stay. Returns 1 when it deleted, else 0.
DELETE_IF_UNCHANGED = """
if redis.call('TYPE', KEYS[1]).ok == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
