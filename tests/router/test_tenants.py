"""Tenants: keys authenticate in constant time, salts are distinct, stable and vLLM-valid."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import TenantKeyConfig, TenantsConfig
from router.hashing import HashConfig, chain_hashes
from router.tenants import (
    AuthenticationError,
    ClientSaltRejected,
    InvalidCacheSalt,
    Tenant,
    TenantRegistry,
    api_key_from_headers,
    check_cache_salt,
    derive_salt,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def registry(allow_anonymous: bool = False, secret: bytes = SECRET) -> TenantRegistry:
    config = TenantsConfig(
        keys=(
            TenantKeyConfig(key="sk-acme-0001", tenant="acme"),
            TenantKeyConfig(key="sk-globex-002", tenant="globex", allow_client_salt="namespace"),
            TenantKeyConfig(key="sk-public-003", tenant="docs", salted=False),
            TenantKeyConfig(
                key="sk-public-004", tenant="wiki", salted=False, allow_client_salt="namespace"
            ),
        ),
        allow_anonymous=allow_anonymous,
    )
    return TenantRegistry.from_config(config, secret)


def test_keys_map_to_their_tenants() -> None:
    reg = registry()
    acme = reg.authenticate("sk-acme-0001")
    assert acme is not None and acme.tenant_id == "acme" and acme.salted
    docs = reg.authenticate("sk-public-003")
    assert docs is not None and docs.tenant_id == "docs" and docs.salt is None
    assert reg.authenticate("sk-nope") is None
    assert reg.authenticate("") is None and reg.authenticate(None) is None


@pytest.mark.parametrize(
    "guess",
    [
        "sk-acme-0002",
        "sk-acme-000",
        "sk-acme-00011",
        "Sk-acme-0001",
        "sk-acme-0001 ",
        "sk-acme-000\x001",
    ],
)
def test_near_misses_do_not_authenticate(guess: str) -> None:
    assert registry().authenticate(guess) is None


def test_registry_keeps_no_raw_key_and_looks_up_by_keyed_hash() -> None:
    lookup_key = b"k" * 32
    config = TenantsConfig(keys=(TenantKeyConfig(key="sk-acme-0001", tenant="acme"),))
    reg = TenantRegistry.from_config(config, SECRET, lookup_key=lookup_key)
    stored = list(reg._by_digest)
    # The dict's keys are HMACs of the API keys: the lookup compares digests an attacker
    # cannot steer byte by byte, never the key's own bytes.
    assert stored == [hmac.new(lookup_key, b"sk-acme-0001", hashlib.sha256).digest()]
    everything = repr(reg) + repr(list(reg.tenants)) + repr(vars(reg))
    assert "sk-acme-0001" not in everything


def test_lookup_key_is_fresh_per_registry() -> None:
    a, b = registry(), registry()
    assert set(a._by_digest).isdisjoint(b._by_digest)
    assert a.authenticate("sk-acme-0001") == b.authenticate("sk-acme-0001")


def test_identify_anonymous_and_401() -> None:
    closed = registry()
    with pytest.raises(AuthenticationError) as info:
        closed.identify(None)
    assert info.value.status == 401 and "missing API key" in str(info.value)
    with pytest.raises(AuthenticationError, match="invalid API key"):
        closed.identify("sk-wrong")
    open_ = registry(allow_anonymous=True)
    anon = open_.identify("sk-wrong")
    assert anon.anonymous and anon.tenant_id == "anonymous" and anon.salt is None
    assert open_.identify("sk-acme-0001").tenant_id == "acme"


def test_salts_are_hmac_over_length_prefixed_fields() -> None:
    fields = b"".join(len(f).to_bytes(8, "big") + f for f in (b"cacheroute-salt-v1", b"acme"))
    expected = "t1-" + hmac.new(SECRET, fields, hashlib.sha256).hexdigest()
    assert derive_salt(SECRET, "acme") == expected
    acme = registry().authenticate("sk-acme-0001")
    assert acme is not None and acme.salt == expected


def test_salts_are_stable_across_registries_and_depend_on_the_secret() -> None:
    a = registry().authenticate("sk-acme-0001")
    b = registry().authenticate("sk-acme-0001")
    c = registry(secret=b"another-secret-of-32-bytes-xxxxx").authenticate("sk-acme-0001")
    assert a is not None and b is not None and c is not None
    assert a.salt == b.salt != c.salt


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_distinct_tenants_get_distinct_valid_salts(t1: str, t2: str) -> None:
    s1, s2 = derive_salt(SECRET, t1), derive_salt(SECRET, t2)
    assert (s1 == s2) == (t1 == t2)
    assert check_cache_salt(s1) == s1


def test_salt_changes_the_block_keys() -> None:
    config = HashConfig(block_size=4)
    tokens = list(range(16))
    acme, globex = derive_salt(SECRET, "acme"), derive_salt(SECRET, "globex")
    plain = chain_hashes(config, tokens)
    assert chain_hashes(config, tokens, cache_salt=acme)[0] != plain[0]
    assert (
        chain_hashes(config, tokens, cache_salt=acme)[0]
        != chain_hashes(config, tokens, cache_salt=globex)[0]
    )


def test_client_salt_rejected_by_default() -> None:
    reg = registry()
    acme = reg.authenticate("sk-acme-0001")
    assert acme is not None
    assert reg.effective_salt(acme, None) == acme.salt
    with pytest.raises(ClientSaltRejected) as info:
        reg.effective_salt(acme, "mine")
    assert info.value.status == 400 and info.value.param == "cache_salt"
    assert "acme" in str(info.value)


def test_namespaced_client_salts_never_equal_any_tenant_salt() -> None:
    reg = registry()
    globex = reg.authenticate("sk-globex-002")
    wiki = reg.authenticate("sk-public-004")
    assert globex is not None and wiki is not None
    acme_salt = derive_salt(SECRET, "acme")
    # A client that learned acme's salt cannot use it to reach acme's cache.
    stolen = reg.effective_salt(globex, acme_salt)
    assert stolen is not None and stolen != acme_salt and stolen.startswith("c1-")
    # The same client salt under two tenants gives two different salts; stable per tenant.
    assert reg.effective_salt(globex, "x") != reg.effective_salt(wiki, "x")
    assert reg.effective_salt(globex, "x") == registry().effective_salt(globex, "x")
    assert reg.effective_salt(globex, "x") != reg.effective_salt(globex, "y")
    check_cache_salt(reg.effective_salt(globex, "x"))


@pytest.mark.parametrize("bad", ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129, 7, ["a"]])
def test_invalid_client_salts(bad: object) -> None:
    reg = registry()
    globex = reg.authenticate("sk-globex-002")
    assert globex is not None
    with pytest.raises(InvalidCacheSalt) as info:
        reg.effective_salt(globex, bad)
    assert info.value.param == "cache_salt"


def test_salted_tenant_needs_a_secret() -> None:
    config = TenantsConfig(keys=(TenantKeyConfig(key="k", tenant="acme"),))
    with pytest.raises(ValueError, match="tenant 'acme' is salted but no secret"):
        TenantRegistry.from_config(config)
    unsalted = TenantsConfig(keys=(TenantKeyConfig(key="k", tenant="acme", salted=False),))
    assert TenantRegistry.from_config(unsalted).authenticate("k") == Tenant("acme", salted=False)


def test_secret_defaults_to_the_configs() -> None:
    config = TenantsConfig(keys=(TenantKeyConfig(key="k", tenant="acme"),), secret=SECRET)
    tenant = TenantRegistry.from_config(config).authenticate("k")
    assert tenant is not None and tenant.salt == derive_salt(SECRET, "acme")


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"Authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer  sk-2 "}, "sk-2"),
        ({"Authorization": "Basic abc"}, None),
        ({"Authorization": "Bearer "}, None),
        ({"x-api-key": "sk-3"}, "sk-3"),
        ({}, None),
    ],
)
def test_api_key_from_headers(headers: dict[str, str], key: str | None) -> None:
    assert api_key_from_headers(headers) == key
