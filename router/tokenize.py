"""Request body -> prompt token ids, exactly as vLLM 0.32 renders them for a model.

A gateway predicts a replica's cache hits from the prompt's block keys, so it must see
the very token ids the replica will: one stray BOS or a differently flattened message
shifts every block. This module follows vLLM's renderer (vllm/renderers/chat_utils.py
and hf.py) for the OpenAI endpoints:

- chat: messages and tools are normalised as vLLM does (router.chat_messages; the
  content format vLLM's "auto" picks is detected the same way, router.content_format);
  the template is rendered by transformers'
  `render_jinja_template` with the tokenizer's special tokens, tools (in vLLM's
  model_dump form), add_generation_prompt (default True), continue_final_message and
  chat_template_kwargs; the text is tokenized with add_special_tokens=False (the body's
  add_special_tokens, default False);
- completions: a text prompt is tokenized with add_special_tokens=True (the body's
  add_special_tokens, default True); a list of ints passes through unchanged.

Encoding uses a private copy of the fast tokenizer's Rust backend, which only reads
its state, so the gateway may call every method here from a thread pool.

Conversation-prefix cache: a chat's rendered text is split at added-token boundaries
(role markers and the like). The tokenizer extracts added tokens before any
pre-tokenization, so BPE never merges across them and each segment's ids are the same
alone as in the whole text. An LRU of segment -> ids therefore makes re-tokenizing a
long history nearly free and stays exact by construction; it is switched off for
tokenizers where that argument does not hold (a normalizer, Metaspace pre-tokenizers,
added tokens that strip neighbouring spaces).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from router import lax_fields, template_lookup
from router.chat_messages import developer_to_system, normalise_messages, normalise_tools
from router.content_format import detect_content_format
from router.lax_fields import Endpoint as Endpoint
from router.request import ClientError

_MAX_POSITION_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
)


# The CLIs and the simulator catch a refused body under this name.
RequestError = ClientError


@dataclass
class SegmentCacheStats:
    """How the conversation-prefix cache has been used."""

    hits: int = 0
    misses: int = 0
    entries: int = 0
    chars: int = 0


class SegmentCache:
    """A thread-safe LRU of text segment -> token ids, bounded by total characters.

    A segment is encoded once however many threads want it at the same moment
    (`get_or_encode`): the first encodes, the others wait for its ids. A burst of
    conversations that share a prefix nobody has sent yet (an agent's first turn: 16
    chats at once, each with the same 30 KB of tools, 8 ms of encoding apiece here)
    would otherwise encode it once per request.
    """

    def __init__(self, max_chars: int = 32_000_000) -> None:
        self._max_chars = max_chars
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self._encoding: dict[str, threading.Event] = {}  # segment -> set once it is cached
        self.stats = SegmentCacheStats()

    def get_or_encode(self, segment: str,
                      encode: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        """The segment's ids: cached, or encoded by the thread already encoding it
        (waited for), or encoded here and cached."""
        if len(segment) > self._max_chars:
            return encode(segment)  # never cached: nobody could wait for it
        while True:
            with self._lock:
                ids = self._entries.get(segment)
                if ids is not None:
                    self._entries.move_to_end(segment)
                    self.stats.hits += 1
                    return ids
                busy = self._encoding.get(segment)
                if busy is None:
                    done = self._encoding[segment] = threading.Event()
                    self.stats.misses += 1
            if busy is None:
                break
            busy.wait()  # then cached, or its encoder failed and this thread tries
        try:
            ids = encode(segment)
            self.put(segment, ids)
            return ids
        finally:
            with self._lock:
                del self._encoding[segment]
            done.set()

    def lookup(self, segments: Sequence[str]) -> list[tuple[int, ...] | None]:
        """Each segment's ids if cached (counted as a use), else None: under one lock.
        A chat's next turn is some hundred segments, nearly all cached; one acquisition
        for each (get_or_encode) cost more than the lookups themselves."""
        found: list[tuple[int, ...] | None] = []
        append = found.append
        with self._lock:
            entries = self._entries
            for segment in segments:
                ids = entries.get(segment)
                if ids is not None:
                    entries.move_to_end(segment)
                append(ids)
            self.stats.hits += sum(1 for ids in found if ids is not None)
        return found

    def missing_chars(self, segments: Iterable[str]) -> int:
        """The characters of the segments not cached (not counted as a use)."""
        with self._lock:
            entries = self._entries
            return sum(len(s) for s in segments if s not in entries)

    def peek(self, segment: str) -> tuple[int, ...] | None:
        """The segment's ids if cached (not counted as a use)."""
        with self._lock:
            return self._entries.get(segment)

    def peek_many(self, segments: Sequence[str]) -> list[tuple[int, ...] | None]:
        """Each segment's ids if cached (not counted as a use), under one lock."""
        with self._lock:
            get = self._entries.get
            return [get(segment) for segment in segments]

    def holds(self, segment: str) -> bool:
        """Whether `segment` is cached (not counted as a use; one being encoded is not)."""
        with self._lock:
            return segment in self._entries

    def put(self, segment: str, ids: tuple[int, ...]) -> None:
        if len(segment) > self._max_chars:
            return
        with self._lock:
            if segment in self._entries:
                return
            self._entries[segment] = ids
            self._chars += len(segment)
            while self._chars > self._max_chars:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)
            self.stats.entries = len(self._entries)
            self.stats.chars = self._chars



