"""FP8 rollouts' fused activation quantization on CUDA (skipped without a GPU; the interpreter runs the same
kernels on the CPU in ``test_fp8_fused_quant.py``): the RMSNorm and SiLU·up kernels that also write their
output's e4m3 rows and per-token scales, at 7B and 0.5B widths in bf16, against torch's ``quantize_rows``
of the output bit for bit (the output itself is the plain kernel's, but for the float32-scaled norm, which
the compiler builds a little differently with the quantization: one bf16 ulp on a few values); and an FP8 engine that takes those rows generating the very tokens and
log-probs it generates when each layer quantizes its own input, with one quantization launch per layer
left (``o_proj``'s) instead of four.
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, greedy

pytestmark = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("offset", [None, 1.0])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("tokens", "width"), [(1, 3584), (256, 3584), (37, 896)])
def test_the_fused_norm_quantization_is_torch_s_bit_for_bit(offset, residual, tokens, width):
    from tidal.rollout.models.triton_norm import add_rms_norm, add_rms_norm_fp8
    from tidal.rollout.quant.fp8 import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, width, device="cuda", generator=gen) * 4).bfloat16()
    res = (torch.randn(tokens, width, device="cuda", generator=gen) * 4).bfloat16() if residual else None
    weight = (torch.rand(width, device="cuda", generator=gen) + 0.5).bfloat16()
    out, total, (q, scales) = add_rms_norm_fp8(x, weight, 1e-6, res, offset)
    want_out, want_total = add_rms_norm(x, weight, 1e-6, res, offset)
    assert torch.equal(total, want_total)
    if offset is None:  # Llama's rounding (Qwen2.5, Llama): the plain kernel's bits
        assert torch.equal(out, want_out)
    else:  # the float32 scaling compiled with the quantization: 2 of 917,504 values one bf16 ulp apart (H200)
        apart = out != want_out
        assert apart.float().mean() < 1e-4
        assert ((out.float() - want_out.float()).abs() <= want_out.float().abs() * 2**-7)[apart].all()
    want_q, want_scales = quantize_rows(out)  # the rows it stored, quantized by torch
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(scales, want_scales)


@pytest.mark.parametrize(("tokens", "width"), [(1, 4864), (37, 18944), (256, 18944)])
def test_the_fused_silu_and_mul_quantization_is_torch_s_bit_for_bit(tokens, width):
    from tidal.rollout.models.triton_fused import silu_and_mul, silu_and_mul_fp8
    from tidal.rollout.quant.fp8 import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * width, device="cuda", generator=gen) * 3).bfloat16()
    gate_up[0] = 0  # an all-zero row: scale 1
    out, (q, scales) = silu_and_mul_fp8(gate_up)
    want_out = silu_and_mul(gate_up)
    assert torch.equal(out, want_out)
    want_q, want_scales = quantize_rows(want_out)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(scales, want_scales)
    assert scales[0].item() == 1.0


def test_an_engine_taking_the_fused_rows_generates_what_one_quantizing_per_layer_does(monkeypatch):
    from transformers import AutoModelForCausalLM

    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.rollout.quant import gemm
    from tidal.rollout.quant.linear import Fp8Forward
    from tidal.testing.tiny import tiny_config

    config = tiny_config("qwen2", vocab_size=151936, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    settings = EngineConfig(
        device="cuda", dtype="bfloat16", quantization="fp8", max_model_len=256, enforce_eager=True
    )
    engine = LLMEngine(config=settings, model=weights)
    launches = []
    quantize = gemm._quantize_activations
    monkeypatch.setattr(
        gemm, "_quantize_activations", lambda *a, **k: launches.append(1) or quantize(*a, **k)
    )

    def run(fused: bool):
        monkeypatch.setattr(Fp8Forward, "fp8_row_input", fused)  # False: each layer quantizes its own input
        launches.clear()
        outs = engine.generate(PROMPTS, greedy(12))
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(launches)

    fused, fused_launches = run(True)
    plain, plain_launches = run(False)
    assert fused == plain
    layers = config.num_hidden_layers
    assert plain_launches == 4 * fused_launches and fused_launches % layers == 0  # o_proj's alone is left
