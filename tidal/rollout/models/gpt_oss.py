"""gpt-oss (``model_type`` "gpt_oss"): GQA attention with per-head sinks and a biased MoE in every layer.

What differs from ``layers.py``'s Llama shape (transformers' ``modeling_gpt_oss.py``):

- attention has biases on q/k/v/o and one learned sink logit per head in the softmax denominator
  (``sink_attention.py``); layers alternate sliding-window and full attention (``layer_types``);
- RoPE is YaRN by default (``rope.py`` computes it with transformers' own frequency function);
- RMSNorm scales in float32 and rounds the product (``scale_in_float32``);
- every layer's MLP is a mixture of experts (``GptOssMoE``): a router with a bias, top-k of the raw
  logits and a softmax over those k only (in the logits' dtype); experts with biases and a clamped
  SwiGLU, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

Expert weights: transformers keeps ``gate_up_proj`` [E, H, 2I] (input-major, gate and up columns
interleaved: gate 0, up 0, gate 1, ...), ``down_proj`` [E, I, H] and their biases; we store
``moe.Experts``' layout (``gate_up_proj`` [E, 2I, H] with the gate rows first, ``down_proj`` [E, H, I]),
so ``moe.grouped_linear`` runs them (grouped GEMM on CUDA). MXFP4 checkpoints (``<name>_blocks`` and
``<name>_scales``, already output-major) are dequantised on load (``mxfp4.py``).

Not supported (``registry.py`` refuses them): tensor parallelism and exact mode. On the Triton backend
decode and prefill with context run the paged kernels with their ``sinks`` argument; on CUDA the experts
run ``triton_moe``'s fused kernels with their biases and the clamped SwiGLU in the epilogues (elsewhere,
or with ``moe.FUSED_MOE`` off, the grouped-GEMM path).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tidal.rollout.kernels.sink_attention import sink_paged_attention
from tidal.rollout.models import moe
from tidal.rollout.models.layers import Attention, CausalLM, DecoderLayer, RMSNorm, fused_kernels_usable
from tidal.rollout.models.moe import MoEArgs, MoEDecoderArgs, SparseMoE, grouped_linear
from tidal.rollout.models.mxfp4 import dequantize_mxfp4
from tidal.rollout.models.rope import apply_rope
from tidal.rollout.runner.attention import AttentionMetadata


@dataclass
class GptOssArgs(MoEDecoderArgs):
    """``MoEDecoderArgs`` plus the experts' clamped-SwiGLU constants."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class GptOssAttention(Attention):
    """Llama attention (with biases) plus ``sinks`` [heads], attended through ``sink_paged_attention``."""

    def __init__(self, args: GptOssArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        v = qkv[:, self.split[0] + self.split[1] :].view(-1, self.num_kv_heads, self.head_dim)
        # On CUDA, RoPE + the KV store as one kernel (``triton_fused``, bit-equal to the torch ops below).
        stored = fused_kernels_usable(qkv) and cos.dtype == qkv.dtype
        if stored:
            q, k = self._fused_rope_store(self.qk_heads(qkv), None, v, cos, sin, meta)
        else:
            qk = apply_rope(self.qk_heads(qkv), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = sink_paged_attention(
            q, k, v, meta, self.layer_idx, self.window, self.scale, self.sinks, stored=stored
        )
        return self.o_proj(out)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """Stacked expert weights and biases (``moe.Experts``' layout, gate rows first) and their forward."""

    def __init__(self, args: GptOssArgs):
        super().__init__()
        experts, inter, hidden = args.moe.num_experts, args.moe.intermediate_size, args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def fp8_parts(self) -> dict[str, tuple[int, ...]]:
        """FP8 rollouts: the stacked weights and their row parts quantized apart (gate rows, up rows)."""
        inter = self.down_proj.shape[-1]
        return {"gate_up_proj": (inter, inter), "down_proj": (self.down_proj.shape[1],)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); x [T, H] -> [T, H]: the fused Triton kernels on CUDA
        (``kernel_forward``), else pairs sorted by expert, each expert run once on its rows (``grouped_forward``)."""
        if moe.fused_usable(x, self.gate_up_proj):
            return self.kernel_forward(x, weights, ids, self.gate_up_proj, self.down_proj)
        if x.is_cuda and torch.cuda.is_current_stream_capturing() and not moe._grouped_mm_usable(x):
            return self._every_expert(x, weights, ids)
        return self.grouped_forward(x, weights, ids, self.gate_up_proj, self.down_proj)

    def kernel_forward(
        self, x, weights, ids, gate_up, down, scales=None, quantize_activations=None
    ) -> torch.Tensor:
        """``triton_moe``'s fused kernels on the weights ``gate_up`` and ``down`` (the parameters, or FP8
        rollouts' e4m3 buffers with their per-channel ``scales``: ``quant/linear.py``), the biases and the
        clamped SwiGLU in their epilogues. ``quantize_activations`` (FP8, ``fused_expert_forward``'s): the
        per-row e4m3 quantizer of the activations, which makes the kernels W8A8 (None: W8A16)."""
        from tidal.rollout.kernels.triton_moe import ClampedSwiGLU, fused_expert_forward

        biases = (self.gate_up_proj_bias, self.down_proj_bias)
        swiglu = ClampedSwiGLU(self.alpha, self.limit)
        return fused_expert_forward(
            x, gate_up, down, weights, ids, scales=scales, biases=biases, swiglu=swiglu,
            quantize_activations=quantize_activations,
        )  # fmt: skip

    def grouped_forward(self, x, weights, ids, gate_up_proj, down_proj) -> torch.Tensor:
        """The experts with the weights given, pairs sorted by expert so each expert runs once on its rows
        (``moe.grouped_linear``), as ``moe`` does."""
        num_tokens, top_k = ids.shape
        sorted_ids, order = torch.sort(ids.reshape(-1))
        rows = x[order // top_k]
        # histc, not bincount: no host sync on CUDA (graph capture); CPU histc wants floats.
        num_experts = gate_up_proj.shape[0]
        counts_input = sorted_ids.float() if not x.is_cuda else sorted_ids.int()
        counts = torch.histc(counts_input, bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate_up = grouped_linear(rows, gate_up_proj, offsets) + self.gate_up_proj_bias[sorted_ids]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = clamped_swiglu(gate, up, self.alpha, self.limit)
        out = grouped_linear(hidden, down_proj, offsets) + self.down_proj_bias[sorted_ids]
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with every expert run on every token and weighted 0 where not chosen: no per-expert
        row counts on the host, so a CUDA graph can capture it where torch's grouped GEMM does not apply
        (float32 decode). E/k times the FLOPs, which decode's few tokens afford."""
        gate_up = torch.einsum("th,eoh->eto", x, self.gate_up_proj) + self.gate_up_proj_bias[:, None]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = clamped_swiglu(gate, up, self.alpha, self.limit)
        out = torch.einsum("eti,ehi->eth", hidden, self.down_proj) + self.down_proj_bias[:, None]
        dense = weights.new_zeros(x.shape[0], out.shape[0]).scatter_add_(1, ids, weights)  # [T, E]
        return (out * dense.t()[..., None]).sum(dim=0).to(x.dtype)


def route_top_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): the k largest logits, then a softmax over those k only, in the
    logits' dtype (transformers' ``GptOssTopKRouter``)."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class GptOssMoE(SparseMoE):
    """Router (a linear layer with bias) + ``GptOssExperts``; x [T, H] -> [T, H].

    A ``SparseMoE`` so that the runner's router replay finds and records it (``recorded``); its own
    parameters replace the base block's (no bias-free ``gate``, no shared expert)."""

    def __init__(self, args: GptOssArgs):
        nn.Module.__init__(self)
        self.moe = args.moe
        self.tp = args.tp
        self.router = nn.Linear(args.hidden_size, args.moe.num_experts, bias=True)
        self.experts = GptOssExperts(args)
        self.recorded: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_logits(self.router(x), self.moe.top_k)
        if self.recorded is not None:
            self.recorded.append(ids)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(DecoderLayer):
    """Pre-norm layer with float32-scaled norms and ``GptOssMoE`` as its MLP."""

    def __init__(self, args: GptOssArgs, layer_idx: int, attention_cls: type[Attention] = GptOssAttention):
        super().__init__(args, layer_idx, attention_cls)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)
        self.mlp = GptOssMoE(args)


