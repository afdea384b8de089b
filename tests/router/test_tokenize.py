"""router.tokenize renders and tokenizes request bodies exactly as vLLM does."""

from __future__ import annotations

import copy
import json
import random
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from replica.processes import wait_until
from router.tokenize import PromptTokenizer, RequestError, SegmentCache, endpoint_of

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "search", "strict": True}}

CHAT_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there!"}]},
    {"messages": [
        {"role": "system", "content": "You are terse.\nAnswer in one line."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ]},
    {"messages": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                     {"type": "text", "text": "and in Rome?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
        {"role": "tool", "tool_call_id": "call_2",
         "content": [{"type": "text", "text": "24 C"}, {"type": "text", "text": "sunny"}]},
    ], "tools": [WEATHER_TOOL, SEARCH_TOOL]},
    {"messages": [
        {"role": "user", "content": "Tell me a story about <tool_call> tags and </s> too"},
        {"role": "assistant", "content": "Once upon a time"},
    ], "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [
        {"role": "developer", "content": "Dev rules apply."},
        {"role": "user", "content": "héllo wörld 你好 🎉 \t tabs  and  spaces"},
    ]},
    {"messages": [{"role": "user", "content": "No generation prompt"}],
     "add_generation_prompt": False, "chat_template_kwargs": {"unused_flag": True}},
    {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "search", "arguments": "not json"}}]},
        {"role": "user", "content": "again", "name": "bob"},
    ], "tools": [SEARCH_TOOL]},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_model_dir)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url} -> {exc.code}: {exc.read().decode()[:500]}") from exc


@pytest.mark.vllm
@pytest.mark.parametrize("index", range(len(CHAT_BODIES)))
def test_chat_tokens_equal_vllm(vllm_server: Any, tok: PromptTokenizer, index: int) -> None:
    body = CHAT_BODIES[index]
    ours = tok.chat_tokens(copy.deepcopy(body))
    theirs = _post(f"{vllm_server.url}/tokenize",
                   {"model": vllm_server.served_model_name, **body})["tokens"]
    assert ours == theirs, f"ours: {tok.decode(ours)!r}\nvLLM: {tok.decode(theirs)!r}"


@pytest.mark.vllm
@pytest.mark.parametrize("text", ["Hello world", "  leading spaces\nand lines", "<s>already"])
def test_completion_text_equals_vllm(vllm_server: Any, tok: PromptTokenizer, text: str) -> None:
    ours = tok.completion_tokens({"prompt": text})
    theirs = _post(f"{vllm_server.url}/tokenize",
                   {"model": vllm_server.served_model_name, "prompt": text})["tokens"]
    assert ours == theirs
    assert ours[0] == tok.encode("<s>", add_special_tokens=False)[0]  # BOS added


@pytest.mark.vllm
def test_completion_usage_counts_our_tokens(vllm_server: Any, tok: PromptTokenizer) -> None:
    body = {"prompt": "Count these tokens, please: one two three.", "max_tokens": 1}
    usage = _post(f"{vllm_server.url}/v1/completions",
                  {"model": vllm_server.served_model_name, **body})["usage"]
    assert usage["prompt_tokens"] == len(tok.completion_tokens(body))


