"""Policy weights in the form a rollout engine loads: Hugging Face names, LoRA merged.

``engine_weights(policy)`` yields ``(name, tensor)`` pairs. A peft LoRA policy has its adapters
merged into the base weights for the duration (and unmerged afterwards), and the peft prefixes
(``base_model.model.``, ``.base_layer``) are stripped; adapter tensors are skipped. Sharded
(FSDP2) parameters stay DTensors: the engine gathers each with ``full_tensor()`` as it loads,
so only one full tensor exists at a time.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from torch import nn

_PEFT_PREFIX = re.compile(r"^base_model\.model\.")


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "peft_config")


def hf_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` → ``model.layers.0.q_proj.weight``."""
    return _PEFT_PREFIX.sub("", name).replace(".base_layer.", ".")


@contextlib.contextmanager
def engine_weights(model: nn.Module) -> Iterator[Iterator]:
    """Context yielding an iterator of HF-named tensors of ``model`` (LoRA merged while open)."""
    peft = _is_peft(model)
    if peft:
        model.merge_adapter()
    try:
        named = (
            (hf_name(n), p)
            for n, p in model.named_parameters()
            if "lora_" not in n and "modules_to_save" not in n
        )
        yield named
    finally:
        if peft:
            model.unmerge_adapter()
