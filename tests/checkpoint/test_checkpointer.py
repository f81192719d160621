"""The ``Checkpointer`` every training loop uses: resume restores the parts and the extra loop state,
``maybe_save`` follows ``--save_steps`` / ``--disable_ds_ckpt`` / ``--save_hf_ckpt``, and ``stopped``
writes the stop step's checkpoint once and names it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch

from tests.checkpoint.parts import Part, make_part
from tidal.checkpoint import Checkpointer, LoopState, StateFns
from tidal.config import CheckpointConfig
from tidal.distributed.world import World
from tidal.trainers.optim import NonFiniteGuard

WORLD = World()


def train_one_step(part: Part) -> None:
    part.model(torch.ones(2, 4)).sum().backward()
    part.optimizer.step()
    part.scheduler.step()
    part.optimizer.zero_grad()


class Holder:
    """A plain value restored through ``StateFns`` (as the RL loop's KL coefficient)."""

    def __init__(self, value: float):
        self.value = value

    def fns(self) -> StateFns:
        return StateFns(lambda: self.value, lambda v: setattr(self, "value", v))


def checkpointer(path: Path, part: Part, guard: NonFiniteGuard, kl: Holder, **flags) -> Checkpointer:
    cfg = CheckpointConfig(ckpt_path=str(path), **flags)
    return Checkpointer(cfg, WORLD, "sft", {"model": part}, state={"nonfinite": guard, "kl": kl.fns()})


def test_resume_restores_parts_and_state(tmp_path):
    part, guard, kl = make_part(0), NonFiniteGuard(skipped=2, in_a_row=1), Holder(0.25)
    ckpt = checkpointer(tmp_path, part, guard, kl, save_steps=2)
    train_one_step(part)
    ckpt.maybe_save(LoopState(1, 0, 1))  # not a multiple of --save_steps
    assert not (tmp_path / "global_step_1").exists()
    ckpt.maybe_save(LoopState(2, 0, 2))
    assert json.loads((tmp_path / "global_step_2" / "meta.json").read_text())["trainer"] == "sft"

    fresh, fresh_guard, fresh_kl = make_part(1), NonFiniteGuard(), Holder(0.0)
    loop = checkpointer(tmp_path, fresh, fresh_guard, fresh_kl, load_checkpoint=True).resume()
    assert loop == LoopState(2, 0, 2)
    assert (fresh_guard.skipped, fresh_guard.in_a_row, fresh_kl.value) == (2, 1, 0.25)
    torch.testing.assert_close(fresh.model.weight, part.model.weight, rtol=0, atol=0)
    assert fresh.scheduler.state_dict()["last_epoch"] == 1
    assert (
        checkpointer(
            tmp_path / "none", make_part(2), NonFiniteGuard(), Holder(0), load_checkpoint=True
        ).resume()
        is None
    )


def test_stopped_writes_the_stop_step_once_and_names_it(tmp_path):
    ckpt = checkpointer(tmp_path, make_part(0), NonFiniteGuard(), Holder(0.1), save_steps=2)
    ckpt.maybe_save(LoopState(2))
    written = json.loads((tmp_path / "global_step_2" / "meta.json").read_text())["written_ns"]
    err = ckpt.stopped(signal.SIGTERM, LoopState(2))  # already saved by maybe_save: not written again
    assert json.loads((tmp_path / "global_step_2" / "meta.json").read_text())["written_ns"] == written
    assert err.exit_code == 143 and f"checkpoint {tmp_path / 'global_step_2'} saved" in str(err)
    err = ckpt.stopped(signal.SIGINT, LoopState(3))
    assert err.exit_code == 130 and (tmp_path / "global_step_3" / "meta.json").is_file()


def test_stopped_without_checkpointing_writes_nothing(tmp_path):
    path = tmp_path / "ckpt"
    ckpt = checkpointer(path, make_part(0), NonFiniteGuard(), Holder(0.1))  # --save_steps -1
    err = ckpt.stopped(signal.SIGTERM, LoopState(5))
    assert "no checkpoint written" in str(err) and not path.exists()


def test_hf_copy_without_resumable_state(tmp_path):
    copies: list[Path] = []
    cfg = CheckpointConfig(ckpt_path=str(tmp_path), save_steps=1, save_hf_ckpt=True, disable_ds_ckpt=True)
    ckpt = Checkpointer(cfg, WORLD, "ppo", {"policy": make_part(0)}, hf_copy=copies.append)
    ckpt.maybe_save(LoopState(1))
    assert copies == [tmp_path / "global_step_1_hf"]
    assert not (tmp_path / "global_step_1").exists()
    assert "no checkpoint written" in str(ckpt.stopped(signal.SIGTERM, LoopState(1)))
