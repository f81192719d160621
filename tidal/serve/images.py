"""Images in chat requests (``tidal serve`` on a vision-language model): OpenAI ``image_url`` parts.

A message's content may hold ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
parts beside its text parts. Each becomes ``{"type": "image"}`` for the chat template (which writes the
model's placeholder, Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``), and its picture goes
to the engine with the prompt as a ``MultiModalInput`` of the image processor's pixels (computed here,
on the server's parse thread, so the engine thread only runs the model).

What is accepted, and why:

- data URIs only (base64 PNG, JPEG, WebP or GIF; the first frame of an animation). An ``http(s)``
  URL is refused: the server fetches nothing from the network (a fetch would let any client make the
  server reach any address, and hold a request open for as long as the remote host likes).
- ``detail`` absent or ``"auto"``: the image processor always decides the resolution (its
  ``min_pixels``/``max_pixels``); ``"low"``/``"high"`` would be ignored, so they are refused.
- at most ``ImageLimits.max_images`` images a request (``--max_images_per_request``), each at most
  ``ImageLimits.max_pixels`` pixels (``--max_image_pixels``). The size is read from the image's header
  before a pixel is decoded, so a decompression bomb (a few KB of PNG that decodes to gigabytes) is
  refused without being decoded. The request body limit (``--max_request_bytes``) bounds the rest.

Every refusal is a ``RequestError`` (400) naming the message and part.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

from tidal.serve.schema import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what OpenAI's vision endpoints take
_DATA_URI = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """How many images one chat request may carry, and how many pixels each may decode to."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096


def image_part_url(where: str, part: dict) -> str:
    """The data URI of one ``image_url`` content part (``where`` names it in errors)."""
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the URL itself
        image_url = {"url": image_url}
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise RequestError(
            f"{where}: an image_url part must be {{'image_url': {{'url': ...}}}}", param="messages"
        )
    if set(image_url) - {"url", "detail"}:
        raise RequestError(f"{where}.image_url may only hold 'url' and 'detail'", param="messages")
    if image_url.get("detail", "auto") != "auto":
        raise RequestError(
            f"{where}.image_url.detail: only 'auto' is supported (the image processor sets the resolution)",
            param="messages",
        )
    url = image_url["url"]
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url):
        raise RequestError(
            f"{where}: image URLs ({url[:60]}) are not fetched (tidal serve reaches no network); "
            "send the image as a data URI: data:image/png;base64,...",
            param="messages",
        )
    if not _DATA_URI.match(url):
        raise RequestError(
            f"{where}: the image url must be a base64 data URI (data:image/png;base64,...), got {url[:40]!r}",
            param="messages",
        )
    return url


def open_image(where: str, url: str, max_pixels: int):
    """The PIL image of a data URI, opened (its header read) but not decoded; its size checked."""
    from PIL import Image

    try:
        data = base64.b64decode(url.partition(",")[2], validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(f"{where}: the image is not valid base64 ({err})", param="messages") from None
    try:
        with warnings.catch_warnings():  # opening reads the header only; the size is checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as err:  # PIL's own (larger) limit, checked as it opens
        raise RequestError(
            f"{where}: the image is over the server's --max_image_pixels {max_pixels} ({err})",
            param="messages",
        ) from None
    except Exception as err:  # UnidentifiedImageError, OSError, ...: not an image PIL can read
        raise _unreadable(where, err) from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise RequestError(
            f"{where}: the image is {width}x{height} = {width * height} pixels, over the server's "
            f"--max_image_pixels {max_pixels}",
            param="messages",
        )
    return image


def decode_image(where: str, image):
    """The RGB pixels of an opened image (every pixel decoded now: a truncated image fails here)."""
    try:
        with image:
            return image.convert("RGB")
    except Exception as err:  # OSError, ValueError, SyntaxError, ...: a corrupt or truncated image
        raise _unreadable(where, err) from None


def _unreadable(where: str, err: Exception) -> RequestError:
    return RequestError(
        f"{where}: not a readable {'/'.join(FORMATS)} image ({type(err).__name__}: {str(err)[:120]})",
        param="messages",
    )


@dataclass
class OpenedImages:
    """A request's images, opened but not decoded, and the tokens each will take (from its size)."""

    wheres: list[str]
    images: list
    counts: list[int]


class ChatImages:
    """A vision model's image reading for chat requests: the limits, and the image processor that turns
    decoded images into the engine's pixel input. ``open`` reads headers only, so a request too long for
    the context is refused before any pixel is decoded; ``pixel_input`` decodes and processes."""

    def __init__(self, image_processor: Any, merge_size: int, limits: ImageLimits, markup: Any = None):
        self.image_processor, self.merge_size, self.limits = image_processor, merge_size, limits
        self.markup = markup  # the family's tidal.data.vision.ImageMarkup (None: the image token repeated)

    def expand_text(self, text: str, opened: OpenedImages) -> str:
        """The rendered chat ``text`` with each image's marker laid out as the model's processor does
        (``ImageMarkup.expand_text``: Gemma's begin/end of image around its tokens); an already laid out
        text, or one without a markup, is left to the engine (which expands the image token alone)."""
        if self.markup is None:
            return text
        try:
            return self.markup.expand_text(text, opened.counts)
        except ValueError as err:  # e.g. a template that drops image parts
            raise RequestError(f"the chat template's images do not match the request's: {err}") from None

    def check_count(self, count: int) -> None:
        if count > self.limits.max_images:
            raise RequestError(
                f"the messages hold {count} images, over the server's --max_images_per_request "
                f"{self.limits.max_images}",
                param="messages",
            )

    def open(self, parts: list[tuple[str, str]]) -> OpenedImages:
        """``(where, url)`` per image, in placeholder order → the opened images and their token counts."""
        self.check_count(len(parts))
        images = [open_image(where, url, self.limits.max_pixels) for where, url in parts]
        return OpenedImages([w for w, _ in parts], images, [self._tokens(im) for im in images])

    def _tokens(self, image) -> int:
        """The image's token count from its size (the processor's resize rule), without decoding it."""
        width, height = image.size
        try:
            patches = self.image_processor.get_number_of_image_patches(height, width)
        except Exception as err:  # e.g. an image smaller than a patch, or an extreme aspect ratio
            raise RequestError(f"the image processor rejected a {width}x{height} image: {err}") from None
        return int(patches) // self.merge_size**2

    def pixel_input(self, opened: OpenedImages):
        """The engine's ``MultiModalInput`` of the opened images (decoded and processed now)."""
        from tidal.rollout.runner.multimodal import (
            MultiModalInput,
        )  # not (yet) a public name of tidal.rollout

        images = [decode_image(where, im) for where, im in zip(opened.wheres, opened.images, strict=True)]
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except Exception as err:  # e.g. an image smaller than a patch, or an extreme aspect ratio
            raise RequestError(f"the image processor rejected an image: {err}", param="messages") from None
        grid = out["image_grid_thw"].long()
        if (grid.prod(-1) // self.merge_size**2).tolist() != opened.counts:  # the size rule disagreed
            raise RequestError("the image processor's token counts differ from the images' sizes")
        return MultiModalInput(pixel_values=out["pixel_values"], image_grid_thw=grid)
