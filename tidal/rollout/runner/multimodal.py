"""Images in the rollout engine's requests: the typed input a caller passes, and what a sequence keeps.

A request's images come as a ``MultiModalInput``: PIL images (the engine's image processor turns them
into pixels), or the processor's own output (``pixel_values`` and ``image_grid_thw``, e.g. what a
trainer already computed). ``LLMEngine.generate(prompts, multi_modal=[...])`` and
``add_request(prompt, multi_modal=...)`` take one per prompt (None: text only).

The prompt holds each image's marker once, as the model's chat template renders it (Qwen-VL:
``<|image_pad|>``; Gemma 3: ``<start_of_image>``; Gemma 4: its image token), or is already expanded as
transformers' processor lays images out (the image token repeated to the image's count, its merged patch
grid ``t * h * w / merge_size²``; Gemma: between ``<start_of_image>``/``<end_of_image>``, Gemma 3 with
newlines around). ``prepare_images`` expands the former through ``tidal.data.vision``'s
``expand_request_images`` (the engine passes the family's ``ImageMarkup``; how an expanded prompt is told
apart: that function's doc) and keeps the latter.

What a sequence keeps (``PromptImages``, in ``Sequence.mm``, shared by the n samples of a prompt): the
pixels and grids, the multimodal rotary positions of the prompt (``mrope_positions``: Qwen's M-RoPE, a
(temporal, height, width) triple per token, computed once at admission) and the delta that decode
positions continue with (``max position + 1 - prompt length``), and the span of each image's placeholder
tokens with its content hash (which key the prefix cache's blocks: ``PromptImages.block_key``; hashed
when the cache first reads them, so an engine without prefix caching never hashes pixels).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

# Fixed- and variable-size image processors (Gemma 3/4): defined with the data path, used by the models.
from tidal.data.image_processors import (  # noqa: F401 (re-exported)
    FixedSizeImageProcessor,
    VariableSizeImageProcessor,
    fixed_size_grid,
    fixed_size_processor,
    images_to_patch_rows,
    patch_rows_to_images,
    patch_rows_to_padded,
    variable_size_kernel,
)
from tidal.data.vision import expand_request_images


@dataclass(frozen=True)
class MultiModalInput:
    """One request's images: ``images`` (PIL images, in placeholder order) or the image processor's
    ``pixel_values`` ``[patches, C*T*P*P]`` with ``image_grid_thw`` ``[images, 3]``; not both."""

    images: tuple = ()
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))
        pixels = self.pixel_values is not None
        if pixels != (self.image_grid_thw is not None):
            raise ValueError("MultiModalInput: pixel_values and image_grid_thw come together")
        if pixels and self.images:
            raise ValueError("MultiModalInput: give images or pixel_values/image_grid_thw, not both")

    @property
    def num_images(self) -> int:
        if self.has_pixels:
            return int(self.image_grid_thw.shape[0])
        return len(self.images)

    @property
    def has_pixels(self) -> bool:
        return self.pixel_values is not None


@dataclass
class PromptImages:
    """What a sequence with images keeps (see the module doc). ``positions``: ``[3, prompt_len]`` int64."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [images, 3] int64
    positions: np.ndarray
    delta: int
    # one content hash per image (``image_hash``); None until the prefix cache first asks (``image_hashes``):
    # hashing 64 images of 1024 patch rows costs ~0.3 s of CPU per step, wasted with the cache off
    hashes: tuple[str, ...] | None = None
    # (first token index, token count) of each image's placeholder tokens in the prompt, in image order
    spans: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def positions_for(self, num_tokens: int) -> np.ndarray:
        """``[3, num_tokens]`` positions: the prompt's, then text positions shifted by ``delta`` (a
        preempted sequence recomputes its outputs too)."""
        prompt = self.positions.shape[1]
        if num_tokens <= prompt:
            return self.positions[:, :num_tokens]
        tail = np.arange(prompt, num_tokens, dtype=np.int64) + self.delta
        return np.concatenate([self.positions, np.broadcast_to(tail, (3, len(tail)))], axis=1)

    # -------------------------------------------------- prefix caching and chunked prefill
    def block_key(self, start: int, end: int) -> tuple:
        """What the prefix-cache key of the tokens ``[start, end)`` adds to their ids: for each image whose
        placeholder tokens it holds, (the image's content hash, the first and end offsets within its
        tokens); empty for text only (prefix_cache.py)."""
        return tuple(
            (int(self.image_hashes()[k], 16), max(start, s) - s, min(end, s + n) - s)
            for k, (s, n) in enumerate(self.spans)
            if s < end and start < s + n
        )

    def image_hashes(self) -> tuple[str, ...]:
        """Each image's content hash, computed on first use and kept."""
        if self.hashes is None:
            self.hashes = tuple(
                image_hash(self.image_pixels(k), self.grid_thw[k]) for k in range(len(self.spans))
            )
        return self.hashes

    def image_start(self, num_tokens: int) -> int:
        """``num_tokens``, or the first token of the image whose placeholders it would cut (a cached prefix
        or a chunk never ends inside an image, so each prefill computes whole images)."""
        return next((s for s, n in self.spans if s < num_tokens < s + n), num_tokens)

    def block_start(self, num_tokens: int, block_size: int) -> int:
        """The last block boundary at or before ``num_tokens`` that cuts no image (where a cached prefix may
        end). Moving back before an image can land inside an earlier one (two images less than a block
        apart), so it moves back until no image is cut."""
        boundary = num_tokens // block_size * block_size
        while (first := self.image_start(boundary)) != boundary:
            boundary = first // block_size * block_size
        return boundary

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk ``[start, end)`` ends so that it holds whole images: before an image it
        would cut, or after it when the image starts the chunk (the chunk then exceeds its token budget
        by at most that image)."""
        cut = self.image_start(end)
        if cut > start or cut == end:
            return cut
        return next(s + n for s, n in self.spans if s == cut)

    def images_within(self, start: int, end: int) -> list[int]:
        """The images whose placeholder tokens all lie in ``[start, end)``."""
        return [k for k, (s, n) in enumerate(self.spans) if start <= s and s + n <= end]

    def image_pixels(self, k: int) -> torch.Tensor:
        """Image ``k``'s rows of ``pixel_values`` (its ``t * h * w`` patches)."""
        patches = self.grid_thw.prod(-1).tolist()
        first = sum(patches[:k])
        return self.pixel_values[first : first + patches[k]]


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a vision-language config."""

    image_token_id: int
    merge_size: int
    # False: plain 1-D positions (Gemma 3: an image's tokens count on like text, see ``fixed_size_grid``)
    mrope: bool = True

    @classmethod
    def from_hf_config(cls, hf_config) -> VisionSpec | None:
        vision = getattr(hf_config, "vision_config", None)
        token = getattr(hf_config, "image_token_id", None)
        if vision is None or token is None:
            return None
        fixed = fixed_size_grid(hf_config)
        if fixed is not None:
            return cls(int(token), fixed[1], mrope=False)
        if variable_size_kernel(hf_config) is not None:
            return cls(int(token), variable_size_kernel(hf_config), mrope=False)
        return cls(int(token), int(getattr(vision, "spatial_merge_size", 1)))


def mrope_positions(ids: Seq[int], grids: torch.Tensor, spec: VisionSpec) -> tuple[np.ndarray, int]:
    """Qwen-VL's multimodal rotary positions of one prompt: ``[3, len(ids)]`` and the decode delta.

    Text tokens get the same position on all three axes, counting on from the last position; an image's
    ``h × w`` merged tokens (row-major) get (start, start + row, start + column) and advance the count by
    ``max(h, w)`` (a still image has one temporal step)."""
    out = np.empty((3, len(ids)), dtype=np.int64)
    current, i, image = 0, 0, 0
    token = spec.image_token_id
    while i < len(ids):
        if ids[i] != token:
            out[:, i] = current
            current, i = current + 1, i + 1
            continue
        t, h, w = (int(v) for v in grids[image])
        h, w = h // spec.merge_size, w // spec.merge_size
        n = t * h * w
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, i : i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current
        current += max(h, w)
        i, image = i + n, image + 1
    return out, int(out.max()) + 1 - len(ids) if len(ids) else 0


def image_hash(pixels: torch.Tensor, grid: torch.Tensor) -> str:
    """A content hash of one image's pixels and grid (what the prefix cache keys its tokens by)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(grid.cpu().numpy().astype(np.int64)).tobytes())
    digest.update(np.ascontiguousarray(pixels.detach().float().cpu().numpy()).tobytes())
    return digest.hexdigest()


