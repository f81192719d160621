"""Random-init shapes of released vision-language models (issue #32), their image processors, and
synthetic images, for ``bench/vlm_rollout.py`` and ``bench/grpo_7b.py``'s VLM workloads.

Each entry holds the checkpoint's HF ``model_type``, its language model's and vision tower's config fields
and its image processor's settings, so a benchmark builds a model of that size without downloading one
(``vlm_config``, ``vlm_image_processor``). Sources: the checkpoints' public ``config.json`` and
``preprocessor_config.json`` (Qwen/Qwen2.5-VL-3B-Instruct, -7B-Instruct, Qwen/Qwen3-VL-8B-Instruct),
cross-checked against transformers' config classes (whose vision defaults are these towers').

- ``qwen2.5-vl-3b``: 36 layers, hidden 2048, 16 query / 2 KV heads, FFN 11008, vocab 151936, tied
  embeddings; a 32-block window-attention ViT of width 1280 (full attention in blocks 7, 15, 23, 31).
- ``qwen2.5-vl-7b``: 28 layers, hidden 3584, 28 / 4 heads, FFN 18944, vocab 152064, untied; the same tower.
- ``qwen3-vl-8b``: 36 layers, hidden 4096, 32 / 8 heads of 128, FFN 12288, interleaved M-RoPE (theta 5e6);
  a 27-block ViT of width 1152 with 16-pixel patches and DeepStack features from blocks 8, 16, 24.

Image token counts: Qwen2.5-VL merges 2×2 patches of 14 pixels (one token per 28×28 pixels): a 448×448
image is 32×32 patches, 256 tokens; Qwen3-VL's patches are 16 pixels: 28×28 patches, 196 tokens.
The processors' pixel bounds are the released ones (Qwen2.5-VL 3136..12845056, Qwen3-VL 65536..16777216),
so a 448×448 image keeps its size.

For ``bench/grpo_7b.py``'s VLM workloads: ``build_vlm_checkpoint`` writes a random-init checkpoint of a shape
with its processor files and a tokenizer covering the vocabulary (tidal's tiny BPE with Qwen's vision
tokens, whose ids the config takes), ``vlm_prompt_rows`` the image rows and their PNG files.
"""

from __future__ import annotations

import json
from pathlib import Path

_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_QWEN_VL_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)  # fmt: skip
_QWEN25_TOWER = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                     fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")  # fmt: skip
_QWEN25_TEXT = dict(rms_norm_eps=1e-6, max_position_embeddings=128000, bos_token_id=151643,
                    eos_token_id=151645,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                     "mrope_section": [16, 24, 24]})  # fmt: skip
_QWEN25_PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=_CLIP_MEAN,
                         image_std=_CLIP_STD, size={"shortest_edge": 3136, "longest_edge": 12845056})  # fmt: skip

