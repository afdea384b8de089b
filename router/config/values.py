"""Readers for config values: each checks one key's value and names the key when it fails.

Values from the environment and flags arrive as `_Text` and are converted by the type
their key expects; values from the YAML file arrive typed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yaml

from router.config.sections import ConfigError

T = TypeVar("T")


class _Text(str):
    """A value that arrived as text (environment or flag), to be read by its key's type."""



def _describe(value: Any) -> str:
    return repr(str(value)) if isinstance(value, _Text) else repr(value)


def _read_int(path: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, _Text):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"must be {kind}, got {_describe(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"must be {kind}, got {value!r}")
    return value


def _pos_int(path: str, value: Any) -> int:
    return _read_int(path, value, 1)


def _nonneg_int(path: str, value: Any) -> int:
    return _read_int(path, value, 0)


def _number(
    path: str, value: Any, *, positive: bool = False, at_most: float | None = None
) -> float:
    if isinstance(value, _Text):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(path, f"must be a number, got {_describe(value)}")
    if positive and value <= 0:
        raise ConfigError(path, f"must be a positive number, got {value!r}")
    if value < 0:
        raise ConfigError(path, f"must not be negative, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigError(path, f"must be at most {at_most}, got {value!r}")
    return float(value)


def _pos_number(path: str, value: Any) -> float:
    return _number(path, value, positive=True)


def _nonneg_number(path: str, value: Any) -> float:
    return _number(path, value)


def _fraction(path: str, value: Any) -> float:
    return _number(path, value, at_most=1.0)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _bool(path: str, value: Any) -> bool:
    if isinstance(value, _Text):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    if not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, got {_describe(value)}")
    return value


def _str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"must be a non-empty string, got {_describe(value)}")
    return str(value)


def _is_null(value: Any) -> bool:
    return value is None or (
        isinstance(value, _Text) and value.strip() in ("", "null", "~", "none")
    )


def _optional(read: Callable[[str, Any], T]) -> Callable[[str, Any], T | None]:
    def reader(path: str, value: Any) -> T | None:
        return None if _is_null(value) else read(path, value)

    return reader


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def reader(path: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(choices)}; got {_describe(value)}")
        return str(value)

    return reader


def _structured(value: Any) -> Any:
    """Text from the environment or a flag standing for a list or mapping: parse as YAML."""
    if isinstance(value, _Text):
        try:
            return yaml.safe_load(str(value))
        except yaml.YAMLError:
            return value
    return value


def _list(path: str, value: Any) -> list[Any]:
    value = _structured(value)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(path, f"must be a list, got {_describe(value)}")
    return value


def _str_list(path: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, _Text) and not value.strip().startswith("["):
        # A comma-separated list is the natural way to write one in an env var.
        return tuple(_str(path, _Text(v.strip())) for v in value.split(",") if v.strip())
    return tuple(_str(f"{path}[{i}]", v) for i, v in enumerate(_list(path, value)))


class _Section:
    """A mapping being read key by key; `finish` rejects keys nobody asked for."""

    def __init__(self, path: str, raw: Any) -> None:
        raw = _structured(raw)
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(path, f"must be a mapping, got {_describe(raw)}")
        for key in raw:
            if not isinstance(key, str):
                raise ConfigError(path, f"keys must be strings, got {key!r}")
        self.path = path
        self.raw = raw
        self.seen: set[str] = set()

    def sub(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.raw and not _is_null(self.raw[key])

    def get(self, key: str, read: Callable[[str, Any], T], default: T) -> T:
        self.seen.add(key)
        if key not in self.raw:
            return default
        return read(self.sub(key), self.raw[key])

    def section(self, key: str) -> _Section:
        self.seen.add(key)
        return _Section(self.sub(key), self.raw.get(key))

    def finish(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        if unknown:
            expected = ", ".join(sorted(self.seen))
            raise ConfigError(self.sub(unknown[0]), f"unknown key; expected one of {expected}")
