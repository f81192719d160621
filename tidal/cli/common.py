"""Shared pieces of the command-line entry points: parser construction and clean error exits."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from tidal.agents.base import AgentError
from tidal.config.args import ConfigError, add_config_group
from tidal.data import DataError
from tidal.rewards.base import RewardError

# Errors in the user's input or files, not bugs: one line naming the flag/file, exit status 2.
USER_ERRORS = (ConfigError, DataError, FileNotFoundError, RewardError, AgentError)


def make_parser(prog: str, description: str, groups: Sequence[tuple]) -> argparse.ArgumentParser:
    """A parser with one ``--help`` group per config dataclass, defaults shown.

    Each group is ``(ConfigClass, title)`` or ``(ConfigClass, title, excluded_field_names)``.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for cls, title, *rest in groups:
        add_config_group(parser, cls, title, exclude=set(rest[0]) if rest else frozenset())
    return parser


def run_command(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, body: Callable[[argparse.Namespace], object]
):
    """Parse ``argv`` and run ``body``; user errors print ``prog: error: ...`` and exit with status 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ns = parser.parse_args(argv)
    try:
        return body(ns)
    except USER_ERRORS as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def module_main(main: Callable[[list[str] | None], object]) -> None:
    """``python -m tidal.cli.X`` entry: run ``main`` on ``sys.argv``."""
    main(sys.argv[1:])
