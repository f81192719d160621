"""FP8 rollouts' Triton kernels run by Triton's interpreter on the CPU (skipped without triton, and where CUDA
runs the compiled kernels: tests/rollout/test_fp8_gpu.py covers them there).

- the fused MoE GEMMs on e4m3 experts (``triton_moe._moe_gemm`` with ``W_SCALED``), in float32
  activations: the dequantized reference up to float32 rounding, and far from it with another row's
  scales;
- the same GEMMs W8A8 (``A_SCALED``: the activations quantized per row, ``tl.dot`` on the e4m3 tiles; the
  interpreter runs an fp8 ``tl.dot`` by widening both tiles to float16, exactly): each launch against the
  float32 product of the very e4m3 operands and scales it was given (``w8a8_reference``, shared with the
  GPU tests), with and without gpt-oss's biases and clamped SwiGLU, and far from it when the kernel gets
  another row's activation scales;
- the activation quantization (``quant/triton_fp8.py``): its scales (bit-equal; on this input the
  reciprocal product and a division differ in 3 of 5 per-token scales) and their layout. The interpreter's
  own float32 -> e4m3 cast mis-rounds values whose rounding carries into the exponent (1.95 -> 1.0), so
  the e4m3 values themselves are compared on a GPU only (the W8A8 references above read whatever e4m3
  values the launch produced, so they do not depend on that cast).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.models.gpt_oss import clamped_swiglu
from tidal.rollout.models.moe import route_torch, unfused_expert_forward
from tidal.rollout.quant.fp8 import dequantize, quantize, quantize_rows


class QuantizeSpy:
    """``fused_expert_forward``'s activation quantizer (W8A8): runs ``quantize_rows_triton`` and records each call's (input, e4m3 values, scales). ``wrong`` (a call index) hands the kernel
    other rows' scales in that call: those of the next row of ``rows`` (the rows the kernel reads)."""

    def __init__(self, quantize_rows_triton, wrong: int | None = None, rows: torch.Tensor | None = None):
        self.quantize, self.wrong, self.rows = quantize_rows_triton, wrong, rows
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, a, group=None, padded=None):
        q, scales = self.quantize(a, group, padded)
        self.calls.append((a.clone(), q, scales.clone()))
        if self.wrong == len(self.calls) - 1:
            scales = scales.clone()
            scales[self.rows] = scales[self.rows.roll(1)]
        return q, scales


def read_rows(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded rows that hold a pair, those pairs) of ``triton_moe``'s alignment (its torch version,
    bit-equal to the kernel's)."""
    from tidal.rollout.kernels.triton_moe import align_pairs_torch

    aligned = align_pairs_torch(ids, num_experts, block_m)
    rows = (aligned.sorted_pairs < aligned.num_pairs).nonzero()[:, 0]
    return rows, aligned.sorted_pairs[rows].long()