def test_chat_matches_transformers_apply_chat_template(tiny_model_dir: Path,
                                                       tok: PromptTokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    expected = hf.apply_chat_template(messages, tools=[WEATHER_TOOL["function"]],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    # Our tool dump holds the same keys the template prints, in vLLM's shape.
    ours = tok.chat_tokens({"messages": messages, "tools": [WEATHER_TOOL]})
    assert ours == list(expected)


def test_add_special_tokens_adds_bos(tok: PromptTokenizer) -> None:
    plain = tok.completion_tokens({"prompt": "Hello world", "add_special_tokens": False})
    with_bos = tok.completion_tokens({"prompt": "Hello world"})
    assert with_bos == [with_bos[0], *plain]
    chat = tok.chat_tokens({"messages": [{"role": "user", "content": "x"}]})
    chat_bos = tok.chat_tokens({"messages": [{"role": "user", "content": "x"}],
                                "add_special_tokens": True})
    assert chat_bos == [chat_bos[0], *chat]  # template's BOS plus the post-processor's


def test_token_id_prompts_pass_through(tok: PromptTokenizer) -> None:
    assert tok.completion_tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.completion_prompts({"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]
    assert tok.completion_prompts({"prompt": ["Hi", "Ho"]}) == [
        tok.completion_tokens({"prompt": "Hi"}), tok.completion_tokens({"prompt": "Ho"})]
    # Read as vLLM's pydantic model reads them: ids written 1.0 or "3" are ids.
    assert tok.completion_prompts({"prompt": [1.0, "3", True]}) == [[1, 3, 1]]
    assert tok.completion_tokens({"prompt": list(range(10)), "truncate_prompt_tokens": 3}) == [7, 8, 9]
    assert tok.request_tokens({"prompt": [9]}, "completions") == [9]


def test_generation_prompt_and_continue_final(tok: PromptTokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    cont = tok.render_chat({"messages": msgs, "continue_final_message": True,
                            "add_generation_prompt": False})
    assert cont.endswith("<|im_start|>assistant\nHel")
    closed = tok.render_chat({"messages": msgs, "add_generation_prompt": False})
    assert closed.endswith("Hel<|im_end|>\n")
    opened = tok.render_chat({"messages": msgs})
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_endpoint_of() -> None:
    assert endpoint_of({"messages": []}) == "chat"
    assert endpoint_of({"prompt": "x"}) == "completions"
    with pytest.raises(RequestError, match="'messages'"):
        endpoint_of({"input": "x"})


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [42]}, "messages[0]", "must be an object, got int"),
        ({"messages": [{"content": "x"}]}, "messages[0]", "role must be a non-empty string"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "got int"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]", "'image_url'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
         "messages[0].content[0].text", "must be a string"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]},
         "tool_calls", "must be objects"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "empty array"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0]", "'function' object"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
         "continue_final_message", "Cannot set both"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
         "chat_template", "not allowed"),
        ({"messages": [{"role": "user", "content": "x"}],
          "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
        ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "maybe"},
         "add_generation_prompt", "boolean"),
    ],
)
def test_bad_chat_bodies_raise_request_error(tok: PromptTokenizer, body: dict[str, Any],
                                             param: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        tok.chat_tokens(body)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "prompt must be a string"),
        ({"prompt": 12}, "got 12"),
        ({"prompt": []}, "got \\[\\]"),
        ({"prompt": [1, "a"]}, "got \\[1, \"a\"\\]"),
        ({"prompt": [1, -2]}, "non-negative integers.*got \\[1, -2\\]"),
        ({"prompt": [[1, 2], "Hi"]}, "got \\[\\[1, 2\\], \"Hi\"\\]"),  # vLLM: no mixed batch
        ({"prompt": [[1], []]}, "prompt\\[1\\] must not be an empty list"),
        ({"prompt": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ],
)
def test_bad_completion_bodies_raise_request_error(tok: PromptTokenizer, body: dict[str, Any],
                                                   message: str) -> None:
    with pytest.raises(RequestError, match=message):
        tok.completion_tokens(body)


# -- the conversation-prefix cache ----------------------------------------------

_PIECES = ["hello", " world", "\n", "  ", "<|im_", "end|>", "<", "s>", "tool", "_call", "{\"a\": 1}",
           "é", "你好", "🎉", "\t", "12345", ".", "The cache", "</", "<|im_start|>", "<s>"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 30)))


def _random_conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _random_text(rng)})
    for i in range(rng.randint(1, 8)):
        role = rng.choice(["user", "assistant", "tool"]) if i else "user"
        messages.append({"role": role, "content": _random_text(rng)})
    return messages


