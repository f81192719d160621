"""Export a (possibly sharded or LoRA-wrapped) model as a plain Hugging Face folder.

The full state dict is gathered to CPU on every rank (FSDP2 needs all ranks to take part) and
rank 0 writes it with ``save_pretrained``; LoRA models save only their adapters, which
``tidal lora_combiner`` merges later.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tidal.distributed.world import World, barrier


def save_hf_model(
    model: nn.Module, tokenizer, path: str | Path, world: World, extra_config: dict | None = None
) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``path`` as a HF folder; returns the path."""
    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    if world.is_main:
        path.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "config", None)
        if config is not None and extra_config:
            for key, value in extra_config.items():
                setattr(config, key, value)
        model.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    barrier(world)
    return path
