"""Checkpoints: resumable training state (DCP + loop/RNG state, rotated) and final HF export."""

from tidal.checkpoint.hf_export import save_hf_model
from tidal.checkpoint.resumable import LoopState, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["LoopState", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "save_hf_model"]
