"""argparse value types the command lines share: a bad value is refused by flag name,
before the command starts anything."""

from __future__ import annotations

import argparse


def tcp_port(text: str) -> int:
    """A TCP port to listen on or connect to, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def int_list(text: str) -> list[int]:
    """Comma-separated whole numbers, e.g. `128,512,2048`."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want comma-separated whole numbers, got {text!r}") from None


def positive_int(text: str) -> int:
    """A count that must be at least 1 (replicas, rounds, concurrent clients)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number of at least 1, got {text!r}")
    return value
