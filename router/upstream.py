"""What goes to a replica and what comes back: the request, the outcome, the SSE stream.

`UpstreamRequest` is what the proxy (router/proxy.py) sends and how the client wants the
answer shaped; `ProxyOutcome` what happened, for recording; `SSEReader` splits a
replica's byte stream into events and `StreamState` relays them, taking usage and
generated token ids and hiding what the gateway asked for on the client's behalf.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec

from router.suspects import Fingerprint, request_fingerprint


@dataclass
class UpstreamRequest:
    """What to send upstream and how the client wanted the answer shaped."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    stream: bool
    client_wants_usage: bool = True
    strip_token_ids: bool = False  # the gateway asked for return_token_ids, not the client
    # Whether the answer's token ids are wanted (a replica without KV events: the gateway
    # records the blocks the answer fills). When not, a stream whose client asked for
    # token ids passes through unparsed like any other.
    collect_token_ids: bool = True
    max_tokens: int | None = None
    payload: bytes | None = None  # `body` already serialized, the salt spliced in
    # replica id -> (predicted prefill seconds, predicted TTFT seconds), for the replica's
    # outstanding-work account (router/outstanding.py); replicas not named count 0.
    predicted_work: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # The cached prompt tokens each prediction assumed (the policy's, pending included).
    predicted_cached: Mapping[str, int] = field(default_factory=dict)
    # replica id -> the outstanding-work entry routing reserved there (Route.reserved,
    # shared): the attempt on that replica takes it over and ends it.
    reserved: dict[str, int] = field(default_factory=dict)
    # Identifies the request again (router/suspects.py); None: `fingerprint_of()` when
    # given (computed only when asked: while no request is suspected, never), else a hash
    # of the body.
    fingerprint: Fingerprint | None = None
    fingerprint_of: Callable[[], Fingerprint] | None = None
    # Called once the body is written to a replica's connection: work that can wait
    # until the replica has the request (router/routing.py Route.finish_keys).
    on_sent: Callable[[], None] | None = None

    def identity(self) -> Fingerprint:
        """The request's fingerprint, computed from the body when none was given."""
        if self.fingerprint is None and self.fingerprint_of is not None:
            self.fingerprint = self.fingerprint_of()
        if self.fingerprint is None:
            body = self.payload if self.payload is not None else \
                json.dumps(self.body, sort_keys=True).encode()
            self.fingerprint = request_fingerprint({}, 0, body, None)
        return self.fingerprint


@dataclass
class ProxyOutcome:
    """What happened to one forwarded request, for recording."""

    replica_id: str | None = None
    status: int = 0
    attempts: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_token_ids: list[int] | None = None
    completed: bool = False
    client_disconnected: bool = False
    error: str | None = None
    first_byte_at: float | None = None  # time.perf_counter() when the client got a byte
    failures: list[tuple[str, str]] = field(default_factory=list)  # (replica, reason)


class ByteStream(Protocol):
    """A response body read as it arrives (router/upstream_http.py's UpstreamResponse,
    aiohttp's StreamReader)."""

    async def readany(self) -> bytes: ...


class SSEReader:
    """Splits an upstream byte stream into SSE events (each ending in a blank line)."""

    def __init__(self, content: ByteStream) -> None:
        self._content = content
        self._buf = b""
        # Where the search for the next event's end resumes: a first chunk that carries
        # the prompt's ids (return_token_ids, 8k ids: 46 KB) comes in several reads, and
        # searching the whole buffer again after each one cost more than the reads.
        self._scanned = 0

    async def _fill(self) -> bool:
        """Read what has arrived into the buffer; False at a clean end of stream."""
        chunk = await self._content.readany()
        if not chunk:
            if self._buf.strip():
                # The connection ended mid-event: not a clean end.
                raise aiohttp.ClientPayloadError("upstream closed mid-event")
            return False
        self._buf += chunk
        return True

    async def next_event(self) -> bytes | None:
        """The next raw event including its terminator, or None at a clean end of stream."""
        while True:
            end = event_end(self._buf, self._scanned)
            if end != -1:
                event, self._buf = self._buf[:end], self._buf[end:]
                self._scanned = 0
                return event
            # A terminator may straddle the next read: resume three bytes back.
            self._scanned = max(0, len(self._buf) - 3)
            if not await self._fill():
                return None

    async def next_events(self) -> bytes | None:
        """Every complete event that has arrived (waiting for at least one), as one
        run of bytes; None at a clean end of stream.

        Relaying what a replica sent in one piece costs one write and one pass through
        the loop instead of one per event: when the gateway falls behind under load,
        several of a stream's events wait in the socket together."""
        while True:
            lf, crlf = self._buf.rfind(b"\n\n"), self._buf.rfind(b"\r\n\r\n")
            end = max(lf + 2 if lf != -1 else 0, crlf + 4 if crlf != -1 else 0)
            if end:
                events, self._buf = self._buf[:end], self._buf[end:]
                self._scanned = 0
                return events
            if not await self._fill():
                return None