# An expert tensor after the prefixes are stripped: "<layers.N.mlp.experts>.<stacked>[_bias|_blocks|_scales]".
_EXPERT_TENSOR = re.compile(
    r"^(?P<block>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales)?$"
)


class GptOssForCausalLM(CausalLM):
    attention_cls = GptOssAttention
    layer_cls = GptOssDecoderLayer
    supports_tp = False
    # FP8 rollouts: ``load_weights`` takes the shared loader's names and whole stacked experts (``_target_of``)
    fp8_traced_loader = True

    def __init__(self, args: GptOssArgs):
        super().__init__(args)
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)

    @classmethod
    def args_from_hf_config(cls, config) -> GptOssArgs:
        moe = MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,  # a softmax over the k selected logits (``route_top_logits``)
            weights_in_model_dtype=True,
            sparse_layers=(True,) * config.num_hidden_layers,
            intermediate_field="intermediate_size",
        )
        quant = getattr(config, "quantization_config", None) or {}
        method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        if method not in (None, "mxfp4"):
            raise ValueError(
                f"gpt_oss checkpoint quantised with {method!r}: the rollout engine loads bf16/fp32 or mxfp4 "
                "expert weights only"
            )
        return GptOssArgs.from_hf_config(
            config,
            moe=moe,
            # Config fields since transformers 5.2x; earlier versions hard-code these same values.
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
        )

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``CausalLM.load_weights``, plus the expert tensors: transformers' stacked layout (input-major,
        gate/up interleaved) or MXFP4 ``_blocks`` / ``_scales`` pairs, dequantised once both arrive."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their other half
        loaded: set[str] = set()

        def generic():
            for raw_name, tensor in named_tensors:
                match = _EXPERT_TENSOR.match(self._our_name(raw_name))
                if match is None:
                    yield raw_name, tensor
                    continue
                target = f"{match['block']}.{match['proj']}"
                kind = match["kind"] or ""
                if kind in ("_blocks", "_scales"):
                    halves = pending.setdefault(target, {})
                    halves[kind] = tensor
                    if len(halves) < 2:
                        continue
                    del pending[target]
                    dst = params.get(target)  # dequantised on its device, in its dtype (exact in bf16)
                    device, dtype = (dst.device, dst.dtype) if dst is not None else ("cpu", torch.float32)
                    blocks, scales = (halves[k].to(device) for k in ("_blocks", "_scales"))
                    rows = dequantize_mxfp4(blocks, scales, dtype)
                    kind = ""
                else:
                    rows = tensor.transpose(1, 2) if kind == "" else tensor  # output-major, as ours
                target += kind
                if target not in params:
                    raise ValueError(f"unexpected weight {raw_name!r} for a {self.args.model_type} decoder")
                _copy_expert(
                    params[target], rows, target.endswith(("gate_up_proj", "gate_up_proj_bias")), raw_name
                )
                loaded.add(target)

        loaded |= super().load_weights(generic())
        if pending:
            name, halves = next(iter(pending.items()))
            raise ValueError(f"MXFP4 weight {name} has {next(iter(halves))} but not its other half")
        return loaded


def _copy_expert(dst: torch.Tensor, rows: torch.Tensor, interleaved: bool, name: str) -> None:
    """Copy an output-major expert tensor ([E, out, in] or a bias [E, out]) into ``dst``; gate/up ones
    arrive interleaved along ``out`` (gate 0, up 0, gate 1, ...) and are stored gate rows first."""
    if interleaved:
        rows = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
    if tuple(rows.shape) != tuple(dst.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(rows.shape)} (output-major), expected {tuple(dst.shape)}"
        )
    dst.copy_(rows)
