"""Qwen3-VL (``qwen3_vl``): transformers' Qwen3-VL vision tower in front of the engine's Qwen3 decoder.

The machinery is Qwen2.5-VL's (``qwen2_5_vl.py``): the vision tower runs once per prefill step over the
images the step prefills (``multimodal.PrefillImages``) and its features replace the embeddings of the
image placeholder tokens; prefill tokens carry (temporal, height, width) positions
(``multimodal.mrope_positions``, the same for still images); decode tokens turn as plain RoPE at
``position + delta``, the delta read from a table indexed by the sequence's first KV block, so decode
steps and their CUDA graphs are those of every family. What differs:

- The language model is Qwen3's (an RMSNorm over each q and k head, no q/k/v bias).
- Interleaved M-RoPE: the rotary frequencies are not cut into three contiguous sections; frequency ``j``
  turns by the height position when ``j % 3 == 1`` and by the width position when ``j % 3 == 2`` (among
  the first ``3 * mrope_section[axis]`` frequencies), by the temporal position otherwise
  (``interleaved_rope_axis``).
- DeepStack: the vision tower (``Qwen3VLVisionModel``: 16-pixel patches, learned position embeddings
  resampled to each image's grid) also merges the hidden states of some of its intermediate blocks
  (``deepstack_visual_indexes``); the k-th of those features is added to the language model's hidden
  state at the image tokens after its k-th decoder layer.

``QwenVisionMixin`` holds all of it but the decoder, so Qwen3.5's vision-language model
(``qwen3_5_vl.py``: the same tower without DeepStack, the hybrid Qwen3.5 decoder) reuses it.
Weight names: ``model.visual.*``/``model.language_model.*``/``lm_head.*`` (transformers 5 and a
trainer's ``named_parameters()``) or the older ``visual.*``/``model.*``; an update may carry the
language model only (``--freeze_visual_encoder``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from tidal.rollout.models.layers import CausalLM, DecoderArgs
from tidal.rollout.models.mrope import MRopeMixin
from tidal.rollout.models.qwen3 import Qwen3Attention
from tidal.rollout.models.vision_attention import build_vision_tower
from tidal.rollout.models.vision_weights import VISION_PREFIX, language_weights
from tidal.rollout.runner.multimodal import PrefillImages


def interleaved_rope_axis(mrope_section: list[int], half: int) -> torch.Tensor:
    """The position axis (0 temporal, 1 height, 2 width) of each rotary column for interleaved M-RoPE
    over ``half`` frequencies (see the module doc); the second half of the rotated channels repeats it."""
    axis = torch.zeros(half, dtype=torch.int64)
    for dim in (1, 2):
        axis[dim : min(3 * mrope_section[dim], half) : 3] = dim
    return torch.cat([axis, axis])


class QwenVisionMixin(MRopeMixin):
    """A Qwen3-VL-style vision tower, interleaved M-RoPE and DeepStack on top of a ``CausalLM`` decoder
    (put it first in the bases). A subclass names its tower (``vision_tower_class``)."""

    family_name: ClassVar[str]
    weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.visual.", VISION_PREFIX),
        ("model.language_model.", "model."),
    )
    supports_tp = False  # the vision tower is not sharded (Family.refuses says so too)

    @classmethod
    def vision_tower_class(cls) -> type:
        raise NotImplementedError

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        hf = args.hf_config
        self.image_token_id = int(hf.image_token_id)
        # never sampled (ModelRunner.never_sample): the trainer's model would take them for images
        video = getattr(hf, "video_token_id", None)
        self.never_sample = (self.image_token_id,) + (() if video is None else (int(video),))
        # one attention call per run of equal-size images, not one per image (vision_attention.py)
        self.visual = build_vision_tower(self.vision_tower_class(), hf.vision_config)
        # Set after ``to_empty``: the rotary column -> position axis map (``init_rope``) and the
        # decode-delta table (``reserve_block_state``).
        self.register_buffer("rope_axis", None, persistent=False)
        self.register_buffer("block_deltas", None, persistent=False)

    @staticmethod
    def vision_args(args: DecoderArgs, config) -> DecoderArgs:
        """``args`` (the text config's) with what the vision-language config adds."""
        args.hf_config = config  # the vision tower's config (read once, when the model is built)
        args.mrope_section = config.get_text_config().rope_parameters.get("mrope_section", [24, 20, 20])
        args.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", args.tie_word_embeddings))
        return args

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """The text RoPE table, and the buffers ``to_empty`` left uninitialised."""
        super().init_rope(hf_config.get_text_config(), max_model_len)
        device = self.model.embed_tokens.weight.device
        rotary = type(self.visual.rotary_pos_emb)(hf_config.vision_config)
        self.visual.rotary_pos_emb = rotary.to(device)
        half = self.rotary.cos.shape[1] // 2  # the rotated channels' frequencies
        self.rope_axis = interleaved_rope_axis(self.args.mrope_section, half).to(device)

    def forward(self, input_ids, positions, meta, logits_index=None, images: PrefillImages | None = None):
        x = self.model.embed_tokens(input_ids)
        deepstack, mask = [], None
        if images is not None:
            x, deepstack, mask = self._embed_images(input_ids, x, images)
        cos, sin = self.rope(positions, meta, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, meta)
            if i < len(deepstack):
                # the hidden state (the layer's output plus its residual), then the features at the
                # image tokens, in transformers' order; the next layer takes it as its residual
                x, residual = x + residual, None
                x = x.index_put((mask,), x[mask] + deepstack[i].to(x.dtype))
        if residual is None:  # the last layer took DeepStack features: its output is the hidden state
            residual = torch.zeros_like(x)
        if logits_index is not None:
            x, residual = x[logits_index], residual[logits_index]
        return self.lm_head(self.model.norm(x, residual)[0])

    def _embed_images(self, input_ids, x, images: PrefillImages):
        """Record the step's decode deltas; return the embeddings with the image features at the image
        tokens, the DeepStack features (one per tapped vision block, rows in image-token order) and the
        image-token mask."""
        device = x.device
        blocks = torch.tensor(images.first_blocks, device=device)
        self.block_deltas[blocks] = torch.tensor(images.deltas, device=device)
        if images.pixel_values is None:
            return x, [], None
        pixels = images.pixel_values.to(device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=images.grid_thw.to(device))
        features = out.pooler_output
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"the prefill has {int(mask.sum())} image tokens but its images give {features.shape[0]}"
            )
        x = x.masked_scatter(mask[:, None].expand_as(x), features.to(x.dtype))
        return x, list(getattr(out, "deepstack_features", None) or []), mask

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's weights through the decoder's loader; the vision tower's as they are."""
        loaded: set[str] = set()
        language = language_weights(named_tensors, self._our_name, self.visual, self.family_name, loaded)
        loaded |= super().load_weights(language)
        return loaded


class Qwen3VLForConditionalGeneration(QwenVisionMixin, CausalLM):
    attention_cls = Qwen3Attention
    family_name = "qwen3_vl"

    @classmethod
    def vision_tower_class(cls) -> type:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    @classmethod
    def args_from_hf_config(cls, config) -> DecoderArgs:
        text = DecoderArgs.from_hf_config(config.get_text_config(), model_type=config.model_type)
        return cls.vision_args(text, config)
