"""Which engine families FP8 rollouts (``linear.py``) can quantize, and which of their modules.

A family's weight syncs must be traceable to the FP8 weights: ``linear.py`` wraps the model's
``load_weights`` and maps each HF name onto the module part it writes (``_target_of``), so the loader
must read names the way the shared loaders do (``CausalLM`` / ``MoECausalLM``). Families on their own
loader say so with ``fp8_traced_loader`` (gpt-oss: the shared names plus whole stacked experts, dense or
MXFP4; Gemma 4 and DeepSeek-V3: the shared loader behind a name filter). A vision family's loader
(``vision_weights.language_weights``) copies the tower's tensors by name and streams the rest on to its
decoder's loader: it is traced when that loader is. The vision tower (``visual.``) keeps the model dtype.

Modules quantized beyond ``linear.py``'s ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``moe.Experts``:
a family's own stacked experts (``fp8_parts``: gpt-oss) and the decoder layers' plain ``nn.Linear``s it
names in ``fp8_linears`` (Gemma 4's unpacked projections; DeepSeek-V3's MLA projections but the absorbed
``kv_b_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.rollout.models.layers import CausalLM
from tidal.rollout.models.moe import MoECausalLM
from tidal.rollout.models.vision_weights import VISION_PREFIX

# The loaders whose HF names ``linear._target_of`` maps onto modules.
_SHARED_LOADERS = (CausalLM.load_weights, MoECausalLM.load_weights)


def family_problem(model: nn.Module, device: torch.device | None = None) -> str | None:
    """Why FP8 cannot quantize this engine model (None: it can), on ``device`` when given."""
    cls, model_type = type(model), model.args.model_type
    return loader_problem(cls, model_type) or device_problem(cls, model_type, device)


def registry_family_problem(model_type: str, device: torch.device | None = None) -> str | None:
    """``family_problem`` from a registry family's name (text or vision), before anything is built."""
    from tidal.rollout.models.registry import model_class

    cls = model_class(model_type)
    return loader_problem(cls, model_type) or device_problem(cls, model_type, device)


def device_problem(cls: type, model_type: str, device: torch.device | None) -> str | None:
    """A family's ``fp8_cuda_refused`` reason, on CUDA: FP8 rollouts found wrong there and refused until the
    cause is fixed (the CPU's emulation stays, for tests)."""
    reason = getattr(cls, "fp8_cuda_refused", None)
    if reason and device is not None and device.type == "cuda":
        return f"--rollout_quantization fp8 is refused for {model_type!r} on CUDA: {reason}"
    return None


def loader_problem(cls: type, model_type: str) -> str | None:
    if not _traced(cls):
        return (
            f"--rollout_quantization fp8 supports the families on the shared weight loader, not "
            f"{model_type!r} (its own loader: weight syncs could not be traced to the FP8 weights)"
        )
    return None


def _traced(cls: type) -> bool:
    """The shared loaders, a loader declared traced (``fp8_traced_loader``), or a vision family's whose
    decoder loader (the next one up its classes) is traced."""
    own = cls.load_weights
    if own in _SHARED_LOADERS or getattr(cls, "fp8_traced_loader", False):
        return True
    if cls not in _vision_classes():
        return False
    bases = [k for k in cls.__mro__[1:] if vars(k).get("load_weights", own) is not own]
    return bool(bases) and _traced(bases[0])


def _vision_classes() -> set[type]:
    from tidal.rollout.models.registry import VISION_FAMILIES, model_class

    return {model_class(model_type) for model_type in VISION_FAMILIES}


def quantizable(path: str) -> bool:
    """Whether the module at ``path`` may be quantized at all: not in a vision tower."""
    return not path.startswith(VISION_PREFIX)


def plain_projection(model: CausalLM, path: str) -> bool:
    """A decoder layer's ``nn.Linear`` the family names in ``fp8_linears``; routers and Gemma 4's
    per-layer-embedding projections are not named, so keep the model dtype."""
    return path.startswith("model.layers.") and path.rpartition(".")[2] in getattr(model, "fp8_linears", ())
