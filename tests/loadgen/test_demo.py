"""`python -m loadgen demo`: the command lines it hands to compare."""

from __future__ import annotations

import argparse

from loadgen import demo


def _compare_argv(*flags: str) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = demo.compare_argv(parser.parse_args(["--out", "o", *flags]))
    return dict(zip(argv[::2], argv[1::2], strict=True))


def test_full_demo_runs_eight_sessions_of_eight_turns_in_real_time() -> None:
    argv = _compare_argv()
    assert (argv["--conversations"], argv["--turns"], argv["--time-scale"]) == ("8", "8", "1.0")


def test_quick_demo_halves_the_turns_and_speeds_the_sims_up() -> None:
    argv = _compare_argv("--quick")
    assert (argv["--conversations"], argv["--turns"], argv["--time-scale"]) == ("8", "4", "4.0")
    assert argv["--policies"] == "round_robin,least_loaded,cache_aware"


def test_an_explicit_time_scale_wins_over_quicks() -> None:
    assert _compare_argv("--quick", "--time-scale", "2")["--time-scale"] == "2.0"
    assert _compare_argv("--time-scale", "3")["--time-scale"] == "3.0"
