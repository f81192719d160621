"""Gemma 4 with images (``gemma4``): transformers' Gemma 4 vision tower and embedder before the engine's
Gemma 4 decoder (``gemma4.py``).

What the vision-language checkpoint adds to the text model (transformers' ``modeling_gemma4.py``,
``Gemma4ForConditionalGeneration``):

- images keep their aspect ratio: the processor resizes each to a patch grid whose sides are multiples
  of the pooling kernel k; the tower (``vision_tower``: 2-D RoPE over the patches' (x, y) positions)
  pools each k×k block into one token and ``embed_vision`` (a weightless RMSNorm, a projection) brings it
  to the text width. The features replace the image placeholder tokens' embeddings; those tokens read
  the pad token's id for their per-layer embeddings (the projection half of the per-layer input sees the
  features).
- ``use_bidirectional_attention == "vision"``: during prefill an image's tokens attend to each other in
  both directions in the sliding-window layers only (``AttentionMetadata.image_spans_sliding_only``);
  the full-attention layers stay causal. Decode steps are the text model's.
- positions are plain (no M-RoPE), so the decode delta is 0.

Images travel as patch rows (``multimodal.VariableSizeImageProcessor``: each image's real patches, grid
``(1, rows, cols)``, k as the merge size); ``patch_rows_to_padded`` rebuilds the tower's padded batch.
Audio and video inputs are not supported: the audio tower and its embedder are not built and their
weights are skipped (the E2B/E4B checkpoints hold them). Weight names:
``model.language_model.*`` / ``model.vision_tower.*`` / ``model.embed_vision.*`` (transformers 5).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.rollout.models.gemma4 import Gemma4Args, Gemma4ForCausalLM
from tidal.rollout.models.vision_weights import language_weights
from tidal.rollout.runner.attention import AttentionMetadata, image_spans
from tidal.rollout.runner.multimodal import PrefillImages, patch_rows_to_padded

# (checkpoint prefix, ours): the first that starts a name applies
PREFIXES = (
    ("model.language_model.", "model."),
    ("model.vision_tower.", "visual.vision_tower."),
    ("model.embed_vision.", "visual.embed_vision."),
)
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")  # weights of a tower the engine does not build


class Gemma4Vision(nn.Module):
    """Gemma 4's vision tower and its embedder into the text width, under transformers' names."""

    def __init__(self, hf_config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        self.kernel = int(hf_config.vision_config.pooling_kernel_size)
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.embed_vision = Gemma4MultimodalEmbedder(hf_config.vision_config, hf_config.get_text_config())

    def forward(self, rows: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Patch rows of images with grids ``[N, 3]`` -> ``[tokens, hidden]`` features, image by image."""
        pixels, positions = patch_rows_to_padded(rows, grid, self.kernel * self.kernel)
        hidden = self.vision_tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        return self.embed_vision(hidden)


class Gemma4VLForConditionalGeneration(Gemma4ForCausalLM):
    def __init__(self, args: Gemma4Args):
        super().__init__(args)
        hf = args.hf_config
        self.image_token_id = int(hf.image_token_id)
        # never sampled (ModelRunner.never_sample): the trainer's model would take them for images
        others = (getattr(hf, "video_token_id", None), getattr(hf, "audio_token_id", None))
        self.never_sample = (self.image_token_id, *(int(t) for t in others if t is not None))
        self.pad_token_id = int(hf.get_text_config().pad_token_id)
        self.bidirectional = getattr(hf.get_text_config(), "use_bidirectional_attention", None) == "vision"
        if hf.vision_config is not None:  # a checkpoint without one serves text (its requests take no images)
            self.visual = Gemma4Vision(hf)

    @classmethod
    def args_from_hf_config(cls, config) -> Gemma4Args:
        args = super().args_from_hf_config(config.get_text_config())
        args.hf_config = config  # the vision tower's config (read once, when the model is built)
        args.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", args.tie_word_embeddings))
        return args

    def init_rope(self, hf_config, max_model_len: int) -> None:
        super().init_rope(hf_config.get_text_config(), max_model_len)
        if not hasattr(self, "visual"):
            return
        # the tower's 2-D RoPE frequencies: buffers that ``to_empty`` left uninitialised
        encoder = self.visual.vision_tower.encoder
        device = self.model.embed_tokens.weight.device
        encoder.rotary_emb = type(encoder.rotary_emb)(hf_config.vision_config).to(device)
        if getattr(hf_config.vision_config, "standardize", False):
            raise ValueError(
                "gemma4 vision towers with standardize=True are not supported by the rollout engine"
            )

    def reserve_block_state(self, num_blocks: int) -> None:
        """Nothing to keep per KV block: positions are plain, so decode needs no delta (the runner's
        vision path calls it)."""

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        if positions.dim() == 2:  # prefill: the vision path's [3, tokens] rows, all three equal here
            positions = positions[0]
        return super().rope(positions, meta, dtype)

    def forward(self, input_ids, positions, meta, logits_index=None, images: PrefillImages | None = None):
        mask = input_ids == self.image_token_id
        ids = input_ids.masked_fill(mask, self.pad_token_id)
        h = self.model.embed_tokens(ids)
        if images is not None and images.pixel_values is not None:
            device = h.device
            rows = images.pixel_values.to(device, self.visual.embed_vision.embedding_projection.weight.dtype)
            features = self.visual(rows, images.grid_thw.to(device)).to(h.dtype)
            if int(mask.sum()) != features.shape[0]:
                raise ValueError(
                    f"the prefill has {int(mask.sum())} image tokens but its images give {features.shape[0]}"
                )
            h = h.masked_scatter(mask[:, None].expand_as(h), features)
        if images is not None and meta.is_prefill and self.bidirectional:
            padded = mask[meta.pad_index] & meta.pad_valid
            if bool(padded.any()):
                starts = meta.query_starts if meta.block_tables is not None else None
                meta.image_spans, meta.image_spans_sliding_only = image_spans(padded, starts), True
        ple = self.per_layer_inputs(ids, h)
        rope = self.rope(positions, meta, h.dtype)
        shared: dict = {}  # producer layer -> its keys/values of this step
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None if ple is None else ple[:, i], rope, meta, shared)
        if logits_index is not None:
            h = h[logits_index]
        return self.lm_head(self.model.norm(h))

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
        vision = getattr(self, "visual", None)
        language = language_weights(
            named_tensors, self._our_name, vision, "gemma4", loaded, skip=AUDIO_PREFIXES
        )
        loaded |= super().load_weights(language)
        return loaded
