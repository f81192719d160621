"""``tidal generate`` / ``python -m tidal.cli.generate``: batch inference, best-of-N scoring, post-processing.

See ``tidal.inference.generate`` for the pipeline and ``tidal.inference.processors`` for ``rs``,
``csft`` and ``iter_dpo``.
"""

from __future__ import annotations

import argparse

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import DatasetConfig
from tidal.config.args import ConfigError, configs_from_args
from tidal.config.data import VisionConfig
from tidal.inference.config import GeneratePromptConfig, PolicyConfig, SamplingConfig, ScoringConfig

GROUPS = [
    (PolicyConfig, "model and engine"),
    (DatasetConfig, "datasets", ("eval_dataset", "eval_split")),
    (GeneratePromptConfig, "prompts and output"),
    (SamplingConfig, "sampling"),
    (ScoringConfig, "reward model and post-processing"),
    (VisionConfig, "images (vision-language models)"),
]


def build_parser(prog: str = "tidal generate") -> argparse.ArgumentParser:
    return make_parser(
        prog,
        "Sample responses for a prompt dataset with tidal's rollout engine and write them as JSONL; "
        "optionally score them with a reward model and keep the best (rs), tag them with their reward "
        "(csft) or pair best and worst (iter_dpo).",
        GROUPS,
        command="generate",
    )


def run_from_namespace(ns: argparse.Namespace, validate: bool = True):
    """The ``GenerateRun`` described by parsed flags (raises ``ConfigError`` on bad combinations);
    ``validate=False`` leaves the cross-flag checks to the caller (batch_inference's rm mode has its own)."""
    from tidal.inference.generate import GenerateRun

    classes = {"policy": PolicyConfig, "sampling": SamplingConfig, "prompts": GeneratePromptConfig,
               "scoring": ScoringConfig, "datasets": DatasetConfig, "vision": VisionConfig}  # fmt: skip
    run = GenerateRun(**configs_from_args(classes, ns))  # every flag checked, all problems reported
    if validate:
        run.validate()
        check_tp_layout(run.policy.pretrain, run.policy.tp_size)
    return run


def check_tp_layout(pretrain: str, tp_size: int) -> None:
    """A ``--tp_size`` that the model's shapes cannot be split by fails here, from its config alone."""
    if tp_size == 1:
        return
    from transformers import AutoConfig

    from tidal.rollout.models.loader import tp_layout_problem

    try:
        problem = tp_layout_problem(AutoConfig.from_pretrained(pretrain), tp_size)
    except (OSError, ValueError):  # unreadable or unsupported: loading the engine reports it
        return
    if problem:
        raise ConfigError(f"--tp_size {tp_size}: {problem}")


def parse_run(argv: list[str]):
    """Flags → validated ``GenerateRun`` without generating (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace):
    from tidal.inference.generate import run_generate

    return run_generate(run_from_namespace(ns))


def main(argv: list[str] | None = None, prog: str = "tidal generate"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.generate"))
