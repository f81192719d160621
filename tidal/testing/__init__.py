"""Offline tiny models, tokenizers and synthetic tasks for tests, the demo and benchmarks.

Nothing here touches the network: every model and tokenizer is built in-process from a seed.
"""

from tidal.testing.tasks import AdditionTask
from tidal.testing.tiny import TINY_FAMILIES, build_tiny_model, build_tiny_tokenizer, perturbed_copy
from tidal.testing.tiny_vlm import TINY_VLM_FAMILIES, build_tiny_vlm
from tidal.testing.vision_tasks import ColourTask

__all__ = [
    "AdditionTask",
    "ColourTask",
    "TINY_FAMILIES",
    "TINY_VLM_FAMILIES",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "perturbed_copy",
]
