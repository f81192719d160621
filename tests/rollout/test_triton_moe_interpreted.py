"""The fused MoE Triton kernels (``tidal/rollout/kernels/triton_moe.py``: pair alignment, grouped expert
GEMMs, routing) run by Triton's interpreter on the CPU against the torch paths, at small shapes; skipped
where triton is not importable. Split from ``test_triton_moe.py`` (its references and helpers are shared).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.test_triton_moe import (
    _assert_same_alignment,
    _rel,
    assert_routes_like_torch,
    experts,
    gpt_oss_reference,
    reference,
    routing,
)
from tests.rollout.triton_interpreter import NumpyLibdevice, interpreted
from tidal.rollout.models import moe


@pytest.fixture(scope="module")
def tm():
    """``tidal.rollout.kernels.triton_moe`` with its kernels run by Triton's interpreter."""
    with interpreted({"tidal.rollout.kernels.triton_moe": "_moe_gemm"}) as (module,):
        yield module


@pytest.fixture(scope="module")
def tr():
    """``tidal.rollout.kernels.triton_route`` with its kernel run by Triton's interpreter."""
    with (
        interpreted({"tidal.rollout.kernels.triton_route": "_route_kernel"}) as (module,),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(module, "libdevice", NumpyLibdevice)
        yield module


def test_align_pairs_sorts_and_pads_each_expert_to_whole_blocks(tm):
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3], [3, 0]])  # expert 2 gets nothing
    aligned = tm.align_pairs(ids, num_experts=5, block_m=2)
    pairs, blocks = aligned.sorted_pairs.tolist(), aligned.block_expert.tolist()
    assert len(pairs) == tm.padded_capacity(10, 5, 2) == 16  # 10 pairs + 5 experts x 1 pad, rounded up
    # Expert 0: pairs 1, 5, 9 (+1 pad); expert 1: 3, 6; expert 3: 0, 2, 4, 7, 8 (+1 pad); 2 blocks unused.
    assert pairs == [1, 5, 9, 10, 3, 6, 0, 2, 4, 7, 8, 10, 10, 10, 10, 10]
    assert blocks == [0, 0, 1, 3, 3, 3, -1, -1]
    assert aligned.num_pairs == 10


def test_align_pairs_capacity_holds_any_routing(tm):
    """The static capacity is enough for the worst case: every expert with a pair pads a whole block."""
    gen = torch.Generator().manual_seed(0)
    for num_tokens, num_experts, top_k, block_m in [(1, 8, 2, 16), (3, 64, 8, 16), (50, 6, 2, 4)]:
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        aligned = tm.align_pairs(ids, num_experts, block_m)
        real = aligned.sorted_pairs[aligned.sorted_pairs < aligned.num_pairs]
        assert sorted(real.tolist()) == list(range(num_tokens * top_k))
        block_of_row = aligned.block_expert.repeat_interleave(block_m)
        assert torch.equal(block_of_row[aligned.sorted_pairs < aligned.num_pairs], ids.reshape(-1)[real])


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, skewed",
    [(1, 4, 1, False), (7, 6, 2, True), (40, 6, 3, True), (33, 8, 2, False)],
)
def test_fused_moe_interpreted_matches_reference(tm, num_tokens, num_experts, top_k, skewed):
    """Tiny shapes that do not divide the tiles (hidden 40, intermediate 24 with 16-wide tiles: several
    K steps and N tiles, masked edges), experts without tokens, one expert over several row blocks."""
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up, down = experts(num_experts, 40, 24, gen, "cpu", torch.float32)
    x = torch.randn(num_tokens, 40, generator=gen)
    weights, ids = routing(num_tokens, num_experts, top_k, skewed, gen, "cpu")
    ref = reference(x, gate_up, down, weights, ids)
    small = tm.TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    for config in (small, None):
        out = tm.fused_expert_forward(x, gate_up, down, weights, ids, config)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The model-dtype routing weights path (Qwen) gives the unfused path's result in float16 too.
    half = [t.half() for t in (x, gate_up, down, weights)]
    out = tm.fused_expert_forward(*half, ids, small)
    assert out.dtype == torch.float16
    assert _rel(out, ref) < 3e-3  # float16: 2^-11 per rounding
    dropped = weights.clone()
    dropped[:, 0] = 0
    assert _rel(reference(x, gate_up, down, dropped, ids), ref) > 0.1


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (13, 4)])
def test_fused_moe_interpreted_gpt_oss_biases_and_clamped_swiglu(tm, num_tokens, top_k):
    """gpt-oss's experts through the fused kernels (``biases``, ``swiglu``): the float32 reference; a limit
    that clamps a good share of the gate and up values, so a kernel ignoring the clamp, the alpha or
    either bias would be far off (checked: each left out moves the result by > 10%)."""
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up, down = experts(6, 40, 24, gen, "cpu", torch.float32)
    gate_up = gate_up * 3  # pre-activations of ~N(0, 3): |values| > 1.5 are common
    biases = (torch.randn(6, 48, generator=gen), torch.randn(6, 40, generator=gen))
    x = torch.randn(num_tokens, 40, generator=gen)
    weights, ids = routing(num_tokens, 6, top_k, False, gen, "cpu")
    alpha, limit = 1.702, 1.5
    ref = gpt_oss_reference(x, gate_up, down, biases, weights, ids, alpha, limit)
    small = tm.TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    swiglu = tm.ClampedSwiGLU(alpha=alpha, limit=limit)
    for config in (small, None):
        out = tm.fused_expert_forward(x, gate_up, down, weights, ids, config, biases=biases, swiglu=swiglu)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    half = [t.half() for t in (x, gate_up, down, weights)]
    out = tm.fused_expert_forward(*half, ids, small, biases=tuple(b.half() for b in biases), swiglu=swiglu)
    assert out.dtype == torch.float16 and _rel(out, ref) < 3e-3
    zero = (torch.zeros_like(biases[0]), torch.zeros_like(biases[1]))
    for wrong in (
        gpt_oss_reference(x, gate_up, down, biases, weights, ids, alpha, 1e4),  # no clamp
        gpt_oss_reference(x, gate_up, down, biases, weights, ids, 1.0, limit),  # no alpha
        gpt_oss_reference(x, gate_up, down, (zero[0], biases[1]), weights, ids, alpha, limit),
        gpt_oss_reference(x, gate_up, down, (biases[0], zero[1]), weights, ids, alpha, limit),
    ):
        assert _rel(wrong, ref) > 0.1