def w8a8_reference(calls, ids, weights, gate_up, down, block_m, biases=None, swiglu=None):
    """The W8A8 launches' float32 products of exactly the e4m3 operands they were given: ``calls`` (a
    ``QuantizeSpy``'s: the tokens' quantization, then the gated output's) and the dequantized float32
    weights ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]. Returns (the padded rows holding a pair, the
    gated output at those rows, the forward's output in float32)."""
    (_, xq, xs), (_, iq, i_s) = calls
    num_tokens, top_k = ids.shape
    rows, pairs = read_rows(ids, gate_up.shape[0], block_m)
    experts = ids.reshape(-1)[pairs]
    a = xq.float()[pairs // top_k] * xs[pairs // top_k]
    a_down = iq.float()[rows] * i_s[rows]
    gated = a.new_empty(len(rows), gate_up.shape[1] // 2)
    out = a.new_empty(len(rows), down.shape[1])
    for expert in experts.unique().tolist():
        mine = experts == expert
        gate, up = (a[mine] @ gate_up[expert].t() + (biases[0][expert].float() if biases else 0)).chunk(2, -1)
        gated[mine] = clamped_swiglu(gate, up, swiglu.alpha, swiglu.limit) if swiglu else F.silu(gate) * up
        out[mine] = a_down[mine] @ down[expert].t() + (biases[1][expert].float() if biases else 0)
    per_pair = a.new_zeros(num_tokens * top_k, down.shape[1])
    per_pair[pairs] = out * weights.reshape(-1)[pairs].float()[:, None]
    return rows, gated, per_pair.view(num_tokens, top_k, -1).sum(dim=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def kernels():
    """``triton_moe`` and ``triton_fp8`` with their kernels interpreted (after the e4m3 helpers ``triton_fp8``
    imports)."""
    modules = {
        "tidal.rollout.kernels.triton_e4m3": "e4m3_scale",
        "tidal.rollout.kernels.triton_moe": "_moe_gemm",
        "tidal.rollout.quant.triton_fp8": "_quantize_rows_kernel",
    }
    with interpreted(modules) as (_, moe_kernels, fp8_kernels):
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
    x[1, :128] = 0
    x[1, 5] = 1e-44  # a group whose scale underflows to 0: the capped reciprocal, zeros not NaN
    q, scales = fp8_kernels.quantize_rows_triton(x, group)
    want_q, want_scales = quantize_rows(x, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape
    # (not the e4m3 bits: Triton's interpreter rounds a value just below a power of two down a binade, 124
    # to 64 not 128, and float32 subnormals to nonzero; tests/rollout/test_fp8_gpu.py compares the bits on
    # the GPU)
    assert not q.float().isnan().any()
    if group is not None:
        assert scales[1, 0].item() == 0.0 and (q[1, :128].float() == 0).all()
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


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("tokens", [1, 7])
def test_w8a8_fused_moe_is_the_product_of_its_e4m3_operands(kernels, tokens, gpt_oss):
    """W8A8: one quantization launch before each GEMM launch, and each launch's output the float32 product
    of the e4m3 activations and weights it read with both scales (then bias, activation, routing weight)."""
    moe_kernels, fp8_kernels = kernels
    gen = torch.Generator().manual_seed(tokens + 10 * gpt_oss)
    experts, hidden, inter, top_k = 4, 64, 32, 2
    x = torch.randn(tokens, hidden, generator=gen) * 4 ** (2 * torch.rand(tokens, 1, generator=gen) - 1)
    rows = 4 ** (2 * torch.rand(experts, 2 * inter, 1, generator=gen) - 1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.5 * rows
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    weights, ids = route_torch(torch.randn(tokens, experts, generator=gen), top_k, True, True)
    q_gu, s_gu = quantize(gate_up, "channel")
    q_d, s_d = quantize(down, "channel")
    extra = {}
    if gpt_oss:  # biases, and pre-activations past the clamp (limit 7)
        biases = (torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen))
        extra = dict(biases=biases, swiglu=moe_kernels.ClampedSwiGLU(alpha=1.702, limit=7.0))
    config = moe_kernels.TileConfig(16, 32, 32, num_warps=4, num_stages=2)
    spy = QuantizeSpy(fp8_kernels.quantize_rows_triton)
    got = moe_kernels.fused_expert_forward(
        x, q_gu, q_d, weights, ids, config, (s_gu[..., 0], s_d[..., 0]), quantize_activations=spy, **extra
    )
    assert len(spy.calls) == 2 and torch.equal(spy.calls[0][0], x)  # the tokens, then the gated output
    assert all(q.dtype == torch.float8_e4m3fn for _, q, _ in spy.calls)
    deq_gu, deq_d = (dequantize(q, s, "channel", torch.float32) for q, s in ((q_gu, s_gu), (q_d, s_d)))
    used, gated, want = w8a8_reference(spy.calls, ids, weights, deq_gu, deq_d, 16, **extra)
    if gpt_oss:
        assert (gated.abs() > 0).all() and (spy.calls[1][0][used].abs().amax() > 7)  # the clamp bites
    assert rel(spy.calls[1][0][used], gated) < 1e-5
    assert rel(got, want) < 1e-5
    # not the weight-only (W8A16, no quantizer) product: the activations' own e4m3 rounding shows
    w8a16 = moe_kernels.fused_expert_forward(
        x, q_gu, q_d, weights, ids, config, (s_gu[..., 0], s_d[..., 0]), **extra
    )
    assert rel(w8a16, want) > 1e-3


@pytest.mark.parametrize("launch", [0, 1])
def test_w8a8_fused_moe_reads_each_row_s_own_activation_scale(kernels, launch):
    """The gated launch (0) reads the tokens' scales, the down launch (1) the padded rows': handed the next
    row's scales, that launch is far from the reference and the other one still on it."""
    moe_kernels, fp8_kernels = kernels
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k, tokens = 4, 64, 32, 2, 7
    x = torch.randn(tokens, hidden, generator=gen) * 4 ** (2 * torch.rand(tokens, 1, generator=gen) - 1)
    q_gu, s_gu = quantize(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.5, "channel")
    q_d, s_d = quantize(torch.randn(experts, hidden, inter, generator=gen) * 0.2, "channel")
    weights, ids = route_torch(torch.randn(tokens, experts, generator=gen), top_k, True, True)
    config = moe_kernels.TileConfig(16, 32, 32, num_warps=4, num_stages=2)
    rows = torch.arange(tokens) if launch == 0 else read_rows(ids, experts, 16)[0]
    spy = QuantizeSpy(fp8_kernels.quantize_rows_triton, wrong=launch, rows=rows)
    got = moe_kernels.fused_expert_forward(
        x, q_gu, q_d, weights, ids, config, (s_gu[..., 0], s_d[..., 0]), quantize_activations=spy
    )
    deq_gu, deq_d = (dequantize(q, s, "channel", torch.float32) for q, s in ((q_gu, s_gu), (q_d, s_d)))
    used, gated, want = w8a8_reference(spy.calls, ids, weights, deq_gu, deq_d, 16)
    # the launch given wrong scales is off (the reference of the down launch reads the gated output the
    # kernel produced, so a wrong gated launch shows in that output only)
    assert rel(spy.calls[1][0][used] if launch == 0 else got, gated if launch == 0 else want) > 0.1
    assert rel(got if launch == 0 else spy.calls[1][0][used], want if launch == 0 else gated) < 1e-5
