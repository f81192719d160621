"""How an engine finds its model: the HF config, tokenizer, image processor and eos ids of a model folder
(or of a loaded transformers model), the weights of a loaded model, and ``resolve_model``, the first steps
both engines' constructors share (``LLMEngine`` and the transformers fallback ``HFEngine``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from tidal.rollout.engine.config import EngineConfig


class ResolvedModel(NamedTuple):
    """What an engine's constructor settles first: its config (the default ``EngineConfig()`` when none is
    given), the HF config, the model type, and the device and dtype the config names."""

    config: EngineConfig
    hf_config: Any
    model_type: str | None
    device: torch.device
    dtype: torch.dtype


def resolve_model(model_path, config: EngineConfig | None, model=None, hf_config=None) -> ResolvedModel:
    """The config, HF config (given, the loaded model's, or read from ``model_path``), model type, device and
    dtype of an engine."""
    config = config or EngineConfig()
    hf_config = hf_config or load_hf_config(model_path, model)
    device = config.torch_device()
    return ResolvedModel(config, hf_config, getattr(hf_config, "model_type", None), device,
                         config.torch_dtype(device))  # fmt: skip


def model_weights(model: torch.nn.Module, model_type: str | None):
    """A loaded transformers model's parameters, and the buffers its family's checkpoints carry as weights
    (``buffer_weights`` of the family class, e.g. Gemma 4's layer scalars)."""
    from itertools import chain

    from tidal.rollout.models.registry import FAMILIES, model_class

    suffixes = getattr(model_class(model_type), "buffer_weights", ()) if model_type in FAMILIES else ()
    buffers = ((name, b) for name, b in model.named_buffers() if suffixes and name.endswith(suffixes))
    return chain(model.named_parameters(), buffers)


def load_hf_config(model_path, model):
    if model is not None:
        return model.config
    if model_path is None:
        raise ValueError("LLMEngine needs a model folder path, a loaded model or hf_config")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


def load_tokenizer(model_path):
    if model_path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError):  # a weights-only folder: the engine still works on token ids
        return None


def load_image_processor(model_path):
    """A vision model folder's image processor (None without one: requests then pass pixel_values)."""
    if model_path is None or not (Path(model_path) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path))


def eos_token_ids(hf_config, model_path, model, tokenizer) -> set[int]:
    """Union of the config's, the generation config's and the tokenizer's eos ids (as vLLM does)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_config = getattr(model, "generation_config", None)
    if (
        gen_config is None
        and model_path is not None
        and (Path(model_path) / "generation_config.json").exists()
    ):
        from transformers import GenerationConfig

        gen_config = GenerationConfig.from_pretrained(str(model_path))
    sources.append(getattr(gen_config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(t) for t in source)
    return ids
