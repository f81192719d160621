"""The fused MoE kernels (``tidal/rollout/kernels/triton_moe.py``) against a plain float32 per-expert reference.

Two groups:

- ``gpu``: the compiled kernels at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8,
  ``moe_intermediate_size`` 768) in bfloat16, 1 to 4096 tokens, uniform and skewed routing (most tokens
  on the same 8 experts, a quarter of the experts given no token), inside a CUDA graph, and the dispatch
  in ``moe.expert_forward`` (``FUSED_MOE``);
- the alignment kernel (``align_pairs_triton``) bit-identical to the torch ops it replaces
  (``align_pairs_torch``), compiled at decode sizes (gpu) and interpreted at small ones;
- the routing kernel (``triton_route.fused_route``) against ``moe.route_torch`` (softmax, ``torch.topk``,
  renormalisation): the ids are the k largest logits with the lower id first among equal ones (a stable
  sort's order), the experts are a top-k of torch's probabilities in torch's order (so the same ids on
  rows without ties), the float32 weights within 1e-6 relative of torch's (only the softmax sum's order
  differs) and the model-dtype weights are those rounded; compiled at decode sizes and in a CUDA graph
  (gpu), interpreted at small ones with deliberate ties;
- interpreter (``test_triton_moe_interpreted.py``): the same kernels run by Triton's interpreter on CPU
  (``TRITON_INTERPRET=1``) at tiny shapes, float32 and float16 (the interpreter's bfloat16 dot is broken in triton 3.6: it returns
  garbage even for a single 16x16 tile), skipped where triton is not importable or CUDA is present
  (there the compiled kernels are tested and the module must stay compiled). The interpreter has no
  libdevice: the routing kernel's ``exp`` is numpy's float32 exp there.

bfloat16 tolerance: the reference upcasts the same bf16 weights and inputs and computes in float32, so
the error is the kernel's roundings: the activation (one bf16 rounding, relative 2^-9 per element), the
per-pair outputs and the final sum (one each). Those are independent per element, so the relative
Frobenius error is ~2^-8 at most: 1e-2 leaves a margin of ~2.5x, and each test also checks that the
fused error is no larger than the unfused path's own (which rounds more often), and that a wrong
routing weight on a single slot would exceed the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.rollout.models import moe


def reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """float32 loop over tokens' slots, one expert matmul each group: the definition, nothing shared
    with the kernels."""
    x, gate_up, down, weights = x.float(), gate_up.float(), down.float(), weights.float()
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        h = x[tokens] @ gate_up[expert].t()
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tokens, (act @ down[expert].t()) * weights[tokens, slots, None])
    return out


def gpt_oss_reference(x, gate_up, down, biases, weights, ids, alpha, limit) -> torch.Tensor:
    """gpt-oss's experts in float32, a loop over experts: ``(act(x W1^T + b1) W2^T + b2)`` per pair, times
    the routing weight, with its clamped SwiGLU (``models/gpt_oss.clamped_swiglu``, the definition)."""
    from tidal.rollout.models.gpt_oss import clamped_swiglu

    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        h = x[tokens] @ gate_up[expert].t() + biases[0][expert]
        act = clamped_swiglu(h[:, :inter], h[:, inter:], alpha, limit)
        out.index_add_(0, tokens, (act @ down[expert].t() + biases[1][expert]) * weights[tokens, slots, None])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routing(num_tokens: int, num_experts: int, top_k: int, skewed: bool, gen: torch.Generator, device):
    """Qwen-style routing (softmax, top-k, renormalised); skewed: 90% of the tokens strongly prefer
    experts 0..top_k-1 and the last quarter of the experts is never chosen."""
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    if skewed:
        logits[: num_tokens * 9 // 10 + 1, :top_k] += 8.0
        logits[:, num_experts * 3 // 4 :] = -1e4
    return moe.route(logits, top_k, renormalize=True, weights_in_model_dtype=False)


def experts(num_experts, hidden, inter, gen, device, dtype):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def tie_free_rows(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows whose k + 1 largest torch probabilities all differ (there ``torch.topk``'s ids are defined)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.topk(min(top_k + 1, probs.shape[-1]), dim=-1).values
    return (top[:, :-1] > top[:, 1:]).all(dim=-1)


def assert_routes_like_torch(
    fused_route, logits: torch.Tensor, top_k: int, renormalize: bool, rounds_to_nearest: bool = True
) -> torch.Tensor:
    """``fused_route`` against ``moe.route_torch`` on ``logits``; returns the rows where the ids must equal
    torch's (no tie of probabilities among its k + 1 largest), after checking that they do.

    ``rounds_to_nearest=False``: the interpreter, whose float32 -> bfloat16 cast truncates (compiled
    Triton, like torch, rounds to nearest even): the model-dtype weights are then within one bf16 ulp."""
    weights, ids = fused_route(logits, top_k, renormalize, False)
    want_weights, want_ids = moe.route_torch(logits, top_k, renormalize, False)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == want_ids.shape
    # The rule: the k largest logits, the lower expert id first among equal ones (a stable sort's order).
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices
    assert torch.equal(ids, ranked[:, :top_k])
    # A top-k of torch's own probabilities, in its order (ties in probability may pick either expert).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.topk(top_k, dim=-1).values)
    tie_free = tie_free_rows(logits, top_k)
    assert torch.equal(ids[tie_free], want_ids[tie_free])
    # Only the order of the softmax sum differs from torch: a few float32 ulps.
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    if logits.dtype != torch.float32:  # Qwen routers: the same weights rounded to the logits' dtype
        model_weights, model_ids = fused_route(logits, top_k, renormalize, True)
        assert model_weights.dtype == logits.dtype and torch.equal(model_ids, ids)
        if rounds_to_nearest:
            assert torch.equal(model_weights, weights.to(logits.dtype))
        else:
            torch.testing.assert_close(model_weights.float(), weights, rtol=2**-7, atol=0)
    return tie_free


# --------------------------------------------------------------------------------------------- GPU
GPU_SHAPE = dict(hidden=2048, num_experts=128, top_k=8, inter=768)


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 4096])
def test_fused_moe_matches_float32_reference_at_qwen3_30b_shapes(num_tokens, skewed):
    from tidal.rollout.kernels.triton_moe import fused_expert_forward

    s = GPU_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    gate_up, down = experts(s["num_experts"], s["hidden"], s["inter"], gen, "cuda", torch.bfloat16)
    x = torch.randn(num_tokens, s["hidden"], generator=gen, device="cuda").bfloat16()
    weights, ids = routing(num_tokens, s["num_experts"], s["top_k"], skewed, gen, "cuda")
    weights = weights.bfloat16()
    if skewed:
        assert ids.unique().numel() <= s["num_experts"] * 3 // 4
    ref = reference(x, gate_up, down, weights, ids)
    out = fused_expert_forward(x, gate_up, down, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    tol = 1e-2
    err = _rel(out, ref)
    assert err < tol, err
    unfused = moe.unfused_expert_forward(x, gate_up, down, weights, ids, F.silu)
    assert err <= 1.5 * _rel(unfused, ref) + 1e-4, (err, _rel(unfused, ref))
    # Every token is right, not just the bulk (a dropped block would hit a few tokens only).
    per_token = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.max().item() < 5 * tol
    # A plausible bug, one slot's routing weight lost for every token, is far outside the tolerance.
    dropped = weights.clone()
    dropped[:, -1] = 0
    assert _rel(reference(x, gate_up, down, dropped, ids), ref) > 3 * tol


@pytest.mark.gpu
def test_fused_moe_mixtral_float32_routing_weights_and_float32_model():
    """Mixtral keeps routing weights in float32 (pair outputs then float32); a float32 engine runs
    IEEE float32 dots (no TF32)."""
    from tidal.rollout.kernels.triton_moe import fused_expert_forward

    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        gate_up, down = experts(8, 512, 384, gen, "cuda", dtype)
        x = torch.randn(100, 512, generator=gen, device="cuda").to(dtype)
        weights, ids = routing(100, 8, 2, False, gen, "cuda")  # float32 weights
        out = fused_expert_forward(x, gate_up, down, weights, ids)
        assert out.dtype == dtype
        assert _rel(out, reference(x, gate_up, down, weights, ids)) < tol


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """Decode replays captured graphs: the alignment must not sync with the host, and a replay with
    other routing (same shapes) must give that routing's result."""
    from tidal.rollout.kernels.triton_moe import fused_expert_forward

    s = GPU_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(2)
    gate_up, down = experts(s["num_experts"], s["hidden"], s["inter"], gen, "cuda", torch.bfloat16)
    x = torch.randn(64, s["hidden"], generator=gen, device="cuda").bfloat16()
    weights, ids = routing(64, s["num_experts"], s["top_k"], False, gen, "cuda")
    weights = weights.bfloat16()
    fused_expert_forward(x, gate_up, down, weights, ids)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_expert_forward(x, gate_up, down, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    new_weights, new_ids = routing(64, s["num_experts"], s["top_k"], True, gen, "cuda")
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(64, s["hidden"], generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_expert_forward(x, gate_up, down, weights, ids))


@pytest.mark.gpu
def test_expert_forward_dispatch_follows_fused_moe_switch(monkeypatch):
    from tidal.rollout.kernels.triton_moe import fused_expert_forward

    gen = torch.Generator(device="cuda").manual_seed(3)
    gate_up, down = experts(16, 256, 128, gen, "cuda", torch.bfloat16)
    x = torch.randn(33, 256, generator=gen, device="cuda").bfloat16()
    weights, ids = routing(33, 16, 4, False, gen, "cuda")
    fused = fused_expert_forward(x, gate_up, down, weights, ids)
    unfused = moe.unfused_expert_forward(x, gate_up, down, weights, ids, F.silu)
    assert not torch.equal(fused, unfused)  # the two paths round differently: the check below can tell
    assert torch.equal(moe.expert_forward(x, gate_up, down, weights, ids, F.silu), fused)
    monkeypatch.setattr(moe, "FUSED_MOE", False)
    assert torch.equal(moe.expert_forward(x, gate_up, down, weights, ids, F.silu), unfused)
    monkeypatch.setattr(moe, "FUSED_MOE", True)
    gelu = moe.ACTIVATIONS["gelu"]  # not fused: the unfused path runs
    assert torch.equal(
        moe.expert_forward(x, gate_up, down, weights, ids, gelu),
        moe.unfused_expert_forward(x, gate_up, down, weights, ids, gelu),
    )


def _assert_same_alignment(ids, num_experts: int, block_m: int, tm) -> None:
    """The kernel's alignment equals the torch ops' bit for bit (both buffers, every padding entry)."""
    got = tm.align_pairs_triton(ids, num_experts, block_m)
    want = tm.align_pairs_torch(ids, num_experts, block_m)
    context = (tuple(ids.shape), num_experts, block_m)
    assert torch.equal(got.sorted_pairs, want.sorted_pairs), context
    assert torch.equal(got.block_expert, want.block_expert), context
    assert got.num_pairs == want.num_pairs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts",
    [(1, 8, 128), (64, 8, 128), (256, 8, 128), (512, 8, 128), (200, 8, 60), (2048, 2, 8)],
)
def test_align_kernel_matches_torch_alignment_at_decode_sizes(num_tokens, top_k, num_experts):
    """Decode batches up to the kernel's limit (512 x top-8 = 4096 pairs), uniform and skewed routing,
    all pairs on one expert or on the last one, each block size tile_configs picks."""
    from tidal.rollout.kernels import triton_moe

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    cases = [routing(num_tokens, num_experts, top_k, skewed, gen, "cuda")[1] for skewed in (False, True)]
    cases += [torch.full((num_tokens, top_k), e, device="cuda") for e in (num_experts // 3, num_experts - 1)]
    for ids in cases:
        for block_m in (16, 32, 64):
            _assert_same_alignment(ids, num_experts, block_m, triton_moe)


@pytest.mark.gpu
def test_fused_moe_output_unchanged_by_the_align_kernel(monkeypatch):
    """``fused_expert_forward`` takes the kernel on CUDA at decode sizes and gives the same bits as with
    the torch alignment."""
    from tidal.rollout.kernels import triton_moe

    s = GPU_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(4)
    gate_up, down = experts(s["num_experts"], s["hidden"], s["inter"], gen, "cuda", torch.bfloat16)
    kernel, torch_ops = triton_moe.align_pairs_triton, triton_moe.align_pairs_torch
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    for num_tokens in (1, 64, 512):
        x = torch.randn(num_tokens, s["hidden"], generator=gen, device="cuda").bfloat16()
        weights, ids = routing(num_tokens, s["num_experts"], s["top_k"], False, gen, "cuda")
        weights = weights.bfloat16()
        monkeypatch.setattr(triton_moe, "align_pairs_triton", counted)
        fast = triton_moe.fused_expert_forward(x, gate_up, down, weights, ids)
        assert calls[-1] == ids.shape
        monkeypatch.setattr(triton_moe, "align_pairs", torch_ops)
        with_torch_alignment = triton_moe.fused_expert_forward(x, gate_up, down, weights, ids)
        monkeypatch.undo()
        assert torch.equal(fast, with_torch_alignment), num_tokens
    assert len(calls) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, top_k", [(128, 8), (60, 4), (8, 2)])
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 512, 4099])
def test_fused_route_matches_torch_at_decode_sizes(num_tokens, num_experts, top_k):
    """Decode batches (and a prefill-sized one not a multiple of the row block) of Qwen3-30B-A3B (128
    experts, top-8), Qwen2-MoE-like (60, top-4) and Mixtral (8, top-2) routers; float32 logits (tie-free
    but for rare collapsed probabilities) and bfloat16 ones (ties common among 128 experts)."""
    from tidal.rollout.kernels.triton_route import fused_route

    gen = torch.Generator(device="cuda").manual_seed(num_tokens * 1000 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    for renormalize in (True, False):
        tie_free = assert_routes_like_torch(fused_route, logits, top_k, renormalize)
        if num_tokens >= 64:  # the id comparison covered (nearly) every row
            assert tie_free.float().mean().item() > 0.9
        assert_routes_like_torch(fused_route, logits.bfloat16(), top_k, renormalize)


@pytest.mark.gpu
def test_route_takes_the_kernel_and_replays_in_a_cuda_graph_with_new_logits(monkeypatch):
    """``moe.route`` on CUDA is ``fused_route`` (no host sync): captured once, a replay on other logits
    gives those logits' routing."""
    from tidal.rollout.kernels import triton_route

    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(64, 128, generator=gen, device="cuda").bfloat16()
    calls = []
    kernel = triton_route.fused_route

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    monkeypatch.setattr(triton_route, "fused_route", counted)
    moe.route(logits, 8, True, True)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            weights, ids = moe.route(logits, 8, True, True)
    torch.cuda.current_stream().wait_stream(stream)
    assert len(calls) == 2
    logits.copy_(torch.randn(64, 128, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want_weights, want_ids = kernel(logits, 8, True, True)
    assert torch.equal(weights, want_weights) and torch.equal(ids, want_ids)
    ranked = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices
    assert torch.equal(ids, ranked[:, :8])
    # Above 1024 experts the torch ops route.
    wide = torch.randn(3, 1025, generator=gen, device="cuda")
    weights, ids = moe.route(wide, 2, False, False)
    assert len(calls) == 2
    assert torch.equal(ids, moe.route_torch(wide, 2, False, False)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_fused_moe_gpt_oss_biases_and_clamped_swiglu_at_gpt_oss_20b_shapes(num_tokens):
    """gpt-oss-20b's experts (hidden 2880, 32 experts, top-4, intermediate 2880, alpha 1.702, limit 7) in
    bf16 with biases: the float32 reference within the bf16 tolerance, no worse than the grouped-GEMM path
    the module takes without the kernels, and the same inside a CUDA graph."""
    from tidal.rollout.kernels.triton_moe import ClampedSwiGLU, fused_expert_forward

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    gate_up, down = experts(32, 2880, 2880, gen, "cuda", torch.bfloat16)
    gate_up = (gate_up.float() * 4).bfloat16()  # pre-activations of ~N(0, 4): the limit of 7 clamps some
    biases = tuple((torch.randn(32, n, generator=gen, device="cuda") * 0.5).bfloat16() for n in (5760, 2880))
    x = torch.randn(num_tokens, 2880, generator=gen, device="cuda").bfloat16()
    weights, ids = routing(num_tokens, 32, 4, False, gen, "cuda")
    weights = weights.bfloat16()
    swiglu = ClampedSwiGLU(1.702, 7.0)
    ref = gpt_oss_reference(x.float(), gate_up.float(), down.float(), [b.float() for b in biases],
                            weights.float(), ids, 1.702, 7.0)  # fmt: skip
    out = fused_expert_forward(x, gate_up, down, weights, ids, biases=biases, swiglu=swiglu)
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2
    from tidal.rollout.models.gpt_oss import clamped_swiglu

    sorted_ids, order = torch.sort(ids.reshape(-1))
    offsets = torch.cumsum(torch.bincount(sorted_ids, minlength=32), 0).int()
    h = moe.grouped_linear(x[order // 4], gate_up, offsets) + biases[0][sorted_ids]
    act = clamped_swiglu(*h.chunk(2, dim=-1), 1.702, 7.0)
    pairs = (moe.grouped_linear(act, down, offsets) + biases[1][sorted_ids]) * weights.reshape(-1)[
        order, None
    ]
    grouped = torch.empty_like(pairs)
    grouped[order] = pairs
    assert _rel(out, ref) <= 1.5 * _rel(grouped.view(num_tokens, 4, -1).sum(1), ref) + 1e-4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_expert_forward(x, gate_up, down, weights, ids, biases=biases, swiglu=swiglu)
    graph.replay()
    assert torch.equal(captured, out)
