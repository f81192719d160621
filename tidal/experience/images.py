"""Images in RL (``tidal ppo --max_images_per_prompt N`` with a vision-language policy).

The path of a prompt's images, from the dataset row to the trainer's forward:

1. ``attach_prompt_images`` (when prompts load): every row's images are read and checked up front
   (``tidal.data.images.check_image_rows``, one line naming the bad row and file), kept as ``ImageRef``s
   on the ``PromptSample``, and each image's one placeholder in the rendered prompt text is repeated to
   the image's token count, so that the ids the agent executor encodes, the engine generates from and the
   trainer scores are the same (the engine takes pre-expanded placeholders as they are).
2. ``run_with_images`` (at each rollout, where the engine is: on the trainer's device, or in an engine
   process of its own, to which the prompts' ``ImageRef``s travel with their texts): the batch's images are
   decoded and turned into pixels once by the engine's image processor (``rollout_images``);
   ``ImagePromptEngine`` hands them to ``LLMEngine.generate`` with their prompts (the executor calls
   ``generate`` as for text); ``attach_trajectory_images`` gives each of a prompt's n trajectories its
   prompt's pixels (which travel back with the trajectories).
3. ``ExperienceImages`` (in ``Experience.images``): each row's ``(pixel_values, image_grid_thw)`` (None for
   a text row), selected and concatenated with the rows; ``batch`` gives a micro-batch's
   ``pixel_values``/``image_grid_thw``/``image_counts``, which ``tidal.models.vision.vision_kwargs`` turns
   into the forward's inputs and M-RoPE positions (old/reference log-probs and the update alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from tidal.data.errors import DataError


def image_prompts(run, dataset, samples: list, tokenizer, source: str):
    """``tidal ppo``'s prompts with their images (``samples``: one per row, no length limit applied yet):
    the image flags checked against the policy, images attached and placeholders expanded, then prompts
    over ``--prompt_max_len`` tokens (image tokens included) skipped. Returns (samples, ``SkipStats``)."""
    from tidal.data.sft import SkipStats
    from tidal.data.templates import tokenize_texts
    from tidal.data.vision import ImageSamples, load_vision_processor

    processor = load_vision_processor(run.actor.pretrain, tokenizer)
    ImageSamples(run.vision, processor).check(
        run.actor.pretrain,
        ring_attn_size=run.dist.ring_attn_size,
        tensor_parallel_size=run.dist.ds_tensor_parallel_size,
    )
    samples = attach_prompt_images(dataset, samples, run.vision, processor, source)
    ids = tokenize_texts(tokenizer, [s.prompt for s in samples], run.data.apply_chat_template)["input_ids"]
    stats, kept = SkipStats(), []
    for i, (sample, tokens) in enumerate(zip(samples, ids, strict=True)):
        if len(tokens) > run.rollout.prompt_max_len:
            stats.add("too_long", i)
        else:
            kept.append(sample)
    if not kept:
        raise DataError(f"no usable prompt in {source} ({stats.summary()}); check --prompt_max_len")
    return kept, stats


def attach_prompt_images(dataset, samples: list, vision_cfg, processor, source: str) -> list:
    """``samples`` (one per dataset row, in order) with their rows' images and expanded placeholders."""
    from tidal.data.images import check_image_rows

    if len(samples) != len(dataset):
        raise ValueError("attach_prompt_images needs one prompt sample per dataset row")
    rows = check_image_rows(dataset, vision_cfg, source, processor.token_counts)
    markup = processor.image_markup  # the family's processor's expansion (Gemma: begin/end of image)
    out = []
    for i, (sample, row) in enumerate(zip(samples, rows, strict=True)):
        try:
            prompt = markup.expand_text(sample.prompt, row.token_counts)
        except ValueError as err:
            raise DataError(
                f"row {i + 1} of {source}: {err} (each image needs one {markup.marker!r}: a "
                "{'type': 'image'} content part)"
            ) from err
        out.append(replace(sample, prompt=prompt, images=row.refs))
    return out


