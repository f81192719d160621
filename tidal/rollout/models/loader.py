"""Build the engine model of a HF config's family (``registry.py``) from checkpoint files or named tensors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tidal.rollout.models.layers import CausalLM
from tidal.rollout.models.registry import model_class


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a HF folder's safetensors files (sharded or not), or a pytorch .bin."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(path / file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        return
    binary = path / "pytorch_model.bin"
    if not binary.exists():
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    yield from torch.load(binary, map_location="cpu", weights_only=True).items()


def build_decoder(
    hf_config,
    weights: Iterable[tuple[str, torch.Tensor]],
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    """Instantiate on ``device`` without random init, then load every weight (all must be present).

    An unsupported ``model_type`` fails here, before any weight is read."""
    cls = model_class(getattr(hf_config, "model_type", None))
    args = cls.args_from_hf_config(hf_config)
    with torch.device("meta"):
        model = cls(args)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty may give tied parameters separate storage
    model.init_rope(hf_config, max_model_len)
    loaded = model.load_weights(weights)
    missing = model.weight_keys() - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")
    return model.eval()
