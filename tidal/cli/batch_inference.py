"""``python -m tidal.cli.batch_inference`` / ``tidal batch_inference``: OpenRLHF's module name for
``tidal generate``, reading OpenRLHF's ``--eval_task`` modes.

OpenRLHF's ``--eval_task generate`` and ``generate_vllm`` both mean "sample responses", which is what
``tidal generate`` always does (tidal has one rollout engine, not a Hugging Face and a vLLM path), so
they are taken out of the flags here; ``rm`` scores an existing file with the reward model at
``--pretrain`` (``tidal.inference.score_file``); any other value is ``tidal generate``'s own
``--eval_task``. ``--zero_stage 0`` (OpenRLHF's default: a whole model per process) is what tidal does and
is taken out too. OpenRLHF's other flags are aliased or refused by ``tidal.cli.openrlhf``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tidal.cli import generate
from tidal.cli.common import module_main, run_command

SAMPLING_MODES = ("generate", "generate_vllm")
RM_MODE = "rm"


def split_eval_task(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without OpenRLHF's ``--eval_task generate|generate_vllm|rm`` (sampling is what tidal
    generate does), and whether ``rm`` (score an existing file) was asked for."""
    out, rm, i = [], False, 0
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
        rm = rm or value == RM_MODE
        if value not in (*SAMPLING_MODES, RM_MODE):
            out += argv[i : i + step]
        i += step
    return out, rm


def drop_zero_stage_0(argv: Sequence[str]) -> list[str]:
    """``argv`` without OpenRLHF's ``--zero_stage 0`` (its default, which its scripts pass): a whole model
    in each process, which is how tidal samples and scores. Another stage (sharding the weights over
    processes) stays in, for ``tidal.cli.openrlhf`` to refuse with its reason."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--zero_stage" and i + 1 < len(argv) and argv[i + 1] == "0":
            i += 2
        elif argv[i] == "--zero_stage=0":
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser(prog: str = "tidal batch_inference"):
    return generate.build_parser(prog)


def score_from_args(ns):
    """``--eval_task rm``: score the file's responses with the reward model at ``--pretrain``."""
    from tidal.inference.score_file import run_score_file

    return run_score_file(generate.run_from_namespace(ns, validate=False))


def main(argv: Sequence[str] | None = None, prog: str = "tidal batch_inference"):
    argv, rm = split_eval_task(drop_zero_stage_0(sys.argv[1:] if argv is None else argv))
    return run_command(build_parser(prog), argv, score_from_args if rm else generate.run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.batch_inference"))
