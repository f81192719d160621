"""Build tiny random-init vision-language model folders offline: Qwen2.5-VL (``qwen2_5_vl``, the
default), Qwen3-VL (``qwen3_vl``: interleaved M-RoPE, DeepStack features, 16-pixel patches), Qwen3.5
(``qwen3_5``: Qwen3-VL's tower without DeepStack, the hybrid linear/full-attention Qwen3.5 decoder) and
Qwen3.5-MoE (``qwen3_5_moe``: the same with a sparse MoE block in every layer).

``build_tiny_vlm(path, family)`` writes a plain Hugging Face folder that ``AutoModelForImageTextToText``
loads (about 0.25M parameters: a 2-block vision tower of width 32 and a 2-layer language model of width
64), with its processor files:

- the tiny byte-level BPE tokenizer of ``tidal.testing.tiny`` extended with Qwen's vision tokens
  (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and a ChatML template
  that renders a ``{"type": "image"}`` content part as ``<|vision_start|><|image_pad|><|vision_end|>``
  and a ``{"type": "text"}`` part as its text (assistant turns keep ``{% generation %}``);
- the image processor (``preprocessor_config.json``), sized for small images: 28×28 pixels is one
  image token (a 2×2 grid of 14-pixel patches merged 2×2; Qwen3-VL: 32×32, 16-pixel patches), 56×56
  (64×64) is four; larger images are scaled down to at most that;
- ``processor_config.json`` and ``video_preprocessor_config.json``, so ``AutoProcessor.from_pretrained``
  builds the family's full processor where torchvision is installed (transformers' video processor
  needs it); ``tidal.data.vision.load_vision_processor`` reads the folder either way.

Gemma 3 (``gemma3``, ``build_tiny_vlm(path, "gemma3")``: ``build_tiny_gemma3``) differs: a 2-layer
SigLIP tower (32×32 images of 8-pixel patches, pooled 2×2 into 4 image tokens), the tiny Gemma 3 text
model (a sliding-window layer then a global one), the tokens ``<start_of_image>``, ``<image_soft_token>``
(the placeholder), ``<end_of_image>`` (the template renders an image part as the three, which tidal
repeats in place; ``GEMMA3_REAL_CHAT_TEMPLATE`` and
``GEMMA4_REAL_CHAT_TEMPLATE`` render the real templates' shapes, ``<start_of_image>`` / the image token alone) and
transformers' own Gemma 3 image processor (its PIL path: no torchvision needed). ``gemma_hf_processor``
builds transformers' ``Gemma3Processor`` / ``Gemma4Processor`` over a tiny tokenizer, which tidal's image
prompts are checked against.

Nothing touches the network. The same seed gives the same weights and tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.testing.tiny import build_tiny_tokenizer, tokenizer_fields

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML with content parts: a string content is rendered as is; a list renders images as Qwen's
# vision placeholder and text parts as their text. ``{% generation %}`` marks the assistant's tokens.
VLM_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ render(message['content']) + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' }}{{ render(message['content']) }}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MERGE, TEMPORAL = 2, 2  # patches merged per side into one token, frames per patch

_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6,
)  # fmt: skip
_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, spatial_merge_size=MERGE,
    temporal_patch_size=TEMPORAL,
)  # fmt: skip
# head_dim 16: M-RoPE splits its 8 frequencies over (temporal, height, width)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


@dataclass(frozen=True)
class TinyVLMFamily:
    """What differs between the tiny families: the config, processor and patch size, and extra fields."""

    config_class: str  # in transformers
    processor_class: str
    video_processor_class: str
    patch: int  # pixels per patch side
    text: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)
    top: dict = field(default_factory=dict)  # fields of the composite config

    @property
    def pixels(self) -> tuple[int, int]:
        """Smallest and largest image area: one image token, four image tokens."""
        side = self.patch * MERGE
        return side * side, 4 * side * side


TINY_VLM_FAMILIES = {
    "qwen2_5_vl": TinyVLMFamily(
        "Qwen2_5_VLConfig", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", patch=14,
        text=dict(rope_parameters=_MROPE, tie_word_embeddings=False),
        vision=dict(window_size=112, fullatt_block_indexes=[1]),
    ),
    "qwen3_vl": TinyVLMFamily(
        "Qwen3VLConfig", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", patch=16,
        text=dict(head_dim=16, rope_parameters={**_MROPE, "mrope_interleaved": True}),
        vision=dict(num_position_embeddings=16, deepstack_visual_indexes=[1]),
        top=dict(tie_word_embeddings=False),
    ),
    # Qwen3.5: Qwen3-VL's tower without DeepStack before the hybrid Qwen3.5 decoder (Gated DeltaNet then
    # gated full attention), partial RoPE: 16 of the 32 head channels, the 8 frequencies M-RoPE splits
    "qwen3_5": TinyVLMFamily(
        "Qwen3_5Config", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", patch=16,
        text=dict(
            head_dim=32, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
            rope_parameters={**_MROPE, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
        ),
        vision=dict(num_position_embeddings=16),
        top=dict(tie_word_embeddings=False),
    ),
}  # fmt: skip
# Qwen3.5-MoE: Qwen3.5's with a sparse MoE block (8 experts, top 2, a shared expert) in every layer
TINY_VLM_FAMILIES["qwen3_5_moe"] = TinyVLMFamily(
    "Qwen3_5MoeConfig", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", patch=16,
    text=dict(
        TINY_VLM_FAMILIES["qwen3_5"].text, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
    ),
    vision=dict(num_position_embeddings=16),
    top=dict(tie_word_embeddings=False),
)  # fmt: skip


def _family(name: str) -> TinyVLMFamily:
    if name not in TINY_VLM_FAMILIES:
        known = sorted([*TINY_VLM_FAMILIES, *GEMMA_VLM_FAMILIES, *GEMMA4_VLM_FAMILIES])
        raise ValueError(f"unknown tiny VLM family {name!r}; expected one of {known}")
    return TINY_VLM_FAMILIES[name]


def image_processor_fields(family: str = "qwen2_5_vl") -> dict:
    """The tiny family's image processor settings (see the module doc)."""
    fam = _family(family)
    low, high = fam.pixels
    return dict(
        size={"shortest_edge": low, "longest_edge": high},
        patch_size=fam.patch,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
    )


