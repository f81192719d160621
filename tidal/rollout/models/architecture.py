"""What a Hugging Face config says about a decoder's layers, read one way by the trainer side and by the
rollout engine: the MLP activation by name and each layer's sliding window.

Both the engine's layers (``layers.py``) and ``tidal.rollout.batch_invariant`` (exact mode, which also
switches a transformers model) need these; a module of their own, so that ``batch_invariant`` does not
import the layers (which reach it through the attention backends).
"""

from __future__ import annotations

import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def sliding_windows(config) -> list[int | None]:
    """Per-layer window: Qwen-style configs list ``layer_types``; Mistral applies one window everywhere."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return [window] * config.num_hidden_layers
