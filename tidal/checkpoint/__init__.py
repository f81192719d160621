"""Checkpoints: resumable training state (DCP + loop/RNG state, rotated), final HF export, and the
graceful stop on SIGTERM/SIGINT that ends in a checkpoint. Training loops use them through one
``Checkpointer`` (``tidal.checkpoint.checkpointer``)."""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.checkpoint.checkpointer import Checkpointer, StateFns, Stateful
    from tidal.checkpoint.hf_export import save_hf_model
    from tidal.checkpoint.interrupt import StopSignals, TrainingInterrupted
    from tidal.checkpoint.manager import RunCheckpoints, RunIdentity, flat_settings, model_fingerprint
    from tidal.checkpoint.resumable import (
        CheckpointError,
        LoopState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "CheckpointError": "tidal.checkpoint.resumable",
    "Checkpointer": "tidal.checkpoint.checkpointer",
    "LoopState": "tidal.checkpoint.resumable",
    "RunCheckpoints": "tidal.checkpoint.manager",
    "RunIdentity": "tidal.checkpoint.manager",
    "StateFns": "tidal.checkpoint.checkpointer",
    "Stateful": "tidal.checkpoint.checkpointer",
    "StopSignals": "tidal.checkpoint.interrupt",
    "TrainingInterrupted": "tidal.checkpoint.interrupt",
    "flat_settings": "tidal.checkpoint.manager",
    "latest_checkpoint": "tidal.checkpoint.resumable",
    "load_checkpoint": "tidal.checkpoint.resumable",
    "model_fingerprint": "tidal.checkpoint.manager",
    "save_checkpoint": "tidal.checkpoint.resumable",
    "save_hf_model": "tidal.checkpoint.hf_export",
}

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LoopState",
    "RunCheckpoints",
    "RunIdentity",
    "StateFns",
    "Stateful",
    "StopSignals",
    "TrainingInterrupted",
    "flat_settings",
    "latest_checkpoint",
    "load_checkpoint",
    "model_fingerprint",
    "save_checkpoint",
    "save_hf_model",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
