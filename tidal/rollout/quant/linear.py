"""FP8 weights in the engine's model: ``quantize_model`` (at load) and the re-quantization at every weight
sync, and the FP8 forward of the linear layers.

What is quantized: every ``ColumnParallelLinear`` / ``RowParallelLinear`` (the attention and MLP
projections of ``layers.py``, packed ``qkv_proj`` / ``gate_up_proj`` quantized part by part, so a packed
part's scales are those of its HF projection alone) and the stacked experts of ``moe.Experts`` (per
expert), plus what a family on its own loader names (``families.py``: gpt-oss's experts, Gemma 4's and
DeepSeek-V3's plain projections). Embeddings, norms, routers (plain ``nn.Linear``) and the LM head keep the
model dtype, as do the KV cache and a vision tower.

Loading is the shared loaders' (packed slices, renames, per-expert tensors), watched by a wrapper of the
model's ``load_weights`` that maps each HF name onto the part it writes (``_target_of``); quantization
runs on the weights' device at the engine's load and at every ``load_weights`` call (each bucket of
``update_weights``). Three ways a module computes:

- ``scaled_mm`` (linear layers; CUDA, bf16 engine, an FP8-capable GPU, shapes the GEMM takes): the e4m3
  weight and its scales live in persistent buffers (``fp8_weight``, ``fp8_weight_scale``) rewritten *in
  place* at each sync, so captured CUDA graphs, which read those addresses, stay valid. The forward
  quantizes the activations per token (dynamic scales; per token and 128 columns for ``fp8_block``; one
  Triton launch, ``triton_fp8.py``, unless the norm or SiLU·up before it left them on its input:
  ``RMSNorm.feeds_fp8``, marked here) and runs an FP8 GEMM (``gemm.fp8_linear``): ``triton_fp8_gemm.py`` at
  decode token counts and for blocks (split-K launches measured per shape), else ``torch._scaled_mm``
  (row-wise scales; without Triton, for blocks, torch's 1x128 x 128x128 block-wise recipe); a
  per-channel layer's bias is added in the GEMM's epilogue (``fuses_bias``). A probe GEMM checks it once
  per process, granularity and weight shape, falling back to ``emulated``, reported in one warning per
  engine start that names the GPU (``fallback_notice``).
- ``triton_fp8`` (MoE experts; the fused Triton MoE path on an FP8-capable GPU, per-channel scales): the
  kernels of ``kernels/triton_moe.py`` read the e4m3 experts (``fp8_gate_up_proj``, ``fp8_down_proj``
  and their ``_scale`` buffers, in place likewise) and multiply them by e4m3 activations (each expert
  GEMM's input quantized per row by ``triton_fp8.py``, one launch each) on FP8 tensor cores, the float32
  accumulator scaled per row and output channel (W8A8, as ``scaled_mm``; the kernels' W8A16 mode, tiles
  widened to the model dtype, stays for tests and benchmarks). A
  family's own experts (gpt-oss: biases and its clamped SwiGLU in the kernels' epilogues) are *staged*:
  their loader converts the checkpoint's layouts (input-major, interleaved, MXFP4) into the model-dtype
  weights, which stay, and those are quantized into the buffers after each load (the decode reads half
  the bytes; no memory is saved).
- ``emulated`` (the CPU; CUDA where neither applies, e.g. block-scaled experts): the parameter itself is
  overwritten with ``dequantize(quantize(w))`` and the module's forward is unchanged, so the model
  computes with exactly the FP8-rounded weights (activations are not quantized). Only the parts a load
  wrote are rounded again (rounding a rounded weight twice is not guaranteed to be a no-op).

In the two CUDA modes the model-dtype weights (but staged ones) are freed once quantized (an empty
parameter stays) and a sync's tensors are quantized straight into the buffers, so the weights take half the model dtype's memory
(plus the float32 scales).

Quantization is per output channel (``fp8``) or per 128 x 128 tile (``fp8_block``): ``fp8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tidal.logging.console import get_logger
from tidal.rollout.models.layers import CausalLM, RMSNorm
from tidal.rollout.models.moe import _PER_EXPERT, Experts
from tidal.rollout.models.parallel import ColumnParallelLinear, RowParallelLinear
from tidal.rollout.quant.experts import Fp8ExpertsForward, Fp8FamilyExpertsForward, kernel_problem
from tidal.rollout.quant.families import (  # the refusals, re-exported for their callers
    family_problem,
    loader_problem,  # noqa: F401
    plain_projection,
    quantizable,
    registry_family_problem,  # noqa: F401
)
from tidal.rollout.quant.fp8 import BLOCK, GRANULARITIES, dequantize, quantize
from tidal.rollout.quant.gemm import fp8_linear, padded_columns

log = get_logger(__name__)


@dataclass
class Target:
    """One quantized module: its weight parameters (``weight``; an ``Experts``' two stacked ones), each
    split into row parts quantized apart, and how it computes (``scaled_mm`` or ``emulated``)."""

    module: nn.Module
    parts: dict[str, tuple[int, ...]]  # parameter -> row counts of its packed parts, in order
    mode: str = "emulated"
    # a family's own experts in a CUDA mode keep their model-dtype weights: the family's loader converts
    # checkpoint layouts (transposed, interleaved, MXFP4) into them, then they are quantized into the buffers
    staged: bool = False


@dataclass
class Fp8State:
    """What ``quantize_model`` attached to a model (``model.fp8``)."""

    granularity: str
    targets: dict[str, Target] = field(default_factory=dict)

    def modes(self) -> dict[str, int]:
        """How many modules compute each way, e.g. ``{"scaled_mm": 168}``."""
        counts: dict[str, int] = {}
        for target in self.targets.values():
            counts[target.mode] = counts.get(target.mode, 0) + 1
        return counts


def quantize_model(model: CausalLM, quantization: str) -> Fp8State:
    """Quantize ``model``'s linear layers and experts to FP8 in place (module docstring) and make every
    later ``model.load_weights`` call re-quantize what it loads. ``quantization``: ``fp8`` or
    ``fp8_block``."""
    problem = family_problem(model, next(model.parameters()).device)
    if problem:
        raise ValueError(problem)
    state = Fp8State(GRANULARITIES[quantization])
    for path, module in model.named_modules():
        if not quantizable(path):  # a vision tower
            continue
        if isinstance(module, ColumnParallelLinear):
            state.targets[path] = Target(module, {"weight": tuple(p.size for p in module.parts)})
        elif isinstance(module, RowParallelLinear):
            state.targets[path] = Target(module, {"weight": (module.out_features,)})
        elif isinstance(module, Experts):
            rows = module.rows.size
            state.targets[path] = Target(
                module, {"gate_up_proj": (rows, rows), "down_proj": (module.down_proj.shape[1],)}
            )
        elif hasattr(module, "fp8_parts"):  # a family's own stacked experts (gpt-oss)
            state.targets[path] = Target(module, module.fp8_parts())
        elif isinstance(module, nn.Linear) and plain_projection(model, path):
            state.targets[path] = Target(module, {"weight": (module.out_features,)})
    refused: dict[str, int] = {}  # why torch._scaled_mm is unusable on this GPU -> linear layers
    own_experts: str | None = None  # why a family's own experts compute emulated on CUDA
    device = None
    for target in state.targets.values():
        if hasattr(target.module, "fp8_parts"):
            if (problem := experts_kernel_problem(target, state.granularity)) is None:
                _use_experts_kernel(target, state.granularity, Fp8FamilyExpertsForward)
                target.staged = True
            elif target.module.down_proj.is_cuda:
                own_experts = problem
        elif isinstance(target.module, Experts):
            if experts_kernel_problem(target, state.granularity) is None:
                _use_experts_kernel(target, state.granularity)
        elif (problem := scaled_mm_problem(target, state.granularity)) is None:
            _use_scaled_mm(target, state.granularity)
        elif target.module.weight.is_cuda:
            refused[problem] = refused.get(problem, 0) + 1
            device = target.module.weight.device
        for param in target.parts:
            _requantize(target, state.granularity, param, None, None)
        if target.mode != "emulated" and not target.staged:
            _release_model_dtype_weights(target)
    model.fp8 = state
    _mark_norms_feeding_fp8(model)
    _requantize_after_loads(model, state)
    log.info("engine: FP8 (%s scales) weights: %s", state.granularity, state.modes())
    if refused:
        layers = sum(isinstance(t.module, nn.Linear) for t in state.targets.values())
        log.warning(fallback_notice(quantization, refused, layers, device))
    if own_experts is not None:  # the fused Triton MoE kernels cannot run them
        log.warning(
            "engine: --rollout_quantization %s: %s's experts compute emulated (FP8-rounded weights in the model "
            "dtype: no speed-up, no memory saved): %s", quantization, model.args.model_type, own_experts,
        )  # fmt: skip
    return state


def _mark_norms_feeding_fp8(model: CausalLM) -> None:
    """Set ``feeds_fp8`` on each norm a layer declares (``fp8_feeds``) whose output an FP8 linear layer with
    per-token activation scales reads (``fp8_row_input``): that norm quantizes the rows in its own launch."""
    for layer in model.modules():
        for norm_name, readers in getattr(layer, "fp8_feeds", ()):
            norm = getattr(layer, norm_name, None)
            if isinstance(norm, RMSNorm) and any(_row_input(layer, path) for path in readers):
                norm.feeds_fp8 = True


def _row_input(layer: nn.Module, path: str) -> bool:
    try:
        return getattr(layer.get_submodule(path), "fp8_row_input", False)
    except AttributeError:  # a path this layer does not have (the other mixer, a sparse MLP)
        return False


def fallback_notice(quantization: str, refused: dict[str, int], layers: int, device: torch.device) -> str:
    """One line at engine start: how many of the ``layers`` linear layers run emulated on this CUDA GPU and
    why (``refused``: reason -> count). For ``fp8_block`` (without Triton its GEMM is cuBLAS's block-wise
    one, whose support on Hopper depends on the shapes) it names the per-channel mode as the fast one."""
    why = "; ".join(f"{reason} ({count} layers)" for reason, count in refused.items())
    notice = (
        f"engine: --rollout_quantization {quantization}: {sum(refused.values())} of {layers} linear layers "
        f"cannot run an FP8 GEMM on {torch.cuda.get_device_name(device)} ({why}), so they compute "
        f"emulated (FP8-rounded weights in the model dtype: no speed-up, no memory saved)"
    )
    if quantization == "fp8_block":
        notice += "; --rollout_quantization fp8 (per-channel scales) is the fast FP8 mode on this GPU"
    return notice


# ------------------------------------------------------------------------------------------ re-quantizing
def _requantize_after_loads(model: CausalLM, state: Fp8State) -> None:
    """Wrap this model's ``load_weights``. A tensor of a module in a CUDA mode (no model-dtype weight
    kept) is quantized straight into its buffers and not passed on; after the rest has loaded, the
    emulated parts the tensors wrote are rounded again."""
    load = model.load_weights

    def load_and_quantize(named_tensors):
        touched: set[tuple] = set()

        def watched():
            for name, tensor in named_tensors:
                hit = _target_of(model, state, name)
                target = state.targets[hit[0]] if hit is not None else None
                if target is not None and target.mode != "emulated" and not target.staged:
                    _load_quantized(state, hit, tensor, name)
                    continue
                if hit is not None:
                    touched.add(hit)
                yield name, tensor

        loaded = load(watched())
        for path, param, expert, part in touched:
            _requantize(state.targets[path], state.granularity, param, expert, part)
        return loaded

    model.load_weights = load_and_quantize


def _target_of(model: CausalLM, state: Fp8State, raw: str) -> tuple | None:
    """(target path, parameter, expert or None, part or None) the HF-named tensor ``raw`` writes, read the
    way the shared loaders read names (renames, packing, per-expert tensors); None: not a quantized one."""
    name = model._our_name(raw)
    match = _PER_EXPERT.match(name)
    expert_weights = getattr(model, "expert_weights", {})
    if match and match["proj"] in expert_weights and match["block"] in state.targets:
        stacked, shard = expert_weights[match["proj"]]
        return match["block"], stacked, int(match["expert"]), shard
    module_name, _, kind = name.rpartition(".")
    kind = kind.removesuffix("_blocks").removesuffix("_scales")  # gpt-oss's MXFP4 halves of stacked experts
    if module_name in state.targets and kind in state.targets[module_name].parts:  # stacked experts
        return module_name, kind, None, None
    parent, _, leaf = module_name.rpartition(".")
    shard = model._packing().get(leaf)
    path = f"{parent}.{shard[0]}" if shard and parent else module_name
    if kind == "weight" and path in state.targets:
        return path, "weight", None, shard[1] if shard else None
    return None


@torch.no_grad()
def _load_quantized(state: Fp8State, hit: tuple, tensor: torch.Tensor, name: str) -> None:
    """Quantize a full HF tensor into its target's buffers: one packed part, one expert's part, or every
    part (a stacked or fused tensor, split by rows)."""
    path, param, expert, part = hit
    target = state.targets[path]
    buffer = getattr(target.module, f"fp8_{param}")
    sizes = target.parts[param]
    indices = range(len(sizes)) if part is None else [part]
    lead = () if expert is not None else tuple(buffer.shape[:-2])
    expected = (*lead, sum(sizes[i] for i in indices), buffer.shape[-1])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
    tensor = tensor.detach().to(buffer.device)
    start = 0
    for index in indices:
        rows = sizes[index]
        _write(target, state.granularity, param, expert, index, tensor.narrow(-2, start, rows))
        start += rows


@torch.no_grad()
def _requantize(target: Target, granularity: str, param: str, expert: int | None, part: int | None) -> None:
    """Quantize one parameter's ``part`` (None: every part) of ``expert`` (None: all, or not experts)."""
    weight = getattr(target.module, param)
    sizes = target.parts[param]
    for index, rows in enumerate(sizes):
        if part is not None and index != part:
            continue
        view = weight.narrow(-2, sum(sizes[:index]), rows)
        _write(target, granularity, param, expert, index, view if expert is None else view[expert])


