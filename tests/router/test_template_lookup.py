"""router.template_lookup: chat templates render the same text (or fail the same way)
with the faster attribute lookup as in jinja's own sandbox, which vLLM renders in."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router import template_lookup
from router.tokenize import PromptTokenizer


class Obj:
    role = "object"
    content = "attr"

    def __getitem__(self, key: str) -> str:
        return f"item:{key}"


TEMPLATES = [
    # the usual reads, and what is absent
    "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}",
    "{% for m in messages %}{{ m.name is defined }}{{ m.tool_calls or '' }}|{% endfor %}",
    "{{ messages[0].missing | default('dflt') }}",
    # names a dict does have: the sandbox's path, its answers unchanged
    "{% for m in messages %}{{ m.items() | list | length }}{{ m.get('role') }}{% endfor %}",
    "{% for m in messages %}{{ m.keys is defined }}{{ m.copy is defined }}{% endfor %}",
    "{{ messages[0].__class__ }}",
    # nested dicts, a dict subclass, an object with attributes and items
    "{{ tools[0].function.name }}/{{ tools[0].function.parameters.type }}",
    "{{ od.role }}/{{ od.items() | list | length }}",
    "{{ obj.role }}/{{ obj.content }}/{{ obj.other }}",
    # a key shadowed by a dict method name: the method, as the sandbox gives it
    "{{ shadow.items is callable }}/{{ shadow['items'] }}",
]

CONTEXT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi", "name": "ann"},
                 {"role": "assistant", "content": "yo", "tool_calls": [{"id": "1"}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "od": OrderedDict(role="ordered"),
    "obj": Obj(),
    "shadow": {"items": "value"},
}


def _render(env: ImmutableSandboxedEnvironment, source: str) -> str:
    try:
        return env.from_string(source).render(**CONTEXT)
    except (SecurityError, UndefinedError) as exc:
        return f"raised {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("source", TEMPLATES)
def test_same_text_as_the_sandbox(source: str) -> None:
    fast = ImmutableSandboxedEnvironment()
    assert template_lookup.install(fast)
    assert _render(fast, source) == _render(ImmutableSandboxedEnvironment(), source)


@pytest.mark.parametrize("source", [
    "{{ messages[0].update({'role': 'x'}) }}",  # the immutable sandbox refuses to modify
    "{{ messages.append(1) }}",
    "{{ messages[0].nope.deeper }}",  # an undefined's attribute
])
def test_same_refusals_as_the_sandbox(source: str) -> None:
    fast = ImmutableSandboxedEnvironment()
    template_lookup.install(fast)
    slow_result = _render(ImmutableSandboxedEnvironment(), source)
    assert slow_result.startswith("raised")
    assert _render(fast, source) == slow_result


def test_install_is_idempotent_and_declines_what_is_not_an_environment() -> None:
    env = ImmutableSandboxedEnvironment()
    assert template_lookup.install(env)
    first = env.getattr
    assert template_lookup.install(env)
    assert env.getattr is first  # not wrapped twice
    assert not template_lookup.install(None)
    assert not template_lookup.speed_up("{% for x in %}")  # does not compile: left alone


def test_the_gateways_renders_use_it(tiny_model_dir: Path) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tok = PromptTokenizer.from_dir(tiny_model_dir)
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    text = tok.render_chat(body)
    template = tok._hf.get_chat_template(None)
    env = _compile_jinja_template(template).environment
    assert getattr(env, "_cacheroute_fast_lookup", False)
    # and the text is the sandbox's own
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.globals.update(env.globals)
    plain.filters.update(env.filters)
    plain.tests.update(env.tests)
    expected = plain.from_string(template).render(
        messages=body["messages"], add_generation_prompt=True, **tok._special_tokens_map)
    assert text == expected


def test_the_template_benchmark_runs_and_names_a_bad_value(tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_template.py"
    done = subprocess.run([sys.executable, str(bench), "--rounds", "2", "--renders", "3",
                           "--turns", "2", "--tools", "2", "--model-dir", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.count("(same text)") == 2 and "shortcut" in done.stdout
    bad = subprocess.run([sys.executable, str(bench), "--renders", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--renders must be at least 1, got 0" in bad.stderr


def _plain_tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
                  separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson filter, as it defines it."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
_json_like = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers(0, 3), inner, max_size=3),
    max_leaves=12)


@given(st.lists(st.dictionaries(st.text(max_size=3) | st.integers(0, 3), _json_like,
                                max_size=4), min_size=1, max_size=6),
       st.booleans(), st.sampled_from([None, 2]), st.booleans())
@example([{"a": float("nan")}, {"a": None}, {"a": float("inf")}, {"a": -float("inf")}],
         False, None, False)
@example([{"a": 1}, {"a": 1.0}, {"a": True}, {"a": -0.0}, {"a": 0.0}, {"a": "1"}],
         False, None, False)
@example([{"a": 1, "b": 2}, {"b": 2, "a": 1}, {1: "x"}, {"1": "x"}, {"a": [1]}, {"a": (1,)}],
         True, 2, False)
def test_memoised_tojson_renders_what_json_dumps_renders(
        values: list[dict[Any, Any]], ensure_ascii: bool, indent: int | None,
        sort_keys: bool) -> None:
    memoised = template_lookup.memo_tojson(_plain_tojson)
    options: dict[str, Any] = {"ensure_ascii": ensure_ascii, "indent": indent,
                               "sort_keys": sort_keys}
    # Every value twice (the second from the memo where it was kept), in both orders:
    # values that look alike to a careless key (1, 1.0 and true; NaN and null; "1" and 1
    # as keys) must each get their own text.
    for x in [*values, *reversed(values), *values]:
        try:
            expected = _plain_tojson(x, **options)
        except (TypeError, ValueError) as exc:  # e.g. sort_keys over str and int keys
            with pytest.raises(type(exc)):
                memoised(x, **options)
            continue
        assert memoised(x, **options) == expected


def test_memoised_tojson_dumps_each_dict_once_and_stays_bounded() -> None:
    calls: list[Any] = []

    def counting(x: Any, **options: Any) -> str:
        calls.append(x)
        return _plain_tojson(x, **options)

    memoised = template_lookup.memo_tojson(counting)
    tool = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    assert memoised(tool) == memoised(dict(tool)) == _plain_tojson(tool)
    assert len(calls) == 1
    assert memoised(tool, indent=2) == _plain_tojson(tool, indent=2) and len(calls) == 2
    assert memoised({"n": 2**70}) == '{"n": 1180591620717411303424}'  # past msgpack: dumped
    assert memoised({"n": 2**70}) and len(calls) == 4
    assert memoised([1, 2]) == "[1, 2]" and memoised([1, 2]) and len(calls) == 6  # not a dict
    for i in range(template_lookup.TOJSON_MEMO_ENTRIES):
        memoised({"i": i})
    calls.clear()
    memoised(tool)  # the oldest entry made room for the newest
    memoised({"i": template_lookup.TOJSON_MEMO_ENTRIES - 1})
    assert calls == [tool]


def test_a_chat_with_tools_renders_as_the_plain_sandbox_does(tiny_model_dir: Path) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tok = PromptTokenizer.from_dir(tiny_model_dir)
    tools = [{"type": "function", "function": {
        "name": f"t{k}", "description": "naïve → “quoted” " * k,
        "parameters": {"type": "object", "properties": {"x": {"type": "number",
                                                              "default": 1.0 if k else 1}}}}}
             for k in range(3)]
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
            "tools": tools}
    texts = [tok.render_chat(body) for _ in range(2)]  # the second from the memo
    template = tok._hf.get_chat_template(None, tools=tools)
    env = _compile_jinja_template(template).environment
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.globals.update(env.globals)
    plain.tests.update(env.tests)
    plain.filters["tojson"] = _plain_tojson
    expected = plain.from_string(template).render(
        messages=body["messages"], tools=tools, add_generation_prompt=True,
        **tok._special_tokens_map)
    assert texts == [expected, expected]
    assert '"default": 1.0' in expected and '"default": 1}' in expected
