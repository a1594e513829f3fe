"""API keys and tenants.

A key comes as ``Authorization: Bearer <key>`` (OpenAI clients) or ``x-api-key: <key>``
(Anthropic clients); the bearer header wins when both are sent.

Keys are high-entropy random tokens, so they are stored as salted SHA-256 (``sha256$salt$hex``),
never in plain text; a key may also come from an environment variable (a Kubernetes Secret),
hashed in memory at start. A verified key is cached by its own SHA-256, not by the key.

Tenants share engines but not their prompts' cached KV blocks: :func:`tenant_cache_salt` is the
vLLM ``cache_salt`` the gateway gives each tenant's requests.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass

from serving.config import AuthConfig
from serving.errors import AuthenticationError

logger = logging.getLogger("serving.gateway")

__all__ = ["ANONYMOUS", "Authenticator", "Tenant", "hash_key", "new_key", "tenant_cache_salt"]


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]
    rpm: int | None = None
    tpm: int | None = None
    priority: int = 5
    max_streams: int | None = None  # concurrent streams, across gateway replicas

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


ANONYMOUS = Tenant("anonymous", frozenset({"*"}))


def hash_key(key: str, salt: str | None = None) -> str:
    salt = salt or secrets.token_hex(8)
    return f"sha256${salt}${hashlib.sha256((salt + key).encode()).hexdigest()}"


def new_key() -> str:
    return "sk-rs-" + secrets.token_urlsafe(32)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Authenticator:
    """Maps a bearer key to its tenant. Built from the gateway's user_config ``auth`` section."""

    def __init__(self, auth: AuthConfig) -> None:
        self.open = auth.mode == "open"
        self._hashed: list[tuple[str, str, Tenant]] = []  # (salt, hexdigest, tenant)
        self._cache: dict[bytes, Tenant] = {}
        for t in auth.tenants:
            tenant = Tenant(t.name, frozenset(t.models), t.rpm, t.tpm, t.priority, t.max_streams)
            for h in t.key_hashes:
                _, salt, hexd = h.split("$")
                self._hashed.append((salt, hexd, tenant))
            if t.key_env:
                key = (os.environ.get(t.key_env) or "").strip()  # a Secret made from a file ends in a newline
                if key:
                    self._cache[_digest(key)] = tenant
                else:
                    logger.warning("tenant %s: environment variable %s is not set", t.name, t.key_env)
        if self.open:
            logger.warning(
                "AUTH IS OFF (auth.mode: open): every request is accepted without a key. "
                "Use this for local development only."
            )

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        if self.open:
            return ANONYMOUS
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        elif api_key and api_key.strip():
            key = api_key.strip()
        else:
            raise AuthenticationError(
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key"
            )
        d = _digest(key)
        tenant = self._cache.get(d)
        if tenant is not None:
            return tenant
        for salt, hexd, t in self._hashed:
            calc = hashlib.sha256((salt + key).encode()).hexdigest()
            if hmac.compare_digest(calc, hexd):
                self._cache[d] = t
                return t
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")


def tenant_cache_salt(tenant: str, client: str | None = None) -> str:
    """vLLM's ``cache_salt`` for a tenant's request (``client``: the salt the client sent, which
    keeps its own requests apart within the tenant). A client cannot send another tenant's:
    the gateway replaces every salt, and engines answer only the gateway."""
    h = hashlib.blake2b(digest_size=12)
    h.update(tenant.encode())
    h.update(b"\x00")
    h.update((client or "").encode())
    return "t" + h.hexdigest()
