"""A vision-language checkpoint's weights into an engine model: the vision tower (transformers' own module,
kept as is under ``visual.``) takes its tensors by name, checked for shape; everything else, the language
model's, streams on to the decoder's loader (its stacked/sharded layouts and name mapping). One function
for every vision family, so that a new one only says how its names map (``our_name``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

VISION_PREFIX = "visual."


def language_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    our_name: Callable[[str], str],
    vision: nn.Module | None,
    family: str,
    loaded: set[str],
    skip: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's ``(name, tensor)`` pairs of ``named_tensors``; each vision-tower tensor is
    copied into ``vision``'s parameter of that name as it passes (its name added to ``loaded``). Names
    (after ``our_name``) starting with one of ``skip`` are dropped (towers the engine does not run, e.g.
    Gemma 4's audio). An unknown or misshapen vision weight raises naming it."""
    params = dict(vision.named_parameters()) if vision is not None else {}
    for raw_name, tensor in named_tensors:
        name = our_name(raw_name)
        if skip and name.startswith(skip):
            continue
        if not name.startswith(VISION_PREFIX):
            yield raw_name, tensor
            continue
        param = params.get(name[len(VISION_PREFIX) :])
        if param is None:
            raise ValueError(f"unexpected weight {raw_name!r} for a {family} vision tower")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
