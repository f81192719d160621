"""A start-up check for training hybrid linear-attention models (Qwen3.5's Gated DeltaNet) on CUDA.

transformers binds flash-linear-attention's kernels (``fla``, from the ``fla-core`` distribution) into its
Gated DeltaNet layers whenever the package is importable. fla refuses the backward of its gated chunk
kernel on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1, which computes wrong gradients there (fla issue
#640), unless ``tilelang`` is installed to run it instead. Unchecked, a ``tidal ppo`` run would start,
generate a whole rollout and only then stop at its first backward with fla's traceback; checked when
the model becomes trainable (``build_optimization``), the run stops at start with one line and the
remedies. The condition mirrors fla 0.6's own; the engine is unaffected (its Gated DeltaNet kernels are
its own, and fla's it uses only forward, with ``TIDAL_FLA=1``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch
from torch import nn

from tidal.config.args import ConfigError

LINEAR = "linear_attention"  # the layer type of a Gated DeltaNet layer in the configs' layer_types
BROKEN_TRITON = ((3, 4, 0), (3, 7, 1))  # [from, to): fla's Triton range for the gated backward


def release(version: str) -> tuple[int, int, int]:
    """``"3.6.0+git1234"`` -> (3, 6, 0): the numeric release (a missing patch number reads 0)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a version: {version!r}")
    return int(found[1]), int(found[2]), int(found[3] or 0)


def _dotted(parts: tuple[int, ...]) -> str:
    return ".".join(map(str, parts))


def has_linear_attention(model: nn.Module) -> bool:
    """Whether ``model`` (or a vision-language model's text model) has linear-attention layers."""
    config = getattr(model, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        if part is not None and LINEAR in (getattr(part, "layer_types", None) or ()):
            return True
    return False


def fla_backward_problem(
    fla: str | None, tilelang: bool, capability: tuple[int, int], triton: str | None
) -> str | None:
    """Why fla (version ``fla``, None: not installed) would refuse a Gated DeltaNet backward on a GPU of
    compute ``capability`` with Triton version ``triton``; None when it runs."""
    if fla is None or tilelang or triton is None or capability != (9, 0):
        return None
    low, high = BROKEN_TRITON
    if not low <= release(triton) < high:
        return None
    return (
        f"flash-linear-attention {fla} refuses the backward of its gated chunk kernel on Hopper GPUs with "
        f"Triton {triton} (>= {_dotted(low)} and < {_dotted(high)} compute wrong gradients there, fla issue #640)"
    )


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_linear_attention_training(model: nn.Module, device: torch.device) -> None:
    """Raise a one-line ``ConfigError`` when ``model``'s Gated DeltaNet layers would train through an fla
    backward that refuses this GPU (``fla_backward_problem``); nothing otherwise."""
    if device.type != "cuda" or not has_linear_attention(model) or importlib.util.find_spec("fla") is None:
        return
    problem = fla_backward_problem(
        _version("fla-core") or "(installed)",
        importlib.util.find_spec("tilelang") is not None,
        torch.cuda.get_device_capability(device),
        _version("triton"),
    )
    if problem:
        raise ConfigError(
            f"{problem}; transformers' Gated DeltaNet layers would call it at the first backward: upgrade "
            f"Triton to >= {_dotted(BROKEN_TRITON[1])}, install tilelang, or uninstall "
            f"flash-linear-attention (transformers then trains through its torch fallback, slower)"
        )
