"""A faster `message.role` in chat templates, with the same results as vLLM's.

A chat template reads its messages as `message.role`, `message.content`, `tool.function`:
jinja's attribute syntax on plain dicts. transformers renders in jinja's immutable sandbox
(as vLLM does, through it), whose `getattr` first tries the Python attribute, which a dict
does not have, so every such read raises and catches an AttributeError before it takes
the item. Half the time of rendering a long conversation went there: 0.33 ms of a 26-message
8k-token chat on this machine, 0.14 ms with the lookup below (the same text, checked).

The shortcut keeps the sandbox's answer exactly: a plain `dict` (not a subclass) has no
attribute besides its type's, so for any other name the sandbox's own path ends at the
item or at an undefined of the same name, which is what is returned here; a name the type
does have (`items`, `get`, `update`, ...) goes through the sandbox unchanged, with its safety
checks. Everything else (strings, lists, tools given as objects) does too.
"""

from __future__ import annotations

from typing import Any

# Every attribute a plain dict has: its type's and object's (a dict has no __dict__).
_DICT_ATTRIBUTES = frozenset(dir(dict))
_MARK = "_cacheroute_fast_lookup"


def install(environment: Any) -> bool:
    """Give `environment` (a jinja sandbox) the shortcut, once; False when it is not
    a jinja environment this can wrap (then it renders as it did)."""
    if getattr(environment, _MARK, False):
        return True
    slow = getattr(environment, "getattr", None)
    undefined = getattr(environment, "undefined", None)
    if slow is None or undefined is None:
        return False

    def getattr_(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except LookupError:  # as the sandbox: no attribute, no item
                return undefined(obj=obj, name=attribute)
        return slow(obj, attribute)

    # An instance attribute: the compiled template calls `environment.getattr(...)`.
    environment.getattr = getattr_
    setattr(environment, _MARK, True)
    return True


def speed_up(template: str) -> bool:
    """Install the shortcut in the environment transformers compiled `template` in (its
    compile is cached per template, so renders of `template` use that environment)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: render as it does
        return False
    try:
        compiled = _compile_jinja_template(template)
    except Exception:  # a template that does not compile fails the same way in the render
        return False
    return install(getattr(compiled, "environment", None))
