"""The optional C speedups of the per-token path (router/_keys.c), with their fallbacks.

A request's token ids are touched three times before it goes upstream: checked, packed
for the chain cache's fingerprints, and (where new) keyed block by block. A completions
body's flat token-id prompt is read in C straight into packed int64 (prompt_ids), and
from then on travels as a memoryview of those ids: no Python int per id is made on the
way to the decision. In Python the keys cost a pickle.dumps, a hashlib object and a
loop turn per block (about 1.5-3 us), the check a msgspec.convert over the list and the
pack a struct.pack of it. router._keys does each in one C pass: it writes the exact
bytes vLLM's pickle (or canonical CBOR) would for a block, and hashes them with
OpenSSL's SHA-256 (benchmarks/bench_hash.py prints both paths side by side).

The extension is built by `pip install` where a C compiler and OpenSSL's headers are
present (setup.py marks it optional); without it every caller takes the Python path,
which gives the same bytes (tests/router/test_native.py checks both). `CACHEROUTE_NATIVE=0`
turns it off, for comparisons and for the tests of the fallback.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Sequence
from types import ModuleType

_keys: ModuleType | None
try:
    from router import _keys  # type: ignore[attr-defined, no-redef]
except ImportError:
    _keys = None

if os.environ.get("CACHEROUTE_NATIVE", "1") == "0":
    _keys = None

AVAILABLE = _keys is not None

# vLLM's algorithms the extension keys: sha256 over pickle (False) or over CBOR (True).
_CBOR = {"sha256": False, "sha256_cbor": True}


def chain_keys(algo: str, parent: bytes, tokens: Sequence[int], start: int, stop: int,
               block_size: int) -> list[bytes] | None:
    """The chained keys of the full blocks of tokens[start:stop] whose extra keys are
    None, or None where the extension cannot: not built, an xxhash algorithm, or an id
    outside what it encodes (the caller's Python loop then handles it, and refuses what
    vLLM would not hash)."""
    cbor = _CBOR.get(algo)
    if _keys is None or cbor is None:
        return None
    try:
        keys: list[bytes] = _keys.chain_sha256(cbor, parent, tokens, start, stop, block_size)
    except (ValueError, TypeError):
        return None
    return keys


def checked_ids(ids: list[object]) -> bool:
    """Whether every item is an int in [0, 2**63) (bool refused), in one C pass; False
    also where the extension is not built (the caller then checks in Python)."""
    if _keys is None:
        return False
    try:
        _keys.check_ids(ids)
    except ValueError:
        return False
    return True


def prompt_ids(raw: bytes) -> tuple[int, int, memoryview] | None:
    """Where `raw` is a JSON object whose top-level "prompt" is a flat array of plain
    non-negative integers: that array's byte span and its ids, as a memoryview of int64
    ("q"). None for every other body, and where the extension is not built: the caller
    then decodes the body generically (router/request.py)."""
    if _keys is None or sys.byteorder != "little":  # pack_ids' bytes are little-endian
        return None
    found = _keys.prompt_ids(raw)
    if found is None:
        return None
    start, stop, packed = found
    return start, stop, memoryview(packed).cast("q")


def pack_ids(ids: Sequence[int], count: int) -> bytes | memoryview:
    """ids[:count] as little-endian int64 (ids already checked to fit); a packed prompt
    (prompt_ids) is already that, and is only sliced."""
    if isinstance(ids, memoryview):
        return ids[:count].cast("B")
    if _keys is not None:
        try:
            packed: bytes = _keys.check_ids(ids, count)
            return packed
        except ValueError:
            pass
    return struct.pack(f"<{count}q", *ids[:count])
