"""Qwen2.5-VL (``qwen2_5_vl``): transformers' vision tower in front of the engine's Qwen2 decoder.

- The language model is the engine's Qwen2 decoder (biased q/k/v, paged KV cache), read from the
  config's ``text_config``.
- The vision tower is transformers' own module (``Qwen2_5_VisionTransformerPretrainedModel``: windowed
  attention blocks and the 2×2 patch merger), run once per prefill step over the images of every
  sequence the step prefills (``multimodal.PrefillImages``); its features replace the embeddings of the
  image placeholder tokens, in order. Decode steps never run it.
- Rotary positions are M-RoPE: a prefill token has a (temporal, height, width) position triple
  (``multimodal.mrope_positions``, computed per sequence at admission); each third of the rotary
  frequencies (``mrope_section``, repeated for the second half of the head) turns by one axis. Text
  tokens have three equal positions, so a decode token turns as plain RoPE at ``position + delta``,
  the sequence's delta. Decode steps read the delta from a small table indexed by the sequence's first
  KV block (written at its prefill), so the decode inputs and CUDA graphs stay those of every family.
- Weight names: checkpoints hold ``model.layers.*``/``visual.*`` (older) or ``model.language_model.*``/
  ``model.visual.*`` (transformers 5 and a trainer's ``named_parameters()``); both load. A weight update
  may carry the language model only (``--freeze_visual_encoder``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from tidal.rollout.models.layers import CausalLM, DecoderArgs
from tidal.rollout.models.mrope import MRopeMixin
from tidal.rollout.models.vision_attention import build_vision_tower
from tidal.rollout.models.vision_weights import VISION_PREFIX, language_weights
from tidal.rollout.runner.multimodal import PrefillImages


class Qwen25VLForConditionalGeneration(MRopeMixin, CausalLM):
    weight_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.visual.", VISION_PREFIX),
        ("model.language_model.", "model."),
    )
    supports_tp = False  # the vision tower is not sharded (Family.refuses says so too)

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        hf = args.hf_config
        self.image_token_id = int(hf.image_token_id)
        # never sampled (ModelRunner.never_sample): in a response the trainer's model would take them for
        # images (and fail: more image tokens than images); the reported log-probs are unchanged
        video = getattr(hf, "video_token_id", None)
        self.never_sample = (self.image_token_id,) + (() if video is None else (int(video),))
        # one attention call per run of equal windows, not one per window (vision_attention.py)
        self.visual = build_vision_tower(Qwen2_5_VisionTransformerPretrainedModel, hf.vision_config)
        # Buffers set after ``to_empty``: the rotary column -> position axis map (``init_rope``) and the
        # decode-delta table (``reserve_block_state``).
        self.register_buffer("rope_axis", None, persistent=False)
        self.register_buffer("block_deltas", None, persistent=False)

    @classmethod
    def args_from_hf_config(cls, config) -> DecoderArgs:
        text = config.get_text_config()
        args = DecoderArgs.from_hf_config(text, qkv_bias=True, model_type=config.model_type)
        args.hf_config = config  # the vision tower's config (read once, when the model is built)
        args.mrope_section = text.rope_parameters.get("mrope_section", [16, 24, 24])
        return args

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """The text RoPE table, and the buffers ``to_empty`` left uninitialised."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionRotaryEmbedding

        device = self.model.embed_tokens.weight.device
        super().init_rope(hf_config.get_text_config(), max_model_len)
        self.visual.rotary_pos_emb = Qwen2_5_VLVisionRotaryEmbedding(hf_config.vision_config).to(device)
        # Column j of the first half turns by axis (section of j) % 3 (0 t, 1 h, 2 w); the second half repeats it.
        axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(self.args.mrope_section)])
        self.rope_axis = torch.cat([axis, axis]).to(device)

    def forward(self, input_ids, positions, meta, logits_index=None, images: PrefillImages | None = None):
        x = self.model.embed_tokens(input_ids)
        if images is not None:
            x = self._scatter_images(input_ids, x, images)
        cos, sin = self.rope(positions, meta, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        if logits_index is not None:
            x, residual = x[logits_index], residual[logits_index]
        return self.lm_head(self.model.norm(x, residual)[0])

    def _scatter_images(self, input_ids, x, images: PrefillImages) -> torch.Tensor:
        """Record the step's decode deltas; put the vision tower's features at the image tokens."""
        device = x.device
        blocks = torch.tensor(images.first_blocks, device=device)
        self.block_deltas[blocks] = torch.tensor(images.deltas, device=device)
        if images.pixel_values is None:
            return x
        pixels = images.pixel_values.to(device, self.visual.dtype)
        features = self.visual(pixels, grid_thw=images.grid_thw.to(device)).pooler_output
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"the prefill has {int(mask.sum())} image tokens but its images give {features.shape[0]}"
            )
        return x.masked_scatter(mask[:, None].expand_as(x), features.to(x.dtype))

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's weights through the decoder's loader; the vision tower's as they are."""
        loaded: set[str] = set()
        language = language_weights(named_tensors, self._our_name, self.visual, "qwen2_5_vl", loaded)
        loaded |= super().load_weights(language)
        return loaded