def rollout_images(image_refs: Sequence, image_processor) -> list | None:
    """Each prompt's ``MultiModalInput`` (pixels computed once; ``image_refs``: each prompt's ``ImageRef``s),
    or None when no prompt has images."""
    if not any(image_refs):
        return None
    from tidal.data.images import open_image
    from tidal.rollout.runner.multimodal import MultiModalInput

    out = []
    for refs in image_refs:
        if not refs:
            out.append(None)
            continue
        pixels = image_processor(images=[open_image(r) for r in refs], return_tensors="pt")
        out.append(
            MultiModalInput(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        )
    return out


class ImagePromptEngine:
    """An engine whose ``generate`` passes each prompt's images along (the single-turn executor calls it
    with the prompts in the rollout's order); a multi-turn executor reads ``prompt_images`` (each prompt's
    ``MultiModalInput``, ``tidal.agents.base.PROMPT_IMAGES``) and its requests bring their own images.
    Everything else is the wrapped engine's."""

    def __init__(self, engine, images: list):
        self._engine, self.prompt_images = engine, images

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, multi_modal=None):
        if multi_modal is not None:  # an agent's requests: each already carries its episode's images
            return self._engine.generate(prompts, sampling_params, use_tqdm, multi_modal=multi_modal)
        if len(prompts) != len(self.prompt_images):
            raise ValueError(
                f"{len(prompts)} prompts for the rollout's {len(self.prompt_images)} image inputs"
            )
        return self._engine.generate(prompts, sampling_params, use_tqdm, multi_modal=self.prompt_images)


def run_with_images(engine, image_refs: Sequence, n: int, run) -> list:
    """``run(engine)`` (the agent executor over a rollout's prompts, ``n`` samples each), with each prompt's
    images (``image_refs``: its ``ImageRef``s, in the prompts' order) going to the engine with it and
    staying with its trajectories; ``run(engine)`` as is when no prompt has images. The same on the
    trainer's engine and in an engine process of its own (``tidal.placement.engines``)."""
    images = rollout_images(image_refs, getattr(engine, "image_processor", None))
    trajectories = run(engine if images is None else ImagePromptEngine(engine, images))
    if images is not None:
        attach_trajectory_images(trajectories, images, n)
    return trajectories


def attach_trajectory_images(trajectories: list, images: list, n: int) -> None:
    """Give each trajectory (prompt-major, ``n`` per prompt) its prompt's pixels and grids; one that has
    images of its own (a multi-turn episode's: its prompt's, then its observations') keeps them."""
    if len(trajectories) != len(images) * n:
        raise ValueError(f"{len(trajectories)} trajectories for {len(images)} prompts x {n} samples")
    for i, traj in enumerate(trajectories):
        mm = images[i // n]
        if getattr(traj, "images", None) is None and mm is not None:
            traj.images = (mm.pixel_values, mm.image_grid_thw)


@dataclass
class ExperienceImages:
    """Each experience row's ``(pixel_values, image_grid_thw)``, or None for a row without images."""

    rows: list

    @classmethod
    def from_trajectories(cls, trajectories: Sequence) -> ExperienceImages | None:
        rows = [getattr(t, "images", None) for t in trajectories]
        return cls(rows) if any(r is not None for r in rows) else None

    def select(self, index: Tensor) -> ExperienceImages:
        return ExperienceImages([self.rows[i] for i in index.tolist()])

    def to(self, device: torch.device) -> ExperienceImages:
        return ExperienceImages(
            [None if r is None else (r[0].to(device), r[1].to(device)) for r in self.rows]
        )

    @staticmethod
    def concat(parts: Sequence[ExperienceImages | None], sizes: Sequence[int]) -> ExperienceImages | None:
        """The rows of several experiences (``sizes``: their row counts; None parts have no images)."""
        if all(p is None for p in parts):
            return None
        rows = []
        for part, size in zip(parts, sizes, strict=True):
            rows += [None] * size if part is None else part.rows
        return ExperienceImages(rows)

    def batch(self) -> dict[str, Tensor]:
        """A micro-batch's image inputs (rows in order, each row's images in order); {} without images."""
        present = [r for r in self.rows if r is not None]
        if not present:
            return {}
        counts = [0 if r is None else int(r[1].shape[0]) for r in self.rows]
        return {
            "pixel_values": torch.cat([r[0] for r in present]),
            "image_grid_thw": torch.cat([r[1] for r in present]),
            "image_counts": torch.tensor(counts, device=present[0][1].device),
        }