def _write(target: Target, granularity: str, param: str, expert: int | None, index: int, weights) -> None:
    """Quantize ``weights`` (part ``index`` of ``param``, of one expert or all) where the module computes
    from: the model-dtype parameter rounded in place (emulated), or the FP8 buffers, in place (captured
    CUDA graphs read them)."""
    sizes = target.parts[param]
    start, rows = sum(sizes[:index]), sizes[index]
    q, scales = quantize(weights, granularity)
    if target.mode == "emulated":
        view = getattr(target.module, param).narrow(-2, start, rows)
        view = view if expert is None else view[expert]
        view.copy_(dequantize(q, scales, granularity, view.dtype))
    else:
        first = start if granularity == "channel" else start // BLOCK
        q_dst = getattr(target.module, f"fp8_{param}").narrow(-2, start, rows)
        s_dst = getattr(target.module, f"fp8_{param}_scale").narrow(-2, first, scales.shape[-2])
        s_dst = s_dst.narrow(-1, 0, scales.shape[-1])  # block scales: the padding columns stay 1
        if expert is not None:
            q_dst, s_dst = q_dst[expert], s_dst[expert]
        q_dst.copy_(q)
        s_dst.copy_(scales)


# ------------------------------------------------------------------------------------------ the FP8 GEMM
_PROBES: dict[tuple, str | None] = {}


