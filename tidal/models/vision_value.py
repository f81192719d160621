"""Reward and value models on a vision-language model (``tidal rm`` with images, the PPO critic of a
vision-language policy).

transformers has no ``*ForSequenceClassification`` for vision-language families (Qwen2.5-VL...), so
``load_vision_value_model`` builds one: the ``AutoModelForImageTextToText`` model with its LM head
replaced by a one-output linear head named ``--value_head_prefix`` (default ``score``) and
``ValueHeadMixin``'s methods (``tidal.models.value_model``): its ``forward`` runs the inner multimodal
model (vision tower, image features scattered into the embeddings, M-RoPE) and applies the head to
every hidden state, so ``values``/``scores`` work on padded and packed batches with images as on text.

The saved folder is the VLM's (its ``config.json`` names the conditional-generation class) with
``<prefix>.weight`` in place of ``lm_head``; loading it again here reads that head back (a fresh
head otherwise, as for a reward model about to be trained). LoRA and 4-bit loading are refused for
these models (one line, ``--lora_rank`` / ``--load_in_4bit``).

``load_critic_model`` is the PPO critic's loader: a vision-language ``--critic_pretrain`` (by default the
policy) loads here, with ``--freeze_visual_encoder`` freezing its vision tower as the policy's, so the critic
values each state with the prompt's images (its forward takes the actor's image inputs: pixels, grids and
M-RoPE positions, padded or packed, through ``tidal.models.forward.model_inputs``), and ``--lora_rank`` puts
adapters on its language model only, as on the policy's; a text one loads as
``tidal.models.value_model.load_value_model``. A run whose prompts carry images refuses a text critic.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tidal.config.args import ConfigError
from tidal.config.model import ModelConfig
from tidal.models.loading import (
    available_attn_implementation,
    check_model_folder,
    model_load_error,
    storage_dtype,
)
from tidal.models.value_model import HF_HEAD, attach_value_head, load_value_model
from tidal.models.value_model import _lora as lora_value_model
from tidal.models.vision import freeze_vision, is_vision_language, language_lora_targets
from tidal.rollout.models.vision_attention import use_segment_attention


def load_vision_value_model(
    cfg: ModelConfig, device: torch.device, value_head_prefix: str = HF_HEAD, path: str | None = None
) -> nn.Module:
    """A VLM with a value head (see the module doc), in ``--master_dtype``, on ``device``."""
    from transformers import AutoModelForImageTextToText

    source = path or cfg.pretrain
    check_model_folder(source)
    for flag, value in (("--lora_rank", cfg.lora_rank > 0), ("--load_in_4bit", cfg.load_in_4bit)):
        if value:
            raise ConfigError(
                f"{flag} with a vision-language value model (reward model or critic) is not supported yet; drop it"
            )
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source,
            dtype=storage_dtype(cfg, device),
            attn_implementation=available_attn_implementation(cfg.attn_implementation),
        )
    except (OSError, ValueError, KeyError) as err:
        raise model_load_error(source, err) from err
    use_segment_attention(model)  # as the policy's tower (tidal.models.vision_attention)
    hidden = model.config.get_text_config().hidden_size
    head = nn.Linear(hidden, 1, bias=False)
    nn.init.normal_(head.weight, std=1 / (hidden + 1))  # OpenRLHF's value-head init
    head.to(model.dtype)  # stored like the body (--master_dtype)
    saved = _saved_head(source, value_head_prefix)
    if saved is not None:
        head.weight.data.copy_(saved)
    model.lm_head = nn.Identity()  # the value head replaces it; not trained, not saved
    model.add_module(HF_HEAD, head)
    model.config.use_cache = False
    attach_value_head(model, value_head_prefix)
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant}
        )
    return model


def load_critic_model(
    cfg: ModelConfig, device: torch.device, value_head_prefix: str, images: bool, freeze_visual_encoder: bool
) -> nn.Module:
    """The PPO critic from ``cfg.pretrain`` (see the module doc). ``images``: the prompts carry images
    (``--max_images_per_prompt`` > 0); ``freeze_visual_encoder``: freeze a vision-language critic's tower."""
    if not is_vision_language(cfg.pretrain):
        if problem := critic_image_problem(cfg.pretrain, images):
            raise ConfigError(problem)
        return load_value_model(cfg, device, value_head_prefix)
    model = load_vision_value_model(dataclasses.replace(cfg, lora_rank=0), device, value_head_prefix)
    if freeze_visual_encoder:  # as the policy's: the critic's language model and value head train
        freeze_vision(model)
    if (
        cfg.lora_rank > 0
    ):  # adapters on the language model only (as the policy's), the value head trained whole
        targets = [t for t in language_lora_targets(model, cfg.target_modules) if t != value_head_prefix]
        model = lora_value_model(model, dataclasses.replace(cfg, target_modules=targets), value_head_prefix)
    return model


def critic_image_problem(source: str, images: bool) -> str | None:
    """Why ``source`` cannot be the critic of a run whose prompts carry images (a text model), or None."""
    if not images or is_vision_language(source):
        return None
    return (
        f"--critic_pretrain {source} is not a vision-language model, but the critic reads the prompts' "
        "images (--max_images_per_prompt): pass one, or leave it unset (the policy)"
    )


def _saved_head(source: str, prefix: str) -> torch.Tensor | None:
    """``<prefix>.weight`` from a local folder's safetensors files, if it has one."""
    folder = Path(source)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in folder.glob("*.safetensors")]
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            if f"{prefix}.weight" in f.keys():  # noqa: SIM118 (safe_open has keys(), no __contains__)
                return f.get_tensor(f"{prefix}.weight")
    return None
