"""``tidal serve_rm`` / ``python -m tidal.cli.serve_rm``: serve a reward model over HTTP.

Point RL training at it with ``--remote_rm_url http://HOST:PORT/get_reward`` (protocol in
``tidal.rewards.server``).
"""

from __future__ import annotations

import argparse

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import config_from_args
from tidal.config.serve_rm import ServeRMConfig

GROUPS = [(ServeRMConfig, "reward server")]


def build_parser(prog: str = "tidal serve_rm") -> argparse.ArgumentParser:
    return make_parser(
        prog,
        'Serve a reward model: POST /get_reward {"query": [...]} -> rewards.',
        GROUPS,
        command="serve_rm",
    )


def parse_config(argv: list[str]) -> ServeRMConfig:
    """Flags → ``ServeRMConfig`` (for scripts and tests)."""
    return config_from_args(ServeRMConfig, build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace) -> None:
    from tidal.rewards.server import serve

    server = serve(config_from_args(ServeRMConfig, ns))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def main(argv: list[str] | None = None, prog: str = "tidal serve_rm"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.serve_rm"))