_Ids = TypeVar("_Ids", bound=Sequence[int])  # a list, or a packed prompt's memoryview


def _truncate(ids: _Ids, body: dict[str, Any], max_model_len: int, endpoint: Endpoint) -> _Ids:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the model's context)."""
    k = lax_fields.field(body, "truncate_prompt_tokens", endpoint)
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    return cast(_Ids, ids[-k:]) if k and len(ids) > k else ids


def _flag(body: dict[str, Any], name: str, endpoint: Endpoint) -> bool:
    """A boolean field as vLLM reads it (its default where absent)."""
    return bool(lax_fields.field(body, name, endpoint))


def _read_max_model_len(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    for key in _MAX_POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _segment_cache_is_exact(tokenizer_json: dict[str, Any]) -> bool:
    """Whether splitting text at added tokens and encoding pieces alone is exact."""
    if tokenizer_json.get("normalizer") is not None:
        return False
    if "Metaspace" in json.dumps(tokenizer_json.get("pre_tokenizer")):
        return False  # its "first" prepend scheme treats the start of the text specially
    for token in tokenizer_json.get("added_tokens", []):
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
    return True


@dataclass(frozen=True)
class DeferredIds:
    """A rendered chat's ids up to its newest text, which is left to encode later
    (PromptTokenizer.chat_ids_deferred): exact through `known`, an estimate and a bound
    for the whole, and `finish` for all of its ids (what chat_ids gives)."""

    known: list[int]
    estimate: int  # the whole prompt's tokens, the new text's estimated
    at_most: int  # the whole prompt has no more tokens than this
    finish: Callable[[], list[int]]


class PromptTokenizer:
    """Renders and tokenizes OpenAI request bodies as a vLLM replica of one model does."""

    def __init__(self, hf_tokenizer: Any, *, max_model_len: int = 0,
                 content_format: str = "auto", segment_cache_chars: int = 32_000_000,
                 chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer

        self._hf = hf_tokenizer
        # A private copy with no truncation or padding: transformers mutates its own
        # backend's settings per call, which is not safe across threads.
        backend_json = hf_tokenizer.backend_tokenizer.to_str()
        self._backend = Tokenizer.from_str(backend_json)
        self._backend.no_truncation()
        self._backend.no_padding()
        # The same ids without the character offsets `encode` also computes: x0.64-0.72
        # of its time from 1k to 32k tokens (benchmarks/bench_hash.py), 8.5 against
        # 10.8 ms for an agent's system prompt and 24 tools. Where this tokenizers
        # release lacks it, the plain encode; tests check the ids are the same.
        self._encode_fast = getattr(self._backend, "encode_batch_fast", None)
        self._special_tokens_map: dict[str, Any] = dict(hf_tokenizer.special_tokens_map)
        self.max_model_len = max_model_len or int(getattr(hf_tokenizer, "model_max_length", 0))
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"content_format must be 'auto', 'string' or 'openai', got {content_format!r}"
            )
        self.content_format = content_format
        self._detected_formats: dict[str, str] = {}
        self._fast_templates: set[str] = set()  # those given template_lookup's shortcut
        # The replica's --chat-template, when it overrides the tokenizer's own.
        self._chat_template = chat_template
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        # Which tokenizer this is, for sharing segment ids between gateways
        # (router/shared_segments.py): equal only where the ids would be.
        self.identity = hashlib.sha256(backend_json.encode()).hexdigest()[:32]
        parsed = json.loads(backend_json)
        added = sorted(
            (t["content"] for t in parsed.get("added_tokens", []) if t.get("content")),
            key=len, reverse=True,
        )
        self._added_ids = {t["content"]: t["id"] for t in parsed.get("added_tokens", [])}
        self._splitter = re.compile("(" + "|".join(re.escape(t) for t in added) + ")") if added else None
        self._last_split: tuple[str, list[str]] | None = None
        # Characters per token of the text encoded so far (its pieces of 64 characters or
        # more, a moving average): how a deferred piece's tokens are estimated.
        self.chars_per_token = 4.0
        self.segment_cache: SegmentCache | None = (
            SegmentCache(segment_cache_chars)
            if self._splitter is not None and _segment_cache_is_exact(parsed) else None
        )

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: Any) -> PromptTokenizer:
        """Load the tokenizer (and context length) of a model directory."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer files in model directory {str(path)!r}")
        hf = AutoTokenizer.from_pretrained(str(path))
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{str(path)!r} has no fast (tokenizer.json) tokenizer")
        kwargs.setdefault("max_model_len", _read_max_model_len(path))
        return cls(hf, **kwargs)

    def warm(self) -> None:
        """Compile the chat template now, with and without tools, so that the first chat
        requests after start-up do not pay for it (9 ms with the tiny model's template,
        on every one of a first burst's threads that gets there before the cache fills).

        Best effort: a template that refuses these bodies, or a tokenizer without one,
        fails the same way on real requests, which report it.
        """
        tool = {"type": "function", "function": {
            "name": "warm_up", "description": "warm-up",
            "parameters": {"type": "object", "properties": {}}}}
        for extra in ({}, {"tools": [tool]}):
            with contextlib.suppress(Exception):
                self.render_chat({"messages": [{"role": "user", "content": "warm-up"}], **extra})

    # -- encoding -------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, straight through the tokenizer."""
        if self._encode_fast is not None:
            return list(self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_cached(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens added, via the segment cache."""
        cache = self.segment_cache
        pieces = self._pieces(text)
        if cache is None or pieces is None:
            return self.encode(text, add_special_tokens=False)
        return self._joined_ids(cache, pieces, cache.lookup(pieces))

    def _joined_ids(self, cache: SegmentCache, pieces: Sequence[str],
                    found: Sequence[tuple[int, ...] | None]) -> list[int]:
        """The ids of `pieces` one after another: an added token's own id, a piece's
        cached ids (`found`), or encoded now (and cached)."""
        ids: list[int] = []
        added = self._added_ids
        for piece, cached in zip(pieces, found, strict=True):
            special = added.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(cached if cached is not None else
                           cache.get_or_encode(piece, self._encode_segment))
        return ids

    def _pieces(self, text: str) -> list[str] | None:
        """`text` split at the tokenizer's added tokens, empty pieces left out; None
        without a segment cache. The gateway asks twice for the same text (how much of
        it is new, then its ids), so the last split is kept (one reference swap: a
        thread that loses the race splits again)."""
        if self.segment_cache is None or self._splitter is None:
            return None
        last = self._last_split
        if last is not None and last[0] is text:
            return last[1]
        pieces = [p for p in self._splitter.split(text) if p]
        self._last_split = (text, pieces)
        return pieces

    def _encode_segment(self, piece: str) -> tuple[int, ...]:
        ids = tuple(self.encode(piece, add_special_tokens=False))
        if len(piece) >= 64 and ids:  # a benign race between threads: a float
            self.chars_per_token += 0.1 * (len(piece) / len(ids) - self.chars_per_token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens included (to show what a prompt holds)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=False))

    # -- chat -----------------------------------------------------------------

    def content_format_for(self, template: str) -> str:
        """The message content format vLLM uses with `template` ("string" or "openai")."""
        if self.content_format != "auto":
            return self.content_format
        detected = self._detected_formats.get(template)
        if detected is None:
            detected = detect_content_format(template)
            self._detected_formats[template] = detected  # a benign race: same value
        return detected

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM's chat template renders for a chat-completions body."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        if body.get("chat_template") is not None:
            raise ClientError(
                "chat_template is not allowed in requests (the server does not trust it)",
                "chat_template",
            )
        tools = normalise_tools(body.get("tools"))
        template = self._chat_template or self._hf.get_chat_template(None, tools=tools)
        conversation = normalise_messages(
            body.get("messages"), content_format=self.content_format_for(template)
        )
        add_generation_prompt = _flag(body, "add_generation_prompt", "chat")
        continue_final = _flag(body, "continue_final_message", "chat")
        if add_generation_prompt and continue_final:
            # add_generation_prompt defaults to True, so a client continuing the final
            # message must turn it off; vLLM rejects the pair whether or not it is explicit.
            raise ClientError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        user_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(user_kwargs, dict):
            raise ClientError("chat_template_kwargs must be an object", "chat_template_kwargs")
        bad = {"chat_template", "tokenize"} & user_kwargs.keys()
        if bad:
            raise ClientError(
                f"Found unexpected chat template kwargs from request: {sorted(bad)}",
                "chat_template_kwargs",
            )
        kwargs: dict[str, Any] = {k: v for k, v in user_kwargs.items() if v is not None}
        if body.get("reasoning_effort") is not None:
            kwargs["reasoning_effort"] = body["reasoning_effort"]
            kwargs.setdefault("enable_thinking", body["reasoning_effort"] != "none")
        documents = body.get("documents")
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        kwargs.pop("documents", None)
        kwargs.pop("tools", None)

        if any(m["role"] == "developer" for m in conversation) and not (
            '"developer"' in template or "'developer'" in template
        ):
            conversation = developer_to_system(conversation)
        template_kwargs = {**self._special_tokens_map, **kwargs}
        if template not in self._fast_templates:
            # A benign race: installing twice is a no-op (router/template_lookup.py).
            template_lookup.speed_up(template)
            self._fast_templates.add(template)
        try:
            # Annotated as str, but it returns (rendered chats, generation indices).
            result: Any = render_jinja_template(
                conversations=[conversation],
                tools=cast(Any, tools),
                documents=documents,
                chat_template=template,
                continue_final_message=continue_final,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except Exception as exc:  # a template rejects bad input by raising; vLLM -> 400
            raise ClientError(f"chat template rejected the request: {exc}", "messages") from exc
        return str(result[0][0])

    def chat_tokens(self, body: dict[str, Any]) -> list[int]:
        """Prompt token ids of a chat-completions body."""
        text, add_special_tokens = self.chat_text(body)
        return self.chat_ids(text, add_special_tokens, body)

    def chat_text(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The first half of chat_tokens: the rendered prompt, and whether vLLM adds
        special tokens to it. Jinja in Python: it holds the GIL throughout."""
        return self.render_chat(body), _flag(body, "add_special_tokens", "chat")

    def chat_ids(self, text: str, add_special_tokens: bool, body: dict[str, Any]) -> list[int]:
        """The second half: the rendered prompt's ids, truncated as vLLM truncates. The
        encoding runs in the Rust tokenizer, which releases the GIL."""
        ids = (self.encode(text, add_special_tokens=True) if add_special_tokens
               else self.encode_cached(text))
        return _truncate(ids, body, self.max_model_len, "chat")

    def chat_ids_deferred(self, text: str, add_special_tokens: bool, body: dict[str, Any],
                          min_chars: int) -> DeferredIds | None:
        """chat_ids without encoding the newest text yet: the ids before the last piece
        the segment cache lacks (when it has `min_chars` or more), an estimate and a bound
        of the whole, and a `finish` that encodes it all (as chat_ids). None where the ids
        before that piece would not be the prompt's first: special tokens added, or the
        prompt truncated from the left; and where there is nothing (or too little) new.

        Pieces are split at added tokens, which BPE never merges across (the segment
        cache's own argument), so the ids of the pieces before the new one are the
        prompt's first ids whatever the new text is.
        """
        cache = self.segment_cache
        if add_special_tokens or cache is None or \
                lax_fields.field(body, "truncate_prompt_tokens", "chat") is not None:
            return None
        pieces = self._pieces(text)
        if not pieces:
            return None
        added = self._added_ids
        found = cache.peek_many(pieces)
        last = next((i for i in range(len(pieces) - 1, -1, -1)
                     if found[i] is None and pieces[i] not in added), -1)
        if last < 1 or len(pieces[last]) < min_chars:
            return None
        # An older piece this gateway lacks is encoded now, as without deferral.
        known = self._joined_ids(cache, pieces[:last], found[:last])
        estimate = at_most = len(known)
        for piece, cached in zip(pieces[last:], found[last:], strict=True):
            if piece in added:
                exact = 1
            elif cached is not None:
                exact = len(cached)
            else:
                # No tokenizer the segment cache serves (no normalizer) makes more tokens
                # than the text has UTF-8 bytes.
                estimate += max(1, round(len(piece) / self.chars_per_token))
                at_most += len(piece.encode()) + 1
                continue
            estimate += exact
            at_most += exact
        return DeferredIds(known, estimate, at_most,
                           lambda: self.chat_ids(text, add_special_tokens, body))

    def uncached_chars(self, text: str, add_special_tokens: bool = False) -> int:
        """How much of `text` chat_ids would encode afresh: the segments the cache does
        not hold (all of it without the cache, or with special tokens added)."""
        cache = self.segment_cache
        pieces = None if add_special_tokens else self._pieces(text)
        if cache is None or pieces is None:
            return len(text)
        added = self._added_ids
        return cache.missing_chars(p for p in pieces if p not in added)

    def long_uncached_pieces(self, text: str, min_chars: int) -> list[str]:
        """The pieces of `text` (between special tokens) of at least `min_chars` that the
        segment cache does not hold, each once: what is worth asking other gateways for."""
        cache, splitter = self.segment_cache, self._splitter
        if cache is None or splitter is None:
            return []
        pieces = (p for p in splitter.split(text) if len(p) >= min_chars)
        return list(dict.fromkeys(p for p in pieces
                                  if p not in self._added_ids and not cache.holds(p)))

    def adopt(self, segments: Mapping[str, tuple[int, ...]]) -> None:
        """Put ids another gateway encoded (for this same tokenizer) into the cache."""
        if self.segment_cache is not None:
            for piece, ids in segments.items():
                self.segment_cache.put(piece, ids)

    def cached_ids(self, piece: str) -> tuple[int, ...] | None:
        """A piece's ids if the segment cache holds them."""
        return None if self.segment_cache is None else self.segment_cache.peek(piece)

    # -- completions ----------------------------------------------------------

    def completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """Token ids of every prompt in a completions body (vLLM accepts batches)."""
        if not isinstance(body, dict):
            raise ClientError("request body must be a JSON object")
        prompt = body.get("prompt")
        add_special = _flag(body, "add_special_tokens", "completions")
        read = lax_fields.prompt(prompt)  # as vLLM reads it: [1.0, 2] is ids, ["1"] text
        if read is None or read == []:
            raise ClientError(
                "prompt must be a string, a list of token ids (non-negative integers), or a "
                "non-empty list of either; "
                f"got {json.dumps(prompt)[:80]}",
                "prompt",
            )
        prompts: list[Any] = [read] if isinstance(read, str) or isinstance(read[0], int) \
            else list(read)
        out = []
        for i, item in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids = self.encode(item, add_special_tokens=add_special)
            elif not item:
                raise ClientError(f"{where} must not be an empty list of token ids", "prompt")
            else:
                ids = item
            out.append(_truncate(ids, body, self.max_model_len, "completions"))
        return out

    def prompt_ids(self, token_ids: Sequence[int], body: dict[str, Any]) -> Sequence[int]:
        """A token-id prompt the request edge already checked, as the replica sees it
        (truncate_prompt_tokens applied)."""
        _flag(body, "add_special_tokens", "completions")  # checked as for any completions body
        return _truncate(token_ids, body, self.max_model_len, "completions")

    def completion_tokens(self, body: dict[str, Any]) -> list[int]:
        """Prompt token ids of a completions body (the first prompt of a batch)."""
        return self.completion_prompts(body)[0]

    def request_tokens(self, body: dict[str, Any], endpoint: Endpoint) -> list[int]:
        """Prompt token ids for `endpoint` ("chat" or "completions")."""
        if endpoint == "chat":
            return self.chat_tokens(body)
        if endpoint == "completions":
            return self.completion_tokens(body)
        raise ValueError(f"unknown endpoint {endpoint!r}; expected 'chat' or 'completions'")


def endpoint_of(body: Any) -> Endpoint:
    """Which endpoint a bare request body is for: chat if it has messages, else completions."""
    if isinstance(body, dict) and "messages" in body:
        return "chat"
    if isinstance(body, dict) and "prompt" in body:
        return "completions"
    raise ClientError("request body needs either 'messages' (chat) or 'prompt' (completions)")


Decode = Callable[[Sequence[int]], str]
