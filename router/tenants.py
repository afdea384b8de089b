"""API key -> tenant -> cache salt.

A salted tenant's requests carry `cache_salt = HMAC-SHA256(secret, fields)` where fields
are length-prefixed (b"cacheroute-salt-v1", tenant_id): vLLM mixes the salt into block 0's
key, so its cached blocks can only be hit by requests with the same salt, i.e. the same
tenant. Length prefixes make the encoding injective (no tenant id can be crafted to
collide with another's fields), and the secret keeps salts unguessable, so knowing a
tenant's name does not let anyone probe its cache. Unsalted tenants share the public pool
(salt None).

A client may send its own cache_salt (to split its cache further). Per tenant it is either
rejected (`ClientSaltRejected`, a 400) or namespaced: HMAC(secret, ("cacheroute-client-salt-v1",
tenant's salt or id, client salt)) under a different prefix, so it can never equal any
tenant's salt nor another tenant's namespaced salt.

Keys are looked up by their keyed hash (HMAC with a per-process random key): the dict
compares digests an attacker cannot steer, never the key's own bytes, so the time a lookup
takes says nothing about how many leading bytes of a guess were right. The registry keeps
no raw key, and nothing here logs one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from router.config import TenantsConfig

SALT_LABEL = b"cacheroute-salt-v1"
CLIENT_SALT_LABEL = b"cacheroute-client-salt-v1"
# Distinct prefixes keep the two kinds of salt disjoint as strings as well as by label.
TENANT_SALT_PREFIX = "t1-"
CLIENT_SALT_PREFIX = "c1-"
MAX_CACHE_SALT_CHARS = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")


class TenantError(ValueError):
    """A request's credentials or cache_salt are unacceptable; `status` is the HTTP code."""

    status = 400
    param: str | None = None


class AuthenticationError(TenantError):
    """No valid API key and anonymous requests are not allowed (401)."""

    status = 401


class ClientSaltError(TenantError):
    """The request's cache_salt cannot be used (400, param cache_salt)."""

    param = "cache_salt"


class ClientSaltRejected(ClientSaltError):
    """This tenant may not choose its own cache_salt."""


class InvalidCacheSalt(ClientSaltError):
    """The cache_salt is not one vLLM accepts."""


def _length_prefixed(*fields: bytes) -> bytes:
    return b"".join(len(f).to_bytes(8, "big") + f for f in fields)


def derive_salt(secret: bytes, tenant_id: str) -> str:
    """The cache_salt of a salted tenant: HMAC-SHA256 over length-prefixed fields, as hex."""
    digest = hmac.new(secret, _length_prefixed(SALT_LABEL, tenant_id.encode()), hashlib.sha256)
    return TENANT_SALT_PREFIX + digest.hexdigest()


def check_cache_salt(value: object) -> str:
    """Return `value` if vLLM accepts it as cache_salt, else raise InvalidCacheSalt."""
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else type(value).__name__
        raise InvalidCacheSalt(f"cache_salt must be a non-empty string, got {got}")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise InvalidCacheSalt(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}"
        )
    for ch in _FORBIDDEN_SALT_CHARS:
        if ch in value:
            raise InvalidCacheSalt(f"cache_salt must not contain {ch!r}")
    return value


@dataclass(frozen=True)
class Tenant:
    """Who a request is from, and the cache salt its requests carry (None = public pool)."""

    tenant_id: str
    salted: bool = True
    allow_client_salt: str = "reject"
    salt: str | None = None
    anonymous: bool = False


@dataclass(frozen=True)
class TenantRegistry:
    """API keys -> tenants, and each tenant's effective cache salt."""

    _by_digest: Mapping[bytes, Tenant] = field(repr=False)
    _lookup_key: bytes = field(repr=False)
    _secret: bytes | None = field(repr=False)
    anonymous: Tenant | None = None

    @classmethod
    def from_config(
        cls, config: TenantsConfig, secret: bytes | None = None, *, lookup_key: bytes | None = None
    ) -> TenantRegistry:
        """Build the registry; `secret` defaults to the one config read from secret_env."""
        secret = config.secret if secret is None else secret
        lookup_key = os.urandom(32) if lookup_key is None else lookup_key
        by_digest: dict[bytes, Tenant] = {}
        for entry in config.keys:
            if entry.salted and not secret:
                raise ValueError(
                    f"tenant {entry.tenant!r} is salted but no secret is set ({config.secret_env})"
                )
            tenant = Tenant(
                tenant_id=entry.tenant,
                salted=entry.salted,
                allow_client_salt=entry.allow_client_salt,
                salt=derive_salt(secret, entry.tenant) if entry.salted and secret else None,
            )
            by_digest[_key_digest(lookup_key, entry.key)] = tenant
        anonymous = None
        if config.allow_anonymous:
            anonymous = Tenant(config.anonymous_tenant, salted=False, anonymous=True)
        return cls(MappingProxyType(by_digest), lookup_key, secret, anonymous)

    @property
    def tenants(self) -> Iterable[Tenant]:
        """Every keyed tenant (one entry per key)."""
        return self._by_digest.values()

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant `api_key` belongs to, or None; the time taken does not depend on the key."""
        if not api_key:
            return None
        return self._by_digest.get(_key_digest(self._lookup_key, api_key))

    def identify(self, api_key: str | None) -> Tenant:
        """The request's tenant: by key, else anonymous if allowed, else AuthenticationError."""
        tenant = self.authenticate(api_key)
        if tenant is not None:
            return tenant
        if self.anonymous is not None:
            return self.anonymous
        raise AuthenticationError("missing API key" if not api_key else "invalid API key")

    def effective_salt(self, tenant: Tenant, client_salt: object | None) -> str | None:
        """The cache_salt to forward for `tenant` given the body's cache_salt (None if absent)."""
        if client_salt is None:
            return tenant.salt
        if tenant.allow_client_salt != "namespace":
            if tenant.salt is None:
                # An unsalted tenant shares the public pool: no salt is set for it at all.
                raise ClientSaltRejected(
                    f"tenant {tenant.tenant_id!r} is unsalted (it shares the public prefix "
                    "cache) and its allow_client_salt policy is 'reject': remove cache_salt "
                    "from the request"
                )
            raise ClientSaltRejected(
                f"cache_salt is set by the gateway for tenant {tenant.tenant_id!r}; "
                "remove it from the request"
            )
        check_cache_salt(client_salt)
        assert isinstance(client_salt, str)
        return self.namespaced_salt(tenant, client_salt)

    def namespaced_salt(self, tenant: Tenant, client_salt: str) -> str:
        """HMAC(secret, (label, tenant's salt or id, client salt)): never another tenant's salt."""
        # Without a secret (no salted tenants) the namespace still separates tenants by id;
        # it is then only as secret as the tenant ids are.
        key = self._secret or b"cacheroute-no-secret"
        owner = tenant.salt if tenant.salt is not None else "id:" + tenant.tenant_id
        fields = _length_prefixed(CLIENT_SALT_LABEL, owner.encode(), client_salt.encode())
        return CLIENT_SALT_PREFIX + hmac.new(key, fields, hashlib.sha256).hexdigest()


def _key_digest(lookup_key: bytes, api_key: str) -> bytes:
    return hmac.new(lookup_key, api_key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The API key from `Authorization: Bearer KEY` (or `x-api-key`), else None."""
    auth = headers.get("Authorization") or headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key") or headers.get("X-Api-Key")
    return key.strip() if key and key.strip() else None
