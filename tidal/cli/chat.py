"""``tidal chat`` / ``python -m tidal.cli.chat``: talk to a model in the terminal, keeping the history.

Reads one user message per line from stdin (so it also works through a pipe); ``/reset`` forgets
the conversation, ``/exit`` or end of input quits. See ``tidal.inference.chat``.
"""

from __future__ import annotations

import argparse
import sys

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import config_from_args
from tidal.inference.chat import ChatConfig
from tidal.inference.config import PolicyConfig, SamplingConfig

# OpenRLHF interactive_chat's sampling defaults (tidal generate keeps vLLM's 1.0 / 1.0 / off).
CHAT_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.2}

GROUPS = [
    (PolicyConfig, "model and engine", ("max_num_seqs",)),
    (ChatConfig, "conversation"),
    (SamplingConfig, "sampling"),
]


def build_parser(prog: str = "tidal chat") -> argparse.ArgumentParser:
    parser = make_parser(
        prog, "Interactive multi-turn chat with a model (one message per input line).", GROUPS, command="chat"
    )
    parser.set_defaults(max_new_tokens=512)  # a chat reply, not a long-form rollout
    parser.set_defaults(**CHAT_SAMPLING_DEFAULTS)
    return parser


def run_from_args(ns: argparse.Namespace):
    from tidal.inference.chat import ChatSession, run_chat
    from tidal.inference.generate import load_engine

    chat = config_from_args(ChatConfig, ns)
    chat.validate()
    sampling = config_from_args(SamplingConfig, ns)
    params = sampling.sampling_params()
    policy = config_from_args(PolicyConfig, ns, max_num_seqs=1)
    session = ChatSession(load_engine(policy, sampling.seed), params, chat)
    return run_chat(session, sys.stdin, sys.stdout, interactive=sys.stdin.isatty())


def main(argv: list[str] | None = None, prog: str = "tidal chat"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.chat"))
