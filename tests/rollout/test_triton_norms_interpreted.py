"""The float32-scaled RMSNorm (Gemma, Qwen3.5; ``triton_norm``) and Qwen3.5's gated norm and decay/beta
kernels (``triton_gated_norm``) run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``; skipped
without triton or with CUDA, where ``test_triton_norms_gpu.py`` runs the compiled kernels).

Two references per kernel:

- ``torch.equal`` against the torch ops with the kernel's sum of squares: the interpreter's ``tl.sum`` is
  numpy's pairwise sum over the zero-padded block, which no torch op reproduces, so the reference takes
  that one number from numpy and computes everything else (torch's CUDA mean ``sum * fl(1 / n)``, rsqrt,
  the scaling and each rounding) as the module does. numpy's ``exp`` stands in for libdevice's here, so
  SiLU / sigmoid / softplus take numpy's too. This checks the op order, roundings, masks and strides.
- the module's own torch path (what the CPU engine runs): float32 to 8 float32 ulps (another sum order;
  the CPU mean divides by n; torch's CPU exp), float16 to one ulp, nearly all elements equal.

float16 and float32 only: the interpreter's float32 -> bfloat16 cast truncates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.rollout.reference import PROMPTS
from tests.rollout.triton_interpreter import interpreted
from tests.spies import count_calls
from tidal.rollout.models import layers
from tidal.rollout.models.gemma2 import GemmaRMSNorm
from tidal.rollout.models.qwen3_5 import GatedDeltaNet, GatedRMSNorm

EPS = 1e-6


@pytest.fixture(scope="module")
def kernels():
    """(``triton_norm``, ``triton_gated_norm``) interpreted (``triton_fused`` first: both import from it)."""
    names = {
        "tidal.rollout.kernels.triton_e4m3": "e4m3_scale",
        "tidal.rollout.models.triton_fused": "_rope_store_kv_kernel",
        "tidal.rollout.models.triton_norm": "_add_rms_norm_kernel",
        "tidal.rollout.models.triton_gated_norm": "_gated_rms_norm_kernel",
    }
    with interpreted(names) as (_, _, norm, gated):
        yield norm, gated


def kernel_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of float32 squares as the interpreted ``tl.sum`` adds them: numpy over the row padded
    with zeros to the kernel's power-of-two block. [..., n] -> [..., 1] float32."""
    rows = x.float().reshape(-1, x.shape[-1]).numpy()
    block = 1 << (x.shape[-1] - 1).bit_length()
    padded = np.zeros((rows.shape[0], block), np.float32)
    padded[:, : x.shape[-1]] = rows
    sums = [np.sum(row * row) for row in padded]  # one 1-D sum per program
    return torch.tensor(np.array(sums, np.float32)).view(*x.shape[:-1], 1)


def cuda_mean_inv(x: torch.Tensor) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) with the kernel's sum and torch's CUDA mean (the sum times fl(1 / n))."""
    inv_n = torch.tensor(1.0) / x.shape[-1]  # float32, as MeanOps' factor
    return torch.rsqrt(kernel_sum_of_squares(x) * inv_n + EPS)


def numpy_silu(z: torch.Tensor) -> torch.Tensor:
    z32 = z.float().numpy()
    return torch.from_numpy(z32 / (np.float32(1) + np.exp(-z32)))


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype float tensors (same signs)."""
    int_dtype = {torch.float32: torch.int32, torch.float16: torch.int16}[a.dtype]
    return (a.view(int_dtype).long() - b.view(int_dtype).long()).abs().max().item() if a.numel() else 0


