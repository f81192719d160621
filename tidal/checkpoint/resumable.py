"""Resumable training checkpoints: sharded model and optimizer state (DCP) plus loop state.

Layout of ``--ckpt_path``::

    global_step_20/            one checkpoint, written to a temporary folder then renamed
      model_optim/             torch.distributed.checkpoint of every trained part's model and
                               optimizer (each rank writes its shards)
      trainer_state_rank0.pt   scheduler, step counters, RNG states (one file per rank)
    latest                     name of the newest complete checkpoint

Only complete checkpoints are ever named by ``latest``, so a crash while saving loses nothing
already saved. The oldest checkpoints beyond ``--max_ckpt_num`` are removed.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tidal.distributed.world import World, barrier

PREFIX = "global_step_"


@dataclass
class LoopState:
    """Where the training loop is: enough to continue exactly where it stopped."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    """The newest complete checkpoint folder in ``ckpt_path``, or None."""
    pointer = Path(ckpt_path) / "latest"
    if not pointer.exists():
        return None
    folder = Path(ckpt_path) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def _rotate(ckpt_path: Path, keep: int) -> None:
    folders = sorted(
        (p for p in ckpt_path.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()),
        key=lambda p: int(p.name[len(PREFIX) :]),
    )
    for old in folders[: max(len(folders) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _dcp_state(parts: dict) -> dict:
    """``{"<name>_model": ..., "<name>_optim": ...}`` for every part (an object with model/optimizer)."""
    state = {}
    for name, part in parts.items():
        state[f"{name}_model"], state[f"{name}_optim"] = get_state_dict(part.model, part.optimizer)
    return state


def save_checkpoint(ckpt_path, parts: dict, loop: LoopState, world: World, keep: int = 3, extra=None) -> Path:
    """Save every part (``model``, ``optimizer``, ``scheduler``), the loop state and RNG; returns the folder.

    ``parts`` maps a name (``model``, ``policy``, ``critic``) to an object with those three attributes.
    """
    ckpt_path = Path(ckpt_path)
    name = f"{PREFIX}{loop.global_step}"
    tmp = ckpt_path / f".tmp_{name}"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    dcp.save(_dcp_state(parts), checkpoint_id=str(tmp / "model_optim"))
    state = {
        "loop": asdict(loop),
        "schedulers": {k: p.scheduler.state_dict() for k, p in parts.items()},
        "rng": rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / f"trainer_state_rank{world.rank}.pt")
    barrier(world)
    final = ckpt_path / name
    if world.is_main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (ckpt_path / "latest").write_text(name)
        _rotate(ckpt_path, keep)
    barrier(world)
    return final


def load_checkpoint(folder, parts: dict, world: World) -> tuple[LoopState, dict]:
    """Restore every part, the schedulers and RNG from ``folder``; returns the loop state and extras."""
    folder = Path(folder)
    state = _dcp_state(parts)
    dcp.load(state, checkpoint_id=str(folder / "model_optim"))
    for name, part in parts.items():
        set_state_dict(
            part.model,
            part.optimizer,
            model_state_dict=state[f"{name}_model"],
            optim_state_dict=state[f"{name}_optim"],
        )
    trainer_state = torch.load(folder / f"trainer_state_rank{world.rank}.pt", weights_only=False)
    for name, part in parts.items():
        part.scheduler.load_state_dict(trainer_state["schedulers"][name])
    set_rng_state(trainer_state["rng"])
    return LoopState(**trainer_state["loop"]), trainer_state.get("extra", {})
