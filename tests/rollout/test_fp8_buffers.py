"""The CUDA modes' bookkeeping of FP8 rollouts, on the CPU: the linear layers' ``scaled_mm`` mode and the
experts' ``triton_fp8`` mode hold e4m3 buffers and scales (their model-dtype weights freed) that every
weight sync quantizes its tensors into, in place (the addresses captured CUDA graphs read). Here their GEMMs are stood in for by the dequantized products, so the
engine must generate exactly what the emulated engine does, before and after a sync.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, cpu_config, greedy
from tests.rollout.test_fp8_engine import FP8_FAMILIES
from tidal.rollout import LLMEngine
from tidal.rollout.models import moe
from tidal.rollout.quant import gemm, linear
from tidal.rollout.quant.fp8 import dequantize, quantize


def _cpu_gemm(x, q, scales, granularity, bias=None, x_fp8=None):
    return F.linear(x, dequantize(q, scales, granularity, x.dtype), bias)


def _cpu_experts(self, x, weights, ids):
    gate_up = dequantize(self.fp8_gate_up_proj, self.fp8_gate_up_proj_scale, "channel", x.dtype)
    down = dequantize(self.fp8_down_proj, self.fp8_down_proj_scale, "channel", x.dtype)
    return moe.unfused_expert_forward(x, gate_up, down, weights, ids, self.act)


def _cpu_family_experts(self, x, weights, ids):
    """gpt-oss's experts on the dequantized buffers, with its own (grouped) arithmetic."""
    gate_up = dequantize(self.fp8_gate_up_proj, self.fp8_gate_up_proj_scale, "channel", x.dtype)
    down = dequantize(self.fp8_down_proj, self.fp8_down_proj_scale, "channel", x.dtype)
    return self.grouped_forward(x, weights, ids, gate_up, down)


def _take_cuda_modes(monkeypatch) -> None:
    """Every module takes its CUDA mode, with the stand-in GEMMs."""
    monkeypatch.setattr(linear, "scaled_mm_problem", lambda target, granularity: None)
    monkeypatch.setattr(linear, "experts_kernel_problem", lambda target, granularity: None)
    fuses = lambda target, granularity: granularity == "channel" and target.module.bias is not None  # noqa: E731
    monkeypatch.setattr(linear, "fuses_bias", fuses)
    monkeypatch.setattr(linear, "fp8_linear", _cpu_gemm)
    monkeypatch.setattr(linear.Fp8ExpertsForward, "forward", _cpu_experts)
    monkeypatch.setattr(linear.Fp8FamilyExpertsForward, "forward", _cpu_family_experts)


