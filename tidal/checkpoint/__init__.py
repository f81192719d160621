"""Checkpoints: resumable training state (DCP + loop/RNG state, rotated), final HF export, and the
graceful stop on SIGTERM/SIGINT that ends in a checkpoint. Training loops use them through one
``Checkpointer`` (``tidal.checkpoint.checkpointer``)."""

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
