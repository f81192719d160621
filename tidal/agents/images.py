"""Images in agent observations (``MultiTurnAgentExecutor`` on a vision-language policy).

OpenRLHF's ``step`` returns its ``environment_feedback`` as text. tidal also takes a list of content
parts, in the shape of a chat message's content::

    {"environment_feedback": [
        {"type": "text", "text": "\\nHere is the board:"},
        {"type": "image", "image": pil_image},          # or PNG/JPEG bytes, a data URI, a file path
        {"type": "text", "text": "\\nYour move:"},
     ], "rewards": 0.0, "done": False}

Each image becomes what the chat template writes for ``{"type": "image"}`` (Qwen-VL:
``<|vision_start|><|image_pad|><|vision_end|>``), its placeholder already repeated to the image's token
count (Gemma 3/4: what transformers' processor makes of it, ``tidal.data.vision.ImageMarkup``), so the ids the engine generates from and the trainer scores are the same. A prompt's own images
(``tidal ppo --max_images_per_prompt``: ``tidal.agents.base.PROMPT_IMAGES`` while its episodes run) are
the episode's first images. The executor keeps the episode's images (``ObservationImages``): every later turn's request carries all of them
(``MultiModalInput`` of their pixels, computed once by the engine's image processor), and the finished
trajectory keeps them (``Trajectory.images``) for the trainer's forward (``tidal.experience.images``).
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.agents.base import AgentError

# The markers around an image's placeholders in the engine's vision families (Qwen2-VL and Qwen2.5-VL).
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def feedback_parts(feedback: Any) -> list[tuple[str, Any]]:
    """``environment_feedback`` as ``("text", str)`` / ``("image", value)`` parts; ``TypeError`` when it
    is neither a str nor a list of text and image parts."""
    if isinstance(feedback, str):
        return [("text", feedback)]
    if not isinstance(feedback, list):
        raise TypeError(
            f"environment_feedback must be a str, got {type(feedback).__name__} (or a list of text and image "
            "content parts)"
        )
    parts = []
    for i, part in enumerate(feedback):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(("text", part["text"]))
        elif kind == "image" and part.get("image") is not None:
            parts.append(("image", part["image"]))
        else:
            raise TypeError(
                f"environment_feedback[{i}] must be {{'type': 'text', 'text': str}} or "
                f"{{'type': 'image', 'image': PIL image | bytes | data URI | path}}, got {str(part)[:80]}"
            )
    return parts


def has_images(parts: list[tuple[str, Any]]) -> bool:
    return any(kind == "image" for kind, _ in parts)


class ObservationImages:
    """One episode's images: each one's pixels and grid, in placeholder order, and how to write them."""

    def __init__(self, engine: Any, tokenizer, where: str):
        vision = getattr(engine, "vision", None)
        processor = getattr(engine, "image_processor", None)
        if vision is None or processor is None:
            raise AgentError(
                f"{where}: environment_feedback holds an image but the policy's engine takes no images "
                "(a vision-language --pretrain of the engine's vision families, e.g. Qwen2.5-VL, does)"
            )
        self.processor, self.merge_size, self.image_token_id = (
            processor,
            vision.merge_size,
            vision.image_token_id,
        )
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.markup, self.before, self.after = _image_pieces(engine, tokenizer, where)
        self.pixels: list[torch.Tensor] = []
        self.grids: list[torch.Tensor] = []
        self.spans: list[tuple[int, int]] = []  # each image's [start, end) in the trajectory's tokens

    def add(self, value: Any, position: int, where: str) -> tuple[list[int], str]:
        """Decode and process one image whose tokens start at ``position`` of the trajectory; its token
        ids (markers and expanded placeholders) and text."""
        from tidal.data.images import ImageError, image_ref, open_image

        try:
            image = open_image(image_ref(value))
        except ImageError as err:
            raise AgentError(f"{where}: an environment_feedback image {err}") from err
        out = self.processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"].long()
        self.pixels.append(out["pixel_values"])
        self.grids.append(grid)
        count = int(grid[0].prod()) // self.merge_size**2
        ids = [*self.before, *[self.image_token_id] * count, *self.after]
        self.spans.append((position, position + len(ids)))
        if self.markup is None:
            return ids, VISION_START + self.image_token * count + VISION_END
        return ids, self.markup.image_text(count)

    def add_prompt_images(self, prompt, token_ids: list[int], where: str) -> None:
        """The prompt's images (``prompt``: its ``MultiModalInput``, as the rollout made it) at their
        placeholders in the episode's first token ids (each a run of image tokens of the image's count)."""
        runs, start = [], None
        for i, token in enumerate([*token_ids, -1]):
            if token == self.image_token_id and start is None:
                start = i
            elif token != self.image_token_id and start is not None:
                runs.append((start, i))
                start = None
        grids = prompt.image_grid_thw.long()
        counts = [int(g.prod()) // self.merge_size**2 for g in grids]
        if [end - begin for begin, end in runs] != counts:
            raise AgentError(
                f"{where}: the observation from reset holds {len(runs)} image placeholder run(s) of "
                f"{[e - b for b, e in runs]} tokens, but the prompt's {len(counts)} image(s) take {counts}: "
                "reset must keep the prompt's image placeholders as they are"
            )
        self.pixels.append(prompt.pixel_values)
        self.grids.append(grids)
        # with the ids around them (their start and end markers)
        self.spans += [(begin - len(self.before), end + len(self.after)) for begin, end in runs]

    def fit(self, length: int) -> int:
        """The length to cut a trajectory of ``length`` tokens (already cut at the length limit) to, so
        that no image is left in part; the images cut off are dropped."""
        for k, (start, end) in enumerate(self.spans):
            if end > length:
                del self.pixels[k:], self.grids[k:], self.spans[k:]
                return start
        return length

    def __len__(self) -> int:
        return len(self.grids)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(pixel_values, image_grid_thw)`` of every image so far (``Trajectory.images``), None if none."""
        if not self.grids:
            return None
        return torch.cat(self.pixels), torch.cat(self.grids)

    def engine_input(self):
        """The engine's ``MultiModalInput`` of every image so far (None without images)."""
        from tidal.rollout.runner.multimodal import (
            MultiModalInput,
        )  # not (yet) a public name of tidal.rollout

        tensors = self.tensors()
        return (
            None if tensors is None else MultiModalInput(pixel_values=tensors[0], image_grid_thw=tensors[1])
        )


