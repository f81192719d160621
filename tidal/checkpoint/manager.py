"""One run's resumable checkpoints: what a checkpoint records about the run that wrote it, and the
checks made before resuming one.

A checkpoint's ``meta.json`` names the trainer (``sft``, ``dpo``, ``ppo``...), a fingerprint of each
trained model (architecture, LoRA setting, parameter names and shapes) and the run's settings
(training, optimizer, data). Resuming one written by another trainer or for another model refuses
with one line naming both; changed settings (learning rate, batch size, dataset) only warn, saying
what the checkpoint keeps. A run and its resumptions share a *lineage* id, which scopes rotation.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from tidal.checkpoint.resumable import (
    CheckpointError,
    LoopState,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from tidal.config.checkpoint import CheckpointConfig
from tidal.distributed.world import World
from tidal.logging import get_logger

log = get_logger(__name__)

# Wrappers that prefix parameter names without changing the model (compile, activation checkpointing).
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _plain_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _lora(model: nn.Module) -> str:
    peft = getattr(model, "peft_config", None)
    if not peft:
        return "no LoRA"
    cfg = next(iter(peft.values()))
    targets = cfg.target_modules
    targets = ",".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else str(targets)
    return f"LoRA rank {cfg.r} alpha {cfg.lora_alpha} on {targets}"


def _architecture(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None:
        return type(model).__name__
    sizes = [f"{k} {getattr(config, k)}" for k in ("hidden_size", "num_hidden_layers", "vocab_size")
             if getattr(config, k, None) is not None]  # fmt: skip
    return f"{getattr(config, 'model_type', type(model).__name__)} ({', '.join(sizes)})"


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """Architecture, LoRA setting and a hash of parameter names and (global) shapes."""
    shapes = sorted(f"{_plain_name(n)}:{tuple(p.shape)}" for n, p in model.named_parameters())
    digest = hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]
    return {"architecture": _architecture(model), "lora": _lora(model), "params": digest}


def _describe(fp: dict) -> str:
    return f"{fp.get('architecture', '?')}, {fp.get('lora', '?')}"


def flat_settings(run_config: dict, groups: tuple[str, ...]) -> dict[str, Any]:
    """``{"<group>.<key>": value}`` of the named config groups (JSON types, so they compare with a
    checkpoint's copy)."""
    flat = {f"{g}.{k}": v for g in groups for k, v in (run_config.get(g) or {}).items()}
    return json.loads(json.dumps(flat, default=str))


@dataclass
class RunIdentity:
    """What a run's checkpoints record about it: trainer kind, trained models, settings."""

    trainer: str
    models: dict[str, dict] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


def incompatibility(meta: dict, ours: RunIdentity, folder: Path) -> str | None:
    """Why this run cannot resume the checkpoint described by ``meta`` (None when it can)."""
    theirs = meta.get("trainer")
    if theirs != ours.trainer:
        return (
            f"{folder} was written by `tidal {theirs}` and this is `tidal {ours.trainer}`: refusing to resume "
            "it (give this run its own --ckpt_path, or drop --load_checkpoint)"
        )
    models = meta.get("models", {})
    for name, fp in ours.models.items():
        saved = models.get(name)
        if saved is None:
            return f"{folder} holds no {name} model (it has {', '.join(models) or 'none'}): refusing to resume it"
        if saved != fp:
            detail = (
                "" if _describe(saved) != _describe(fp) else " (same description, different parameter shapes)"
            )
            return (
                f"{folder} holds a {name} model for {_describe(saved)}, but this run trains {_describe(fp)}"
                f"{detail}: refusing to resume it (use another --ckpt_path, or drop --load_checkpoint)"
            )
    return None


def changed_settings(meta: dict, ours: RunIdentity) -> list[str]:
    """``key old -> new`` for every recorded setting this run changes."""
    saved = meta.get("settings", {})
    return [f"{k} {saved[k]!r} -> {v!r}" for k, v in ours.settings.items() if k in saved and saved[k] != v]


class RunCheckpoints:
    """Save and resume one run's checkpoints in ``--ckpt_path`` (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, identity: RunIdentity, world: World):
        self.cfg, self.identity, self.world = cfg, identity, world
        self.lineage = uuid.uuid4().hex  # only the main process writes meta.json and rotates
        self.last_saved_step: int | None = None
        self.resumed_settings: dict[str, Any] = {}  # the settings recorded by the checkpoint resumed

    @property
    def enabled(self) -> bool:
        """Whether periodic (and interrupt) checkpoints are written: ``--save_steps`` > 0 and the
        resumable state not disabled."""
        return self.cfg.save_steps > 0 and not self.cfg.disable_ds_ckpt

    def resume(self, parts: dict) -> tuple[LoopState, dict] | None:
        """Load the checkpoint to continue from (``--load_checkpoint``), or None to start afresh."""
        if not self.cfg.load_checkpoint:
            return None
        folder = latest_checkpoint(self.cfg.ckpt_path)
        if folder is None:
            log.info("no checkpoint in %s: starting from scratch", self.cfg.ckpt_path)
            return None
        meta = read_meta(folder)
        problem = incompatibility(meta, self.identity, folder)
        if problem:
            raise CheckpointError(problem)
        loop, extra = load_checkpoint(folder, parts, self.world)
        changes = changed_settings(meta, self.identity)
        if changes:
            log.warning(
                "resuming %s with changed settings (%s): keeps the checkpoint's weights, optimizer state "
                "(including its learning rate) and position (step %d, epoch %d); the other changes apply "
                "from here on", folder, "; ".join(changes), loop.global_step, loop.epoch,
            )  # fmt: skip
        self.lineage = meta.get("lineage", self.lineage)
        self.resumed_settings = meta.get("settings", {})
        self.last_saved_step = loop.global_step
        return loop, extra

    def save(self, parts: dict, loop: LoopState, extra: dict | None = None, name: str | None = None) -> Path:
        """A rolling checkpoint of ``loop`` (rotated), or with ``name`` one kept beside them (``save_checkpoint``)."""
        meta = {
            "trainer": self.identity.trainer,
            "models": self.identity.models,
            "settings": self.identity.settings,
            "lineage": self.lineage,
        }
        folder = save_checkpoint(
            self.cfg.ckpt_path, parts, loop, self.world, self.cfg.max_ckpt_num, extra, meta, name
        )
        if name is None:  # a named checkpoint is not the one a stop or resume goes by
            self.last_saved_step = loop.global_step
        log.info("saved checkpoint %s", folder)
        return folder
