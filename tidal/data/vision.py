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
- ``ImageMarkup`` (``image_markup(config, tokenizer)``): what the family's transformers processor makes
  of the template's image marker, so tidal's prompts get its ids (Gemma 3: ``<start_of_image>`` becomes
  ``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n``; Gemma 4: its image token becomes
  ``<start_of_image>`` + image tokens + ``<end_of_image>``; Qwen-VL: the image token repeated), on the text
  (``expand_text``: RL prompts) or the ids (``VisionProcessor.image_pieces`` for ``expand_image_tokens``).
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
    markup: ImageMarkup | None = (
        None  # how the chat template's image marker expands (None: image token alone)
    )

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

    @property
    def image_markup(self) -> ImageMarkup:
        """How the rendered prompt's image marker expands (``image_markup``; the image token alone when
        the processor was built by hand)."""
        return self.markup or ImageMarkup(self.image_token, self.image_token)

    def image_pieces(self, ids: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """``ImageMarkup.pieces`` with this tokenizer, for rendered ``ids``: for ``expand_image_tokens``."""
        markup = self.image_markup
        opener = self.tokenizer.convert_tokens_to_ids(markup.open) if markup.open else None
        found = [sum(1 for t in ids if t == token) for token in (self.image_token_id, opener)]
        return markup.for_rendered(*found).pieces(self.tokenizer)

    def request_ids(self, ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """A rollout engine request's prompt ids with its images laid out as transformers' processor does
        (``expand_request_images`` with this tokenizer's pieces)."""
        return expand_request_images(ids, counts, self.image_token_id, self.image_pieces(ids))

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
    source = path if Path(path).is_dir() else None
    return VisionProcessor(tokenizer, image_processor, int(token_id), source, image_markup(config, tokenizer))


@dataclass(frozen=True)
class ImageMarkup:
    """What transformers' processor of a family turns the chat template's image marker into, per image:
    ``before + open + image_token × count + close + after`` (text; ``open``/``close`` are empty for
    Qwen-VL, whose template already renders ``<|vision_start|>…<|vision_end|>`` around the marker).
    Gemma 3's template renders ``<start_of_image>`` (the marker), which ``Gemma3Processor`` rewrites to
    ``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n``; Gemma 4's renders its image token,
    which ``Gemma4Processor`` wraps in ``<boi>``/``<eoi>`` (no newlines)."""

    marker: str
    image_token: str
    open: str = ""
    close: str = ""
    before: str = ""
    after: str = ""

    def expand_text(self, text: str, counts: Sequence[int]) -> str:
        """``text`` with its i-th marker replaced as the processor does for an image of ``counts[i]``
        tokens; ``ValueError`` when markers and images do not pair up."""
        markup = self.for_rendered(text.count(self.image_token), text.count(self.open) if self.open else 0)
        parts = text.split(markup.marker)
        if len(parts) - 1 != len(counts):
            raise ValueError(
                f"the rendered text has {len(parts) - 1} image placeholder(s) but the row has {len(counts)} "
                "image(s)"
            )
        out = parts[0]
        for count, part in zip(counts, parts[1:], strict=True):
            out += markup.image_text(count) + part
        return out

    def image_text(self, count: int) -> str:
        """One image's text in the processed prompt."""
        return self.before + self.open + self.image_token * count + self.close + self.after

    def for_rendered(self, image_tokens: int, open_tokens: int) -> ImageMarkup:
        """This markup, or the image token alone for a prompt (holding ``image_tokens`` image tokens and
        ``open_tokens`` begin-of-image tokens) whose template rendered the whole group itself, e.g.
        ``<start_of_image><image_soft_token><end_of_image>`` (tidal's tiny Gemma test models, the shape
        the engine's requests take): its image token is then repeated in place."""
        if image_tokens and open_tokens:
            return ImageMarkup(self.image_token, self.image_token)
        return self

    def pieces(self, tokenizer) -> tuple[int, list[int], list[int]]:
        """The marker's id, and the ids before and after an image's run of image tokens (text pieces
        tokenized on their own: a newline beside the marker may tokenize apart from how the whole text
        would)."""

        def ids(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False) if text else []

        marker_id = tokenizer.convert_tokens_to_ids(self.marker)
        return marker_id, ids(self.before + self.open), ids(self.close + self.after)


def image_markup(config, tokenizer) -> ImageMarkup:
    """The ``ImageMarkup`` of a vision-language config's family (read from its token ids)."""

    def token(*names: str) -> str:
        ids = [getattr(config, n, None) for n in names]
        return tokenizer.convert_ids_to_tokens(int(next(i for i in ids if i is not None)))

    image = token("image_token_id", "image_token_index")
    family = getattr(config, "model_type", None)
    if family == "gemma3":
        boi, eoi = token("boi_token_index", "boi_token_id"), token("eoi_token_index", "eoi_token_id")
        return ImageMarkup(boi, image, open=boi, close=eoi, before="\n\n", after="\n\n")
    if family == "gemma4":
        boi, eoi = token("boi_token_id"), token("eoi_token_id")
        return ImageMarkup(image, image, open=boi, close=eoi)
    return ImageMarkup(image, image)


@dataclass(frozen=True)
class SampleImages:
    """The images of one sample, in the order of its placeholder runs, and the processor that turns
    them into pixels when the sample is collated."""

    refs: tuple[ImageRef, ...]
    processor: VisionProcessor

    def __len__(self) -> int:
        return len(self.refs)


def expand_image_tokens(
    ids: list[int],
    mask: list[int],
    counts: list[int],
    image_token_id: int,
    pieces: tuple[int, list[int], list[int]] | None = None,
) -> tuple[list[int], list[int]]:
    """Replace the i-th placeholder token of ``ids`` by ``counts[i]`` image tokens (mask 0), between the
    family's ids (``pieces``: ``ImageMarkup.pieces``'s marker id, ids before, ids after; default: the
    image token is its own marker, nothing around it); ``ValueError`` when placeholders and images do
    not pair up."""
    marker, before, after = pieces or (image_token_id, [], [])
    found = sum(1 for t in ids if t == marker)
    if found != len(counts):
        raise ValueError(
            f"the rendered text has {found} image placeholder(s) but the row has {len(counts)} image(s)"
        )
    out_ids, out_mask, k = [], [], 0
    for token, m in zip(ids, mask, strict=True):
        if token == marker:
            run = [*before, *[image_token_id] * counts[k], *after]
            out_ids += run
            out_mask += [0] * len(run)
            k += 1
        else:
            out_ids.append(token)
            out_mask.append(m)
    return out_ids, out_mask


def expand_request_images(
    ids: Sequence[int],
    counts: Sequence[int],
    image_token_id: int,
    pieces: tuple[int, list[int], list[int]] | None = None,
) -> list[int]:
    """The rollout engine's requests (``tidal generate``, ``tidal serve``, ``LLMEngine`` calls): ``ids`` with
    each image's marker expanded as ``expand_image_tokens`` does (``pieces``: ``VisionProcessor.image_pieces``
    of ``ids``; None: the image token alone), or ``ids`` as they are when already expanded. They are when
    the image token is its own marker in them (nothing is added around it: Qwen-VL, or a Gemma prompt that
    already holds its begin-of-image tokens) and they hold exactly as many image tokens as the images take
    (``sum(counts)``). A Gemma 3 prompt with lone ``<start_of_image>`` markers, or a Gemma 4 one whose image
    tokens have no ``<start_of_image>``, is expanded whatever its counts; ``ValueError`` when markers and
    images do not pair up."""
    ids, pieces = list(ids), pieces or (image_token_id, [], [])
    found = sum(1 for t in ids if t == image_token_id)
    if pieces == (image_token_id, [], []) and found == sum(counts):
        return ids
    markers = sum(1 for t in ids if t == pieces[0])
    if markers != len(counts):
        raise ValueError(
            f"the prompt has {markers} image placeholder token(s) but its {len(counts)} image(s) make "
            f"{sum(counts)} image tokens (give one placeholder per image, or the expanded count)"
        )
    return expand_image_tokens(ids, [0] * len(ids), list(counts), image_token_id, pieces)[0]


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
                return _attach_pair(sample, counts, processor, images)
            ids, mask = expand_image_tokens(
                sample.input_ids,
                sample.loss_mask,
                counts,
                processor.image_token_id,
                processor.image_pieces(sample.input_ids),
            )
        except ValueError as err:
            marker = processor.image_markup.marker
            raise DataError(
                f"{row_name(dataset, sample.row, source)}: {err} (each image needs one {marker!r} "
                "in the prompt: a {'type': 'image'} content part rendered by the chat template)"
            ) from err
        return replace(sample, input_ids=ids, loss_mask=mask, images=images)


def _attach_pair(sample, counts: list[int], processor: VisionProcessor, images: SampleImages | None):
    """Expand both sides of a pair; the images are in the shared prompt, which grows by the same count."""
    sides, pieces = {}, processor.image_pieces(sample.chosen_ids[: sample.prompt_len])
    for side in ("chosen_ids", "rejected_ids"):
        ids = getattr(sample, side)
        if any(t in (pieces[0], processor.image_token_id) for t in ids[sample.prompt_len :]):
            raise ValueError("an image placeholder is in a response; images must be in the prompt")
        sides[side], _ = expand_image_tokens(ids, [0] * len(ids), counts, processor.image_token_id, pieces)
    grown = sum(counts) + len(counts) * (len(pieces[1]) + len(pieces[2]) - 1)
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