def test_prefix_cache_equals_full_tokenization(tiny_model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    assert tok.segment_cache is not None
    rng = random.Random(0)
    for _ in range(150):
        messages = _random_conversation(rng)
        # Grow the conversation turn by turn, as a client resends its history.
        for end in range(1, len(messages) + 1):
            body = {"messages": messages[:end], "tools": [WEATHER_TOOL] if end % 2 else None}
            cached = tok.chat_tokens(body)
            full = tok.encode(tok.render_chat(body), add_special_tokens=False)
            assert cached == full, tok.render_chat(body)
    assert tok.segment_cache.stats.hits > tok.segment_cache.stats.misses


def test_encoding_without_offsets_gives_the_tokenizers_own_ids(tok: PromptTokenizer) -> None:
    # PromptTokenizer.encode skips the character offsets (encode_batch_fast); the ids must
    # be those of the tokenizer's plain encode, special tokens in the text and added.
    backend = tok._backend
    rng = random.Random(2)
    texts = ["", " ", "\n\n", "héllo wörld 你好 🎉 \t tabs  and  spaces",
             "<|im_start|>user\nhi<|im_end|>\n<s> </s>", "a" * 5000,
             *(tok.render_chat({"messages": _random_conversation(rng)}) for _ in range(30))]
    for text in texts:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == \
                backend.encode(text, add_special_tokens=special).ids, (text[:60], special)


def test_prefix_cache_is_bounded(tiny_model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_model_dir, segment_cache_chars=2_000)
    assert tok.segment_cache is not None
    for i in range(50):
        tok.chat_tokens({"messages": [{"role": "user", "content": f"message {i} " * 20}]})
    assert tok.segment_cache.stats.chars <= 2_000


def test_thread_pool_gives_same_ids(tiny_model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    rng = random.Random(1)
    bodies = [{"messages": _random_conversation(rng)} for _ in range(200)]
    expected = [tok.encode(tok.render_chat(b), add_special_tokens=False) for b in bodies]
    shared = PromptTokenizer.from_dir(tiny_model_dir)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(shared.chat_tokens, bodies * 3))
    assert results == expected * 3


def test_decode_round_trips(tok: PromptTokenizer) -> None:
    ids = tok.chat_tokens({"messages": [{"role": "user", "content": "héllo 🎉"}]})
    assert tok.decode(ids) == "<s><|im_start|>user\nhéllo 🎉<|im_end|>\n<|im_start|>assistant\n"
    assert tok.max_model_len == 8192


# -- content format detection, against vLLM's own ---------------------------------

TEMPLATES = {
    "tiny": None,  # filled from the model
    "loop_over_content": (
        "{% for message in messages %}{% for part in message['content'] %}"
        "{{ part['text'] }}{% endfor %}{% endfor %}"
    ),
    "alias_and_attr": (
        "{% set msgs = messages[1:] %}{% for m in msgs %}"
        "{% for c in m.content | list %}{{ c.text }}{% endfor %}{% endfor %}"
    ),
    "macro_param": (
        "{% macro render(items) %}{% for it in items %}{{ it.text }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ render(message.content) }}{% endfor %}"
    ),
    "content_var": (
        "{% for message in messages %}{% set content = message.content %}"
        "{% for item in content %}{{ item }}{% endfor %}{% endfor %}"
    ),
    "string_only": "{% for message in messages %}{{ message.content }}{% endfor %}",
    "unparseable": "{% for x in %}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_detection_matches_vllm(tok: PromptTokenizer, name: str) -> None:
    from vllm.renderers.hf import _detect_content_format

    from router.tokenize import detect_content_format

    template = TEMPLATES[name] or tok._hf.get_chat_template(None)
    expected = _detect_content_format.__wrapped__(template, default="string")
    assert detect_content_format(template) == expected
    if name == "tiny":
        assert expected == "string"
    if name == "loop_over_content":
        assert expected == "openai"


def test_openai_content_format_keeps_parts(tiny_model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(tiny_model_dir, content_format="openai")
    template = TEMPLATES["loop_over_content"]
    assert tok.content_format_for("ignored") == "openai"
    from router.tokenize import normalise_messages

    conv = normalise_messages(
        [{"role": "user", "content": ["a", {"type": "text", "text": "b"}]},
         {"role": "assistant", "content": None},
         {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
        content_format="openai",
    )
    assert conv[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert conv[1]["content"] == []
    assert conv[2]["content"] == "x\ny"  # vLLM flattens text-only tool results
    auto = PromptTokenizer.from_dir(tiny_model_dir)
    assert auto.content_format_for(str(template)) == "openai"
    assert auto.content_format_for(str(TEMPLATES["string_only"])) == "string"
    with pytest.raises(ValueError, match="content_format must be"):
        PromptTokenizer.from_dir(tiny_model_dir, content_format="json")


PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'text' %}[{{ part.text }}]{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.vllm
def test_openai_content_format_equals_vllm_with_chat_template_override(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A second server (other seed and block size) with a template looping over parts."""
    from vllm_server import start_vllm_server

    from router.hashing import HashConfig

    template_path = tmp_path / "parts.jinja"
    template_path.write_text(PARTS_TEMPLATE)
    tok = PromptTokenizer.from_dir(tiny_model_dir, chat_template=PARTS_TEMPLATE)
    bodies: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]},
        {"messages": [{"role": "system", "content": "sys"},
                      {"role": "user", "content": "plain string"},
                      {"role": "assistant", "content": None},
                      {"role": "tool", "content": [{"type": "text", "text": "x"},
                                                   {"type": "text", "text": "y"}]}]},
    ]
    with start_vllm_server(tiny_model_dir, block_size=64, seed="1", kv_events=False,
                           extra_args=("--chat-template", str(template_path))) as server:
        assert server.hash == HashConfig("sha256", 64, "1")
        assert server.kv_events_endpoint == ""
        for body in bodies:
            theirs = _post(f"{server.url}/tokenize",
                           {"model": server.served_model_name, **body})["tokens"]
            ours = tok.chat_tokens(copy.deepcopy(body))
            assert ours == theirs, f"ours: {tok.decode(ours)!r}\nvLLM: {tok.decode(theirs)!r}"
    assert "[a][b]" in tok.render_chat(bodies[0])


def test_warm_compiles_the_chat_template_before_the_first_request(tiny_model_dir: Path) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # A template of this test's own, so no earlier test has compiled it already.
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                "{% if tools %}{{ tools | length }} tools{% endif %}{# warm-up test #}")
    tok = PromptTokenizer.from_dir(tiny_model_dir, chat_template=template)
    tok.warm()
    compiled = _compile_jinja_template.cache_info()
    body = {"messages": [{"role": "user", "content": "hello"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    assert tok.render_chat(body).startswith("<|user|>hello")
    after = _compile_jinja_template.cache_info()
    assert (after.misses, after.hits) == (compiled.misses, compiled.hits + 1)


def _waiting_on_an_event(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and "threading" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_a_segment_wanted_by_two_threads_at_once_is_encoded_once() -> None:
    cache = SegmentCache()
    encoding, release = threading.Event(), threading.Event()
    calls: list[str] = []
    got: dict[str, tuple[int, ...]] = {}

    def slow(segment: str) -> tuple[int, ...]:
        calls.append("first")
        encoding.set()
        release.wait(30)
        return (1, 2, 3)

    def fast(segment: str) -> tuple[int, ...]:
        calls.append("second")
        return (9,)

    first = threading.Thread(target=lambda: got.update(a=cache.get_or_encode("seg", slow)))
    first.start()
    assert encoding.wait(30)
    second = threading.Thread(target=lambda: got.update(b=cache.get_or_encode("seg", fast)))
    second.start()
    wait_until(lambda: _waiting_on_an_event(second), 30, "the second thread to wait")
    release.set()
    first.join(30)
    second.join(30)
    assert calls == ["first"]
    assert got == {"a": (1, 2, 3), "b": (1, 2, 3)}
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)


def test_when_the_encoding_thread_fails_a_waiting_one_encodes() -> None:
    cache = SegmentCache()
    encoding, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    got: list[tuple[int, ...]] = []

    def failing(segment: str) -> tuple[int, ...]:
        encoding.set()
        release.wait(30)
        raise ValueError("tokenizer failed")

    def run_failing() -> None:
        try:
            cache.get_or_encode("seg", failing)
        except ValueError as exc:
            errors.append(exc)

    first = threading.Thread(target=run_failing)
    first.start()
    assert encoding.wait(30)
    second = threading.Thread(target=lambda: got.append(cache.get_or_encode("seg", lambda s: (4,))))
    second.start()
    wait_until(lambda: _waiting_on_an_event(second), 30, "the second thread to wait")
    release.set()
    first.join(30)
    second.join(30)
    assert len(errors) == 1 and got == [(4,)]
    assert cache.holds("seg")


def test_lookup_answers_every_segment_under_one_lock_and_keeps_lru_order() -> None:
    cache = SegmentCache(max_chars=6)
    for segment, ids in (("aa", (1,)), ("bb", (2,)), ("cc", (3,))):
        cache.put(segment, ids)
    assert cache.lookup(["aa", "zz", "cc"]) == [(1,), None, (3,)]
    assert (cache.stats.hits, cache.stats.misses) == (2, 0)  # a miss is get_or_encode's
    assert cache.missing_chars(["aa", "zzz", "bb", "q"]) == 4
    cache.put("dd", (4,))  # over 6 chars: the least recently used goes, "bb" (not looked up)
    assert cache.lookup(["aa", "bb", "cc", "dd"]) == [(1,), None, (3,), (4,)]


def test_how_much_is_new_then_the_ids_of_the_same_text(tiny_model_dir: Path) -> None:
    # The gateway asks uncached_chars, then chat_ids, of one rendered text (the split is
    # kept between them); a different text after it must not get the kept split.
    tok = PromptTokenizer.from_dir(tiny_model_dir)
    rng = random.Random(5)
    first = tok.render_chat({"messages": _random_conversation(rng)})
    second = tok.render_chat({"messages": _random_conversation(rng)})
    assert 0 < tok.uncached_chars(first) <= len(first)  # nothing cached yet
    assert tok.chat_ids(first, False, {}) == tok.encode(first, add_special_tokens=False)
    assert tok.uncached_chars(first) == 0  # every piece is cached now
    assert tok.chat_ids(second, False, {}) == tok.encode(second, add_special_tokens=False)
    assert tok.chat_ids(first, False, {}) == tok.encode(first, add_special_tokens=False)