def event_end(buf: bytes, start: int = 0) -> int:
    """The index just past the first event terminator ("\\n\\n" or "\\r\\n\\r\\n") that
    ends at or after `start`, or -1.

    Found line end by line end (memchr): bytes.find of a two-byte pattern ran at ~1 GB/s
    over a chunk of digits, 39 us for the 46 KB first chunk of an 8k-token prompt's ids,
    where its lines are one or two."""
    nl = buf.find(b"\n", start)
    while nl != -1:
        after = buf[nl + 1:nl + 3]
        if after[:1] == b"\n":
            return nl + 2
        if after == b"\r\n" and buf[nl - 1:nl] == b"\r":
            return nl + 3
        nl = buf.find(b"\n", nl + 1)
    return -1


def split_events(events: bytes) -> list[bytes]:
    """A run of complete SSE events (SSEReader.next_events) as single events."""
    out: list[bytes] = []
    start = 0
    while start < len(events):
        end = event_end(events, start)
        if end == -1:
            end = len(events)
        out.append(events[start:end])
        start = end
    return out


def event_data(event: bytes) -> bytes:
    """The concatenated data lines of one SSE event."""
    # vLLM's events are one line, "data: {...}": taken with one copy, without splitting
    # (and joining) a first chunk of 46 KB.
    first = event.find(b"\n")
    if event.startswith(b"data: ") and event[6:7] != b" " and (
            first == -1 or not event[first:].strip()):
        end = len(event) if first == -1 else first - (event[first - 1:first] == b"\r")
        line = event[6:end]
        if b"\r" not in line:
            return line
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


