"""The training side of vision-language models (``AutoModelForImageTextToText``): which folders are one,
their vision tower, LoRA on their language model only, and multimodal rotary positions.

- ``is_vision_language(path)``: the config has a ``vision_config`` and an ``image_token_id``;
  ``tidal.models.loading.load_causal_lm`` then loads ``AutoModelForImageTextToText``.
- ``vision_modules(model)``: the vision tower and its projector (Qwen-VL: ``model.visual``, which holds
  the patch merger; LLaVA/Gemma 3 style: ``vision_tower`` and ``multi_modal_projector``; Gemma 4:
  ``vision_tower`` and ``embed_vision``).
  ``freeze_vision(model)`` stops their gradients (``--freeze_visual_encoder``): only the language model
  trains, and the optimizer never sees the vision weights.
- ``language_lora_targets(model, targets)``: the language model's linear layers that ``--target_modules``
  names (``all-linear``: every one but the LM head), as full module names for peft, so LoRA adapts the
  language model only (peft would otherwise also match the vision tower's ``gate_proj``...).
- ``vision_lm_head(model)``: the LM head of Qwen-VL families, which apply it as is, so their token
  log-probs run through the chunked head as text families' do (``tidal.models.forward``).
- ``vision_kwargs(model, batch)``: the forward's image inputs: ``pixel_values``, ``image_grid_thw`` and
  the model's own rotary positions (Qwen-VL's M-RoPE: ``get_rope_index``, three position rows for
  temporal/height/width). A packed row gets each sample's positions computed alone and concatenated
  (positions restart per sample, as for text), with the plain per-sample positions prepended as a
  fourth row, which transformers' Qwen-VL reads as the packed text positions. Gemma 3 (fixed-size images,
  ``fixed_size_kwargs``): its ``[N, 3, S, S]`` pixels and ``token_type_ids`` (its bidirectional image
  attention), plain positions; Gemma 4 likewise with padded patches, ``image_position_ids`` and
  ``mm_token_type_ids``; packed rows are refused (``--packing_samples``, the registry).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# Gemma 4: its tower and ``embed_vision`` (and the audio tower and embedder, which tidal never feeds)
VISION_MODULE_NAMES = (
    "visual", "vision_tower", "vision_model", "multi_modal_projector", "embed_vision", "audio_tower", "embed_audio",
)  # fmt: skip
VISION_MODULE_NAMES_SET = frozenset(VISION_MODULE_NAMES)
# VLM families whose LM head is applied as is (no soft-capping or scaling): their token log-probs take
# tidal's chunked head (tidal.models.logprob_head) instead of full [B, T, vocab] logits.
CHUNKABLE_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


def is_vision_language(path: str) -> bool:
    """Whether the model folder or name is a vision-language model (by its config)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return False  # the loader reports an unreadable folder itself
    return getattr(config, "vision_config", None) is not None and hasattr(config, "image_token_id")


def vision_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the vision tower and projector of a (peft-wrapped) VLM."""
    found = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in VISION_MODULE_NAMES and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return found


def freeze_vision(model: nn.Module) -> int:
    """Freeze the vision tower's parameters; returns how many parameters were frozen."""
    frozen = 0
    for _, module in vision_modules(model):
        for p in module.parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    if frozen == 0:
        raise ValueError(f"{type(model).__name__}: no vision tower found (looked for {VISION_MODULE_NAMES})")
    return frozen


