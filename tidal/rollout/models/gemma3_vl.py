"""Gemma 3 with images (``gemma3``): transformers' SigLIP tower and projector before the engine's Gemma 3
decoder (``gemma3.py``).

What the vision-language checkpoint adds to the text model (transformers' ``modeling_gemma3.py``,
``Gemma3ForConditionalGeneration``):

- every image is resized to one square (``vision_config.image_size``); the SigLIP tower
  (``vision_tower``) turns its ``(S/P)²`` patches into features, the projector
  (``multi_modal_projector``) average-pools them to ``mm_tokens_per_image`` tokens, RMS-normalises them
  and projects them to the text width. The prompt holds ``<start_of_image>``, that many
  ``<image_soft_token>`` placeholders and ``<end_of_image>``; the features replace the placeholders'
  embeddings (unscaled: the text embeddings alone are multiplied by ``sqrt(hidden_size)``).
- During prefill an image's tokens attend to each other in both directions (all of its soft tokens, a
  run of placeholders); text stays causal, and sliding-window layers still apply their window on top
  (``attention.image_spans``, read by the prefill masks). Decode steps only add text tokens, so they,
  their CUDA graphs and the paged decode kernels are the text model's.
- Positions are plain: an image's tokens count on like text (no M-RoPE), so the decode delta is 0.

Images travel as the engine's patch rows (``multimodal.FixedSizeImageProcessor``: the processor's
``[N, 3, S, S]`` pixels as ``(S/P)²`` rows per image, grid ``(1, S/P, S/P)``, the pooling kernel as the
merge size); ``_image_features`` turns them back into pixels for the tower. A prefix-cache hit or a
prefill chunk never ends inside an image (``PromptImages.image_start`` / ``chunk_end``), so the
bidirectional block is always computed whole.

Weight names: ``model.language_model.*`` / ``model.vision_tower.*`` / ``model.multi_modal_projector.*``
(transformers 5, a trainer's ``named_parameters()``) or the older ``language_model.model.*`` /
``vision_tower.*`` / ``multi_modal_projector.*``; an update may carry the language model only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.rollout.models.gemma2 import GemmaArgs
from tidal.rollout.models.gemma3 import Gemma3ForCausalLM
from tidal.rollout.models.vision_weights import language_weights
from tidal.rollout.runner.attention import AttentionMetadata, image_spans
from tidal.rollout.runner.multimodal import PrefillImages, fixed_size_grid, patch_rows_to_images

# (checkpoint prefix, ours): the first that starts a name applies
PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "visual.vision_tower."),
    ("vision_tower.", "visual.vision_tower."),
    ("model.multi_modal_projector.", "visual.multi_modal_projector."),
    ("multi_modal_projector.", "visual.multi_modal_projector."),
)


class Gemma3Vision(nn.Module):
    """The SigLIP tower and Gemma 3's pooling projector, under transformers' names."""

    def __init__(self, hf_config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[N, 3, S, S]`` pixels -> ``[N * mm_tokens_per_image, hidden]`` features, image by image."""
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return self.multi_modal_projector(hidden).flatten(0, 1)


class Gemma3VLForConditionalGeneration(Gemma3ForCausalLM):
    supports_tp = False  # the vision tower is not sharded (Family.refuses says so too)

    def __init__(self, args: GemmaArgs):
        super().__init__(args)
        hf = args.hf_config
        self.image_token_id = int(hf.image_token_id)
        # never sampled (ModelRunner.never_sample): the trainer's model would take them for images
        self.never_sample = (self.image_token_id,)
        self.patch = fixed_size_grid(hf)[0]
        self.visual = Gemma3Vision(hf)

    @classmethod
    def args_from_hf_config(cls, config) -> GemmaArgs:
        args = super().args_from_hf_config(config.get_text_config())
        args.hf_config = config  # the vision tower's config (read once, when the model is built)
        args.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", args.tie_word_embeddings))
        return args

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """The text RoPE tables, and the tower's position ids (a buffer ``to_empty`` left uninitialised)."""
        super().init_rope(hf_config.get_text_config(), max_model_len)
        for name, buffer in self.visual.named_buffers():
            if name.endswith("position_ids"):  # SigLIP's patch position ids: 0, 1, ... per patch
                buffer.copy_(torch.arange(buffer.shape[-1], device=buffer.device).expand_as(buffer))

    def reserve_block_state(self, num_blocks: int) -> None:
        """Nothing to keep per KV block: positions are plain, so decode needs no delta (the runner's
        vision path calls it)."""

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        if positions.dim() == 2:  # prefill: the vision path's [3, tokens] rows, all three equal here
            positions = positions[0]
        return super().rope(positions, meta, dtype)

    def forward(self, input_ids, positions, meta, logits_index=None, images: PrefillImages | None = None):
        mask = input_ids == self.image_token_id
        ids = input_ids.masked_fill(mask, 0) if self.image_token_id >= self.args.vocab_size else input_ids
        x = self.model.embed_tokens(ids)
        if images is not None and images.pixel_values is not None:
            features = self._image_features(images).to(x.dtype)
            if int(mask.sum()) != features.shape[0]:
                raise ValueError(
                    f"the prefill has {int(mask.sum())} image tokens but its images give {features.shape[0]}"
                )
            x = x.masked_scatter(mask[:, None].expand_as(x), features)
        if images is not None and meta.is_prefill:
            padded = mask[meta.pad_index] & meta.pad_valid
            if bool(padded.any()):
                meta.image_spans = image_spans(
                    padded, meta.query_starts if meta.block_tables is not None else None
                )
        cos, sin = self.rope(positions, meta, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        if logits_index is not None:
            x, residual = x[logits_index], residual[logits_index]
        return self.lm_head(self.model.norm(x, residual)[0])

    def _image_features(self, images: PrefillImages) -> torch.Tensor:
        device = self.model.embed_tokens.weight.device
        pixels = patch_rows_to_images(images.pixel_values, images.grid_thw, self.patch)
        return self.visual(pixels.to(device, self.visual.vision_tower.dtype))

    # ------------------------------------------------------------------ weights
    def _our_name(self, name: str) -> str:
        name = super()._our_name(name)
        for hf, ours in PREFIXES:
            if name.startswith(hf):
                return ours + name[len(hf) :]
        return name

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The language model's weights through the decoder's loader; the vision tower's as they are."""
        loaded: set[str] = set()
        language = language_weights(named_tensors, self._our_name, self.visual, "gemma3", loaded)
        loaded |= super().load_weights(language)
        return loaded