def has_content(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated output (not just the role)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning") or \
                    delta.get("reasoning_content"):
                return True
        elif choice.get("text"):
            return True
        if choice.get("finish_reason") is not None or choice.get("token_ids"):
            return True
    return False


@dataclass
class StreamState:
    """Per-response bookkeeping while relaying chunks."""

    up: UpstreamRequest
    outcome: ProxyOutcome
    token_ids: list[int] = field(default_factory=list)
    saw_token_ids: bool = False
    # The 5xx code of the last event `process` read, where it was an error event (vLLM
    # streams an engine failure so, before any content): read from the parse `process`
    # does anyway, rather than searching a first chunk of 46 KB for "error" again.
    error_code: int | None = None

    def take_usage(self, usage: Any) -> None:
        # What a replica sends is checked, not trusted: a malformed usage block is
        # relayed as it came and recorded as no usage, never an exception mid-stream.
        if not usage or not isinstance(usage, Mapping):
            return
        prompt = usage.get("prompt_tokens")
        self.outcome.prompt_tokens = prompt if type(prompt) is int else None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        if type(cached) is int:
            self.outcome.cached_tokens = cached

    def absorb(self, data: dict[str, Any]) -> bool:
        """Take usage and generated token ids from a response body or chunk; strip the
        token ids the gateway asked for on the client's behalf. Whether it changed."""
        self.take_usage(data.get("usage"))
        changed = False
        for choice in data.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is not None and self.up.collect_token_ids and choice.get("index", 0) == 0 \
                    and isinstance(ids, list) and all(type(t) is int for t in ids):
                self.token_ids.extend(ids)
                self.saw_token_ids = True
            if self.up.strip_token_ids and "token_ids" in choice:
                del choice["token_ids"]
                changed = True
            # Completions put the prompt's ids in each choice (chat at the top level).
            if self.up.strip_token_ids and "prompt_token_ids" in choice:
                del choice["prompt_token_ids"]
                changed = True
        if self.up.strip_token_ids and "prompt_token_ids" in data:
            del data["prompt_token_ids"]
            changed = True
        return changed

    def absorb_body(self, payload: bytes) -> bytes:
        """absorb() for a whole (non-streamed) answer's bytes: what to send the client.

        As with streamed chunks (process), the answer is read through the typed view,
        which skips the prompt's ids a return_token_ids answer carries; only an answer
        the gateway must change, or that the view does not fit, is parsed whole."""
        try:
            view = _CHUNK_VIEW.decode(payload if self.up.strip_token_ids
                                      else without_prompt_ids(payload))
            if not (self.up.strip_token_ids and _carries_ids(view)):
                self.take_usage(_USAGE.decode(view.usage) if view.usage else None)
                for choice in view.choices or ():
                    if self.up.collect_token_ids and choice.index == 0 and choice.token_ids \
                            and bytes(choice.token_ids) != b"null":
                        self.token_ids.extend(_TOKEN_IDS.decode(choice.token_ids))
                        self.saw_token_ids = True
                return payload
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        try:
            data = _ANY_JSON.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return payload
        if isinstance(data, dict) and self.absorb(data):
            return _JSON_ENCODER.encode(data)
        return payload

    def process_run(self, events: bytes) -> bytes:
        """A run of complete events after the first byte (SSEReader.next_events): what
        to send on. Only a run that carries usage, or token ids the gateway wants or must
        strip, is opened up; the rest, a stream's every token but its last, passes
        through unparsed."""
        if b'"usage"' not in events and (
                b"token_ids" not in events
                or not (self.up.collect_token_ids or self.up.strip_token_ids)):
            return events
        return b"".join(out for event in split_events(events)
                        if (out := self.process(event)[0]) is not None)

    def process(self, event: bytes) -> tuple[bytes | None, bool]:
        """(bytes to send or None to drop, whether it carries content). Unchanged unless
        it is the usage chunk the client did not ask for or carries token ids we asked for.

        Every event before a stream's first content comes through here, on the way to
        the first token. A client that asked for return_token_ids gets the prompt's ids
        in the first chunk (8k ids: 0.42 ms to parse with the json module), so the chunk
        is first read as a typed view of what the gateway uses, the ids cut out before
        (without_prompt_ids); only a chunk the gateway must change, or one the view does
        not fit, is parsed whole. `error_code` tells the caller whether it was a 5xx
        error event."""
        self.error_code = None
        data = event_data(event)
        if not data or data == b"[DONE]" or not data.startswith(b"{"):
            return event, False
        # "choices" first: it opens every chunk but an error, so the usual chunk is not
        # searched to its end (46 KB for a first chunk with 8k prompt ids).
        if b'"choices"' not in data and b'"usage"' not in data:
            if b'"error"' in data:
                self._take_error(_decode_or_none(data))
            return event, False
        try:
            # The prompt's ids are none of the gateway's business here; skipping them
            # still cost msgspec 72 us at 8k ids.
            view = _CHUNK_VIEW.decode(data if self.up.strip_token_ids
                                      else without_prompt_ids(data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._process_whole(event, data)
        if view.error:
            self._take_error({"error": _decode_or_none(view.error)})
            return event, True
        if self._must_rewrite(view):
            return self._process_whole(event, data)
        if view.usage and view.usage != b"null":
            try:
                self.take_usage(_USAGE.decode(view.usage))
            except (msgspec.DecodeError, msgspec.ValidationError):
                return self._process_whole(event, data)
        content = False
        for choice in view.choices or ():
            if self.up.collect_token_ids and choice.index == 0 and choice.token_ids and \
                    bytes(choice.token_ids) != b"null":
                try:
                    self.token_ids.extend(_TOKEN_IDS.decode(choice.token_ids))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return self._process_whole(event, data)
                self.saw_token_ids = True
            content = content or _choice_has_content(choice)
        return event, content

    def _take_error(self, chunk: Any) -> None:
        """Note the 5xx code of an error chunk ({"error": {"code": ...}})."""
        err = chunk.get("error") if isinstance(chunk, dict) else None
        try:
            code = int(err.get("code") or 0) if isinstance(err, dict) else 0
        except (ValueError, TypeError):
            return
        self.error_code = code if code >= 500 else None

    def _must_rewrite(self, view: _ChunkView) -> bool:
        """Whether the chunk changes on its way to the client (see absorb and process)."""
        if not self.up.client_wants_usage and _present(view.usage):
            return True
        return self.up.strip_token_ids and _carries_ids(view)

    def _process_whole(self, event: bytes, data: bytes) -> tuple[bytes | None, bool]:
        try:
            chunk = _ANY_JSON.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event, False
        if not isinstance(chunk, dict):
            return event, False
        if "error" in chunk:
            self._take_error(chunk)
            return event, True
        content = has_content(chunk)
        changed = self.absorb(chunk)
        if not self.up.client_wants_usage and chunk.get("usage"):
            if not chunk.get("choices"):
                return None, False  # the usage-only chunk the gateway added
            chunk["usage"] = None
            changed = True
        if changed:
            return b"data: " + _JSON_ENCODER.encode(chunk) + b"\n\n", content
        return event, content


# A streamed chunk as far as the gateway reads it before relaying: msgspec skips every
# other field without building it (the prompt's ids above all). Raw fields keep a
# value's bytes unparsed; an empty Raw is a field the chunk did not have.
class _DeltaView(msgspec.Struct):
    content: str | None = None
    tool_calls: msgspec.Raw = msgspec.Raw()
    reasoning: str | None = None
    reasoning_content: str | None = None


class _ChoiceView(msgspec.Struct):
    index: int = 0
    delta: _DeltaView | None = None
    text: str | None = None
    finish_reason: msgspec.Raw = msgspec.Raw()
    token_ids: msgspec.Raw = msgspec.Raw()
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


class _ChunkView(msgspec.Struct):
    choices: list[_ChoiceView] | None = None
    usage: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


_CHUNK_VIEW = msgspec.json.Decoder(_ChunkView)
_USAGE = msgspec.json.Decoder(dict[str, Any] | None)
_TOKEN_IDS = msgspec.json.Decoder(list[int])
_ANY_JSON = msgspec.json.Decoder()
_JSON_ENCODER = msgspec.json.Encoder()
_PROMPT_IDS_KEY = b'"prompt_token_ids":'


def _decode_or_none(data: bytes) -> Any:
    try:
        return _ANY_JSON.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def without_prompt_ids(data: bytes) -> bytes:
    """A JSON answer or chunk with every "prompt_token_ids" array's value replaced by
    null: what the typed view reads when the gateway does not touch the prompt's ids.

    The key cannot occur inside a string (a quote there is escaped) and the array holds
    only numbers, so its first "]" closes it; anything else (a nested array, a truncated
    one) leaves JSON the view refuses, and the caller then parses the original whole."""
    parts: list[bytes] = []
    start = 0
    while (key := data.find(_PROMPT_IDS_KEY, start)) != -1:
        value = key + len(_PROMPT_IDS_KEY)
        while data[value:value + 1] in (b" ", b"\t", b"\n", b"\r"):
            value += 1
        if data[value:value + 1] != b"[":
            break
        close = data.find(b"]", value)
        if close == -1:
            break
        parts += (data[start:value], b"null")
        start = close + 1
    if not parts:
        return data
    parts.append(data[start:])
    return b"".join(parts)


def _carries_ids(view: _ChunkView) -> bool:
    """Whether a chunk or answer has a token-id field (absorb strips them all)."""
    return bool(view.prompt_token_ids) or any(
        choice.token_ids or choice.prompt_token_ids for choice in view.choices or ())


def _present(raw: msgspec.Raw) -> bool:
    """A Raw field the chunk had with a JSON-truthy value (what `.get(k)` tests)."""
    return bool(raw) and bytes(raw).strip() not in _FALSY_JSON


_FALSY_JSON = frozenset({b"null", b"[]", b"{}", b'""', b"false", b"0"})


def _choice_has_content(choice: _ChoiceView) -> bool:
    """has_content for one choice of the typed view."""
    delta = choice.delta
    if delta is not None:
        if delta.content or _present(delta.tool_calls) or delta.reasoning or \
                delta.reasoning_content:
            return True
    elif choice.text:
        return True
    return (bool(choice.finish_reason) and bytes(choice.finish_reason) != b"null") or \
        _present(choice.token_ids)