def build_vlm_tokenizer(path: str | Path | None = None, seed: int = 0):
    """The tiny tokenizer with Qwen's vision special tokens and the content-part chat template."""
    tokenizer = build_tiny_tokenizer(None, seed=seed, add_bos=False)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(str(path))
    return tokenizer


def _write_processor_files(path: Path, family: str) -> None:
    """The image processor's config, and the processor / video processor configs AutoProcessor reads."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fam, fields = _family(family), image_processor_fields(family)
    Qwen2VLImageProcessorPil(**fields).save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": fam.processor_class}))
    video = {"video_processor_type": fam.video_processor_class, "processor_class": fam.processor_class}
    (path / "video_preprocessor_config.json").write_text(json.dumps({**video, **fields}, indent=2))


def tiny_vlm_config(tokenizer, family: str = "qwen2_5_vl", **text_overrides):
    """The family's config with tiny shapes whose special-token ids are ``tokenizer``'s."""
    import transformers

    fam = _family(family)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _TOKEN_FIELDS.items()}
    text = dict(_TEXT, **fam.text, **tokenizer_fields(tokenizer))
    text.update(text_overrides)
    vision = dict(_VISION, **fam.vision, patch_size=fam.patch, out_hidden_size=text["hidden_size"])
    config_class = getattr(transformers, fam.config_class)
    return config_class(text_config=text, vision_config=vision, **fam.top, **ids)


_TOKEN_FIELDS = {
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}


def build_tiny_vlm(path: str | Path, family: str = "qwen2_5_vl", seed: int = 0, **text_overrides) -> Path:
    """Write a random-init tiny VLM of ``family`` with its tokenizer and processor files to ``path``."""
    from transformers import AutoModelForImageTextToText

    if family in GEMMA_VLM_FAMILIES:
        return build_tiny_gemma3(path, seed, **text_overrides)
    if family in GEMMA4_VLM_FAMILIES:
        return build_tiny_gemma4(path, seed, **text_overrides)
    path = Path(path)
    _family(family)  # before anything is written to ``path``
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer(path, seed=seed)
    _write_processor_files(path, family)
    config = tiny_vlm_config(tokenizer, family, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return path


# ------------------------------------------------------------------ Gemma 3
# Fixed-size images (every image is resized to IMAGE_SIDE²), so no patch grid per image: kept apart from
# TINY_VLM_FAMILIES, whose entries are Qwen-VL-shaped.
GEMMA_VLM_FAMILIES = ("gemma3",)
BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
GEMMA_IMAGE_SIDE, GEMMA_PATCH, GEMMA_IMAGE_TOKENS = 32, 8, 4
GEMMA_LOGIT_SCALE = 8.0
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# What an image content part renders as. The tiny models' templates render the whole group with one soft
# token, which tidal expands in place.
GEMMA3_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace(_QWEN_IMAGE, BOI + SOFT + EOI)
# The real templates' shapes (tidal.data.vision.ImageMarkup expands them as transformers' processors do):
# Gemma 3's renders <start_of_image> alone (Gemma3Processor: "\n\n" + it + soft tokens + end + "\n\n"),
# Gemma 4's its image token (Gemma4Processor: wrapped in <start_of_image>/<end_of_image>, no newlines).
GEMMA3_REAL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace(_QWEN_IMAGE, BOI)
GEMMA4_REAL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace(_QWEN_IMAGE, SOFT)
# the registry's tiny gemma3_text shapes: a sliding-window (8) layer, then a global one
_GEMMA3_TEXT = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2)
_SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=GEMMA_IMAGE_SIDE, patch_size=GEMMA_PATCH,
)  # fmt: skip


def build_gemma3_tokenizer(path: str | Path | None = None, seed: int = 0):
    """The tiny tokenizer with Gemma 3's image tokens and the content-part chat template."""
    tokenizer = build_tiny_tokenizer(None, seed=seed, add_bos=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT]})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(str(path))
    return tokenizer


