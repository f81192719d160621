"""The bytes one decode step of tidal's engine must move, per model family (the roofline of bench/rollout.py).

A decode step at batch B reads (``decode_bytes``):

- every weight once, except an untied input embedding, of which it reads only the B rows looked up;
- of a routed-experts block (MoE), only the experts some token picks: with top-k of E experts and the
  near-uniform routing of a random-init router, a fraction ``1 - (1 - k/E) ** B`` of them (at B = 256 and
  top-8 of 256: 99.97%, i.e. nearly all; at B = 1: k/E);
- the KV cache of each attention layer over the sequence's context, at most the layer's sliding window
  (gpt-oss: half the layers read at most 128 positions), averaged over the decode steps of the run;
- per sequence, the recurrent state of each linear-attention layer (Qwen3.5's Gated DeltaNet: the
  engine's float32 [v_heads, k_dim, v_dim] matrix and the bf16 convolution history), read and written
  back in full every step, so counted twice, instead of a KV cache.

The result is split by part (GB), so a reader sees which one dominates: at batch 256 Qwen3.5-0.8B's
recurrent states (~10 GB a step, read and written) outweigh its weights (~1.5 GB) several times over.
"""

from __future__ import annotations

import torch

LINEAR = "linear_attention"


def expert_fraction(top_k: int, num_experts: int, batch: int) -> float:
    """Expected share of experts at least one of ``batch`` tokens routes to (uniform top-k routing)."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def _size(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _bytes(module: torch.nn.Module) -> int:
    """Bytes of weights the forward reads: a parameter with an FP8 copy (``--rollout_quantization``:
    ``fp8_<name>`` and its ``_scale`` buffers) counts as that copy, which is what the decode reads,
    whether or not the model-dtype parameter was kept (gpt-oss's staged experts keep it)."""
    total = 0
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            fp8 = getattr(sub, f"fp8_{name}", None)
            if isinstance(fp8, torch.Tensor):
                total += _size(fp8) + _size(getattr(sub, f"fp8_{name}_scale", None))
            else:
                total += _size(param)
    return total


def weight_bytes(model: torch.nn.Module, batch: int) -> tuple[float, float]:
    """(dense weights' bytes read, routed experts' bytes read) of one decode step."""
    total = _bytes(model)
    experts_all, experts_read = 0, 0.0
    for module in model.modules():
        moe = getattr(module, "moe", None)  # a SparseMoE: its routed experts live in ``.experts``
        if moe is not None and hasattr(module, "experts"):
            size = _bytes(module.experts)
            experts_all += size
            experts_read += size * expert_fraction(moe.top_k, moe.num_experts, batch)
    dense = total - experts_all
    if not model.args.tie_word_embeddings:
        table = model.model.embed_tokens.weight
        dense -= table.numel() * table.element_size() * (1 - min(batch, table.shape[0]) / table.shape[0])
    return dense, experts_read


def attention_windows(args) -> list[int | None]:
    """The sliding window (None: full context) of every layer that reads the KV cache."""
    kinds = getattr(args, "layer_types", None) or ()
    return [w for i, w in enumerate(args.sliding_windows) if i >= len(kinds) or kinds[i] != LINEAR]


def mean_read_positions(window: int | None, prompt_len: int, new_tokens: int) -> float:
    """KV positions a layer reads per sequence, averaged over the decode steps (the first new token
    comes from the prefill; step t attends over prompt_len + t positions, at most the window)."""
    steps = range(1, max(2, new_tokens))
    limit = window if window else float("inf")
    return sum(min(prompt_len + t, limit) for t in steps) / len(steps)


def decode_bytes(engine, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Bytes one decode step must move, by part, and their ``total``."""
    from tidal.rollout.scheduling.state_cache import StateCache

    model, args = engine.model, engine.model.args
    dense, experts = weight_bytes(model, batch)
    # Per layer and position: the paged cache's row (k and v of this rank's KV heads, or MLA's latent).
    per_position = engine.kv_bytes_per_block() / engine.config.block_size / max(1, args.kv_layers)
    kv = (
        batch
        * per_position
        * sum(mean_read_positions(w, prompt_len, new_tokens) for w in attention_windows(args))
    )
    spec = model.state_spec()
    state = 2 * batch * StateCache.bytes_per_slot(spec, engine.dtype) if spec is not None else 0
    parts = {"weights": dense, "experts": experts, "kv_cache": kv, "recurrent_state": state}
    parts["total"] = sum(parts.values())
    return parts