VLM_SHAPES: dict[str, dict] = {
    "qwen2.5-vl-3b": dict(
        model_type="qwen2_5_vl", ids=_QWEN_VL_IDS, processor=_QWEN25_PROCESSOR, top=dict(tie_word_embeddings=True),
        text=dict(_QWEN25_TEXT, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        vision=dict(_QWEN25_TOWER, out_hidden_size=2048),
    ),
    "qwen2.5-vl-7b": dict(
        model_type="qwen2_5_vl", ids=_QWEN_VL_IDS, processor=_QWEN25_PROCESSOR, top=dict(tie_word_embeddings=False),
        text=dict(_QWEN25_TEXT, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
        vision=dict(_QWEN25_TOWER, out_hidden_size=3584),
    ),
    "qwen3-vl-8b": dict(
        model_type="qwen3_vl", ids=_QWEN_VL_IDS, top=dict(tie_word_embeddings=False),
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                  max_position_embeddings=262144, tie_word_embeddings=False, bos_token_id=151643,
                  eos_token_id=151645,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh", out_hidden_size=4096),
        processor=dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                       image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216}),
    ),
}  # fmt: skip
_CONFIG_CLASS = {"qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig"}
_PROCESSOR_CLASS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
_VIDEO_PROCESSOR_CLASS = {"qwen2_5_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}


def vlm_config(name: str, text_overrides: dict | None = None, **top_overrides):
    """The transformers config of ``VLM_SHAPES[name]`` (``text_overrides``: language-model fields;
    ``top_overrides``: fields of the composite config, e.g. other token ids)."""
    import transformers

    shape = VLM_SHAPES[name]
    config_class = getattr(transformers, _CONFIG_CLASS[shape["model_type"]])
    top = dict(shape["ids"], **shape["top"], **top_overrides)
    text = dict(shape["text"], **(text_overrides or {}))
    return config_class(text_config=text, vision_config=dict(shape["vision"]), **top)


def vlm_image_processor(name: str):
    """The released image processor's settings, as transformers' PIL Qwen2-VL image processor (no
    torchvision needed)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:  # transformers releases before the PIL backends: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor as cls

    return cls(**VLM_SHAPES[name]["processor"])


def write_processor_files(folder: Path, name: str) -> None:
    """The image processor's config plus the processor / video processor configs that
    ``AutoProcessor.from_pretrained`` (TRL) reads where torchvision is installed."""
    model_type = VLM_SHAPES[name]["model_type"]
    vlm_image_processor(name).save_pretrained(str(folder))
    fields = dict(VLM_SHAPES[name]["processor"])
    processor = {"processor_class": _PROCESSOR_CLASS[model_type]}
    (folder / "processor_config.json").write_text(json.dumps(processor))
    video = {"video_processor_type": _VIDEO_PROCESSOR_CLASS[model_type], **processor, **fields}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def image_tokens(name: str, side: int) -> int:
    """Tokens of a ``side``×``side`` image (a multiple of patch × merge) in the language model."""
    fields = VLM_SHAPES[name]["processor"]
    return (side // (fields["patch_size"] * fields["merge_size"])) ** 2


def synthetic_images(count: int, side: int = 448, seed: int = 0) -> list:
    """``count`` seeded RGB images of ``side``×``side``: a random colour per image with noise on top (so
    no two images hash alike in the engine's prefix cache)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        base = rng.integers(0, 256, size=3)
        noise = rng.integers(-40, 41, size=(side, side, 3))
        images.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB"))
    return images


# ---- GRPO workloads (bench/grpo_7b.py) ----------------------------------------------------------------
TINY_GRPO = {"tiny-qwen2.5-vl": "qwen2_5_vl"}  # CPU smoke workloads: tidal.testing's tiny VLM family


def build_vlm_checkpoint(folder: Path, name: str, device: str) -> Path:
    """A random-init bf16 checkpoint of ``VLM_SHAPES[name]`` (or a tiny VLM of ``TINY_GRPO``) with its
    processor files and a tokenizer covering the whole vocabulary (tidal's tiny BPE with Qwen's vision
    tokens and chat template, plus added tokens), written once and reused."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tidal.testing import build_tiny_vlm
    from tidal.testing.tiny_vlm import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, build_vlm_tokenizer

    if (folder / "config.json").exists():
        return folder
    if name in TINY_GRPO:
        return build_tiny_vlm(folder, TINY_GRPO[name], seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vlm_tokenizer(None, seed=0)
    vocab = VLM_SHAPES[name]["text"]["vocab_size"]
    tokenizer.add_tokens([f"<x{i}>" for i in range(vocab - len(tokenizer))])
    tokenizer.save_pretrained(str(folder))
    tokens = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END)  # fmt: skip
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    ids = {field: tokenizer.convert_tokens_to_ids(tok) for field, tok in tokens.items()}
    config = vlm_config(name, text_overrides=special, **ids)
    write_processor_files(folder, name)
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of minutes
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(folder), max_shard_size="5GB")
    return folder


def vlm_prompt_rows(folder: Path, texts: list[str], side: int = 448) -> list[dict]:
    """One row per text as tidal's image rows are (docs/recipes.md): a chat prompt whose user turn is an
    image part then the text, the image's path (relative to ``folder``, where the data file goes) under
    ``images``; the seeded synthetic images are written to ``folder/images``."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (text, image) in enumerate(zip(texts, synthetic_images(len(texts), side), strict=True)):
        image.save(folder / "images" / f"{i}.png")
        content = [{"type": "image"}, {"type": "text", "text": text}]
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "images": [f"images/{i}.png"], "label": ""}
        )
    return rows