def gemma3_config(tokenizer, **text_overrides):
    """A tiny ``Gemma3Config`` whose image token ids are ``tokenizer``'s."""
    from transformers import Gemma3Config

    text = dict(_TEXT, **_GEMMA3_TEXT, **tokenizer_fields(tokenizer))
    text.update(text_overrides)
    ids = dict(zip(("boi_token_index", "eoi_token_index", "image_token_index"),
                   tokenizer.convert_tokens_to_ids([BOI, EOI, SOFT]), strict=True))  # fmt: skip
    return Gemma3Config(
        text_config=text, vision_config=_SIGLIP, mm_tokens_per_image=GEMMA_IMAGE_TOKENS, **ids
    )


def build_tiny_gemma3(path: str | Path, seed: int = 0, **text_overrides) -> Path:
    """Write a random-init tiny Gemma 3 VLM with its tokenizer and image processor to ``path``."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_gemma3_tokenizer(path, seed=seed)
    Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE_SIDE, "width": GEMMA_IMAGE_SIDE}).save_pretrained(
        str(path)
    )
    config = gemma3_config(tokenizer, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises the projection to zeros: images would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
        # peaked next-token distributions, as a trained model's: the final norm's 1 + w scales every logit
        model.model.language_model.norm.weight.fill_(GEMMA_LOGIT_SCALE - 1.0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return path


# ------------------------------------------------------------------ Gemma 4
# Variable-size images (aspect ratio kept, 8-pixel patches pooled 2×2, at most 70 tokens per image), the
# registry's tiny Gemma 4 text model (sliding and full layers, KV-shared layers, per-layer embeddings),
# bidirectional image attention in the sliding-window layers; no audio tower.
GEMMA4_VLM_FAMILIES = ("gemma4",)
GEMMA4_MAX_SOFT_TOKENS = 70  # the smallest budget transformers' Gemma 4 processor takes
_GEMMA4_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=16, patch_size=8, pooling_kernel_size=2, position_embedding_size=64,
)  # fmt: skip
_GEMMA4_OTHER_TOKENS = ("<video_soft_token>", "<audio_soft_token>", "<start_of_audio>", "<end_of_audio>")


def gemma4_config(tokenizer, **text_overrides):
    """A tiny ``Gemma4Config`` (no audio) whose special-token ids are ``tokenizer``'s."""
    from transformers import Gemma4Config

    from tidal.rollout.models.registry import FAMILIES

    text = dict(_TEXT, **FAMILIES["gemma4_text"].tiny, **tokenizer_fields(tokenizer))
    text.update(vocab_size_per_layer_input=len(tokenizer), use_bidirectional_attention="vision")
    text["num_hidden_layers"] = len(text["layer_types"])
    text.update(text_overrides)
    names = ("boi_token_id", "eoi_token_id", "image_token_id", "video_token_id", "audio_token_id",
             "boa_token_id", "eoa_token_index")  # fmt: skip
    ids = dict(
        zip(names, tokenizer.convert_tokens_to_ids([BOI, EOI, SOFT, *_GEMMA4_OTHER_TOKENS]), strict=True)
    )
    return Gemma4Config(text_config=text, vision_config=_GEMMA4_VISION, audio_config=None, **ids)


