"""``python -m tidal.cli.batch_inference`` / ``tidal batch_inference``: OpenRLHF's module name for
``tidal generate``, reading OpenRLHF's ``--eval_task`` modes.

OpenRLHF's ``--eval_task generate`` and ``generate_vllm`` both mean "sample responses", which is what
``tidal generate`` always does (tidal has one rollout engine, not a Hugging Face and a vLLM path), so
they are taken out of the flags here; ``rm`` (scoring an existing file) is refused with a reason; any
other value is ``tidal generate``'s own ``--eval_task``. OpenRLHF's other flags are aliased or refused
by ``tidal.cli.openrlhf``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tidal.cli import generate
from tidal.cli.common import module_main, run_command
from tidal.config.args import ConfigError

SAMPLING_MODES = ("generate", "generate_vllm")
RM_REFUSAL = (
    "--eval_task rm (score an existing file) is not supported yet: score the samples while "
    "generating with --reward_pretrain"
)


def without_sampling_modes(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--eval_task generate|generate_vllm`` (sampling is what tidal generate does);
    ``--eval_task rm`` raises ``ConfigError`` with the reason."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--eval_task" and i + 1 < len(argv):
            value, step = argv[i + 1], 2
        elif token.startswith("--eval_task="):
            value, step = token.split("=", 1)[1], 1
        else:
            out.append(token)
            i += 1
            continue
        if value == "rm":
            raise ConfigError(RM_REFUSAL)
        if value not in SAMPLING_MODES:
            out += argv[i : i + step]
        i += step
    return out


def build_parser(prog: str = "tidal batch_inference"):
    return generate.build_parser(prog)


def main(argv: Sequence[str] | None = None, prog: str = "tidal batch_inference"):
    parser = build_parser(prog)
    try:
        argv = without_sampling_modes(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        parser.exit(2, f"{prog}: error: {err}\n")
    return run_command(parser, argv, generate.run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.batch_inference"))
