"""SSE events out of a replica's byte stream: SSEReader, event_end, event_data and
without_prompt_ids, held to the plain definitions they replaced for speed.

A first chunk that carries the prompt's ids (return_token_ids: 46 KB at 8k ids) comes in
several reads on the way to the first token; these tests split streams at every byte, or
at random places, and compare with splitting the whole stream at once.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from router.upstream import SSEReader, event_data, event_end, split_events, without_prompt_ids

EVENTS = [
    b'data: {"choices": [{"index": 0, "text": "", "prompt_token_ids": ['
    + b", ".join(str(i).encode() for i in range(3000)) + b']}]}\n\n',
    b'data: {"choices":[{"index":0,"text":"a"}]}\r\n\r\n',
    b"event: message\ndata: {\"x\": 1}\ndata: {\"y\": 2}\n\n",
    b": keep-alive\n\n",
    b"data: [DONE]\n\n",
]


class _Pieces:
    """A body arriving in the given pieces (UpstreamResponse.readany's shape)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


def _read_all(pieces: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        reader = SSEReader(_Pieces(pieces))
        out = []
        while (event := await reader.next_event()) is not None:
            out.append(event)
        return out
    return asyncio.run(run())


def _split_terminators(stream: bytes) -> list[bytes]:
    """The plain definition: each event ends at the first "\\n\\n" or "\\r\\n\\r\\n"."""
    out, start = [], 0
    while start < len(stream):
        ends = [p + len(sep) for sep in (b"\n\n", b"\r\n\r\n")
                if (p := stream.find(sep, start)) != -1]
        end = min(ends) if ends else len(stream)
        out.append(stream[start:end])
        start = end
    return out


def test_events_split_at_every_byte_come_out_whole() -> None:
    stream = b"".join(EVENTS[1:])  # the small ones: every split point of ~120 bytes
    for cut in range(1, len(stream)):
        assert _read_all([stream[:cut], stream[cut:]]) == EVENTS[1:], cut
    assert _read_all([bytes([b]) for b in stream]) == EVENTS[1:]


@pytest.mark.parametrize("seed", range(20))
def test_a_long_first_event_in_random_reads_comes_out_whole(seed: int) -> None:
    rng = random.Random(seed)
    stream = b"".join(EVENTS)
    cuts = sorted(rng.sample(range(1, len(stream)), rng.randrange(1, 40)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert _read_all(pieces) == EVENTS == _split_terminators(stream)


def test_event_end_finds_the_first_terminator_from_where_it_is_asked() -> None:
    stream = b"a\nb\n\nc\r\n\r\nd\n"
    assert event_end(stream) == 5
    assert event_end(stream, 5) == 10
    assert event_end(stream, 10) == -1
    assert event_end(b"x\n\r\ny\n\n") == 7  # "\n\r\n" without the "\r" before is no end
    assert split_events(b"".join(EVENTS)) == EVENTS


def test_a_stream_cut_mid_event_is_an_error_not_an_end() -> None:
    with pytest.raises(Exception, match="mid-event"):
        _read_all([b'data: {"choices": ['])


def _plain_event_data(event: bytes) -> bytes:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


@pytest.mark.parametrize("event", [
    *EVENTS, b"data: x", b"data:x\n\n", b"data:  x\n\n", b"data: x\r\n\r\n", b"data: a\rb\n\n",
    b"data: x\r\r", b"data: x\ndata: y\n\n", b"data: \n\n", b"data: x\n\n\n", b"id: 1\n\n", b""])
def test_event_data_reads_as_the_plain_definition(event: bytes) -> None:
    assert event_data(event) == _plain_event_data(event)


def test_the_prompts_ids_are_cut_out_and_nothing_else() -> None:
    chunk = {"prompt_token_ids": list(range(50)), "choices": [
        {"index": 0, "text": '"prompt_token_ids": [7]', "token_ids": [1, 2],
         "prompt_token_ids": [9, 8]}]}
    for separators in ((", ", ": "), (",", ":")):
        data = json.dumps(chunk, separators=separators).encode()
        cut = json.loads(without_prompt_ids(data))
        assert cut == {"prompt_token_ids": None, "choices": [
            {"index": 0, "text": '"prompt_token_ids": [7]', "token_ids": [1, 2],
             "prompt_token_ids": None}]}
    plain = b'{"choices": [{"index": 0, "text": "a"}]}'
    assert without_prompt_ids(plain) is plain  # nothing to cut: not copied
