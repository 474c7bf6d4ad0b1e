"""Which tenant a request may act as.

A tenant names the caches a request reads and writes (its key salt), so naming a tenant must not be
enough to become it: with a server secret (`LLM_TENANT_SECRET`, the same on every replica and model),
a request that names a tenant other than `default` must carry that tenant's token, an HMAC-SHA256 of
the name under the secret, which the operator issues (`python -m client tenant-token NAME`) and the
client cannot compute. Both the scheduler step and the engine check it: Triton serves `llm_engine`
directly too. `default` needs no token: it is the shared tenant of unauthenticated traffic, unless
`LLM_TENANT_ANONYMOUS=false`, which refuses requests without a token (a deployment whose every client
is a tenant of its own must not let anonymous traffic share one tenant's caches).

Tokens may expire: `tenant-token NAME --ttl 30d` (the default) signs the tenant with an expiry time, and
the server refuses the token after it; `--ttl never` issues the old kind, which only a new secret
revokes, and `LLM_TENANT_TOKEN_REQUIRE_EXPIRY=1` makes the servers refuse those. A secret is rotated
without refusing live tokens: move it to `LLM_TENANT_SECRET_PREVIOUS`, set the new one, reissue the
tokens, then drop the previous one.

Without a secret a server cannot tell tenants apart, so it serves `default` only and refuses a request
that names another tenant: the key salt is set by the server, never by the client. Development, or a
deployment whose every client is trusted, may take tenants as named instead (`LLM_TENANT_TRUST_CLIENT=
true`); the engine logs that once when it loads. `python -m deploy.launch` started without either gives
its stack a secret of its own (deploy/launch.py), which the client tools read for a stack they target.
A gateway that assigns tenants needs the secret too (it sends the tokens): the `tenant` input and
request parameter both come from the client, and a header Triton forwards as a parameter loses to the
client's own `tenant` tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

from scheduler.errors import RequestError
from scheduler.messages import utf8_encodable
from scheduler.tiers import Tier
from scheduler.validation import DEFAULT_TENANT

SECRET_ENV = "LLM_TENANT_SECRET"
PREVIOUS_SECRET_ENV = "LLM_TENANT_SECRET_PREVIOUS"  # still accepted while tokens are reissued
REQUIRE_EXPIRY_ENV = "LLM_TENANT_TOKEN_REQUIRE_EXPIRY"
ANONYMOUS_ENV = "LLM_TENANT_ANONYMOUS"  # false: every request needs a token, `default`'s included
TRUST_ENV = "LLM_TENANT_TRUST_CLIENT"  # true, without a secret: tenants taken as named (development)
_CONTEXT = b"llm-tenant-token-v1\0"  # a token is good for this use only
_CONTEXT_EXPIRING = b"llm-tenant-token-v2\0"
TOOL_TOKEN_TTL_S = 24 * 3600  # what operator tools (warmup job, load generator) sign for themselves
_MAX_EXPIRY_DIGITS = 12  # unix seconds until the year 33658: a longer number is no token of ours
_EXPIRY = re.compile(f"[0-9]{{1,{_MAX_EXPIRY_DIGITS}}}")
MAX_TTL_S = 10 * 365 * 86400  # what `tenant-token --ttl` signs at most: ten years


DEFAULT_TOKEN_TTL = "30d"  # what `tenant-token` signs unless told otherwise
_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def ttl_argument(text: str) -> int | None:
    """An argparse type for a token's lifetime: seconds from "3600s", "90m", "24h", "30d"; None for
    "never"."""
    text = text.strip().lower()
    if text == "never":
        return None
    number, unit = text[:-1], text[-1:]
    if unit not in _TTL_UNITS or not (number.isascii() and number.isdigit()) or int(number) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 3600s, 90m, 24h, 30d or 'never', got {text!r}"
        )
    seconds = int(number) * _TTL_UNITS[unit]
    if seconds > MAX_TTL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than {MAX_TTL_S // 86400}d; use 'never' for a token that does not expire"
        )
    return seconds


def utc_text(unix_s: int) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _key(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else secret


def tenant_token(secret: str | bytes, tenant: str, expires_at: int | None = None) -> str:
    """The token that lets a request act as `tenant`: hex of an HMAC-SHA256 of it, or with `expires_at`
    (unix seconds) "EXPIRY.HEX", the expiry signed with the tenant."""
    if expires_at is None:
        return hmac.new(_key(secret), _CONTEXT + tenant.encode("utf-8"), hashlib.sha256).hexdigest()
    if not 0 < expires_at < 10**_MAX_EXPIRY_DIGITS:
        raise ValueError(f"expires_at must be unix seconds, got {expires_at}")
    message = _CONTEXT_EXPIRING + tenant.encode("utf-8") + b"\0" + str(expires_at).encode("ascii")
    return f"{expires_at}.{hmac.new(_key(secret), message, hashlib.sha256).hexdigest()}"


def secret_error(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a tool cannot sign tokens with the secret in its environment (it is not UTF-8 text), or None."""
    if utf8_encodable(environ.get(SECRET_ENV, "")):
        return None
    return f"{SECRET_ENV} is not UTF-8 text: tokens are signed with its UTF-8 bytes"


def token_from_env(
    tenant: str | None,
    environ: Mapping[str, str] = os.environ,
    now: float | None = None,
    ttl_s: int | None = TOOL_TOKEN_TTL_S,
) -> str | None:
    """What an operator's tool (warmup job, load generator, launcher) sends for `tenant` (None: default):
    a token good for `ttl_s` (None: one that never expires) when the secret is in its environment, else
    None. The tools send `default`'s too: they use the restricted tiers (warmup, critical)."""
    secret = environ.get(SECRET_ENV, "")
    if not secret:
        return None
    tenant = tenant or DEFAULT_TENANT  # default's token: for the restricted tiers
    expires_at = None if ttl_s is None else int(time.time() if now is None else now) + ttl_s
    return tenant_token(secret, tenant, expires_at)


