"""Build a tiny random-init vision-language model folder offline: Qwen2.5-VL (``qwen2_5_vl``).

``build_tiny_vlm(path)`` writes a plain Hugging Face folder that ``AutoModelForImageTextToText`` loads
(about 0.2M parameters: a 2-block vision tower of width 32 and a 2-layer language model of width 64),
with its processor files:

- the tiny byte-level BPE tokenizer of ``tidal.testing.tiny`` extended with Qwen's vision tokens
  (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and a ChatML template
  that renders a ``{"type": "image"}`` content part as ``<|vision_start|><|image_pad|><|vision_end|>``
  and a ``{"type": "text"}`` part as its text (assistant turns keep ``{% generation %}``);
- the image processor (``preprocessor_config.json``), sized for small images: 28×28 pixels is one
  image token (a 2×2 grid of 14-pixel patches merged 2×2), 56×56 is four; larger images are scaled
  down to at most 56×56 pixels;
- ``processor_config.json`` and ``video_preprocessor_config.json``, so ``AutoProcessor.from_pretrained``
  builds the full ``Qwen2_5_VLProcessor`` where torchvision is installed (transformers' video processor
  needs it); ``tidal.data.vision.load_vision_processor`` reads the folder either way.

Nothing touches the network. The same seed gives the same weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tidal.testing.tiny import build_tiny_tokenizer

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

PATCH, MERGE, TEMPORAL = 14, 2, 2  # pixels per patch side, patches merged per side, frames per patch
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56  # one image token ... four image tokens

_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # head_dim 16: M-RoPE splits its 8 frequencies over (temporal, height, width)
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
)  # fmt: skip
_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=112, fullatt_block_indexes=[1],
    patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
)  # fmt: skip
_IMAGE_PROCESSOR = dict(
    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    patch_size=PATCH,
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


def _write_processor_files(path: Path) -> None:
    """The image processor's config, and the processor / video processor configs AutoProcessor reads."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(**_IMAGE_PROCESSOR).save_pretrained(str(path))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor"}
    (path / "video_preprocessor_config.json").write_text(json.dumps({**video, **_IMAGE_PROCESSOR}, indent=2))


def tiny_vlm_config(tokenizer, **text_overrides):
    """A ``Qwen2_5_VLConfig`` with tiny shapes whose special-token ids are ``tokenizer``'s."""
    from transformers import Qwen2_5_VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _TOKEN_FIELDS.items()}
    text = dict(
        _TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **text_overrides,
    )
    vision = dict(_VISION, out_hidden_size=text["hidden_size"])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


_TOKEN_FIELDS = {
    "image_token_id": IMAGE_PAD,
    "video_token_id": VIDEO_PAD,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}


def build_tiny_vlm(path: str | Path, seed: int = 0, **text_overrides) -> Path:
    """Write a random-init tiny Qwen2.5-VL with its tokenizer and processor files to ``path``."""
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer(path, seed=seed)
    _write_processor_files(path)
    config = tiny_vlm_config(tokenizer, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return path