def assert_near_module(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Against the module's own torch path: float32 within 8 ulps (another sum order; torch's CPU exp in
    SiLU), a tiny absolute slack for values near zero; float16 within 1 ulp, 99% of elements equal."""
    out, ref = out.detach(), ref.detach()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    else:
        assert ulps(out, ref) <= 1
        assert (out != ref).float().mean().item() < 0.01


def gemma_norm(dim: int, dtype, gen) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(dim, EPS).to(dtype)
    norm.weight.data = (torch.randn(dim, generator=gen) * 0.3).to(dtype)
    return norm


# (rows, width): odd widths (masked columns: 96 of a 128 block, 2560 of 4096), one row, head-norm shapes.
SHAPES = [(5, 96), (1, 2560), (3, 8), (4, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, width", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gemma_norm_interpreted(kernels, dtype, rows, width, residual):
    norm_module, _ = kernels
    gen = torch.Generator().manual_seed(rows * width)
    norm = gemma_norm(width, dtype, gen)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    res = (torch.randn(rows, width, generator=gen) * 3).to(dtype) if residual else None
    out, total = norm_module.add_rms_norm(x, norm.weight, EPS, res, weight_offset=1.0)
    ref_total = x + res if residual else x
    assert torch.equal(total, ref_total)  # the residual stream: torch's rounded add
    x32 = ref_total.float()
    exact_ref = ((x32 * cuda_mean_inv(ref_total)) * (1.0 + norm.weight.float())).to(dtype)
    assert torch.equal(out, exact_ref), (out.float() - exact_ref.float()).abs().max().item()
    assert_near_module(out, norm._norm(ref_total))
    # Rounding the normalised value before the scaling (the default RMSNorm's order) is told apart.
    early = ((x32 * cuda_mean_inv(ref_total)).to(dtype).float() * (1.0 + norm.weight.float())).to(dtype)
    assert dtype == torch.float32 or not torch.equal(out, early)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemma_head_norms_of_a_packed_projection_interpreted(kernels, dtype):
    """Qwen3.5's q norm reads the query half of each (query, gate) head pair in place: a 3-D view whose
    rows are not evenly spaced in memory as a 2-D tensor would be; also a plain 3-D contiguous k."""
    norm_module, _ = kernels
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 3, 4, 96
    norm = gemma_norm(head_dim, dtype, gen)
    q_gate = (torch.randn(tokens, heads, 2, head_dim, generator=gen) * 2).to(dtype)
    q = q_gate[:, :, 0]
    assert not q.is_contiguous()
    assert norm_module.row_layout(q)[0].data_ptr() == q.data_ptr()  # no copy
    out, _ = norm_module.add_rms_norm(q, norm.weight, EPS, None, weight_offset=1.0)
    exact_ref = ((q.float() * cuda_mean_inv(q)) * (1.0 + norm.weight.float())).to(dtype)
    assert out.shape == q.shape and torch.equal(out, exact_ref)
    packed = (torch.randn(tokens, 7 * head_dim, generator=gen) * 2).to(dtype)  # k: heads 2..4 of a row
    k = packed[:, 2 * head_dim : 5 * head_dim].view(tokens, 3, head_dim)
    out, _ = norm_module.add_rms_norm(k, norm.weight, EPS, None, weight_offset=1.0)
    assert torch.equal(out, ((k.float() * cuda_mean_inv(k)) * (1.0 + norm.weight.float())).to(dtype))


def test_float32_scaling_without_offset_interpreted(kernels):
    """``scale_in_float32`` with a plain weight (GPT-OSS): offset 0."""
    norm_module, _ = kernels
    gen = torch.Generator().manual_seed(5)
    norm = layers.RMSNorm(96, EPS, scale_in_float32=True).half()
    norm.weight.data = (torch.randn(96, generator=gen) + 1).half()
    x = (torch.randn(6, 96, generator=gen) * 3).half()
    out, _ = norm_module.add_rms_norm(x, norm.weight, EPS, None, weight_offset=0.0)
    assert torch.equal(out, (norm.weight.float() * (x.float() * cuda_mean_inv(x))).half())
    assert_near_module(out, norm._norm(x))


def test_default_rms_norm_is_unchanged_interpreted(kernels):
    """The default rounding (Llama) still divides by n and rounds before the weight; 3-D views too."""
    norm_module, _ = kernels
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(64, generator=gen) + 1).half()
    x = (torch.randn(4, 3, 2, 64, generator=gen) * 3).half()[:, :, 1]
    inv = torch.rsqrt(kernel_sum_of_squares(x) / 64 + EPS)
    out, _ = norm_module.add_rms_norm(x, weight, EPS)
    assert torch.equal(out, weight * (x.float() * inv).half())


def gated_reference(x, z, weight):
    """``GatedRMSNorm.forward`` with the kernel's sum and the interpreter's SiLU."""
    normed = (x.float() * cuda_mean_inv(x)).to(x.dtype)
    return (weight * normed * numpy_silu(z)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, heads, v_dim", [(3, 4, 24), (1, 2, 96), (5, 3, 128)])
def test_gated_norm_interpreted(kernels, dtype, tokens, heads, v_dim):
    """Value heads [T, H, V] and z a head view of the packed projection (read in place)."""
    _, gated = kernels
    gen = torch.Generator().manual_seed(tokens * v_dim)
    norm = GatedRMSNorm(v_dim, EPS).to(dtype)
    norm.weight.data = (torch.randn(v_dim, generator=gen) * 0.5 + 1).to(dtype)
    x = (torch.randn(tokens, heads, v_dim, generator=gen) * 0.3).to(dtype)
    packed = (torch.randn(tokens, (2 * heads + 3) * v_dim, generator=gen) * 3).to(dtype)
    z = packed[:, heads * v_dim : 2 * heads * v_dim].view(tokens, heads, v_dim)
    out = gated.gated_rms_norm(x, z, norm.weight, EPS)
    assert out.is_contiguous()
    assert torch.equal(out, gated_reference(x, z, norm.weight))
    assert_near_module(out, norm(x, z))  # the torch path: CPU on this machine
    flat = gated.gated_rms_norm(x.reshape(-1, v_dim), z.reshape(-1, v_dim), norm.weight, EPS)
    assert torch.equal(flat, out.view(-1, v_dim))  # 2-D rows give the same


def test_gated_norm_rounds_the_weighted_value_in_the_model_dtype_interpreted(kernels):
    """float16 x and weight: ``weight * normed`` is a float16 product (rounded) before ``* silu(z)``; with a
    float32 weight it is not. Skipping that rounding is told apart."""
    _, gated = kernels
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 2, 96, generator=gen).half()
    z = (torch.randn(8, 2, 96, generator=gen) * 3).half()
    weight = torch.randn(96, generator=gen) * 0.5 + 1
    out16 = gated.gated_rms_norm(x, z, weight.half(), EPS)
    assert torch.equal(out16, gated_reference(x, z, weight.half()))
    out32 = gated.gated_rms_norm(x, z, weight, EPS)
    assert torch.equal(out32, gated_reference(x, z, weight))  # float32 product: no rounding there
    unrounded = (weight.half().float() * (x.float() * cuda_mean_inv(x)).half().float() * numpy_silu(z)).half()
    assert not torch.equal(out16, unrounded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, heads", [(1, 4), (37, 32), (3, 48)])
def test_decay_and_beta_interpreted(kernels, dtype, tokens, heads):
    """``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)`` from slices of the packed
    projection; a > 20 takes softplus' threshold branch."""
    _, gated = kernels
    gen = torch.Generator().manual_seed(tokens + heads)
    packed = (torch.randn(tokens, 5 * heads, generator=gen) * 6).to(dtype)
    b, a = packed[:, 2 * heads : 3 * heads], packed[:, 3 * heads : 4 * heads]
    if tokens > 1:
        a[0, 0] = 25.0
    a_log = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    g, beta = gated.decay_and_beta(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.is_contiguous() and beta.is_contiguous()
    b32, x = b.float().numpy(), (a.float() + dt_bias).numpy()
    ref_beta = torch.from_numpy(np.float32(1) / (np.float32(1) + np.exp(-b32))).to(dtype)
    soft = np.where(x > 20, x, np.log(np.float32(1) + np.exp(x)))
    ref_g = torch.from_numpy((np.exp(a_log.numpy()) * np.float32(-1)) * soft)
    assert torch.equal(beta, ref_beta) and torch.equal(g, ref_g)
    # Against torch: the interpreter's log(1 + e) stands in for log1p (inexact for very negative a).
    torch.testing.assert_close(beta, b.sigmoid(), rtol=0, atol=1e-3 if dtype == torch.float16 else 2e-7)
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a.float() + dt_bias), rtol=2e-4, atol=1e-6)


