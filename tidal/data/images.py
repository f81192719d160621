"""Images of dataset rows: what a row's image value may be, how it becomes a PIL image, and the check
of every row's images before training starts.

A row's images are the list under ``--image_key`` (default ``images``; OpenRLHF's row format:
``{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}],
"images": ["/path/img.png"], "label": "3"}``). Each entry may be

- a file path; a relative one is read beside the data file the row came from (a folder dataset:
  inside the folder), else beside the working directory;
- a data URI (``data:image/png;base64,...``) or a bare base64 string;
- raw bytes (a parquet/arrow binary column), or the ``{"bytes": ..., "path": ...}`` struct that the
  ``datasets`` ``Image`` feature stores;
- a PIL image (rows built in Python).

URLs are refused (tidal reads local data only). ``check_image_rows`` opens and decodes every image
of every row up front and reports the bad ones in one line naming the file, the row and the image
(OpenRLHF skips such rows silently, mid-run). A row with more images than ``--max_images_per_prompt``
is an error, as is any image when the flag is 0 (text only), naming the flag. What a sample keeps is
an ``ImageRef`` per image (the resolved path, or the encoded bytes), decoded again when a batch is
collated (``open_image``), so a dataset's pixels are never all in memory.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.config.data import VisionConfig
from tidal.data.errors import DataError
from tidal.data.rows import MAX_REPORTED_ROWS, row_name, row_source

if TYPE_CHECKING:
    import datasets
    from PIL import Image

_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")
_MIN_BASE64 = 32  # shorter strings are names of files, not encoded images


class ImageError(ValueError):
    """Why one image value cannot be read (the caller names its row and file)."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a sample: a file path, or the encoded bytes of an image held in the dataset."""

    path: str | None = None
    data: bytes | None = None

    @property
    def label(self) -> str:
        return self.path if self.path is not None else f"{len(self.data or b'')} bytes of image data"


def image_ref(value: Any, base_dir: Path | None = None) -> ImageRef:
    """The ``ImageRef`` of one image value of a row (see the module doc); ``ImageError`` if it is none."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(data=bytes(value))
    if not isinstance(value, str):
        if type(value).__module__.startswith("PIL."):
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return ImageRef(data=buffer.getvalue())
        raise ImageError(f"is a {type(value).__name__}, expected a path, base64 string or bytes")
    text = value.strip()
    if text.startswith("data:"):
        head, _, payload = text.partition(",")
        if ";base64" not in head:
            raise ImageError(f"data URI {head[:40]!r} is not base64-encoded")
        return ImageRef(data=_b64(payload))
    if re.match(r"^[a-z]+://", text):
        raise ImageError(f"{text[:80]} is a URL: tidal reads local images only; download it first")
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists() and len(text) >= _MIN_BASE64 and _BASE64.fullmatch(text):
        return ImageRef(data=_b64(text))
    return ImageRef(path=str(path))


def _b64(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"is not valid base64 ({err})") from err


def open_image(ref: ImageRef) -> Image.Image:
    """Decode ``ref`` to an RGB PIL image; ``ImageError`` for a missing file or undecodable data."""
    from PIL import Image, UnidentifiedImageError

    if ref.path is not None and not Path(ref.path).is_file():
        raise ImageError(f"{ref.path}: no such file")
    try:
        with Image.open(ref.path if ref.path is not None else io.BytesIO(ref.data or b"")) as image:
            return image.convert("RGB")  # decodes every pixel now: a truncated file fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise ImageError(f"{ref.label}: not a readable image ({type(err).__name__}: {err})") from err


def row_image_values(value: Any) -> list:
    """A row's image column value as a list (None and a missing value: no images; one value: one)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def base_dir(dataset: datasets.Dataset, row: int) -> Path | None:
    """Where a relative image path of ``row`` is read from: its data file's folder (or the folder
    dataset itself)."""
    source = row_source(dataset, row)
    if source is None:
        return None
    path = Path(source).expanduser()
    return path if path.is_dir() else path.parent


@dataclass(frozen=True)
class RowImages:
    """One row's images: where to read each, and (when measured) the tokens each becomes."""

    refs: tuple[ImageRef, ...] = ()
    token_counts: tuple[int, ...] = ()


def check_image_rows(
    dataset: datasets.Dataset,
    cfg: VisionConfig,
    source: str,
    measure: Callable[[list], list[int]] | None = None,
) -> list[RowImages]:
    """Each row's ``RowImages``, after checking every row: one ``DataError`` names the first bad rows
    (file, row, image) in one line. Every image is decoded once here; ``measure`` (a processor's
    ``token_counts``) turns a row's decoded images into their token counts, and may reject one with a
    ``ValueError``. Decoded pixels are not kept. A dataset without the image column has no images."""
    if cfg.image_key not in dataset.column_names:
        return [RowImages()] * len(dataset)

    def check(i: int, value: Any) -> tuple[RowImages, str | None]:
        values = row_image_values(value)
        problem = _count_problem(len(values), cfg)
        if not values or problem is not None:
            return RowImages(), problem
        return _read_row(values, base_dir(dataset, i), measure)

    # decoding releases the GIL: threads read rows in parallel; results keep the rows' order
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        checked = list(pool.map(check, range(len(dataset)), dataset[cfg.image_key]))
    rows = [row for row, _ in checked]
    problems = [f"{row_name(dataset, i, source)}: {p}" for i, (_, p) in enumerate(checked) if p]
    if problems:
        more = len(problems) - MAX_REPORTED_ROWS
        tail = f"; and {more} more" if more > 0 else ""
        shown = "; ".join(problems[:MAX_REPORTED_ROWS])
        raise DataError(f"{len(problems)} row(s) with bad images in {source}: {shown}{tail}")
    return rows


def _read_row(values: list, folder: Path | None, measure) -> tuple[RowImages, str | None]:
    """A row's images read and measured, or why one cannot be (naming the image)."""
    refs, images = [], []
    for j, item in enumerate(values):
        try:
            refs.append(image_ref(item, folder))
            images.append(open_image(refs[-1]))
        except ImageError as err:
            return RowImages(), f"image {j + 1}: {err}"
    if measure is None:
        return RowImages(tuple(refs)), None
    try:
        return RowImages(tuple(refs), tuple(measure(images))), None
    except ValueError as err:  # e.g. an aspect ratio the image processor cannot resize
        return RowImages(), f"the image processor cannot take its images ({err})"


def _count_problem(n: int, cfg: VisionConfig) -> str | None:
    if n and cfg.max_images_per_prompt == 0:
        return (
            f"has {n} image(s) under {cfg.image_key!r}, but --max_images_per_prompt is 0 (text only): "
            "set it to the most images a row has, with a vision-language model"
        )
    if n > cfg.max_images_per_prompt:
        return f"has {n} images, more than --max_images_per_prompt {cfg.max_images_per_prompt}"
    return None
