"""Disk space for a model export: how much a model needs, how much a folder's filesystem has, and where a
final model goes when its ``--save_path`` has no room.

A full disk at the final save used to lose the trained weights (they exist only in memory then). Two
guards keep them: every trainer checks ``--save_path``'s free space against the model's size before it
trains (``space_problem``: refused while the run can still be pointed elsewhere), and a final export
that finds no room, or fails with ENOSPC, writes the model to a rescue folder under the system's
temporary folder (``tempfile.gettempdir()``, i.e. ``$TMPDIR``) and names it in the error
(``tidal.checkpoint.hf_export``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

# Room kept beyond the weights: the tokenizer files, config.json and safetensors headers.
EXTRA_BYTES = 32 * 2**20


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as saved (global shapes for sharded DTensors; each tensor object once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def model_bytes(model: nn.Module) -> int:
    """What exporting ``model`` writes: its LoRA adapters (the trainable parameters) under LoRA, else
    every parameter and buffer (tied parameters once)."""
    if getattr(model, "peft_config", None):
        return tensor_bytes(p for p in model.parameters() if p.requires_grad)
    return tensor_bytes([*model.parameters(), *model.buffers()])


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that ``path`` is (or would be created) on."""
    folder = Path(os.path.abspath(path))
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def space_problem(path: str | Path, need: int) -> str | None:
    """``"<path> has N MiB free, the model needs ~M MiB"`` when ``need`` bytes (plus ``EXTRA_BYTES``)
    do not fit, else None."""
    need += EXTRA_BYTES
    free = free_bytes(path)
    if free >= need:
        return None
    return f"{path} has {megabytes(free)} free, the model needs ~{megabytes(need)}"


def rescue_folder(path: str | Path) -> Path:
    """A new folder under the system's temporary folder for a model that ``path`` had no room for."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (
        Path(tempfile.gettempdir()) / f"tidal-rescue-{Path(os.path.abspath(path)).name}-{stamp}-{os.getpid()}"
    )