def language_lora_targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the linear layers LoRA adapts in a VLM: outside the vision tower, not the LM head,
    and (unless ``targets`` is ``["all-linear"]``) whose own name is one of ``targets``."""
    vision = tuple(f"{name}." for name, _ in vision_modules(model))
    head = model.get_output_embeddings()
    every = list(targets) == ["all-linear"]
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not head
        and not name.startswith(vision)
        and (every or name.rsplit(".", 1)[-1] in targets)
    ]


def vision_lm_head(model: nn.Module) -> nn.Linear | None:
    """The plain ``nn.Linear`` LM head of a VLM family in ``CHUNKABLE_VLM_TYPES``, or None."""
    if getattr(getattr(model, "config", None), "model_type", None) not in CHUNKABLE_VLM_TYPES:
        return None
    head = model.get_output_embeddings()
    # FSDP2 gives a separately sharded head a generated subclass named FSDPLinear; peft/LoRA heads differ
    plain = type(head) is nn.Linear or (isinstance(head, nn.Linear) and type(head).__name__ == "FSDPLinear")
    return head if plain else None


def _rope_owner(model: nn.Module) -> nn.Module | None:
    """The submodule with the family's ``get_rope_index`` (Qwen-VL's inner model), if any."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def vision_kwargs(model: nn.Module, batch: dict) -> dict:
    """The forward keyword arguments of a batch's images (see the module doc); {} without images."""
    if "image_grid_thw" not in batch:
        return {}
    fixed = fixed_size_kwargs(
        model.config, batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"]
    )
    if fixed is not None and "segment_ids" in batch:
        raise ValueError(
            f"--packing_samples with images is not supported for {model.config.model_type}: packed rows "
            "take tidal's per-sample causal masks, which would drop its bidirectional image attention"
        )
    if fixed is not None:
        return fixed
    kwargs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    owner = _rope_owner(model)
    if owner is not None:
        kwargs["position_ids"] = rope_positions(owner, batch)
    return kwargs


def fixed_size_kwargs(config, input_ids: torch.Tensor, pixel_values, image_grid_thw) -> dict | None:
    """Gemma 3's and Gemma 4's forward arguments (None for other families): Gemma 3's ``[N, 3, S, S]``
    pixels back from the patch rows tidal carries (``multimodal.FixedSizeImageProcessor``), Gemma 4's
    padded patches and positions (``VariableSizeImageProcessor``), and the token types (1 at image tokens)
    that make each image's tokens attend to each other in both directions."""
    from tidal.rollout.runner.multimodal import (
        fixed_size_grid,
        patch_rows_to_images,
        patch_rows_to_padded,
        variable_size_kernel,
    )

    types = (input_ids == config.image_token_id).long()
    kernel = variable_size_kernel(config)
    if kernel is not None:  # Gemma 4: the padded patches with their (x, y) positions
        pixels, positions = patch_rows_to_padded(pixel_values, image_grid_thw, kernel * kernel)
        return {"pixel_values": pixels, "image_position_ids": positions, "mm_token_type_ids": types}
    fixed = fixed_size_grid(config)
    if fixed is None:
        return None
    pixels = patch_rows_to_images(pixel_values, image_grid_thw, fixed[0])
    return {"pixel_values": pixels, "token_type_ids": types}


def rope_positions(owner: nn.Module, batch: dict) -> torch.Tensor:
    """Multimodal rotary positions of a padded ``[3, B, T]`` or packed ``[4, 1, T]`` batch."""
    ids, grids = batch["input_ids"], batch["image_grid_thw"]
    image_token = owner.config.image_token_id
    if "segment_ids" not in batch:
        types = (ids == image_token).int()
        positions, _ = owner.get_rope_index(
            ids, types, image_grid_thw=grids, attention_mask=batch["attention_mask"]
        )
        return positions
    parts, start, first_image = [], 0, 0
    for n, count in zip(batch["seq_lens"].tolist(), batch["image_counts"].tolist(), strict=True):
        sample = ids[:, start : start + n]
        sample_grids = grids[first_image : first_image + count] if count else None
        positions, _ = owner.get_rope_index(
            sample, (sample == image_token).int(), image_grid_thw=sample_grids
        )
        parts.append(positions)
        start, first_image = start + n, first_image + count
    return torch.cat([batch["position_ids"][None], torch.cat(parts, dim=-1)], dim=0)


def language_weights(model: nn.Module, named):
    """``named`` (HF-named tensors of ``model``) without the vision tower's when it is frozen
    (``--freeze_visual_encoder``: only the language model changes, so only it is synced to the engine)."""
    towers = vision_modules(model)
    frozen = towers and not any(p.requires_grad for _, m in towers for p in m.parameters())
    if not frozen:
        return named
    return ((n, t) for n, t in named if not VISION_MODULE_NAMES_SET.intersection(n.split(".")))