def prepare_images(
    index: int,
    ids: list[int],
    mm: MultiModalInput,
    spec: VisionSpec,
    image_processor: Any,
    expand: Callable[[list[int], list[int]], list[int]] | None = None,
) -> tuple[list[int], PromptImages]:
    """The prompt's ids with its images laid out as the family's processor does and its ``PromptImages``;
    ``expand(ids, counts)`` makes the ids (default: ``tidal.data.vision.expand_request_images`` with the
    image token alone). ``ValueError`` naming request ``index`` when placeholders and images disagree."""
    if mm.has_pixels:
        pixels, grid = mm.pixel_values, mm.image_grid_thw.long()
    else:
        if image_processor is None:
            raise ValueError(
                f"request {index}: images need the model's image processor (a model folder with "
                "preprocessor_config.json, or LLMEngine(image_processor=...)); or pass pixel_values"
            )
        out = image_processor(images=list(mm.images), return_tensors="pt")
        pixels, grid = out["pixel_values"], out["image_grid_thw"].long()
    counts = (grid.prod(-1) // spec.merge_size**2).tolist()
    try:
        ids = (expand or partial(expand_request_images, image_token_id=spec.image_token_id))(ids, counts)
    except ValueError as err:
        raise ValueError(f"request {index}: {err}") from None
    if spec.mrope:
        positions, delta = mrope_positions(ids, grid, spec)
    else:  # every token, image or text, one position on
        positions, delta = np.broadcast_to(np.arange(len(ids), dtype=np.int64), (3, len(ids))).copy(), 0
    spans = image_spans(ids, counts, spec.image_token_id)
    return ids, PromptImages(pixels, grid, positions, delta, spans=spans)  # hashes: on first use


def image_spans(ids: Seq[int], counts: Seq[int], token: int) -> tuple[tuple[int, int], ...]:
    """(first index, count) of each image's placeholder tokens: image k takes the next ``counts[k]``
    placeholders, one run each (as ``mrope_positions`` reads them)."""
    where = [i for i, t in enumerate(ids) if t == token]
    firsts = np.cumsum([0, *counts[:-1]]).tolist() if counts else []
    return tuple((where[first], int(n)) for first, n in zip(firsts, counts, strict=True))


@dataclass
class PrefillImages:
    """A prefill step's image inputs (``ModelRunner`` passes them to a vision family's forward): the
    step's images' pixels and grids (sequences in step order), and the decode delta of every sampled
    sequence keyed by its first KV block (``first_blocks``), which decode steps look up."""

    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None
    first_blocks: list[int]
    deltas: list[int]


def prefill_images(groups: list[list]) -> tuple[np.ndarray, PrefillImages]:
    """The ``[3, tokens]`` positions of a prefill's groups (their first sequences' tokens, as the
    runner lays them out) and its ``PrefillImages``."""
    positions, pixels, grids, blocks, deltas = [], [], [], [], []
    for group in groups:
        seq = group[0]
        mm: PromptImages | None = seq.mm
        if mm is None:
            positions.append(np.broadcast_to(np.arange(seq.num_tokens, dtype=np.int64), (3, seq.num_tokens)))
        else:
            positions.append(mm.positions_for(seq.num_tokens))
            pixels.append(mm.pixel_values)
            grids.append(mm.grid_thw)
        for member in group:  # n samples may hold private copies of a short prompt's block
            blocks.append(member.block_table[0])
            deltas.append(0 if mm is None else mm.delta)
    step = PrefillImages(
        torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None, blocks, deltas
    )
    return np.concatenate(positions, axis=1), step


def context_prefill_images(
    groups: list[list], chunks: list[tuple[int, int]]
) -> tuple[np.ndarray, PrefillImages]:
    """``prefill_images`` for a prefill with context (prefix caching, chunked prefill): each group computes
    its tokens ``[start, end)`` only. The vision tower runs on the images whose tokens are all in that range;
    those before it are cached (their features live on in the cached K/V), and none is cut by the range
    (``PromptImages.image_start``, ``chunk_end``)."""
    positions, pixels, grids, blocks, deltas = [], [], [], [], []
    for group, (start, end) in zip(groups, chunks, strict=True):
        mm: PromptImages | None = group[0].mm
        if mm is None:
            positions.append(np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start)))
        else:
            positions.append(mm.positions_for(end)[:, start:end])
            for k in mm.images_within(start, end):
                pixels.append(mm.image_pixels(k))
                grids.append(mm.grid_thw[k : k + 1])
        for member in group:  # its first block is its own (BlockManager's private_first_block)
            blocks.append(member.block_table[0])
            deltas.append(0 if mm is None else mm.delta)
    step = PrefillImages(
        torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None, blocks, deltas
    )
    return np.concatenate(positions, axis=1), step
