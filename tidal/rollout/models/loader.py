"""Build the engine model of a HF config's family (``registry.py``) from checkpoint files or named tensors.

With a tensor-parallel ``TPGroup`` the model is built as this rank's shard (``parallel.py``) and every
full tensor read is sliced to that shard as it is copied, so no rank holds more than its share (MoE
families: every expert's slice of the intermediate size, ``moe.Experts``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tidal.rollout.models.layers import CausalLM, DecoderArgs
from tidal.rollout.models.parallel import SINGLE, TPGroup, TPLayoutError, check_heads, even_rows
from tidal.rollout.models.registry import model_class
from tidal.rollout.models.rope import rope_parameters


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


def tp_layout_problem(hf_config, tp_size: int) -> str | None:
    """Why ``hf_config``'s model cannot run as a ``tp_size``-way tensor-parallel engine, or None.

    Reads only the config (an unsupported family raises ``UnsupportedModelError``), so commands call it
    before any weight is loaded."""
    if tp_size == 1:
        return None
    cls = model_class(getattr(hf_config, "model_type", None))
    args = cls.args_from_hf_config(hf_config)
    if not cls.supports_tp:
        return f"the rollout engine does not shard {args.model_type} models for tensor parallelism (use 1)"
    try:
        check_heads(args.num_heads, args.num_kv_heads, tp_size)
        for field, size in split_sizes(args).items():
            even_rows(size, TPGroup(size=tp_size), field)
    except TPLayoutError as err:
        return str(err)
    return None


def split_sizes(args: DecoderArgs) -> dict[str, int]:
    """The intermediate sizes a tensor-parallel engine splits, by config field: the dense MLP's (where a
    layer has one), each MoE expert's and the shared expert's (MoE families), and the head counts a family
    names beyond the attention heads (``head_split_sizes``: Qwen3.5's linear-attention heads)."""
    moe = getattr(args, "moe", None)
    sizes = {}
    if moe is None or not all(moe.sparse_layers):
        sizes["intermediate_size"] = args.intermediate_size
    if moe is not None:
        sizes[moe.intermediate_field] = moe.intermediate_size
        if moe.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    sizes.update(getattr(args, "head_split_sizes", {}))  # a family's other heads (Qwen3.5's linear ones)
    return sizes


def context_prefill_problem(hf_config) -> str | None:
    """Why prefix caching / chunked prefill (a prompt's tail computed against its cached head) cannot run
    ``hf_config``'s model, or None: soft-capped attention scores (Gemma 2; the context prefill does not
    cap them) and LongRoPE (Phi-3 long context: its RoPE table depends on the whole prompt's length).
    Reads only the config, so commands call it before any weight is loaded."""
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (Gemma 2)"
    if rope_parameters(hf_config).get("rope_type") == "longrope":
        return "LongRoPE (Phi-3 long context)"
    return None


def model_args(hf_config, tp: TPGroup = SINGLE) -> tuple[type[CausalLM], DecoderArgs]:
    """The family class and its ``DecoderArgs`` for this rank; an impossible TP layout raises."""
    cls = model_class(getattr(hf_config, "model_type", None))
    problem = tp_layout_problem(hf_config, tp.size)
    if problem:
        raise TPLayoutError(problem)
    args = cls.args_from_hf_config(hf_config)
    args.tp = tp
    return cls, args


def build_decoder(
    hf_config,
    weights: Iterable[tuple[str, torch.Tensor]],
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
) -> CausalLM:
    """Instantiate on ``device`` without random init, then load every weight (all must be present).

    An unsupported ``model_type`` or TP layout fails here, before any weight is read."""
    cls, args = model_args(hf_config, tp)
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
