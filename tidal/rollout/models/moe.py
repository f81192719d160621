"""The sparse mixture-of-experts block shared by the engine's MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral).

A sparse layer replaces the dense MLP of ``layers.DecoderLayer`` by:

- a router (``gate``, a bias-free linear layer to ``num_experts`` logits), softmax in float32, top-k,
  optionally renormalised over the k selected (``route``);
- the experts, stored stacked like transformers' ``*Experts`` modules: ``gate_up_proj`` [E, 2*I, H]
  (gate rows first) and ``down_proj`` [E, H, I]; ``expert_forward`` sorts the token/expert pairs by
  expert and runs each expert once on its contiguous slice (grouped GEMM on CUDA, a loop over experts
  elsewhere: never a loop over tokens), then sums each token's k weighted outputs as transformers does;
- optionally a shared expert (Qwen2-MoE): a dense gated MLP scaled by ``sigmoid(shared_expert_gate(x))``
  and added to the routed output.

DeepSeek-V3's block (``deepseek_v3.py``) reuses ``Experts`` with its own router, ``group_limited_route``
(sigmoid scores, a correction bias for the choice, groups of experts; the torch ops on every device).

``expert_forward`` dispatches to the fused Triton kernels (``tidal/rollout/kernels/triton_moe.py``) on CUDA when
Triton is importable and the experts are SiLU-gated (every MoE family here); the path above is the
reference and the fallback. ``FUSED_MOE = False`` forces it (benchmarks; read at each call, so set it
before an engine captures its CUDA graphs).

Router replay (``--moe_router_replay``): while ``SparseMoE.recorded`` is a list, each forward appends
its selected expert ids; ``ModelRunner`` hands them to the sequences (see ``record_routing``).

Tensor parallelism (``parallel.py``): each rank holds every expert's slice of the expert intermediate
size (gate/up rows split as a column-parallel layer, down columns as a row-parallel one, as vLLM's
default MoE split) and the replicated router, so every rank routes alike (rank 0's runner records) and
the fused and unfused paths run unchanged on the slice; the routed experts' partial sum, plus the shared
expert's (its down projection defers its reduction), is all-reduced once per block.

Weights: checkpoint folders store one module per expert (``mlp.experts.{e}.gate_proj.weight``, or
Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``, renamed by the family); a trainer's
``named_parameters()`` under transformers >= 5 give the stacked ``mlp.experts.gate_up_proj`` directly.
``MoECausalLM.load_weights`` takes both: per-expert tensors are copied into their expert's slice of the
stacked parameter, everything else goes through ``CausalLM``'s generic loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tidal.accel import triton_usable
from tidal.rollout.models.layers import ACTIVATIONS, Attention, CausalLM, DecoderArgs, DecoderLayer, GatedMLP
from tidal.rollout.models.parallel import SINGLE, TPGroup, check_full, even_rows


@dataclass(frozen=True)
class MoEArgs:
    """The routed-experts part of a config.

    ``weights_in_model_dtype``: Qwen-style routers round the top-k weights to the model dtype before
    they scale the expert outputs; Mixtral keeps them in float32 (the products are then float32 until the
    per-token sum is rounded). ``sparse_layers``: per layer, whether it has this block (else a dense MLP).
    ``intermediate_field``: the config field of ``intermediate_size`` (named in tensor-parallel errors).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    weights_in_model_dtype: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    intermediate_field: str = "moe_intermediate_size"


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """``DecoderArgs`` plus the MoE block's arguments (``None``: every layer dense)."""

    moe: MoEArgs | None = None

    def is_sparse(self, layer_idx: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer_idx]


def qwen_sparse_layers(config) -> tuple[bool, ...]:
    """Qwen-MoE's rule: a layer is sparse unless listed in ``mlp_only_layers``, when ``num_experts > 0``
    and its 1-based index is a multiple of ``decoder_sparse_step``."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in dense and config.num_experts > 0 and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    )


def qwen_moe_args(config, shared_expert_intermediate_size: int | None = None) -> MoEArgs:
    """The MoE settings of a Qwen-MoE config (Qwen2-MoE adds a shared expert)."""
    return MoEArgs(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=True,
        sparse_layers=qwen_sparse_layers(config),
        shared_expert_intermediate_size=shared_expert_intermediate_size,
    )


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k], expert ids [tokens, k]) of the k most probable experts, as transformers'
    top-k routers compute them: softmax in float32, ``topk``, optional renormalisation over the k.

    On CUDA with Triton (up to 1024 experts): ``triton_route.fused_route``, one launch instead of ~6
    kernels, the same weights up to the order of the softmax sum and the lower expert id first among
    equal logits. Elsewhere ``route_torch``."""
    if triton_usable(router_logits):
        from tidal.rollout.kernels import triton_route

        if triton_route.route_kernel_fits(router_logits):
            return triton_route.fused_route(router_logits, top_k, renormalize, weights_in_model_dtype)
    return route_torch(router_logits, top_k, renormalize, weights_in_model_dtype)


