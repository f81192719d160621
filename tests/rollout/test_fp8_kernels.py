"""FP8 rollouts' Triton kernels run by Triton's interpreter on the CPU (skipped without triton, and where CUDA
runs the compiled kernels: tests/rollout/test_fp8_gpu.py covers them there).

- the fused MoE GEMMs on e4m3 experts (``triton_moe._moe_gemm`` with ``W_SCALED``), in float32
  activations: the dequantized reference up to float32 rounding, and far from it with another row's
  scales;
- the activation quantization (``quant/triton_fp8.py``): its scales (bit-equal; on this input the
  reciprocal product and a division differ in 3 of 5 per-token scales) and their layout. The interpreter's
  own float32 -> e4m3 cast mis-rounds values whose rounding carries into the exponent (1.95 -> 1.0), so
  the e4m3 values themselves are compared on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.models.moe import route_torch, unfused_expert_forward
from tidal.rollout.quant.fp8 import dequantize, quantize, quantize_rows


@pytest.fixture(scope="module")
def kernels():
    """``triton_moe`` and ``triton_fp8`` with their kernels interpreted."""
    modules = {
        "tidal.rollout.kernels.triton_moe": "_moe_gemm",
        "tidal.rollout.quant.triton_fp8": "_quantize_rows_kernel",
    }
    with interpreted(modules) as (moe_kernels, fp8_kernels):
        yield moe_kernels, fp8_kernels


@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_moe_on_e4m3_experts_is_the_dequantized_reference(kernels, tokens):
    moe_kernels, _ = kernels
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 4, 64, 32, 2
    x = torch.randn(tokens, hidden, generator=gen)
    rows = 4 ** (2 * torch.rand(experts, 2 * inter, 1, generator=gen) - 1)  # rows of different sizes
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1 * rows
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    weights, ids = route_torch(torch.randn(tokens, experts, generator=gen), top_k, True, True)
    q_gu, s_gu = quantize(gate_up, "channel")
    q_d, s_d = quantize(down, "channel")
    reference = unfused_expert_forward(
        x, dequantize(q_gu, s_gu, "channel", torch.float32), dequantize(q_d, s_d, "channel", torch.float32),
        weights, ids, F.silu,
    )  # fmt: skip

    def fused(gate_up_scales):
        out = moe_kernels.fused_expert_forward(
            x, q_gu, q_d, weights, ids, scales=(gate_up_scales, s_d[..., 0])
        )
        return ((out - reference).norm() / reference.norm()).item()

    assert fused(s_gu[..., 0]) < 1e-5
    assert fused(s_gu.flip(1)[..., 0]) > 0.3


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_scales_and_layout(kernels, group):
    _, fp8_kernels = kernels
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :128] = 0  # an all-zero group: scale 1
    q, scales = fp8_kernels.quantize_rows_triton(x, group)
    want_q, want_scales = quantize_rows(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape
    assert torch.equal(scales, want_scales)
    assert scales.stride() == ((1, 1) if group is None else (1, 5))  # [M, K/128] outer-dimension-major
    if group is not None:
        assert scales[0, 0].item() == 1.0


def test_activation_quantization_pads_rows_with_zeros(kernels, monkeypatch):
    """``padded``: the block GEMM's extra rows, written by the same launch as zeros with scale 1 (the
    outputs start filled with 3s, so nothing passes unwritten)."""
    _, fp8_kernels = kernels
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kw: empty(*args, **kw).fill_(3))
    q, scales = fp8_kernels.quantize_rows_triton(x, 128, padded=8)
    monkeypatch.undo()
    want_q, want_scales = fp8_kernels.quantize_rows_triton(x, 128)
    assert q.shape == (8, 256) and scales.shape == (8, 2) and scales.stride() == (1, 8)
    assert torch.equal(scales[:5], want_scales) and torch.equal(
        q[:5].view(torch.uint8), want_q.view(torch.uint8)
    )
    assert (q[5:].float() == 0).all() and (scales[5:] == 1).all()
