"""FP8 rollouts quantize a linear layer's input in the kernel that writes it: the RMSNorm before ``qkv_proj``
and ``gate_up_proj`` (``triton_norm.add_rms_norm_fp8``) and the SiLU·up before ``down_proj``
(``triton_fused.silu_and_mul_fp8``) leave the e4m3 rows and scales on their output (``fp8_rows``), and the
FP8 layer takes them instead of launching ``triton_fp8``'s quantization (3 of its 4 launches per layer).

- the fused kernels, run by Triton's interpreter (skipped without triton or with CUDA, where
  ``test_fp8_gpu.py`` runs them compiled): their outputs are the plain kernels' and their e4m3 rows and
  scales bit-equal to ``quantize_rows_triton`` of those outputs (the interpreter's e4m3 cast is the same
  in both, so the comparison holds on its mis-rounded values too), the scales to torch's ``quantize_rows``;
- which norms are marked (``quant.linear``): those an FP8 layer with per-token scales reads, per layer as
  the layer class declares (``fp8_feeds``), not for block scales, not the final norm;
- ``gemm.fp8_linear`` hands those rows to the GEMM (Triton's at decode, torch's at prefill) and does not
  quantize again.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.rollout.reference import cpu_config
from tests.rollout.test_fp8_buffers import _take_cuda_modes
from tests.rollout.triton_interpreter import interpreted
from tidal.rollout import LLMEngine
from tidal.rollout.models.layers import RMSNorm
from tidal.rollout.quant import gemm
from tidal.rollout.quant.fp8 import quantize, quantize_rows


@pytest.fixture(scope="module")
def kernels():
    """(``triton_fp8``, ``triton_fused``, ``triton_norm``) interpreted, after the e4m3 helpers they import."""
    names = {
        "tidal.rollout.kernels.triton_e4m3": "e4m3_scale",
        "tidal.rollout.quant.triton_fp8": "_quantize_rows_kernel",
        "tidal.rollout.models.triton_fused": "_silu_and_mul_fp8_kernel",
        "tidal.rollout.models.triton_norm": "_add_rms_norm_kernel",
    }
    with interpreted(names) as (_, *modules):
        yield modules


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [None, 1.0])  # Llama's rounding, Gemma's float32 scaling
@pytest.mark.parametrize("width", [96, 200])
def test_the_norm_quantizes_the_rows_it_writes_as_the_quantization_launch_would(
    kernels, residual, offset, width
):
    fp8, _, norm = kernels
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(6, width, generator=gen) * 4).half()
    x[2] = 0  # an all-zero row (scale 1), with the residual also zero there
    res = (torch.randn(6, width, generator=gen) * 4).half() if residual else None
    if res is not None:
        res[2] = 0
    weight = (torch.rand(width, generator=gen) + 0.5).half()
    out, total, (q, scales) = norm.add_rms_norm_fp8(x, weight, 1e-6, res, offset)
    want_out, want_total = norm.add_rms_norm(x, weight, 1e-6, res, offset)
    assert same_bits(out, want_out) and same_bits(total, want_total)
    want_q, want_scales = fp8.quantize_rows_triton(want_out)
    assert same_bits(q, want_q) and same_bits(scales, want_scales)
    assert same_bits(scales, quantize_rows(want_out)[1]) and scales[2].item() == 1.0
    assert q.shape == (6, width) and scales.shape == (6, 1)


# (width, the launch it takes): one 1024-column block with a masked tail; five of them (the narrow launch,
# 0.5B's rows are 4,864 wide); three 4096-column blocks (the wide launch, 7B's 18,944)
@pytest.mark.parametrize(("width", "launch"), [(300, "narrow"), (5000, "narrow"), (9000, "wide")])
def test_silu_and_mul_quantizes_the_rows_it_writes_as_the_quantization_launch_would(kernels, width, launch):
    fp8, fused, _ = kernels
    assert fused.silu_fp8_launch(width) == {"narrow": (1024, 8), "wide": (4096, 16)}[launch]
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(3, 2 * width, generator=gen) * 3).half()
    gate_up[1] = 0
    out, (q, scales) = fused.silu_and_mul_fp8(gate_up)
    want_out = fused.silu_and_mul(gate_up)
    assert same_bits(out, want_out)
    want_q, want_scales = fp8.quantize_rows_triton(want_out)
    assert same_bits(q, want_q) and same_bits(scales, want_scales)
    assert same_bits(scales, quantize_rows(want_out)[1]) and scales[1].item() == 1.0


def test_a_fixed_silu_launch_overrides_the_width_rule(kernels, monkeypatch):
    _, fused, _ = kernels
    assert fused.silu_fp8_launch(4864) == (1024, 8) and fused.silu_fp8_launch(18944) == (4096, 16)
    monkeypatch.setattr(fused, "SILU_FP8_LAUNCH", (2048, 4))
    assert fused.silu_fp8_launch(4864) == fused.silu_fp8_launch(18944) == (2048, 4)


def test_no_rows(kernels):
    _, fused, norm = kernels
    out, (q, scales) = fused.silu_and_mul_fp8(torch.zeros(0, 64, dtype=torch.half))
    assert out.shape == (0, 32) and q.shape == (0, 32) and scales.shape == (0, 1)
    out, _, (q, scales) = norm.add_rms_norm_fp8(
        torch.zeros(0, 64, dtype=torch.half), torch.ones(64).half(), 1e-6
    )
    assert out.shape == (0, 64) and q.shape == (0, 64) and scales.shape == (0, 1)


def _marked(engine) -> dict[str, bool]:
    return {path: m.feeds_fp8 for path, m in engine.model.named_modules() if isinstance(m, RMSNorm)}


@pytest.mark.parametrize(
    ("family", "attention_norm", "mlp_norm"),
    [
        ("qwen2", "input_layernorm", "post_attention_layernorm"),
        ("qwen3_moe", "input_layernorm", "post_attention_layernorm"),
        ("gemma2", "input_layernorm", "pre_feedforward_layernorm"),
    ],
)
def test_the_norms_an_fp8_layer_reads_are_marked(family, attention_norm, mlp_norm, tiny_model, monkeypatch):
    """Per layer, the norm before attention and the one before a dense MLP; not before a sparse MLP (the
    experts quantize their own rows), not the final norm or q/k head norms."""
    _take_cuda_modes(monkeypatch)
    engine = LLMEngine(tiny_model(family), cpu_config(quantization="fp8"))
    want = set()
    for index, layer in enumerate(engine.model.model.layers):
        want.add(f"model.layers.{index}.{attention_norm}")
        if hasattr(layer.mlp, "gate_up_proj"):
            want.add(f"model.layers.{index}.{mlp_norm}")
    marked = _marked(engine)
    assert {path for path, on in marked.items() if on} == want
    assert len(want) < len(marked) and (
        family != "qwen3_moe" or len(want) < 2 * len(engine.model.model.layers)
    )
    # 128 x 128 block scales: the GEMM quantizes per 128 columns, so no norm quantizes for it
    assert not any(_marked(LLMEngine(tiny_model(family), cpu_config(quantization="fp8_block"))).values())


def test_an_emulated_engine_marks_no_norm(tiny_model):
    assert not any(_marked(LLMEngine(tiny_model("qwen2"), cpu_config(quantization="fp8"))).values())


@pytest.mark.parametrize("tokens", [8, 1024])  # Triton's GEMM at decode, torch._scaled_mm at prefill
def test_fp8_linear_hands_the_gemm_the_rows_its_input_carries(monkeypatch, tokens):
    seen = []

    def fp8_gemm(xq, xs, wq, ws, config, bias, out_dtype, block_scaled):
        seen.append((xq, xs))
        return torch.zeros(xq.shape[0], wq.shape[0], dtype=out_dtype)

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None, use_fast_accum=False):
        seen.append((a, scale_a))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    def no_quantization(*args, **kwargs):
        raise AssertionError("quantized again")

    fake_gemm = types.ModuleType("triton_fp8_gemm")
    fake_gemm.fp8_gemm = fp8_gemm
    monkeypatch.setitem(sys.modules, "tidal.rollout.quant.triton_fp8_gemm", fake_gemm)
    monkeypatch.setattr(gemm, "triton_usable", lambda t: True)
    monkeypatch.setattr(gemm, "sm_count", lambda device: 132)
    monkeypatch.setattr(gemm, "_quantize_activations", no_quantization)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(0)
    q, scales = quantize(torch.randn(384, 256, generator=gen), "channel")
    x = torch.randn(tokens, 256, generator=gen)
    rows = quantize_rows(x)
    out = gemm.fp8_linear(x, q, scales, "channel", None, rows)
    assert out.shape == (tokens, 384)
    assert len(seen) == 1 and seen[0][0] is rows[0] and seen[0][1] is rows[1]


def test_an_fp8_layer_passes_on_the_rows_its_input_carries(tiny_model, monkeypatch):
    """``Fp8Forward`` gives ``fp8_linear`` the ``fp8_rows`` of its input (per-token scales), and nothing
    for an input without them."""
    from tidal.rollout.quant import linear

    _take_cuda_modes(monkeypatch)
    engine = LLMEngine(tiny_model("qwen2"), cpu_config(quantization="fp8"))
    layer = engine.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    seen = []
    monkeypatch.setattr(
        linear, "fp8_linear", lambda x, q, s, g, bias=None, rows=None: seen.append(rows) or x @ q.float().t()
    )
    x = torch.randn(3, layer.fp8_weight.shape[1])
    layer(x)
    x.fp8_rows = quantize_rows(x)
    layer(x)
    assert seen == [None, x.fp8_rows]