def route_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in torch ops, transformers' own (the CPU path, bit for bit, and the kernel's reference)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_model_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def group_limited_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    top_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] float32, expert ids [tokens, k]) of DeepSeek-V3's router (transformers'
    ``DeepseekV3TopkRouter``): sigmoid scores; the choice alone adds ``correction_bias`` (auxiliary-loss-free
    load balancing) and is limited to the ``top_groups`` of ``num_groups`` equal groups of experts whose two
    best biased scores sum highest; the weights are the unbiased scores of the k chosen, renormalised over
    them if asked, times ``scaling`` (``routed_scaling_factor``). ``router_logits`` are float32."""
    scores = router_logits.sigmoid()
    biased = scores + correction_bias
    tokens, experts = biased.shape
    grouped = biased.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(top_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    keep = keep[:, :, None].expand_as(grouped).reshape(tokens, experts)
    ids = biased.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


# False: ``expert_forward`` always takes the unfused path (benchmarks compare the two).
FUSED_MOE = True


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    # torch's grouped GEMM has no host sync (CUDA-graph safe); its CUDA kernel wants bf16 and sm80+.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [S, in] sorted by expert, ``weight`` [E, out, in], ``offsets`` [E] cumulative row counts ->
    [S, out]: rows of expert e times ``weight[e].T``."""
    if _grouped_mm_usable(x):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the loop below needs the counts on the host
        raise RuntimeError(
            f"MoE decode in CUDA graphs needs bfloat16 weights (torch grouped GEMM), not {x.dtype}: "
            "load the engine in bfloat16 or set enforce_eager"
        )
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # one host sync for all experts
        if end > start:
            torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
        start = end
    return out


def fused_usable(x: torch.Tensor, gate_up_proj: torch.Tensor) -> bool:
    """The fused Triton kernels can run these experts (16-bit tensor-core dots need sm80+ for bfloat16)."""
    return (
        FUSED_MOE
        and triton_usable(x)
        and gate_up_proj.dtype == x.dtype
        and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) >= (8, 0))
    )


