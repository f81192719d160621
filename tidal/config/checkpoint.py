"""Checkpoint configuration: final HF export, periodic resumable checkpoints, rotation."""

from __future__ import annotations

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
