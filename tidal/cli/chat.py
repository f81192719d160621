"""``tidal chat`` / ``python -m tidal.cli.chat``: talk to a model in the terminal, keeping the history.

Reads one user message per line from stdin (so it also works through a pipe); ``/reset`` forgets
the conversation, ``/exit`` or end of input quits. See ``tidal.inference.chat``.
"""

from __future__ import annotations

import argparse
import sys

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import ConfigError, config_from_args
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
    engine = load_4bit(policy, sampling.seed) if chat.load_in_4bit else load_engine(policy, sampling.seed)
    session = ChatSession(engine, params, chat, model=policy.pretrain)
    return run_chat(session, sys.stdin, sys.stdout, interactive=sys.stdin.isatty())


def load_4bit(policy, seed: int):
    """``--load_in_4bit``: the model in NF4 through transformers (``tidal.inference.hf_generator``)."""
    from tidal.config import ModelConfig
    from tidal.inference.hf_generator import HFGenerator
    from tidal.models import load_tokenizer

    if policy.tp_size != 1 or policy.enable_prefix_caching:
        raise ConfigError("--load_in_4bit chats through transformers: --tp_size and --enable_prefix_caching are "
                          "options of tidal's engine, which it does not use")  # fmt: skip
    model = ModelConfig(pretrain=policy.pretrain, disable_fast_tokenizer=policy.disable_fast_tokenizer,
                        tokenizer_chat_template=policy.tokenizer_chat_template)  # fmt: skip
    try:
        return HFGenerator(policy.pretrain, load_tokenizer(policy.pretrain, model), seed)
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"--pretrain {policy.pretrain} --load_in_4bit: cannot load it in 4 bits ({err})"
        ) from err


def main(argv: list[str] | None = None, prog: str = "tidal chat"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.chat"))