def _image_pieces(engine: Any, tokenizer, where: str) -> tuple[Any, list[int], list[int]]:
    """How a feedback image is written: the family's ``ImageMarkup`` (None for Qwen-VL) and the ids
    before and after its image tokens: what transformers' processor makes of the chat template's
    image (Gemma 3: ``\\n\\n<start_of_image>`` … ``<end_of_image>\\n\\n``, Gemma 4: no newlines; Qwen-VL:
    its template's ``<|vision_start|>`` … ``<|vision_end|>``)."""
    from tidal.data.vision import image_markup

    hf_config = getattr(engine, "hf_config", None)
    markup = image_markup(hf_config, tokenizer) if hf_config is not None else None
    if markup is not None and markup.open:
        _, before, after = markup.pieces(tokenizer)
        return markup, before, after
    markers = [tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END)]
    if any(m is None or m == tokenizer.unk_token_id for m in markers):
        raise AgentError(f"{where}: the tokenizer has no {VISION_START}/{VISION_END} tokens for an image")
    return None, markers[:1], markers[1:]


def encode_feedback(
    parts: list[tuple[str, Any]], tokenizer, images: ObservationImages | None, position: int, where: str
) -> tuple[list[int], str]:
    """The feedback's token ids and text (each image's markers and placeholders in place); ``position``:
    where the feedback starts in the trajectory."""
    ids, text = [], ""
    for kind, value in parts:
        if kind == "text":
            ids += tokenizer(value, add_special_tokens=False)["input_ids"]
            text += value
        else:
            image_ids, image_text = images.add(value, position + len(ids), where)
            ids += image_ids
            text += image_text
    return ids, text
