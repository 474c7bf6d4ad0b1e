"""Which tenant a request may act as.

A tenant names the caches a request reads and writes (its key salt), so naming a tenant must not be
enough to become it: with a server secret (`LLM_TENANT_SECRET`, the same on every replica and model),
a request that names a tenant other than `default` must carry that tenant's token, an HMAC-SHA256 of
the name under the secret, which the operator issues (`python -m client tenant-token NAME`) and the
client cannot compute. Both the scheduler step and the engine check it: Triton serves `llm_engine`
directly too. `default` needs no token: it is the shared tenant of unauthenticated traffic.

Without a secret every named tenant is taken as given (development, or every client trusted); the
engine logs that once when it loads. A gateway that assigns tenants needs the secret too (it sends the
tokens): the `tenant` input and request parameter both come from the client, and a header Triton
forwards as a parameter loses to the client's own `tenant` tensor.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.errors import RequestError
from scheduler.validation import DEFAULT_TENANT

SECRET_ENV = "LLM_TENANT_SECRET"
_CONTEXT = b"llm-tenant-token-v1\0"  # a token is good for this use only


def tenant_token(secret: str | bytes, tenant: str) -> str:
    """The token that lets a request act as `tenant` (hex)."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hmac.new(key, _CONTEXT + tenant.encode("utf-8"), hashlib.sha256).hexdigest()


def token_from_env(tenant: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """What an operator's tool (warmup job, load generator, launcher) sends for `tenant`: its token
    when the secret is in its environment and the tenant needs one, else None."""
    secret = environ.get(SECRET_ENV, "")
    if not secret or tenant in (None, "", DEFAULT_TENANT):
        return None
    return tenant_token(secret, tenant)


@dataclass(frozen=True)
class TenantAuth:
    secret: bytes | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TenantAuth:
        value = environ.get(SECRET_ENV, "")
        return cls(value.encode("utf-8") if value else None)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def check(self, tenant: str, token: str | bytes | None) -> str:
        """The verified token ("" when none is needed); RequestError (INVALID_ARG) unless the request
        may act as `tenant`."""
        if self.secret is None or tenant == DEFAULT_TENANT:
            return ""
        if isinstance(token, bytes):
            token = token.decode("utf-8", errors="replace")
        if not token:
            raise RequestError.invalid(
                f"tenant {tenant!r} needs its tenant_token (input or request parameter): this server "
                "authenticates tenants; the operator issues tokens with `python -m client tenant-token NAME`"
            )
        if not hmac.compare_digest(token.encode("utf-8"), tenant_token(self.secret, tenant).encode("ascii")):
            raise RequestError.invalid(f"tenant_token is not tenant {tenant!r}'s")
        return token