def scaled_mm_problem(target: Target, granularity: str) -> str | None:
    """Why this linear layer cannot run ``torch._scaled_mm`` (None: it can). The GEMM is probed once per
    process, granularity and weight shape (``_probe``): a torch or GPU that refuses it falls back here."""
    weight = target.module.weight
    if weight.device.type != "cuda":
        return "not on CUDA"
    if weight.dtype != torch.bfloat16:  # torch's row-wise and block-wise FP8 GEMMs write bf16
        return f"{weight.dtype} engine (the FP8 GEMM writes bfloat16)"
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        return "the GPU has no FP8 tensor cores (sm89+)"
    out_features, in_features = weight.shape
    multiple = 16 if granularity == "channel" else BLOCK
    sizes = target.parts["weight"] if granularity == "block" else (out_features,)
    if in_features % multiple or any(size % multiple for size in sizes):
        return f"shapes not multiples of {multiple}"
    key = (granularity, weight.device, out_features, in_features)
    if key not in _PROBES:  # a refusal is reported once per engine start (``fallback_notice``)
        _PROBES[key] = _probe(granularity, weight.device, out_features, in_features)
    return _PROBES[key]


def fuses_bias(target: Target, granularity: str) -> bool:
    """Whether ``torch._scaled_mm`` adds this layer's bias in its epilogue (the row-wise GEMM's epilogue
    adds a bf16 bias to the scaled float32 accumulator, saving a separate add over the output per step):
    per-channel scales, a bias, no tensor-parallel all-reduce before it, and a probe that agrees."""
    module = target.module
    if granularity != "channel" or module.bias is None or not module.weight.is_cuda:
        return False
    if isinstance(module, RowParallelLinear) and module.tp.size > 1:
        return False
    out_features, in_features = module.weight.shape
    key = ("channel+bias", module.weight.device, out_features, in_features)
    if key not in _PROBES:  # refused: the bias is added after the GEMM instead
        _PROBES[key] = _probe("channel", module.weight.device, out_features, in_features, bias=True)
    return _PROBES[key] is None