def spy_on_kernels(kernels, monkeypatch) -> dict[str, list]:
    """The three kernel entry points patched to record their calls (``tests.spies.count_calls``)."""
    norm_module, gated = kernels
    owners = {"add_rms_norm": norm_module, "gated_rms_norm": gated, "decay_and_beta": gated}
    return {name: count_calls(monkeypatch, owner, name) for name, owner in owners.items()}


def calls_of(spies: dict[str, list]) -> dict[str, int]:
    """How many calls each spy saw since the last look (the records are emptied)."""
    counts = {name: len(calls) for name, calls in spies.items()}
    for calls in spies.values():
        calls.clear()
    return counts


def test_modules_take_the_kernels_where_usable_interpreted(kernels, monkeypatch):
    """With Triton "usable" on CPU tensors: GemmaRMSNorm (with and without residual), GatedRMSNorm and the
    decay/beta run the kernels; ``FUSED_KERNELS = False`` keeps all three on the torch ops."""
    spies = spy_on_kernels(kernels, monkeypatch)
    monkeypatch.setattr(layers, "triton_usable", lambda x: True)
    monkeypatch.setattr(layers, "fused_kernels_usable", lambda x: layers.FUSED_KERNELS)
    gen = torch.Generator().manual_seed(1)
    norm = gemma_norm(96, torch.float16, gen)
    x, res = ((torch.randn(4, 96, generator=gen) * 3).half() for _ in "xr")
    gated_norm = GatedRMSNorm(24, EPS).half()
    value, z = (torch.randn(4, 2, 24, generator=gen).half() for _ in "vz")
    delta = GatedDeltaNet.__new__(GatedDeltaNet)
    torch.nn.Module.__init__(delta)
    delta.A_log, delta.dt_bias = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.ones(2))
    a, b = (torch.randn(4, 2, generator=gen) for _ in "ab")

    def run():
        return norm(x), norm(x, res), gated_norm(value, z), delta.decay_and_beta(a, b)

    fused = run()
    assert calls_of(spies) == {"add_rms_norm": 2, "gated_rms_norm": 1, "decay_and_beta": 1}
    monkeypatch.setattr(layers, "FUSED_KERNELS", False)
    unfused = run()
    assert calls_of(spies) == {"add_rms_norm": 0, "gated_rms_norm": 0, "decay_and_beta": 0}
    assert_near_module(fused[0], unfused[0])
    assert torch.equal(fused[1][1], unfused[1][1])
    assert_near_module(fused[1][0], unfused[1][0])
    assert_near_module(fused[2], unfused[2])
    torch.testing.assert_close(fused[3], unfused[3], rtol=2e-4, atol=1e-6)


def test_qwen3_5_engine_with_the_kernels_interpreted(kernels, tiny_model, monkeypatch):
    """A tiny Qwen3.5 (Gemma norms, q/k head norms, gated norms, decay/beta) generates the same greedy
    tokens with the kernels (interpreted) as with the torch ops; log-probs to float32 noise."""
    from tests.rollout.test_triton_fused import generate

    monkeypatch.setattr(layers, "triton_usable", lambda x: True)
    monkeypatch.setattr(layers, "fused_kernels_usable", lambda x: layers.FUSED_KERNELS)
    spies = spy_on_kernels(kernels, monkeypatch)
    path = tiny_model("qwen3_5_text")
    prompts = [PROMPTS[0], PROMPTS[3]]
    fused = generate(path, "float32", "cpu", True, monkeypatch, prompts, new_tokens=4, sample=False)
    assert all(calls_of(spies).values())
    unfused = generate(path, "float32", "cpu", False, monkeypatch, prompts, new_tokens=4, sample=False)
    assert not any(calls_of(spies).values())
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, unfused, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-5)
