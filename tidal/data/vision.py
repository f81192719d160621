"""Vision-language samples: the model's image processor, image-token expansion, and image batches.

The one interface the trainers and (later) the rollout engine share:

- ``load_vision_processor(path, tokenizer)`` → a ``VisionProcessor`` for a vision-language folder (None
  for a text model): the tokenizer, the image processor and the image placeholder token the model
  scatters image features into (``config.image_token_id``); trainers export it in the tokenizer's
  place, so the final folder holds the processor files too. It reads ``preprocessor_config.json`` with
  ``AutoImageProcessor``, so it does not need torchvision (transformers' full ``AutoProcessor`` for
  Qwen-VL builds a video processor that does). ``token_counts`` says how many placeholder tokens an
  image becomes (Qwen-VL: its patch grid over ``merge_size²``), ``pixel_inputs`` gives the model's
  ``pixel_values`` and ``image_grid_thw``.
- ``expand_image_tokens``: a prompt rendered by the chat template holds one placeholder per image
  (``<|vision_start|><|image_pad|><|vision_end|>``); each becomes its image's count of placeholders,
  never trained (loss mask 0). A row whose placeholder count differs from its image count is an error.
- ``ImageSamples.wrap(builder)``: a sample builder (SFT, pairs) whose rows' images are checked first
  (``tidal.data.images.check_image_rows``), then expanded into each sample's ids; the sample keeps
  ``SampleImages`` (the image refs and the processor). ``image_batch(samples)`` (called by the
  collators) decodes a micro-batch's images into ``pixel_values``, ``image_grid_thw`` (images in token
  order) and ``image_counts`` (images per sample, so packed rows get per-sample rotary positions).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tidal.config.args import ConfigError
from tidal.config.data import VisionConfig
from tidal.data.errors import DataError
from tidal.data.image_processors import fixed_size_processor
from tidal.data.images import ImageRef, RowImages, check_image_rows, open_image
from tidal.data.rows import row_name

# Processor files besides the image processor's: copied as they are into exported folders.
PROCESSOR_FILES = ("processor_config.json", "video_preprocessor_config.json", "chat_template.json")


@dataclass
class VisionProcessor:
    """A vision-language model's tokenizer, image processor and image placeholder token. Other
    attributes are the tokenizer's, and ``save_pretrained`` writes the processor files with the
    tokenizer's, so a trainer exports it where it would export the tokenizer."""

    tokenizer: Any
    image_processor: Any
    image_token_id: int
    source: str | None = None  # the folder it was read from (its other processor files are copied)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def save_pretrained(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        for name in PROCESSOR_FILES:
            source = Path(self.source or "") / name
            if self.source and source.is_file():
                shutil.copyfile(source, Path(path) / name)

    @property
    def image_token(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.image_token_id)

    def pixel_inputs(self, images: Sequence) -> dict[str, torch.Tensor]:
        """``pixel_values`` (all images' patches, in order) and ``image_grid_thw`` ``[N, 3]``."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_counts(self, images: Sequence) -> list[int]:
        """Placeholder tokens each image becomes (its merged patch grid): from the image's size where
        the image processor says (vLLM's hook, no pixels computed), else from its output."""
        if not images:
            return []
        merged = self.image_processor.merge_size**2
        patches = getattr(self.image_processor, "get_number_of_image_patches", None)
        if patches is not None:
            return [patches(image.height, image.width, {}) // merged for image in images]
        grid = self.pixel_inputs(images)["image_grid_thw"]
        return (grid.prod(-1) // merged).tolist()


def load_vision_processor(path: str, tokenizer) -> VisionProcessor | None:
    """The ``VisionProcessor`` of a model folder, or None when its config has no vision tower."""
    from transformers import AutoConfig, AutoImageProcessor

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None  # the model loader reports an unreadable folder
    token_id = getattr(config, "image_token_id", None)
    if getattr(config, "vision_config", None) is None or token_id is None:
        return None
    try:
        image_processor = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--pretrain {path}: cannot load its image processor ({err})") from err
    image_processor = fixed_size_processor(image_processor, config)  # Gemma 3's, as patch rows
    if not hasattr(image_processor, "merge_size"):
        raise ConfigError(
            f"--pretrain {path}: {type(image_processor).__name__} is not supported for training on images; "
            "tidal trains Qwen-VL-style models (image_grid_thw patch grids: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and Gemma 3"
        )
    return VisionProcessor(tokenizer, image_processor, int(token_id), path if Path(path).is_dir() else None)


@dataclass(frozen=True)
class SampleImages:
    """The images of one sample, in the order of its placeholder runs, and the processor that turns
    them into pixels when the sample is collated."""

    refs: tuple[ImageRef, ...]
    processor: VisionProcessor

    def __len__(self) -> int:
        return len(self.refs)


def expand_image_tokens(
    ids: list[int], mask: list[int], counts: list[int], image_token_id: int
) -> tuple[list[int], list[int]]:
    """Replace the i-th placeholder token of ``ids`` by ``counts[i]`` copies (mask 0); ``ValueError``
    when the placeholders and images do not pair up."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ValueError(
            f"the rendered text has {found} image placeholder(s) but the row has {len(counts)} image(s)"
        )
    out_ids, out_mask, k = [], [], 0
    for token, m in zip(ids, mask, strict=True):
        if token == image_token_id:
            out_ids += [token] * counts[k]
            out_mask += [0] * counts[k]
            k += 1
        else:
            out_ids.append(token)
            out_mask.append(m)
    return out_ids, out_mask


@dataclass
class ImageSamples:
    """A run's images: its ``VisionConfig`` and the model's processor (None for a text model)."""

    cfg: VisionConfig
    processor: VisionProcessor | None = None

    def check(
        self, pretrain: str, vision_model: bool = True, ring_attn_size: int = 1, tensor_parallel_size: int = 1
    ) -> None:
        """One ``ConfigError`` line for image flags this model (``vision_model``: it has a vision tower)
        or layout cannot honour."""
        text_only = (
            f"--pretrain {pretrain} has no vision tower (its config has no vision_config/image_token_id)"
        )
        n = self.cfg.max_images_per_prompt
        if n > 0 and self.processor is None:
            raise ConfigError(f"--max_images_per_prompt {n} needs a vision-language model; {text_only}")
        if self.cfg.freeze_visual_encoder and not vision_model:
            raise ConfigError(f"--freeze_visual_encoder needs a vision-language model; {text_only}")
        if n > 0 and ring_attn_size > 1:
            raise ConfigError(
                f"--ring_attn_size {ring_attn_size} with images: splitting a row's image tokens over ranks "
                "is not supported; train images without ring attention"
            )
        if n > 0 and tensor_parallel_size > 1:
            raise ConfigError(
                f"--ds_tensor_parallel_size {tensor_parallel_size} with images: tensor-parallel plans cover "
                "text models only; shard the vision-language model with FSDP2 (--zero_stage)"
            )

    def wrap(self, builder: Callable) -> Callable:
        """``builder(dataset, tokenizer, cfg, source=...)`` whose samples carry their rows' images."""

        def build(dataset, tokenizer, cfg, source: str = "dataset", **kwargs):
            # every row's images, before any sample is built
            measure = self.processor.token_counts if self.processor is not None else None
            rows = check_image_rows(dataset, self.cfg, source, measure)
            samples, stats = builder(dataset, tokenizer, cfg, source=source, **kwargs)
            if self.processor is None:  # a text model: the check refused every image
                return samples, stats
            kept = []
            for sample in samples:  # a text-only row too: a placeholder without its image is an error
                sample = self._attach(sample, rows[sample.row], dataset, source)
                if _length(sample) > cfg.max_len:
                    stats.add("too_long", sample.row)
                else:
                    kept.append(sample)
            if not kept:
                raise DataError(
                    f"no usable sample in {source} with its images ({stats.summary()}); check --max_len"
                )
            return kept, stats

        return build

    def _attach(self, sample, row: RowImages, dataset, source: str):
        processor, counts = self.processor, list(row.token_counts)
        images = SampleImages(row.refs, processor) if row.refs else None
        try:
            if hasattr(sample, "chosen_ids"):
                return _attach_pair(sample, counts, processor.image_token_id, images)
            ids, mask = expand_image_tokens(
                sample.input_ids, sample.loss_mask, counts, processor.image_token_id
            )
        except ValueError as err:
            raise DataError(
                f"{row_name(dataset, sample.row, source)}: {err} (each image needs one {processor.image_token!r} "
                "in the prompt: a {'type': 'image'} content part rendered by the chat template)"
            ) from err
        return replace(sample, input_ids=ids, loss_mask=mask, images=images)


def _attach_pair(sample, counts: list[int], image_token_id: int, images: SampleImages | None):
    """Expand both sides of a pair; the images are in the shared prompt, which grows by the same count."""
    sides = {}
    for side in ("chosen_ids", "rejected_ids"):
        ids = getattr(sample, side)
        if any(t == image_token_id for t in ids[sample.prompt_len :]):
            raise ValueError("an image placeholder is in a response; images must be in the prompt")
        sides[side], _ = expand_image_tokens(ids, [0] * len(ids), counts, image_token_id)
    grown = sum(counts) - len(counts)
    return replace(sample, **sides, prompt_len=sample.prompt_len + grown, images=images)


def _length(sample) -> int:
    if hasattr(sample, "chosen_ids"):
        return max(len(sample.chosen_ids), len(sample.rejected_ids))
    return len(sample)


def image_batch(samples: Sequence) -> dict[str, torch.Tensor]:
    """The image inputs of a micro-batch (empty when no sample has images): ``pixel_values``,
    ``image_grid_thw`` ``[N, 3]`` (samples in order, each sample's images in order) and ``image_counts``
    ``[B]``."""
    with_images = [s.images for s in samples if getattr(s, "images", None)]
    if not with_images:
        return {}
    images = [open_image(ref) for sample_images in with_images for ref in sample_images.refs]
    processor = with_images[0].processor
    batch = processor.pixel_inputs(images)
    counts = [len(getattr(s, "images", None) or ()) for s in samples]
    _check_token_counts(samples, counts, batch["image_grid_thw"], processor)
    batch["image_counts"] = torch.tensor(counts)
    return batch


def _check_token_counts(samples: Sequence, counts: list[int], grid: torch.Tensor, processor) -> None:
    """Each sample's image tokens must be what the processor makes of its images now (they were
    measured when the data was checked; a file changed since would otherwise fail inside the model)."""
    tokens = (grid.prod(-1) // processor.image_processor.merge_size**2).tolist()
    start = 0
    for sample, n in zip(samples, counts, strict=True):
        want, start = sum(tokens[start : start + n]), start + n
        have = sum(1 for t in sample.input_ids if t == processor.image_token_id)
        if have != want:
            raise DataError(
                f"dataset row {sample.row + 1}: its {n} image(s) now make {want} image tokens, not the {have} "
                "counted when the data was checked (did an image file change during the run?)"
            )
