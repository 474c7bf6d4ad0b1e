"""Every Redis client is built here, from the user's `redis_url`.

redis-py's `from_url` lets the URL's query options override the keyword arguments the code passes. The
engine's guarantees rest on some of them: millisecond timeouts (a slow Redis never stalls a request),
bytes replies (the stores parse bytes), one connection pool shared by threads. A URL setting one of those
is refused here, naming the option, and so is a name the connection class would not take (redis-py would
raise TypeError at the first command, in a lookup or a background thread). The message names the option
only: the URL may carry a password. (`retry_on_timeout` and `health_check_interval` are honoured: the
request path's clients pass a Retry of no retries, which redis-py keeps, so neither adds a timeout there.)
"""

from __future__ import annotations

import inspect
from urllib.parse import parse_qs, urlsplit

_TIMEOUTS = (
    "the engine sets its own (milliseconds on the request path) so that a slow Redis never stalls a request"
)
ENGINE_OWNED = {
    "socket_timeout": _TIMEOUTS,
    "socket_connect_timeout": _TIMEOUTS,
    "retry": "a retry policy cannot come from a URL (the request path never retries)",
    "retry_on_error": "redis-py reads it from a URL as a list of characters, not of exception classes, and a "
    "failing Redis would then raise TypeError (retry_on_timeout=true is the URL's way to ask for retries)",
    "decode_responses": "the caches read replies as bytes (redis-py takes any value, 'false' too, as true)",
    "single_connection_client": "the caches share one client between threads",
}


def _accepted_names(scheme: str) -> set[str]:
    """The keyword names redis-py's pool and the scheme's connection class take."""
    from redis.connection import ConnectionPool, Connection, SSLConnection, UnixDomainSocketConnection

    connection = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}.get(scheme, Connection)
    names: set[str] = set()
    for cls in (*connection.__mro__, ConnectionPool):
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        for param in inspect.signature(init).parameters.values():
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                names.add(param.name)
    return names - {"self", "connection_class"}


def check_redis_query(redis_url: str) -> None:
    """Raise ValueError naming the first query option of `redis_url` the engine cannot honour."""
    parts = urlsplit(redis_url)
    names = parse_qs(parts.query)  # as redis-py reads them: names decoded, blank values dropped
    if not names:
        return
    accepted = _accepted_names(parts.scheme)
    credentials = redis_url.rpartition("@")[0]  # a password with an unencoded '?' puts a piece in the query
    for name in names:
        if name in ENGINE_OWNED:
            raise ValueError(f"redis_url sets {name!r}, which it may not: {ENGINE_OWNED[name]}; drop it")
        if name not in accepted:
            shown = "a query option" if name in credentials else f"the query option {name!r}"
            raise ValueError(
                f"redis_url has {shown} that redis-py's client does not take (percent-encode '/', '?', '#' "
                "and '@' in a user name or password)"
            )


def redis_from_url(redis_url: str, **kwargs):
    """`redis.Redis.from_url(redis_url, **kwargs)`, after `check_redis_query`: `kwargs` hold. A URL
    redis-py cannot read is refused without its credentials (`url_error`)."""
    import redis

    from cache.response_cache import url_error

    check_redis_query(redis_url)
    try:
        return redis.Redis.from_url(redis_url, **kwargs)
    except ValueError as exc:  # its text may quote part of the password
        raise url_error(redis_url, exc) from None
