"""Prompt hygiene: notice when a tenant's requests stop sharing the prefixes they used to.

Prefix caching pays only while prompts share leading tokens. A small change at the top of
a prompt (a timestamp or request id in the system prompt, tool JSON serialised in a new
order) moves the point where consecutive prompts diverge to near token 0, and every
request becomes a cold prefill. Nothing fails; TTFT just rises. This module watches for it.

Per tenant it keeps the leading `prefix_tokens` tokens of its last `history` requests.
For each new request it measures the longest prefix shared with any of them (its
"shared length"). When the median shared length of the latest `window` requests falls to
at most `drop_ratio` of the median over the `window` before them, and that earlier
median was at least `min_shared` tokens, it returns a `HygieneFinding`: the tenant, the
token position where requests now diverge, and how long they used to share. The tenant's
baseline then restarts from the new behaviour, so one change is reported once.

Pure and bounded: at most `max_tenants` tenants (least recently seen evicted), each
holding `history` prefixes of at most `prefix_tokens` tokens and 2 * `window` lengths.
"""

from __future__ import annotations

import statistics
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HygieneFinding:
    """A tenant's prompts now diverge at `position`; they used to share `previous_shared` tokens."""

    tenant: str
    position: int
    previous_shared: int

    def describe(self) -> str:
        """The log line: names the token position where prompts now differ."""
        return (
            f"tenant {self.tenant!r}: prompts now differ from token {self.position} "
            f"(they used to share about {self.previous_shared} leading tokens); look for "
            f"something changing near token {self.position}, such as a timestamp, an id or "
            "reordered tool definitions"
        )


def shared_prefix_len(a: bytes, b: bytes, itemsize: int, at_least: int = 0) -> int:
    """Leading items two packed token arrays share (binary search over C-level compares).

    The caller promises they share at least `at_least` items.
    """
    lo, hi = at_least, min(len(a), len(b)) // itemsize
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * itemsize] == b[: mid * itemsize]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _TenantPrompts:
    prefixes: deque[bytes]
    shared: deque[int]


@dataclass
class PromptHygiene:
    """Per-tenant watch on shared prompt prefixes; `observe` returns a finding or None."""

    prefix_tokens: int = 256
    history: int = 32
    window: int = 16
    min_shared: int = 32
    drop_ratio: float = 0.5
    max_tenants: int = 1024
    _tenants: OrderedDict[str, _TenantPrompts] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if min(self.prefix_tokens, self.history, self.window, self.max_tenants) < 1:
            raise ValueError("prefix_tokens, history, window and max_tenants must be positive")
        if not 0.0 <= self.drop_ratio < 1.0:
            raise ValueError(f"drop_ratio must be in [0, 1), got {self.drop_ratio}")

    @property
    def tenants(self) -> int:
        return len(self._tenants)

    def observe(self, tenant: str, tokens: Sequence[int]) -> HygieneFinding | None:
        """Record one request's prompt tokens; return a finding if the divergence point moved."""
        head = tokens[: self.prefix_tokens]
        # A packed prompt (router.native.prompt_ids) is int64 already.
        packed = head.tobytes() if isinstance(head, memoryview) else array("q", head).tobytes()
        itemsize = array("q").itemsize
        state = self._state(tenant)
        if state.prefixes:
            best = 0
            for prev in reversed(state.prefixes):
                # One compare rules out a prefix that cannot beat the best so far; only
                # the few that can are measured exactly.
                probe = (best + 1) * itemsize
                if len(prev) >= probe and prev[:probe] == packed[:probe]:
                    best = shared_prefix_len(packed, prev, itemsize, best + 1)
            state.shared.append(best)
        state.prefixes.append(packed)
        return self._check(tenant, state)

    def _state(self, tenant: str) -> _TenantPrompts:
        state = self._tenants.get(tenant)
        if state is None:
            state = _TenantPrompts(deque(maxlen=self.history), deque(maxlen=2 * self.window))
            self._tenants[tenant] = state
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        return state

    def _check(self, tenant: str, state: _TenantPrompts) -> HygieneFinding | None:
        if len(state.shared) < 2 * self.window:
            return None
        lengths = list(state.shared)
        before = statistics.median_low(lengths[: self.window])
        now = statistics.median_low(lengths[self.window :])
        if before < self.min_shared or now > before * self.drop_ratio:
            return None
        # Report once: the new behaviour becomes the baseline the next change is judged by.
        state.shared.clear()
        return HygieneFinding(tenant, now, before)