def _outputs(engine):
    outs = engine.generate(PROMPTS, greedy(8))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _per_expert(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A state dict with stacked experts split into checkpoint-style per-expert tensors (the sync then
    updates each expert, its gate and its up rows apart)."""
    out = []
    for name, tensor in state.items():
        block, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                out += [(f"{block}.{e}.gate_proj.weight", gate), (f"{block}.{e}.up_proj.weight", up)]
        elif kind == "down_proj" and block.endswith("experts"):
            out += [(f"{block}.{e}.down_proj.weight", t) for e, t in enumerate(tensor)]
        else:
            out.append((name, tensor))
    return out


def _buffers(engine) -> dict[str, int]:
    return {n: b.data_ptr() for n, b in engine.model.named_buffers() if ".fp8_" in n}


def _with_random_biases(path, out):
    """A copy of the tiny HF folder ``path`` whose biases are random (transformers initializes them to 0)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    gen = torch.Generator().manual_seed(len(str(out)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.copy_(torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(out))
    for extra in path.iterdir():  # the tokenizer's files
        if not (out / extra.name).exists():
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


# 128-row blocks need packed parts of multiples of 128 rows (``scaled_mm_problem``): heads of 128
BLOCK_SHAPES = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                "intermediate_size": 384}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "quantization", "overrides"),
    [
        ("llama", "fp8_block", BLOCK_SHAPES),
        ("qwen3_moe", "fp8", {}),
        ("qwen2", "fp8", {}),
        ("gpt_oss", "fp8", {}),
    ],
)
def test_buffers_are_rewritten_in_place_and_generate_as_the_emulated_engine(
    family, quantization, overrides, tiny_model, monkeypatch, tmp_path
):
    old, new = tiny_model(family, seed=0, **overrides), tiny_model(family, seed=1, **overrides)
    if family == "qwen2":  # its q/k/v biases, nonzero
        old, new = _with_random_biases(old, tmp_path / "old"), _with_random_biases(new, tmp_path / "new")
    emulated_old = _outputs(LLMEngine(old, cpu_config(quantization=quantization)))
    emulated_new = _outputs(LLMEngine(new, cpu_config(quantization=quantization)))
    _take_cuda_modes(monkeypatch)
    engine = LLMEngine(old, cpu_config(quantization=quantization))
    modes = engine.model.fp8.modes()
    assert set(modes) == (
        {"scaled_mm", "triton_fp8"} if "moe" in family or family == "gpt_oss" else {"scaled_mm"}
    )
    # qwen2's q/k/v biases (gpt-oss's too): the GEMM adds them (the stand-in as F.linear does), not the forward
    fused = {path for path, t in engine.model.fp8.targets.items() if getattr(t.module, "fp8_fused_bias", 0)}
    assert bool(fused) == (family in ("qwen2", "gpt_oss"))  # gpt-oss: biases on q/k/v and o
    assert all(p.endswith(("qkv_proj", "o_proj" if family == "gpt_oss" else "qkv_proj")) for p in fused)
    assert _outputs(engine) == emulated_old
    addresses = _buffers(engine)
    assert addresses
    for target in engine.model.fp8.targets.values():  # the model-dtype weights are freed (staged: kept)
        assert all((getattr(target.module, param).numel() == 0) != target.staged for param in target.parts)
    assert any(t.staged for t in engine.model.fp8.targets.values()) == (family == "gpt_oss")
    # a sync in two buckets that cut the packed projections (and, for the MoE, the experts) apart
    state = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).state_dict()
    weights = list(state.items()) if family == "gpt_oss" else _per_expert(state)  # its experts: stacked
    first = {
        n for n, _ in weights if "q_proj" in n or "gate_proj" in n or ".experts.0." in n or "layers.0." in n
    }
    engine.update_weights([(n, t) for n, t in weights if n in first])
    engine.update_weights([(n, t) for n, t in weights if n not in first])
    assert _buffers(engine) == addresses
    assert _outputs(engine) == emulated_new


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_every_family_s_sync_quantizes_into_the_buffers_a_fresh_load_fills(family, tiny_model, monkeypatch):
    """Each family's HF names (renames, packing, fused checkpoint projections, per-expert or stacked
    experts, shared experts) reach the buffers: after a sync they hold, bit for bit, a fresh FP8 engine's."""
    _take_cuda_modes(monkeypatch)
    old, new = tiny_model(family, seed=0), tiny_model(family, seed=1)
    engine = LLMEngine(old, cpu_config(quantization="fp8"))
    engine.update_weights(
        AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32).named_parameters()
    )
    fresh = LLMEngine(new, cpu_config(quantization="fp8"))
    # every module in its CUDA mode (gpt-oss's experts staged: their loader fills the model-dtype weights)
    targets = engine.model.fp8.targets.values()
    assert all(t.mode != "emulated" for t in targets)
    want = dict(fresh.model.named_buffers())
    for name, buffer in engine.model.named_buffers():
        if ".fp8_" in name:
            assert torch.equal(_raw(buffer), _raw(want[name])), name
    want = dict(fresh.model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, want[name]), name


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_fp8_linear_hands_torch_the_weight_buffers_themselves(monkeypatch, granularity):
    """``fp8_linear`` with ``torch._scaled_mm`` stood in for: the weight operand is the e4m3 buffer itself,
    column-major (``q.t()``: a view, no per-call copy), the scales are views of their buffer, the
    activation scales in the layout torch reads, and the product is the two-sided dequantized one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 256, generator=gen)
    q, scales = quantize(torch.randn(384, 256, generator=gen) * 0.1, granularity)
    if granularity == "block":
        scales = gemm.padded_block_scales(scales).contiguous()  # as the module's buffer is allocated
    seen = {}

    bias = torch.randn(384, generator=gen) if granularity == "channel" else None  # fused: channel only

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, use_fast_accum=False):
        seen.update(
            b=b, scale_b=scale_b, scale_a=scale_a, out_dtype=out_dtype, bias=bias, fast=use_fast_accum
        )
        if granularity == "block":  # [M, K/128] and [K/128, N/128 (+ padding)] -> per element
            scale_a = scale_a.repeat_interleave(128, 1)
            scale_b = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, : b.shape[1]]
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        return out if bias is None else out + bias

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    out = gemm.fp8_linear(x, q, scales, granularity, bias)
    assert seen["b"].data_ptr() == q.data_ptr() and seen["b"].stride() == (1, 256)  # column-major view
    assert seen["scale_b"].data_ptr() == scales.data_ptr() and seen["out_dtype"] == x.dtype
    assert seen["bias"] is bias
    assert seen["fast"] == (granularity == "channel")  # the row-wise GEMM accumulates as the Triton one does
    if granularity == "block":
        # 6 tokens padded to 128 (cuBLAS's block-wise GEMM refused 1 and 3000 tokens on the H200)
        assert seen["scale_a"].shape == (128, 2) and seen["scale_a"].stride() == (1, 128)
    weight = dequantize(q, scales[:, :2] if granularity == "block" else scales, granularity, x.dtype)
    want = F.linear(x, weight, bias)
    assert out.shape == (2, 3, 384)
    assert ((out - want).norm() / want.norm()).item() < 0.04  # the activations' own e4m3 rounding


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_fp8_linear_takes_the_triton_gemm_at_decode_and_torch_s_at_prefill(monkeypatch, granularity):
    """The routing of ``fp8_linear`` where Triton runs (stood in for here: this machine may have no Triton):
    a decode token count goes to ``triton_fp8_gemm.fp8_gemm`` with the weight buffer itself, its scales,
    the launch ``fp8_gemm_config`` picks and the bias; a prefill one (per-channel) to ``torch._scaled_mm``;
    block scales always to the Triton kernel."""
    import sys
    import types

    seen = []
    fake_gemm = types.ModuleType("triton_fp8_gemm")
    fake_quant = types.ModuleType("triton_fp8")

    def fp8_gemm(xq, xs, wq, ws, config, bias, out_dtype, block_scaled):
        seen.append(("triton", wq, ws, config, bias, block_scaled))
        return torch.zeros(xq.shape[0], wq.shape[0], dtype=out_dtype)

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, use_fast_accum=False):
        seen.append(("torch", b, scale_b, None, bias, False))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    fake_gemm.fp8_gemm = fp8_gemm
    fake_quant.quantize_rows_triton = lambda rows, group=None, padded=None: gemm.quantize_rows(rows, group)
    monkeypatch.setitem(sys.modules, "tidal.rollout.quant.triton_fp8_gemm", fake_gemm)
    monkeypatch.setitem(sys.modules, "tidal.rollout.quant.triton_fp8", fake_quant)
    monkeypatch.setattr(gemm, "triton_usable", lambda t: True)
    monkeypatch.setattr(gemm, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(0)
    q, scales = quantize(torch.randn(384, 256, generator=gen), granularity)
    bias = torch.randn(384, generator=gen) if granularity == "channel" else None
    for tokens in (8, 1024):
        out = gemm.fp8_linear(torch.randn(tokens, 256, generator=gen), q, scales, granularity, bias)
        assert out.shape == (tokens, 384)
    decode, prefill = seen
    assert decode[0] == "triton" and decode[1] is q and decode[2] is scales and decode[4] is bias
    assert decode[3] == gemm.gemm_config(8, 384, 256, 132, granularity == "block")
    assert decode[5] == (granularity == "block")
    assert prefill[0] == ("triton" if granularity == "block" else "torch")


def test_a_gpu_without_the_fp8_gemm_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    reason = "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic"
    notice = linear.fallback_notice("fp8_block", {reason: 112}, 112, torch.device("cuda", 0))
    assert notice == (
        "engine: --rollout_quantization fp8_block: 112 of 112 linear layers cannot run an FP8 GEMM on "
        f"NVIDIA H200 ({reason} (112 layers)), so they compute emulated (FP8-rounded weights in the model "
        "dtype: no speed-up, no memory saved); --rollout_quantization fp8 (per-channel scales) is the fast "
        "FP8 mode on this GPU"
    )
    assert "\n" not in notice and "per-channel" not in linear.fallback_notice("fp8", {reason: 3}, 112, None)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_experts_cuda_mode_runs_the_kernels_w8a8(family, tiny_model, monkeypatch):
    """The ``triton_fp8`` experts (``moe.Experts`` and gpt-oss's own) hand the fused MoE kernels their e4m3
    buffers and scales and ask for W8A8 (the activations quantized per row, as the dense FP8 linears do),
    not the weight-only variant; gpt-oss adds its biases and clamped SwiGLU."""
    pytest.importorskip("triton")
    from tidal.rollout.kernels import triton_moe
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    monkeypatch.setattr(linear, "scaled_mm_problem", lambda target, granularity: None)
    monkeypatch.setattr(linear, "experts_kernel_problem", lambda target, granularity: None)
    engine = LLMEngine(tiny_model(family), cpu_config(quantization="fp8"))
    seen = {}

    def fused(x, gate_up, down, weights, ids, **kw):
        seen.update(gate_up=gate_up, down=down, **kw)
        return torch.zeros_like(x)

    monkeypatch.setattr(triton_moe, "fused_expert_forward", fused)
    experts = engine.model.model.layers[0].mlp.experts
    hidden = experts.fp8_down_proj.shape[1]
    experts(torch.randn(3, hidden), torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 2], [2, 3]]))
    assert seen["quantize_activations"] is quantize_rows_triton
    assert seen["gate_up"] is experts.fp8_gate_up_proj and seen["down"] is experts.fp8_down_proj
    gate_up_scale, down_scale = seen["scales"]
    assert gate_up_scale.data_ptr() == experts.fp8_gate_up_proj_scale.data_ptr()
    assert down_scale.data_ptr() == experts.fp8_down_proj_scale.data_ptr()
    assert ("swiglu" in seen) == (family == "gpt_oss")