def build_tiny_gemma4(path: str | Path, seed: int = 0, **text_overrides) -> Path:
    """Write a random-init tiny Gemma 4 VLM with its tokenizer and image processor to ``path``."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_gemma3_tokenizer(None, seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_GEMMA4_OTHER_TOKENS)})
    tokenizer.save_pretrained(str(path))
    processor = Gemma4ImageProcessorPil(
        patch_size=_GEMMA4_VISION["patch_size"], pooling_kernel_size=_GEMMA4_VISION["pooling_kernel_size"],
        max_soft_tokens=GEMMA4_MAX_SOFT_TOKENS,
    )  # fmt: skip
    processor.save_pretrained(str(path))
    config = gemma4_config(tokenizer, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # image features as large as the text embeddings' scale, so that the image decides the answer
        model.model.embed_vision.embedding_projection.weight.normal_(0.0, 0.5)
        # peaked next-token distributions, as a trained model's (Gemma 4's norm scales by w)
        model.model.language_model.norm.weight.mul_(GEMMA_LOGIT_SCALE)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return path


# ------------------------------------------------------------------ transformers' Gemma processors
# What transformers' Gemma processors read from a real Gemma tokenizer (the tiny one is given them here).
GEMMA_NAMED_TOKENS = {
    "boi_token": BOI, "eoi_token": EOI, "image_token": SOFT, "audio_token": "<audio_soft_token>",
    "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>",
}  # fmt: skip


def gemma_hf_processor(family: str, tokenizer):
    """transformers' ``Gemma3Processor`` / ``Gemma4Processor`` over ``tokenizer`` (a tiny Gemma one, given the
    token names a real one has) with the tiny models' image processor settings; what tidal's image prompts
    are checked against. No torchvision: Gemma 4's video processor and audio feature extractor are left
    out, which its image path does not use."""
    for name, token in GEMMA_NAMED_TOKENS.items():
        setattr(tokenizer, name, token)
        setattr(tokenizer, name + "_id", tokenizer.convert_tokens_to_ids(token))
    if family == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = {"height": GEMMA_IMAGE_SIDE, "width": GEMMA_IMAGE_SIDE}
        return Gemma3Processor(
            Gemma3ImageProcessorPil(size=side), tokenizer, image_seq_length=GEMMA_IMAGE_TOKENS
        )
    from transformers import Gemma4Processor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    class ImagesOnly(Gemma4Processor):
        def check_argument_for_proper_class(self, name, argument):
            if argument is not None:
                super().check_argument_for_proper_class(name, argument)

    image_processor = Gemma4ImageProcessorPil(
        patch_size=_GEMMA4_VISION["patch_size"], pooling_kernel_size=_GEMMA4_VISION["pooling_kernel_size"],
        max_soft_tokens=GEMMA4_MAX_SOFT_TOKENS,
    )  # fmt: skip
    return ImagesOnly(None, image_processor, tokenizer, None)
