"""API keys and tenants.

A key comes as ``Authorization: Bearer <key>`` (OpenAI clients) or ``x-api-key: <key>``
(Anthropic clients); the bearer header wins when both are sent.

Keys are high-entropy random tokens, so they are stored as salted SHA-256 (``sha256$salt$hex``),
never in plain text; a key may also come from an environment variable (a Kubernetes Secret),
hashed in memory at start. A verified key is cached by its own SHA-256, not by the key.

One key, one tenant: a key from the environment that is also another tenant's (its value under a
second tenant's variable, or a key that another tenant's hash verifies) makes the gateway refuse
to start, naming the two tenants, never the key; so does an admin key that is also a tenant's
(:func:`check_admin_keys`). Hashes are salted, so two hashes of one key cannot be told apart;
the config refuses the same hash listed twice (``serving.config``).

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

__all__ = ["ANONYMOUS", "Authenticator", "Tenant", "check_admin_keys", "hash_key", "new_key", "tenant_cache_salt"]


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


def _env_key(var: str) -> str:
    return (os.environ.get(var) or "").strip()  # a Secret made from a file ends in a newline


def _verifies(key: str, salt: str, hexd: str) -> bool:
    return hmac.compare_digest(hashlib.sha256((salt + key).encode()).hexdigest(), hexd)


class Authenticator:
    """Maps a bearer key to its tenant. Built from the gateway's user_config ``auth`` section."""

    def __init__(self, auth: AuthConfig) -> None:
        self.open = auth.mode == "open"
        self._hashed: list[tuple[str, str, Tenant]] = []  # (salt, hexdigest, tenant)
        self._cache: dict[bytes, Tenant] = {}
        self._env: list[tuple[str, str]] = []  # (tenant, variable) of each key read from the environment
        for t in auth.tenants:
            tenant = Tenant(t.name, frozenset(t.models), t.rpm, t.tpm, t.priority, t.max_streams)
            for h in t.key_hashes:
                _, salt, hexd = h.split("$")
                self._hashed.append((salt, hexd, tenant))
            if t.key_env:
                key = _env_key(t.key_env)
                if key:
                    self._env.append((t.name, t.key_env))
                    self._cache[_digest(key)] = tenant
                else:
                    logger.warning("tenant %s: environment variable %s is not set", t.name, t.key_env)
        shared = None if self.open else self.shared_key()
        if shared is not None:
            (a, how_a), (b, how_b) = sorted(shared, key=lambda o: [t.name for t in auth.tenants].index(o[0]))
            raise ValueError(
                f"auth: tenants {a!r} ({how_a}) and {b!r} ({how_b}) have the same API key: "
                "each tenant needs keys of its own"
            )
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
            if _verifies(key, salt, hexd):
                self._cache[d] = t
                return t
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")

    def _owners(self, key: str) -> list[tuple[str, str]]:
        """Every (tenant, how) ``key`` authenticates as here, one per key entry: none, or more
        than one tenant when keys are shared."""
        d = _digest(key)
        found = [(name, f"key_env {var}") for name, var in self._env if _digest(_env_key(var)) == d]
        return found + [(t.name, "key_hashes") for salt, hexd, t in self._hashed if _verifies(key, salt, hexd)]

    def shared_key(self, other: Authenticator | None = None) -> tuple[tuple[str, str], tuple[str, str]] | None:
        """Two tenants that one key authenticates as, each with where its key comes from (a
        variable, hashes): two of this authenticator's, or (with ``other``) this one's first,
        then the other's; None if there are none. Only keys
        from the environment are known here, so they are what is checked: against every key of
        both, and (hashes being salted) a hash only as the same ``salt$hex`` listed in both."""
        pairs: list[tuple[Authenticator, Authenticator]] = (
            [(self, self)] if other is None else [(self, other), (other, self)]
        )
        for mine, theirs in pairs:
            for name, var in mine._env:
                for owner in theirs._owners(_env_key(var)):
                    if other is not None or owner[0] != name:
                        return ((name, f"key_env {var}"), owner) if mine is self else (owner, (name, f"key_env {var}"))
        if other is not None:
            ours = {(salt, hexd): t.name for salt, hexd, t in self._hashed}
            for salt, hexd, t in other._hashed:
                if (salt, hexd) in ours:
                    return (ours[(salt, hexd)], "key_hashes"), (t.name, "key_hashes")
        return None


def check_admin_keys(admins: Authenticator, tenants: Authenticator) -> None:
    """Refuse (ValueError, naming the tenant, never the key) an admin key that is also a tenant's:
    a tenant would read the admin routes. Nothing to check while tenants are open (no keys)."""
    if tenants.open:
        return
    shared = admins.shared_key(tenants)
    if shared is not None:
        (_, how_admin), (tenant, how_tenant) = shared
        raise ValueError(
            f"controller: the admin key ({how_admin}) is also the API key of tenant {tenant!r} ({how_tenant}): "
            "an admin key must be no tenant's"
        )


def tenant_cache_salt(tenant: str, client: str | None = None) -> str:
    """vLLM's ``cache_salt`` for a tenant's request (``client``: the salt the client sent, which
    keeps its own requests apart within the tenant). A client cannot send another tenant's:
    the gateway replaces every salt, and engines answer only the gateway."""
    h = hashlib.blake2b(digest_size=12)
    h.update(tenant.encode())
    h.update(b"\x00")
    h.update((client or "").encode())
    return "t" + h.hexdigest()
