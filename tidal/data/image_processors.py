"""Image processors wrapped to give Qwen-VL-style patch rows and grids, for vision towers that take whole
fixed-size images (Gemma 3) or padded variable-size patch sets (Gemma 4): the engine, the trainers, the
experience path and ``tidal serve`` then carry every family's images in one layout (``[patches, 3*P*P]``
rows plus a ``(t, h, w)`` grid per image). ``fixed_size_processor`` picks the wrapper a config needs; the
inverse maps (``patch_rows_to_images``, ``patch_rows_to_padded``) rebuild each tower's own input.

It lives in ``tidal.data`` because the trainers' data path wraps the processor before any engine exists;
``tidal.rollout.runner.multimodal`` re-exports it for the engine's model files.
"""

from __future__ import annotations

from typing import Any

import torch

# ------------------------------------------------------------- fixed-size images (Gemma 3)
# Gemma 3's image processor resizes every image to one square size and gives ``[images, 3, S, S]``
# pixels, and its projector average-pools the ``S/P × S/P`` patch features into ``mm_tokens_per_image``
# tokens. The engine and the trainers carry images as Qwen-VL's patch rows with a grid per image, so
# such a processor is wrapped (``FixedSizeImageProcessor``): each image becomes its ``(S/P)²`` patches,
# rows of ``3 * P * P`` values (row-major over the patch grid), with the grid ``(1, S/P, S/P)``, and the
# pooling kernel ``S/P / sqrt(mm_tokens_per_image)`` plays the merge size, so that grid / merge² is the
# image's token count. ``patch_rows_to_images`` undoes it exactly (a permutation of the same values).


def fixed_size_grid(hf_config) -> tuple[int, int] | None:
    """(patch size, pooling kernel) of a fixed-size-image config (one with ``mm_tokens_per_image``:
    Gemma 3), or None (Qwen-VL's patch grids)."""
    tokens = getattr(hf_config, "mm_tokens_per_image", None)
    vision = getattr(hf_config, "vision_config", None)
    if tokens is None or vision is None:
        return None
    patches = int(vision.image_size) // int(vision.patch_size)
    side = round(int(tokens) ** 0.5)
    if side * side != int(tokens) or patches % side:
        raise ValueError(
            f"mm_tokens_per_image={tokens} must be a square whose side divides the {patches} patches per side"
        )
    return int(vision.patch_size), patches // side


def images_to_patch_rows(pixels: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, C, S, S]`` pixels -> ``[N * (S/P)², C * P * P]`` patch rows and the ``[N, 3]`` grids."""
    n, c, height, width = pixels.shape
    gh, gw = height // patch, width // patch
    rows = pixels.reshape(n, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5).reshape(n * gh * gw, -1)
    return rows, torch.tensor([[1, gh, gw]] * n, dtype=torch.int64)


def patch_rows_to_images(rows: torch.Tensor, grid: torch.Tensor, patch: int) -> torch.Tensor:
    """The inverse of ``images_to_patch_rows``: ``[N, C, S, S]`` pixels (every grid the same)."""
    n, gh, gw = grid.shape[0], int(grid[0, 1]), int(grid[0, 2])
    c = rows.shape[-1] // (patch * patch)
    images = rows.reshape(n, gh, gw, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return images.reshape(n, c, gh * patch, gw * patch)


class WrappedProcessor:
    """A wrapped image processor: what the subclass does not define (``save_pretrained``, its settings) is
    the wrapped ``self.processor``'s."""

    processor: Any

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "processor":  # no recursion before __init__ set it
            raise AttributeError(name)
        return getattr(self.processor, name)