def test_fused_moe_interpreted_no_tokens(tm):
    gate_up, down = experts(4, 40, 24, torch.Generator().manual_seed(0), "cpu", torch.float32)
    ids = torch.zeros(0, 2, dtype=torch.long)
    out = tm.fused_expert_forward(torch.zeros(0, 40), gate_up, down, torch.zeros(0, 2), ids)
    assert out.shape == (0, 40)


def test_expert_forward_dispatches_to_fused_kernels_unless_switched_off(tm, monkeypatch):
    """Where the fused path is usable (patched to count CPU tensors as usable here), ``expert_forward``
    returns the kernels' result; ``FUSED_MOE = False`` and non-SiLU experts take the unfused path."""
    calls = []

    def counted(*args):
        calls.append(len(args))
        return fused_expert_forward(*args)

    fused_expert_forward = tm.fused_expert_forward
    monkeypatch.setattr(tm, "fused_expert_forward", counted)
    gen = torch.Generator().manual_seed(5)
    gate_up, down = experts(4, 40, 24, gen, "cpu", torch.float32)
    x = torch.randn(9, 40, generator=gen)
    weights, ids = routing(9, 4, 2, False, gen, "cpu")  # torch's routing: the kernel's is tested apart
    ref = reference(x, gate_up, down, weights, ids)
    monkeypatch.setattr(moe, "triton_usable", lambda x: True)
    torch.testing.assert_close(moe.expert_forward(x, gate_up, down, weights, ids, F.silu), ref)
    assert calls == [5]
    gelu = moe.ACTIVATIONS["gelu"]
    moe.expert_forward(x, gate_up, down, weights, ids, gelu)
    monkeypatch.setattr(moe, "FUSED_MOE", False)
    torch.testing.assert_close(moe.expert_forward(x, gate_up, down, weights, ids, F.silu), ref)
    assert calls == [5]  # neither the GELU experts nor the switched-off path reached the kernels


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m, routed",
    [
        (1, 1, 8, 16, "uniform"),  # a single pair
        (5, 2, 8, 16, "uniform"),
        (16, 8, 128, 16, "uniform"),  # exactly the kernel's smallest pair tile (128)
        (20, 2, 60, 64, "uniform"),  # experts not a power of two
        (60, 2, 60, 16, "one"),  # one expert over several blocks
        (33, 1, 60, 64, "last"),
        (12, 8, 128, 64, "last"),
        (17, 8, 128, 16, "uniform"),  # 136 pairs: the next pair tile
        (150, 2, 8, 64, "uniform"),  # 300 pairs, several blocks per expert
    ],
)
def test_align_kernel_interpreted_matches_torch_alignment(
    tm, num_tokens, top_k, num_experts, block_m, routed
):
    gen = torch.Generator().manual_seed(num_tokens)
    if routed == "uniform":
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    else:
        ids = torch.full((num_tokens, top_k), num_experts // 3 if routed == "one" else num_experts - 1)
    _assert_same_alignment(ids, num_experts, block_m, tm)


def test_align_pairs_takes_the_kernel_where_it_fits(tm, monkeypatch):
    """Usable Triton (patched: CPU tensors count as usable here) and up to 4096 pairs and 1024 experts:
    the kernel; else the torch ops."""
    kernel = tm.align_pairs_triton
    with pytest.raises(ValueError, match="4097 pairs over 8 experts"):
        kernel(torch.zeros(4097, 1, dtype=torch.long), 8, 16)
    monkeypatch.setattr(tm, "triton_usable", lambda t: True)
    taken = []
    monkeypatch.setattr(tm, "align_pairs_triton", lambda *a: taken.append("kernel"))
    monkeypatch.setattr(tm, "align_pairs_torch", lambda *a: taken.append("torch"))
    tm.align_pairs(torch.zeros(512, 8, dtype=torch.long), 128, 64)
    tm.align_pairs(torch.zeros(513, 8, dtype=torch.long), 128, 64)
    tm.align_pairs(torch.zeros(4, 2, dtype=torch.long), 2048, 16)
    tm.align_pairs(torch.zeros(0, 2, dtype=torch.long), 8, 16)
    assert taken == ["kernel", "torch", "torch", "torch"]
    monkeypatch.setattr(tm, "triton_usable", lambda t: False)
    tm.align_pairs(torch.zeros(4, 2, dtype=torch.long), 8, 16)
    assert taken[-1] == "torch"


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k",
    [(1, 8, 1), (40, 8, 2), (17, 60, 2), (23, 60, 8), (5, 128, 8), (40, 128, 1)],
)
def test_fused_route_interpreted_matches_torch(tr, num_tokens, num_experts, top_k):
    """Random normal logits: float32 ones have no ties (the ids are torch's, every row), bfloat16 ones
    do among 60 or 128 experts (the ids then follow the lower-id rule)."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    for renormalize in (True, False):
        assert assert_routes_like_torch(tr.fused_route, logits, top_k, renormalize).all()
        assert_routes_like_torch(
            tr.fused_route, logits.bfloat16(), top_k, renormalize, rounds_to_nearest=False
        )


def test_fused_route_ties_go_to_the_lower_expert_id(tr):
    """Repeated logits: equal weights, lower id first, each expert once (also a row's -inf experts, once
    its finite ones are taken); a row of equal logits routes to experts 0..k-1 with weight 1/E."""
    inf = float("inf")
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, -1.0],
            [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
            [0.5, -inf, -inf, -inf, -inf, -inf, -inf, -inf],
            [-inf, -inf, 0.0, -0.0, -inf, 0.0, -inf, -inf],
        ]
    )
    weights, ids = tr.fused_route(logits, 5, False, False)
    assert ids.tolist() == [[1, 2, 4, 5, 6], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [2, 3, 5, 0, 1]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids), rtol=1e-6, atol=0)
    assert weights[1].tolist() == [0.125] * 5 and weights[2].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] and weights[0, 3] == weights[0, 4]
    renormalized, same_ids = tr.fused_route(logits, 5, True, False)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormalized, weights / weights.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    # torch's values agree wherever its order among ties does not matter.
    torch.testing.assert_close(weights, moe.route_torch(logits, 5, False, False)[0], rtol=1e-6, atol=0)


def test_fused_route_interpreted_no_tokens_and_bad_top_k(tr):
    weights, ids = tr.fused_route(torch.zeros(0, 8, dtype=torch.bfloat16), 2, True, True)
    assert weights.shape == ids.shape == (0, 2) and weights.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"shape \(3, 8\) with top_k=9"):
        tr.fused_route(torch.zeros(3, 8), 9, True, False)


def test_route_takes_the_kernel_where_it_fits(tr, monkeypatch):
    """Usable Triton (patched: CPU tensors count as usable here) and up to 1024 experts: ``fused_route``;
    more experts, or Triton not usable (the CPU path): the torch ops."""
    taken = []
    monkeypatch.setattr(tr, "fused_route", lambda *a: taken.append("kernel"))
    monkeypatch.setattr(moe, "route_torch", lambda *a: taken.append("torch"))
    monkeypatch.setattr(moe, "triton_usable", lambda t: True)
    moe.route(torch.zeros(4, 1024), 2, True, False)
    moe.route(torch.zeros(4, 1025), 2, True, False)
    monkeypatch.setattr(moe, "triton_usable", lambda t: False)
    moe.route(torch.zeros(4, 8), 2, True, False)
    assert taken == ["kernel", "torch", "torch"]
