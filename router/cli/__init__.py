"""The command-line tools: one module per `python -m router` command.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`;
router/__main__.py names them in its command table, and `subcommands.dispatch` (also used
by `python -m replica` and `python -m loadgen`) imports only the one asked for.
"""
