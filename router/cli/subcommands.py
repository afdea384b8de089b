"""The sub-command table behind the three packages' `python -m` entry points.

Each command lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; the table maps a command name to that module, imported only when
the command (or its --help) is asked for, so `python -m router hash` does not pay for
importing the gateway's server stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def dispatch(prog: str, description: str, commands: dict[str, tuple[str, str]],
             argv: Sequence[str] | None = None) -> int:
    """Parse argv against the command table and run the chosen command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(commands)}")
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    module_name, help_text = commands[name]
    module = importlib.import_module(module_name)
    cmd_parser = argparse.ArgumentParser(prog=f"{prog} {name}", description=help_text)
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
