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


def decode_image(where: str, url: str, max_pixels: int):
    """The RGB PIL image of a data URI, its size checked from the header before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = base64.b64decode(url.partition(",")[2], validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(f"{where}: the image is not valid base64 ({err})", param="messages") from None
    try:
        with warnings.catch_warnings():  # opening reads the header only; the size is checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        with image:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestError(
                    f"{where}: the image is {width}x{height} = {width * height} pixels, over the server's "
                    f"--max_image_pixels {max_pixels}",
                    param="messages",
                )
            return image.convert("RGB")  # decodes every pixel now: a truncated image fails here
    except Image.DecompressionBombError as err:  # PIL's own (larger) limit, checked as it opens
        raise RequestError(
            f"{where}: the image is over the server's --max_image_pixels {max_pixels} ({err})",
            param="messages",
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise RequestError(
            f"{where}: not a readable {'/'.join(FORMATS)} image ({type(err).__name__}: {str(err)[:120]})",
            param="messages",
        ) from None


class ChatImages:
    """A vision model's image reading for chat requests: the limits, and the image processor that turns
    decoded images into the engine's pixel input."""

    def __init__(self, image_processor: Any, merge_size: int, limits: ImageLimits):
        self.image_processor, self.merge_size, self.limits = image_processor, merge_size, limits

    def check_count(self, count: int) -> None:
        if count > self.limits.max_images:
            raise RequestError(
                f"the messages hold {count} images, over the server's --max_images_per_request "
                f"{self.limits.max_images}",
                param="messages",
            )

    def pixel_input(self, parts: list[tuple[str, str]]):
        """``(where, url)`` per image, in placeholder order → the engine's ``MultiModalInput`` and each
        image's token count (its placeholder's expanded length)."""
        from tidal.rollout.runner.multimodal import (
            MultiModalInput,
        )  # not (yet) a public name of tidal.rollout

        images = [decode_image(where, url, self.limits.max_pixels) for where, url in parts]
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except Exception as err:  # e.g. an image smaller than a patch, or an extreme aspect ratio
            raise RequestError(f"the image processor rejected an image: {err}", param="messages") from None
        grid = out["image_grid_thw"].long()
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        return MultiModalInput(pixel_values=out["pixel_values"], image_grid_thw=grid), counts