class FixedSizeImageProcessor(WrappedProcessor):
    """A fixed-size image processor (Gemma 3's) giving patch rows and grids (see above); everything else
    (``save_pretrained``, its settings) is the wrapped processor's."""

    def __init__(self, processor: Any, patch: int, kernel: int):
        if getattr(processor, "do_pan_and_scan", False):
            raise ValueError("do_pan_and_scan (extra image crops) is not supported: set it to false")
        self.processor, self.patch_size, self.merge_size = processor, patch, kernel

    def __call__(self, images, return_tensors: str = "pt", **kwargs) -> dict[str, torch.Tensor]:
        out = self.processor(images=images, return_tensors="pt", **kwargs)
        rows, grid = images_to_patch_rows(out["pixel_values"], self.patch_size)
        return {"pixel_values": rows, "image_grid_thw": grid}

    def get_number_of_image_patches(self, height: int, width: int, kwargs: dict | None = None) -> int:
        """Patches of any image (every image is resized to the same square)."""
        size = self.processor.size
        return (size["height"] // self.patch_size) * (size["width"] // self.patch_size)


def fixed_size_processor(processor: Any, hf_config) -> Any:
    """``processor`` wrapped as a ``FixedSizeImageProcessor`` for a fixed-size-image config, or as a
    ``VariableSizeImageProcessor`` for Gemma 4's (once), else as it is."""
    if processor is None or isinstance(processor, (FixedSizeImageProcessor, VariableSizeImageProcessor)):
        return processor
    fixed = fixed_size_grid(hf_config)
    if fixed is not None:
        return FixedSizeImageProcessor(processor, *fixed)
    if variable_size_kernel(hf_config) is not None:
        return VariableSizeImageProcessor(processor)
    return processor


# ------------------------------------------------------------- variable-size images (Gemma 4)
# Gemma 4's processor resizes each image (aspect ratio kept) to a patch grid whose sides are multiples of
# the pooling kernel k and gives ``[N, max_patches, P*P*3]`` patches (row-major, then zero padding) with
# their ``(x, y)`` positions (-1 for padding); the tower pools each k×k block into one token. Wrapped
# (``VariableSizeImageProcessor``), an image is its real patches as rows with the grid ``(1, rows, cols)``
# and k as the merge size; ``patch_rows_to_padded`` rebuilds the padded batch and positions for the tower.


def variable_size_kernel(hf_config) -> int | None:
    """The pooling kernel of a Gemma 4 vision config (variable-size images), or None."""
    vision = getattr(hf_config, "vision_config", None)
    if getattr(hf_config, "model_type", None) != "gemma4" or vision is None:
        return None
    return int(vision.pooling_kernel_size)


class VariableSizeImageProcessor(WrappedProcessor):
    """Gemma 4's image processor giving patch rows and grids (see above); the rest is the wrapped one's."""

    def __init__(self, processor: Any):
        self.processor, self.merge_size = processor, int(processor.pooling_kernel_size)

    def __call__(self, images, return_tensors: str = "pt", **kwargs) -> dict[str, torch.Tensor]:
        out = self.processor(images=images, return_tensors="pt", **kwargs)
        rows, grids = [], []
        for patches, positions in zip(out["pixel_values"], out["image_position_ids"], strict=True):
            real = (positions != -1).all(-1)
            rows.append(patches[real])
            cols, height = (int(v) + 1 for v in positions[real].max(0).values)
            grids.append([1, height, cols])
        return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor(grids, dtype=torch.int64)}

    def get_number_of_image_patches(self, height: int, width: int, kwargs: dict | None = None) -> int:
        """Patches of an image of that size after the processor's aspect-ratio-preserving resize."""
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        p, k = self.processor.patch_size, self.merge_size
        h, w = get_aspect_ratio_preserving_size(height, width, p, self.processor.max_soft_tokens * k * k, k)
        return (h // p) * (w // p)


def patch_rows_to_padded(
    rows: torch.Tensor, grid: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``VariableSizeImageProcessor``: ``[N, L, D]`` patches padded with zeros to the
    longest image (rounded up to ``multiple``) and their ``[N, L, 2]`` ``(x, y)`` positions (-1: padding)."""
    counts = grid.prod(-1).tolist()
    length = -(-max(counts) // multiple) * multiple
    pixels = rows.new_zeros(len(counts), length, rows.shape[-1])
    positions = torch.full((len(counts), length, 2), -1, dtype=torch.int64, device=rows.device)
    first = 0
    for i, (n, (_, height, cols)) in enumerate(zip(counts, grid.tolist(), strict=True)):
        pixels[i, :n] = rows[first : first + n]
        y, x = torch.meshgrid(torch.arange(height), torch.arange(cols), indexing="ij")
        positions[i, :n] = torch.stack([x.reshape(-1), y.reshape(-1)], -1).to(rows.device)
        first += n
    return pixels, positions