def expert_forward(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t; x [T, H] -> [T, H].

    On CUDA with Triton: ``triton_moe.fused_expert_forward``. Else the arithmetic is transformers'
    grouped path (its default): pairs sorted by expert, gated MLP per expert, scaled by the routing
    weight, back in token order, summed over k, rounded to ``x.dtype``."""
    if act is F.silu and fused_usable(
        x, gate_up_proj
    ):  # the kernels' gated activations: SiLU (and gpt-oss's)
        from tidal.rollout.kernels.triton_moe import fused_expert_forward

        return fused_expert_forward(x, gate_up_proj, down_proj, weights, ids)
    return unfused_expert_forward(x, gate_up_proj, down_proj, weights, ids, act)


def unfused_expert_forward(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act,
) -> torch.Tensor:
    """``expert_forward`` without the fused kernels (grouped GEMM or a loop over experts)."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_ids = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids)
    rows = x[order // top_k]
    # histc, not bincount: no host sync on CUDA (graph capture); CPU histc wants floats.
    counts_input = sorted_ids.float() if not x.is_cuda else sorted_ids.int()
    counts = torch.histc(counts_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = grouped_linear(rows, gate_up_proj, offsets).chunk(2, dim=-1)
    out = grouped_linear(act(gate) * up, down_proj, offsets)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class Experts(nn.Module):
    """The stacked expert weights (names and shapes as transformers' ``*Experts`` modules).

    With tensor parallelism each rank holds every expert's ``rows`` of the intermediate size: its gate
    rows then its up rows in ``gate_up_proj`` [E, 2 * rows, H], its columns of ``down_proj`` [E, H, rows];
    the forward then gives this rank's partial sum (``SparseMoE`` all-reduces it). ``take`` and
    ``take_expert`` slice full checkpoint tensors (stacked, or one expert's) to that shard."""

    def __init__(self, moe: MoEArgs, hidden_size: int, hidden_act: str, tp: TPGroup = SINGLE):
        super().__init__()
        self.rows = even_rows(moe.intermediate_size, tp, moe.intermediate_field)
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * self.rows.size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.rows.size))
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return expert_forward(x, self.gate_up_proj, self.down_proj, weights, ids, self.act)

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        """(``param``, the rank's shard of ``tensor``): a stacked full tensor (a trainer's weights)."""
        full = self.rows.full
        if kind == "gate_up_proj":
            check_full(tensor, (param.shape[0], 2 * full, param.shape[2]), name)
            gate, up = tensor.chunk(2, dim=1)
            return param, torch.cat([self.rows.take(gate, 1), self.rows.take(up, 1)], dim=1)
        check_full(tensor, (*param.shape[:2], full), name)
        return param, self.rows.take(tensor, 2)

    def take_expert(self, stacked: str, expert: int, shard: int | None, tensor: torch.Tensor, name: str):
        """(destination view, the rank's shard of ``tensor``) for one expert's full gate (``shard`` 0),
        up (1) or down (``None``) projection."""
        dst = getattr(self, stacked).select(0, expert)
        if shard is None:  # down [H, I]: the rank's input columns
            check_full(tensor, (dst.shape[0], self.rows.full), name)
            return dst, self.rows.take(tensor, 1)
        dst = dst.chunk(2, dim=0)[shard]
        check_full(tensor, (self.rows.full, dst.shape[1]), name)
        return dst, self.rows.take(tensor, 0)


class SparseMoE(nn.Module):
    """Router + experts (+ the optional gated shared expert); x [T, H] -> [T, H].

    Tensor parallelism: the router (and the shared expert's gate) is replicated, so every rank routes
    alike; the routed and shared experts each give this rank's partial sum, all-reduced once."""

    def __init__(self, args: MoEDecoderArgs):
        super().__init__()
        moe = args.moe
        self.moe = moe
        self.tp = args.tp
        self.gate = nn.Linear(args.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe, args.hidden_size, args.hidden_act, args.tp)
        if moe.shared_expert_intermediate_size:
            shared = replace(args, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False)
            self.shared_expert = GatedMLP(shared)
            self.shared_expert.down_proj.defer_reduce()  # reduced with the routed experts' sum
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        # Router replay: a list while the runner records routing (each forward appends its ids [T, k]).
        self.recorded: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(
            self.gate(x), self.moe.top_k, self.moe.renormalize, self.moe.weights_in_model_dtype
        )
        if self.recorded is not None:
            self.recorded.append(ids)
        out = self.experts(x, weights, ids)
        if self.moe.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # the identity without tensor parallelism


class MoEDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with the MLP replaced by ``moe_cls`` (``SparseMoE`` unless a family's layer
    names its own block) where the config says."""

    moe_cls: ClassVar[type[nn.Module]] = SparseMoE

    def __init__(self, args: MoEDecoderArgs, layer_idx: int, attention_cls: type[Attention] = Attention):
        super().__init__(args, layer_idx, attention_cls)
        if args.is_sparse(layer_idx):
            self.mlp = self.moe_cls(args)


# A per-expert checkpoint weight, after the family's renames: "<block>.experts.<e>.<proj>.weight".
_PER_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class MoECausalLM(CausalLM):
    """Base of the MoE families: ``MoEDecoderLayer``s and a loader that also takes per-expert weights."""

    layer_cls = MoEDecoderLayer
    # Per-expert projection -> (stacked parameter of ``Experts``, shard of the packed gate/up or None).
    expert_weights: ClassVar[dict[str, tuple[str, int | None]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``CausalLM.load_weights``, plus per-expert tensors copied into their expert's slice (this rank's
        shard of it: ``Experts.take_expert``). Stacked expert tensors go through ``Experts.take`` and the
        shared expert (a ``GatedMLP``, its own sizes) through its parallel layers, as dense MLPs do.

        A stacked parameter's key counts as loaded once every expert's slices have been given."""
        params = dict(self.named_parameters())
        pieces: dict[str, set[tuple[int, int | None]]] = {}
        loaded: set[str] = set()

        def generic():
            for raw_name, tensor in named_tensors:
                name = self._our_name(raw_name)
                if (match := _PER_EXPERT.match(name)) and match["proj"] in self.expert_weights:
                    stacked, shard = self.expert_weights[match["proj"]]
                    target = f"{match['block']}.{stacked}"
                    self._param(params, target, raw_name)  # an unknown block fails in one line
                    experts = self.get_submodule(match["block"])
                    dst, src = experts.take_expert(stacked, int(match["expert"]), shard, tensor, raw_name)
                    dst.copy_(src)
                    pieces.setdefault(target, set()).add((int(match["expert"]), shard))
                else:
                    yield raw_name, tensor

        loaded |= super().load_weights(generic())
        for target, got in pieces.items():
            experts = params[target].shape[0]
            shards = (0, 1) if target.endswith("gate_up_proj") else (None,)
            if len(got) == experts * len(shards):
                loaded.add(target)
        return loaded

    def _param(self, params: dict[str, nn.Parameter], target: str, raw_name: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(f"unexpected weight {raw_name!r} for a {self.args.model_type} decoder")
        return params[target]