def _probe(granularity: str, device: torch.device, out_features: int, in_features: int, bias: bool = False):
    """Run the FP8 GEMM once at this weight shape (with a bias: fused) and compare it with the dequantized
    product; the reason it is unusable, or None."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(device, torch.bfloat16) if bias else None
    q, scales = quantize(w, granularity)
    # 32 tokens: the Triton GEMM (decode); 1024: torch._scaled_mm for per-channel scales (prefill)
    for tokens in (32, 1024) if granularity == "channel" else (1, 32, 300):
        x = torch.randn(tokens, in_features, generator=gen).to(device, torch.bfloat16)
        try:
            got = fp8_linear(x, q, scales, granularity, b).float()
        except (RuntimeError, ValueError, NotImplementedError) as err:  # torch and cuBLAS refusals
            return str(err).splitlines()[0]
        want = x.float() @ dequantize(q, scales, granularity, torch.float32).t()
        want = want if b is None else want + b.float()
        error = ((got - want).norm() / want.norm()).item()
        if error >= 0.1:
            return f"probe GEMM relative error {error:.3f} at {tokens} tokens"
    return None


class Fp8Forward:
    """Mixed into a quantized linear layer's class (``scaled_mm`` mode): the forward reads the FP8 buffers;
    a row-parallel layer still all-reduces before its bias."""

    fp8_granularity: str
    fp8_fused_bias: bool  # ``fuses_bias``: the GEMM adds the bias

    @property
    def fp8_row_input(self) -> bool:
        """Per-token activation scales: the layer takes the e4m3 rows a norm or SiLU·up left on its input
        (``fp8_rows``), and ``_mark_norms_feeding_fp8`` marks the norms it reads."""
        return self.fp8_granularity == "channel"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.bias if self.fp8_fused_bias else None
        rows = getattr(x, "fp8_rows", None) if self.fp8_row_input else None
        out = fp8_linear(x, self.fp8_weight, self.fp8_weight_scale, self.fp8_granularity, fused, rows)
        if isinstance(self, RowParallelLinear) and self.tp.size > 1:
            if not self.reduce:
                return out
            out = self.tp.all_reduce(out)
        return out if self.bias is None or fused is not None else out + self.bias


_FP8_CLASSES: dict[tuple[type, type], type] = {}


def _use_scaled_mm(target: Target, granularity: str) -> None:
    """Give the module its FP8 buffers and the FP8 forward (its class becomes a subclass of its own)."""
    _add_buffers(target, granularity)
    target.module.fp8_granularity = granularity
    target.module.fp8_fused_bias = fuses_bias(target, granularity)
    _swap_class(target.module, Fp8Forward)
    target.mode = "scaled_mm"


def _add_buffers(target: Target, granularity: str) -> None:
    """``fp8_<param>`` (e4m3) and ``fp8_<param>_scale`` (float32) beside each quantized parameter: buffers,
    so that they follow the model's ``.to`` (sleep level 2), kept out of state dicts."""
    for param in target.parts:
        weight = getattr(target.module, param)
        *lead, rows, cols = weight.shape
        if granularity == "channel":
            scale_shape = (*lead, rows, 1)
        else:  # columns padded for torch's block-wise GEMM (``padded_columns``), the padding staying 1
            scale_shape = (*lead, -(-rows // BLOCK), padded_columns(-(-cols // BLOCK)))
        qweight = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
        scales = torch.ones(scale_shape, dtype=torch.float32, device=weight.device)
        target.module.register_buffer(f"fp8_{param}", qweight, persistent=False)
        target.module.register_buffer(f"fp8_{param}_scale", scales, persistent=False)


def _release_model_dtype_weights(target: Target) -> None:
    """A module in a CUDA mode computes from its FP8 buffers and loads straight into them: free its
    model-dtype weights (an empty parameter of their dtype and device stays in their place)."""
    for param in target.parts:
        old = getattr(target.module, param)
        setattr(target.module, param, nn.Parameter(old.new_empty(0), requires_grad=False))


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Make ``module`` an instance of a subclass of its class with ``mixin``'s forward first."""
    cls = type(module)
    if (cls, mixin) not in _FP8_CLASSES:
        _FP8_CLASSES[cls, mixin] = type(f"Fp8{cls.__name__}", (mixin, cls), {})
    module.__class__ = _FP8_CLASSES[cls, mixin]


# ------------------------------------------------------------------------------------------ MoE experts
def experts_kernel_problem(target: Target, granularity: str) -> str | None:
    """Why these experts cannot run the fused Triton MoE kernels on e4m3 weights (None: they can)."""
    return kernel_problem(target.module, granularity)


def _use_experts_kernel(target: Target, granularity: str, mixin: type = Fp8ExpertsForward) -> None:
    _add_buffers(target, granularity)
    _swap_class(target.module, mixin)
    target.mode = "triton_fp8"
