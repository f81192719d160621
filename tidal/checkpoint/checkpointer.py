"""One run's checkpointing, as every training loop uses it: resume, periodic saves with rotation, the
Hugging Face copies and exports, and the save made when a signal stops training.

A loop builds one ``Checkpointer`` from the ``--ckpt_path`` flags (``CheckpointConfig``), the
trainer kind (``sft``, ``dpo``, ``ppo``...), the settings it records, and what it saves:

- ``parts``: the trained models by name (``{"model": opt}`` for a supervised trainer,
  ``{"policy": actor, "critic": critic}`` for RL), each an object with ``model``, ``optimizer`` and
  ``scheduler`` (``tidal.trainers.loop.Optimization``); their weights, optimizer and LR schedule are
  saved, and their fingerprints make a checkpoint of another model refuse to resume;
- ``state``: anything else the loop must restore to continue exactly, by name, each with
  ``state_dict()`` / ``load_state_dict(dict)`` (the non-finite step guard, the KL controller, reward
  moments...; ``StateFns`` adapts a getter/setter pair);
- ``hf_copy``: what ``--save_hf_ckpt`` writes next to each checkpoint (a function of the folder).

Then the loop calls ``resume()`` once, ``maybe_save(loop)`` after every step, ``stopped(signum, loop)``
when ``StopSignals`` asks it to stop, and ``export(..., final=True)`` for the final model(s); ``check_space``
before training refuses a ``--save_path`` without room for them. The files, their
checks (temporary folders + rename, full disk, NaN weights, lineage rotation, foreign checkpoints)
are ``tidal.checkpoint.resumable`` / ``manager`` / ``hf_export``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tidal.checkpoint.hf_export import save_hf_model
from tidal.checkpoint.interrupt import StopSignals, TrainingInterrupted
from tidal.checkpoint.manager import RunCheckpoints, RunIdentity, model_fingerprint
from tidal.checkpoint.resumable import PREFIX, LoopState, agree_ok
from tidal.checkpoint.space import model_bytes, space_problem
from tidal.config.args import ConfigError
from tidal.config.checkpoint import CheckpointConfig
from tidal.distributed.world import World
from tidal.logging import get_logger

log = get_logger(__name__)


class Stateful(Protocol):
    """Loop state saved in a checkpoint besides the trained parts."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class StateFns:
    """A ``Stateful`` made of a getter and a setter (for a plain value such as the KL coefficient)."""

    get: Callable[[], Any]
    set: Callable[[Any], None]

    def state_dict(self) -> Any:
        return self.get()

    def load_state_dict(self, state: Any) -> None:
        self.set(state)


class Checkpointer:
    """Checkpoints of one run (see the module docstring)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        world: World,
        kind: str,
        parts: Mapping[str, Any],
        settings: dict | None = None,
        state: Mapping[str, Stateful] | None = None,
        hf_copy: Callable[[Path], object] | None = None,
    ):
        self.cfg, self.world, self.parts = cfg, world, dict(parts)
        self.state, self.hf_copy = dict(state or {}), hf_copy
        models = {name: model_fingerprint(part.model) for name, part in self.parts.items()}
        self.runs = RunCheckpoints(cfg, RunIdentity(kind, models, settings or {}), world)

    def folder(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is written."""
        return Path(self.cfg.ckpt_path) / f"{PREFIX}{step}"

    # ---- resume ------------------------------------------------------------------------------
    def resume(self) -> LoopState | None:
        """Restore the parts and state from ``--ckpt_path`` (``--load_checkpoint``); the loop state to
        continue from, or None when starting afresh."""
        resumed = self.runs.resume(self.parts)
        if resumed is None:
            return None
        loop, saved = resumed
        for name, item in self.state.items():
            item.load_state_dict(saved.get(name, {}))
        log.info("resumed at step %d (epoch %d)", loop.global_step, loop.epoch)
        return loop

    def resumed_setting(self, key: str) -> Any:
        """A setting (``"train.train_batch_size"``) as the resumed checkpoint recorded it; None when not
        resumed or not recorded."""
        return self.runs.resumed_settings.get(key)

    def resume_step(self, loop: LoopState) -> int | None:
        """The step the metrics continue after (drops later logged steps), None without ``--load_checkpoint``."""
        return loop.global_step if self.cfg.load_checkpoint else None

    # ---- saving ------------------------------------------------------------------------------
    def save(self, loop: LoopState, name: str | None = None) -> Path:
        """Write the resumable checkpoint of ``loop`` now (rotating this run's older ones); with ``name``, a
        checkpoint kept beside the rolling ones instead (``tidal.checkpoint.best``)."""
        extra = {key: item.state_dict() for key, item in self.state.items()}
        return self.runs.save(self.parts, loop, extra, name)

    def maybe_save(self, loop: LoopState) -> None:
        """Every ``--save_steps`` steps: the resumable checkpoint (unless ``--disable_ds_ckpt``) and the
        HF copy (``--save_hf_ckpt``)."""
        cfg = self.cfg
        if cfg.save_steps <= 0 or loop.global_step % cfg.save_steps:
            return
        if not cfg.disable_ds_ckpt:
            self.save(loop)
        if cfg.save_hf_ckpt and self.hf_copy is not None:
            self.hf_copy(Path(cfg.ckpt_path) / f"{PREFIX}{loop.global_step}_hf")

    def stopped(self, signum: int, loop: LoopState) -> TrainingInterrupted:
        """The error that ends training on ``signum`` after ``loop``'s step, once the checkpoint of that
        step is written (unless it already is, or checkpointing is off). Every rank calls it together."""
        saved = None
        if self.runs.enabled:
            if self.runs.last_saved_step != loop.global_step:
                self.save(loop)
            saved = str(self.folder(loop.global_step))
        return StopSignals.interrupted(signum, loop.global_step, saved)

    def check_space(self, models: list, path: str | Path) -> None:
        """Refuse to train (``ConfigError``, every rank) when ``--save_path`` has no room for the final
        ``models``: said now, the run can still be pointed elsewhere; after training it could not."""
        problem = space_problem(path, sum(model_bytes(m) for m in models)) if self.world.is_main else None
        if not agree_ok(problem is None, self.world):
            raise ConfigError(
                f"--save_path {problem or '(see rank 0)'}: free space there, or pass another --save_path"
            )

    def export(
        self, model, tokenizer, path: str | Path, extra_config: dict | None = None, final: bool = False
    ) -> Path:
        """``model`` (and ``tokenizer``) as a Hugging Face folder at ``path`` (all ranks take part). The
        ``final`` model goes to a rescue folder, named in the error, when ``path`` has no room for it."""
        return save_hf_model(model, tokenizer, path, self.world, extra_config, rescue=final)