def _flag(environ: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class TenantAuth:
    secret: bytes | None = None
    previous: bytes | None = None  # the secret before a rotation: its tokens still pass
    require_expiry: bool = False  # refuse tokens without an expiry
    anonymous: bool = True  # `default` without a token (at unrestricted tiers); False: every request signed
    # without a secret: take named tenants as given. The servers read it from TRUST_ENV (default false);
    # True here is for engines built in-process (tests, in-process benchmarks), whose caller is the client
    trust_client: bool = True
    clock: Callable[[], float] = field(default=time.time, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TenantAuth:
        """ValueError for a setting that makes no sense (a previous secret without a current one, a flag
        that is not true or false): a server must not start half-authenticating."""
        value, previous = environ.get(SECRET_ENV, ""), environ.get(PREVIOUS_SECRET_ENV, "")
        require_expiry = _flag(environ, REQUIRE_EXPIRY_ENV)
        anonymous = _flag(environ, ANONYMOUS_ENV, default=True)
        trust_client = _flag(environ, TRUST_ENV)
        if trust_client and value:
            raise ValueError(f"{TRUST_ENV}=true and {SECRET_ENV} are both set: tenants need tokens or do not")
        for name, needs_secret in (
            (PREVIOUS_SECRET_ENV, bool(previous)),
            (REQUIRE_EXPIRY_ENV, require_expiry),
            (ANONYMOUS_ENV, not anonymous),
        ):
            if needs_secret and not value:
                raise ValueError(f"{name} is set but {SECRET_ENV} is not: tenants would be taken as named")
        return cls(
            value.encode("utf-8") if value else None,
            previous.encode("utf-8") if previous else None,
            require_expiry,
            anonymous,
            trust_client,
        )

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def check(self, tenant: str, token: str | bytes | None, tier: Tier | None = None) -> str:
        """The verified token ("" when none is needed); RequestError (INVALID_ARG) unless the request
        may act as `tenant` at `tier`. A restricted tier needs a token, `default`'s included: anonymous
        traffic may not jump the queue or, at the warmup tier, write the caches at once. `tier` None: the
        steps' own requests (the engine's warmup, the scheduler step's self-warmup, Triton's warmup
        samples to either), never refused for lacking one."""
        if self.secret is None:
            if tier is None or self.trust_client:
                return ""
            if tenant != DEFAULT_TENANT:
                raise RequestError.invalid(
                    f"tenant {tenant!r}: this server has no {SECRET_ENV}, so it cannot tell tenants apart "
                    f"and serves tenant {DEFAULT_TENANT!r} only; leave the tenant out, or have the operator "
                    f"set {SECRET_ENV} (tenants then send tokens) or, in development, {TRUST_ENV}=true"
                )
            if tier.restricted:  # no token could show the right to it
                raise RequestError.invalid(
                    f"slo_tier {tier.name!r} is restricted to clients with a tenant_token, and this server "
                    f"has no {SECRET_ENV} to check one against (in development: {TRUST_ENV}=true)"
                )
            return ""
        if isinstance(token, bytes):
            token = token.decode("utf-8", errors="replace")
        if not isinstance(token, (str, type(None))):  # a request parameter may be an int or a bool
            raise RequestError.invalid(f"tenant_token must be a string, got {type(token).__name__}")
        if tenant == DEFAULT_TENANT and not token:
            if tier is not None and not self.anonymous:
                raise RequestError.invalid(
                    f"this server refuses requests without a tenant_token ({ANONYMOUS_ENV}=false): name "
                    "your tenant and send its token (the operator issues it with `python -m client "
                    "tenant-token NAME`)"
                )
            if tier is not None and tier.restricted:
                raise RequestError.invalid(
                    f"slo_tier {tier.name!r} is restricted to clients with a tenant_token (for 'default' too:"
                    " the operator issues it with `python -m client tenant-token default`)"
                )
            return ""
        if not token:
            raise RequestError.invalid(
                f"tenant {tenant!r} needs its tenant_token (input or request parameter): this server "
                "authenticates tenants; the operator issues tokens with `python -m client tenant-token NAME`"
            )
        expiry, _, _ = token.rpartition(".")
        if expiry and not (_EXPIRY.fullmatch(expiry) and int(expiry) > 0):  # ASCII digits: "²".isdigit()
            raise RequestError.invalid(f"tenant_token is not the token of tenant {tenant!r}")
        expires_at = int(expiry) if expiry else None
        secrets = [s for s in (self.secret, self.previous) if s is not None]
        signed = (tenant_token(s, tenant, expires_at).encode("ascii") for s in secrets)
        sent = token.encode("utf-8", errors="replace")  # a lone surrogate: no token of ours either
        if not any(hmac.compare_digest(sent, good) for good in signed):
            raise RequestError.invalid(f"tenant_token is not the token of tenant {tenant!r}")
        if expires_at is None and self.require_expiry:
            raise RequestError.invalid(
                f"tenant {tenant!r}'s tenant_token has no expiry and this server requires one "
                f"({REQUIRE_EXPIRY_ENV}): ask the operator for a new one (`tenant-token NAME --ttl 30d`)"
            )
        if expires_at is not None and expires_at <= self.clock():
            raise RequestError.invalid(f"tenant {tenant!r}'s tenant_token expired at {utc_text(expires_at)}")
        return token
