"""Checkpoint configuration: final HF export, periodic resumable checkpoints, rotation."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tidal.config.args import AT_LEAST_ONE, Checked, arg


@dataclass
class CheckpointConfig(Checked):
    """Checkpoints: where the final model goes and how training state is saved and resumed.

    Each trainer's run sets its own ``--ckpt_path`` default (``./ckpt/checkpoints_sft``, ``_dpo``,
    ``_ppo``...: ``tidal.trainers.common.checkpoints``), as OpenRLHF does, so one trainer never resumes
    another's checkpoint. ``--max_ckpt_num`` >= 1: 0 would delete every checkpoint right after writing it.
    """

    save_path: str = arg("./ckpt", help="folder for the final Hugging Face model")
    ckpt_path: str = arg("./ckpt/checkpoints", help="folder for resumable training checkpoints")
    save_steps: int = arg(
        -1,
        help="save a resumable checkpoint every N optimizer steps, and on SIGTERM/SIGINT (-1: never)",
    )
    max_ckpt_num: int = arg(
        3,
        help="keep at most this many resumable checkpoints of this run (its oldest removed first)",
        check=AT_LEAST_ONE,
    )
    load_checkpoint: bool = arg(
        False, help="resume from the latest checkpoint in --ckpt_path if there is one"
    )
    save_hf_ckpt: bool = arg(False, help="also write a Hugging Face folder next to each resumable checkpoint")
    disable_ds_ckpt: bool = arg(
        False, help="skip the resumable state (optimizer, RNG) in periodic checkpoints"
    )


def trainer_checkpoints(kind: str) -> Callable[[], CheckpointConfig]:
    """A run's default ``CheckpointConfig``: ``--ckpt_path ./ckpt/checkpoints_<kind>`` (OpenRLHF's)."""
    return lambda: CheckpointConfig(ckpt_path=f"./ckpt/checkpoints_{kind}")


@dataclass
class BestCheckpointConfig(Checked):
    """``tidal ppo``'s best checkpoint by an evaluation metric (``tidal.checkpoint.best``), OpenRLHF's
    ``--best_metric_key`` (v0.10.1) / ``--ckpt.best_metric_key`` (v0.11)."""

    best_metric_key: str = arg(
        "",
        help="after each evaluation, keep the checkpoint with the highest eval metric of this name (pass@1, "
        "pass@k, score, reward, a reward-function log; OpenRLHF's eval_<source>_pass<k> means pass@<k>) as "
        "<--ckpt_path>/best_global_step_N, beside the --max_ckpt_num rolling ones; empty: pass@1 "
        "(OpenRLHF's auto-detection); none: keep no best checkpoint",
    )


def best_metric_name(key: str) -> str | None:
    """The evaluation metric (without ``eval/``) a ``--best_metric_key`` value names; None: ``none``. Empty
    is OpenRLHF's auto-detection of a pass@1 metric; its ``eval_<source>_pass<k>`` names mean pass@<k>."""
    key = key.strip()
    if key.lower() == "none":
        return None
    if not key:
        return "pass@1"
    key = key.removeprefix("eval/")
    openrlhf = re.fullmatch(r"eval_.+_pass(\d+)", key)
    return f"pass@{openrlhf.group(1)}" if openrlhf else key


def best_key_problems(key: str, evaluates: bool, disable_ds_ckpt: bool, save_hf_ckpt: bool) -> list[str]:
    """A ``--best_metric_key`` naming a metric needs an evaluation and something to save (the default and
    ``none`` need nothing: OpenRLHF's auto-detection finds no metric without an evaluation)."""
    if best_metric_name(key) is None or not key.strip():
        return []
    if not evaluates:
        return [f"--best_metric_key {key} keeps the best checkpoint by an evaluation metric: add "
                "--eval_dataset and --eval_steps > 0"]  # fmt: skip
    if disable_ds_ckpt and not save_hf_ckpt:
        return [f"--best_metric_key {key}: --disable_ds_ckpt without --save_hf_ckpt leaves nothing to keep"]
    return []
