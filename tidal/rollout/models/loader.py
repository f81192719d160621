"""Build a ``DecoderForCausalLM`` from a HF folder, a loaded HF model or a state dict, and read weights."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tidal.rollout.models.decoder import DecoderArgs, DecoderForCausalLM


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
) -> DecoderForCausalLM:
    """Instantiate on ``device`` without random init, then load every weight (all must be present)."""
    args = DecoderArgs.from_hf_config(hf_config)
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty may give tied parameters separate storage
    model.init_rope(hf_config, max_model_len)
    loaded = model.load_weights(weights)
    missing = model.weight_keys() - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")
    return model.eval()
