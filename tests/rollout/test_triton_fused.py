"""The fused decoder kernels (``tidal/rollout/models/triton_fused.py``) against the torch ops they replace.

The contract is bit-equality with the unfused path on the same device (greedy parity with transformers
must not move), so the GPU tests assert ``torch.equal``:

- ``gpu``: ``silu_and_mul`` and ``rope_store_kv`` (with and without Qwen3's per-head q/k norms, whose
  unfused CUDA path is ``triton_norm``) at the 0.5B and 7B shapes, T in {1, 256, 4096}, bf16 and fp32;
  both kernels inside a captured CUDA graph replayed on new inputs; and engines (CUDA graphs on) with the
  kernels on and off giving identical tokens and log-probs;
- interpreter: the same kernels run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``) at tiny
  shapes, float32 and float16 (the interpreter's float32 -> bfloat16 cast truncates, so bfloat16 is left
  to the GPU tests), skipped where triton is not importable or CUDA is present. RoPE/KV store is
  bit-equal there too; the interpreter's ``exp`` is numpy's, not libdevice's, so SiLU is compared to
  float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.cuda_graphs import capture
from tests.rollout.reference import PROMPTS
from tests.rollout.triton_interpreter import interpreted
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models import layers
from tidal.rollout.models.layers import Attention
from tidal.rollout.models.rope import apply_rope, rope_table
from tidal.rollout.runner.attention import store_kv

SHAPES = {
    "tiny": dict(heads=6, kv_heads=2, head_dim=32, inter=512),  # tidal.testing's tiny models
    "0.5b": dict(heads=14, kv_heads=2, head_dim=64, inter=4864),
    "7b": dict(heads=28, kv_heads=4, head_dim=128, inter=18944),
}


def torch_rope_store(qkv, heads, kv_heads, head_dim, cos, sin, cache, slots, norms=None):
    """The unfused path of ``Attention.forward`` (+ Qwen3's ``qk_heads`` when ``norms``): (q, k, cache)."""
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    if norms is not None:
        qk = torch.cat((norms[0](qk[:, :heads]), norms[1](qk[:, heads:])), dim=1)
    qk = apply_rope(qk, cos, sin)
    if cache is not None:
        store_kv(cache, qk[:, heads:], v, slots)
    return qk[:, :heads], qk[:, heads:]


def rope_inputs(tokens, heads, kv_heads, head_dim, dtype, device, gen, blocks=None, block_size=16):
    """Packed qkv [T, (H + 2 KV) D], cos/sin at random positions < 32k, a random-filled cache and distinct
    random slots (untouched slots must keep their values)."""
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, device=device) * 3).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_table(inv_freq, 1.0, 32768)
    positions = torch.randint(0, 32768, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cos, sin = cos[positions].to(device, dtype), sin[positions].to(device, dtype)
    blocks = blocks or (tokens // block_size + 2)
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen, device=device)[:tokens]
    return qkv, cos, sin, cache, slots


def head_norms(head_dim, dtype, device, gen):
    norms = [layers.RMSNorm(head_dim, 1e-6).to(device, dtype) for _ in "qk"]
    for norm in norms:
        norm.weight.data = (torch.randn(head_dim, generator=gen, device=device) * 0.5 + 1).to(dtype)
    return norms


def run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, cache, slots, norms=None):
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    weights = None if norms is None else (norms[0].weight, norms[1].weight)
    eps = 0.0 if norms is None else norms[0].eps
    return tf.rope_store_kv(qk, v, cos, sin, heads, cache, slots, weights, eps)


def make_engine(path, dtype, device, **overrides) -> LLMEngine:
    config = EngineConfig(
        device=device, dtype=dtype, max_model_len=96, block_size=4, max_num_seqs=8, **overrides
    )
    return LLMEngine(path, config)


def generate(
    path, dtype, device, fused: bool, monkeypatch, prompts=PROMPTS, new_tokens=12, sample=True, engine=None
):
    """Greedy (and sampled) (token ids, log-probs) of an engine (a new one unless ``engine``) with the fused
    kernels on or off."""
    monkeypatch.setattr(layers, "FUSED_KERNELS", fused)
    engine = engine or make_engine(path, dtype, device)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, n=2, max_new_tokens=new_tokens, seed=3, ignore_eos=True)
    outputs = engine.generate(prompts, greedy) + (engine.generate(prompts[:1], sampled) if sample else [])
    return [(s.token_ids, s.logprobs) for o in outputs for s in o.outputs]


def family_model(tiny_model, family: str):
    """A tiny model; "qwen3-d64": Qwen3 with head_dim 64, where its q/k norms are fused (the tiny default,
    32, keeps them unfused: ``layers.fusable_head_norm``)."""
    return tiny_model("qwen3", head_dim=64) if family == "qwen3-d64" else tiny_model(family)


def first_difference(ours, ref) -> str | None:
    """Where two runs' (token ids, log-probs) first differ (every sample has the same length: ignore_eos)."""
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(ours, ref, strict=True)):
        steps = list(zip(tokens, ref_tokens, logprobs, ref_logprobs, strict=True))
        at = next((j for j, (a, b, la, lb) in enumerate(steps) if a != b or la != lb), None)
        if at is not None:
            return (
                f"sample {i} token {at}: ids {steps[at][:2]}, log-probs {steps[at][2]!r} vs {steps[at][3]!r}"
            )
    return None


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_silu_and_mul_is_bit_equal_to_torch(tokens, shape, dtype):
    import tidal.rollout.models.triton_fused as tf
    from tidal.rollout.models.triton_fused import silu_and_mul

    inter = SHAPES[shape]["inter"]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen, device="cuda") * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.dtype == dtype and out.shape == ref.shape
    if not torch.equal(out, ref):  # say whether the other contraction setting would match this torch
        tf.SILU_CONTRACT = not tf.SILU_CONTRACT
        try:
            other = (silu_and_mul(gate_up) != ref).sum().item()
        finally:
            tf.SILU_CONTRACT = not tf.SILU_CONTRACT
        pytest.fail(
            f"{(out != ref).sum().item()} elements differ; with SILU_CONTRACT={not tf.SILU_CONTRACT}: {other}"
        )


@pytest.mark.gpu
def test_silu_and_mul_is_bit_equal_to_torch_at_every_bf16_gate():
    """Every finite bf16 value as the gate (subnormals, the largest, both signs), against two ups: exact
    mode relies on this kernel computing torch's bits wherever the engine's activations land."""
    from tidal.rollout.models.triton_fused import silu_and_mul

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    gate = every[torch.isfinite(every)]
    for up in (torch.ones_like(gate), (torch.randn(gate.shape, device="cuda") * 3).bfloat16()):
        out = silu_and_mul(torch.cat([gate, up])[None])[0]
        ref = F.silu(gate) * up
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_rope_store_kv_is_bit_equal_to_torch(tokens, shape, dtype, qk_norm):
    import tidal.rollout.models.triton_fused as tf

    s = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens + s["head_dim"])
    qkv, cos, sin, cache, slots = rope_inputs(
        tokens, s["heads"], s["kv_heads"], s["head_dim"], dtype, "cuda", gen
    )
    norms = head_norms(s["head_dim"], dtype, "cuda", gen) if qk_norm else None
    if qk_norm and not layers.fusable_head_norm(s["head_dim"]):  # refused, not silently different
        with pytest.raises(ValueError, match="head_dim > 32"):
            run_fused(tf, qkv, s["heads"], s["kv_heads"], s["head_dim"], cos, sin, cache, slots, norms)
        return
    ref_cache = cache.clone()
    ref_q, ref_k = torch_rope_store(
        qkv, s["heads"], s["kv_heads"], s["head_dim"], cos, sin, ref_cache, slots, norms
    )
    q, k = run_fused(tf, qkv, s["heads"], s["kv_heads"], s["head_dim"], cos, sin, cache, slots, norms)
    assert torch.equal(q, ref_q), (q.float() - ref_q.float()).abs().max().item()
    assert torch.equal(k, ref_k), (k.float() - ref_k.float()).abs().max().item()
    assert torch.equal(cache, ref_cache)
    # Without a cache (a forward with no KV cache) only q and k are produced.
    q2, k2 = run_fused(tf, qkv, s["heads"], s["kv_heads"], s["head_dim"], cos, sin, None, None, norms)
    assert torch.equal(q2, ref_q) and torch.equal(k2, ref_k)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_kernels_replay_in_a_cuda_graph(qk_norm):
    """Decode replays captured graphs: a replay on new inputs (same shapes) gives those inputs' result."""
    import tidal.rollout.models.triton_fused as tf

    heads, kv_heads, head_dim, tokens = 14, 2, 64, 256
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv, cos, sin, cache, slots = rope_inputs(tokens, heads, kv_heads, head_dim, torch.bfloat16, "cuda", gen)
    gate_up = torch.randn(tokens, 2 * 4864, generator=gen, device="cuda").bfloat16()
    norms = head_norms(head_dim, torch.bfloat16, "cuda", gen) if qk_norm else None

    def step():
        return (
            *run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, cache, slots, norms),
            tf.silu_and_mul(gate_up),
        )

    graph, (q, k, act) = capture(step)
    new_qkv, new_cos, new_sin, _, new_slots = rope_inputs(
        tokens, heads, kv_heads, head_dim, torch.bfloat16, "cuda", gen
    )
    for static, new in ((qkv, new_qkv), (cos, new_cos), (sin, new_sin), (slots, new_slots)):
        static.copy_(new)
    gate_up.copy_(torch.randn(tokens, 2 * 4864, generator=gen, device="cuda"))
    ref_cache = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_k = torch_rope_store(qkv, heads, kv_heads, head_dim, cos, sin, ref_cache, slots, norms)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(cache, ref_cache)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(act, F.silu(gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3-d64"])
def test_engine_with_fused_kernels_matches_unfused(family, dtype, tiny_model, monkeypatch):
    """The whole engine (prefill, CUDA-graph decode) gives the same tokens and log-probs either way, and
    the switch really selects the path."""
    import tidal.rollout.models.triton_fused as tf

    calls = []
    for name in ("rope_store_kv", "silu_and_mul"):
        kernel = getattr(tf, name)
        monkeypatch.setattr(
            tf, name, lambda *a, _k=kernel, _n=name, **kw: (calls.append(_n), _k(*a, **kw))[1]
        )
    path = family_model(tiny_model, family)
    fused = generate(path, dtype, "cuda", True, monkeypatch)
    assert {"rope_store_kv", "silu_and_mul"} <= set(calls)
    calls.clear()
    unfused = generate(path, dtype, "cuda", False, monkeypatch)
    assert calls == []
    difference = first_difference(fused, unfused)
    if difference is not None:  # tell a kernel difference from two unfused engines that already disagree
        again = first_difference(generate(path, dtype, "cuda", False, monkeypatch), unfused)
        pytest.fail(f"fused vs unfused: {difference}; unfused vs a second unfused engine: {again or 'equal'}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3-d64"])
def test_one_eager_engine_gives_the_same_outputs_with_the_kernels_on_and_off(
    family, dtype, tiny_model, monkeypatch
):
    """The same engine (no graphs: the switch is read at every forward; steps run one after the other)
    with the kernels on, off, on."""
    path = family_model(tiny_model, family)
    engine = make_engine(path, dtype, "cuda", enforce_eager=True, async_scheduling=False)
    runs = [generate(None, dtype, "cuda", fused, monkeypatch, engine=engine) for fused in (True, False, True)]
    assert first_difference(runs[2], runs[0]) is None  # the engine itself repeats its outputs
    assert first_difference(runs[0], runs[1]) is None, first_difference(runs[0], runs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch, max_ctx", [(256, 640), (8, 20000)])
def test_decode_attention_with_rope_is_bit_equal(batch, max_ctx, shape, dtype):
    """RoPE + KV store inside the decode attention kernel (``rope=``) = ``rope_store_kv`` then
    ``paged_decode_attention``: output and cache bit-equal, with tables as wide as a CUDA graph's (32k
    tokens), a padding row, and (8 rows of long contexts) the context split over 16 programs, only one of
    which holds and stores the step's own key and value."""
    import tidal.rollout.models.triton_fused as tf
    from tidal.rollout.kernels.triton_attention import RopeInputs, paged_decode_attention

    s, block = SHAPES[shape], 16
    heads, kv_heads, head_dim = s["heads"], s["kv_heads"], s["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(batch + head_dim)
    qkv, cos, sin, _, _ = rope_inputs(batch, heads, kv_heads, head_dim, dtype, "cuda", gen)
    width = 32768 // block
    blocks = batch * (max_ctx // block + 1) + 1
    cache = torch.randn(2, blocks, block, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    used = torch.randperm(blocks - 1, generator=gen, device="cuda").int()  # the last block: padding's
    per_row = max_ctx // block + 1
    tables[:, :per_row] = used[: batch * per_row].view(batch, per_row)
    ctx = torch.randint(1, max_ctx, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    ctx[batch // 2] = 0  # a CUDA-graph padding row
    pos = (ctx - 1).clamp(min=0).long()
    rows = torch.arange(batch, device="cuda")
    slots = torch.where(
        ctx > 0, tables[rows, pos // block].long() * block + pos % block, (blocks - 1) * block
    )
    scale = head_dim**-0.5

    ref_cache = cache.clone()
    q, _ = run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, ref_cache, slots)
    ref = paged_decode_attention(q, ref_cache, tables, ctx, None, scale)
    packed = qkv.view(batch, -1, head_dim)
    out = paged_decode_attention(packed, cache, tables, ctx, None, scale, rope=RopeInputs(cos, sin, slots))
    assert torch.equal(cache, ref_cache)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_engine_with_rope_in_decode_attention_matches_two_kernels(family, dtype, tiny_model, monkeypatch):
    """Engines (CUDA graphs, async scheduling) with RoPE + KV store inside the decode attention kernel and
    with them as two kernels give the same tokens and log-probs; the switch really selects the path."""
    import tidal.rollout.kernels.triton_attention as ta

    calls = []  # decode attention calls that rotate and store themselves
    kernel = ta.paged_decode_attention
    monkeypatch.setattr(
        ta,
        "paged_decode_attention",
        lambda *a, **kw: (calls.append(kw.get("rope") is not None), kernel(*a, **kw))[1],
    )
    path = tiny_model(family)
    fused = generate(path, dtype, "cuda", True, monkeypatch)
    assert any(calls)
    calls.clear()
    monkeypatch.setattr(layers, "FUSED_DECODE_ATTENTION", False)
    two_kernels = generate(path, dtype, "cuda", True, monkeypatch)
    assert calls and not any(calls)  # decode attention still runs, without RoPE inside
    assert first_difference(fused, two_kernels) is None, first_difference(fused, two_kernels)


# ------------------------------------------------------------------------------------ interpreter
@pytest.fixture(scope="module")
def tf():
    """``triton_fused`` (and ``triton_norm``, the unfused q/k-norm path) run by Triton's interpreter."""
    kernels = {
        "tidal.rollout.models.triton_fused": "_rope_store_kv_kernel",
        "tidal.rollout.models.triton_norm": "_add_rms_norm_kernel",
    }
    with interpreted(kernels) as (fused, _):
        yield fused


@pytest.mark.parametrize("rows, inter", [(1, 24), (5, 1100), (0, 8)])
def test_silu_and_mul_interpreted(tf, rows, inter):
    """Several column blocks with a masked tail (1100 > the 1024-wide block); SiLU as float32 computes it."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    out = tf.silu_and_mul(gate_up)
    assert out.shape == (rows, inter)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-7, atol=1e-7)
    if rows:  # swapped halves (a wrong offset) would be far off
        assert (out - F.silu(up) * gate).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, tokens", [(3, 1, 12, 5), (4, 2, 8, 9), (2, 2, 16, 1), (9, 3, 12, 4)]
)
def test_rope_store_kv_interpreted_is_bit_equal(tf, dtype, heads, kv_heads, head_dim, tokens):
    """Non-power-of-two head_dim (masked lanes), GQA, scattered slots, q/k/v heads spread over two programs
    (9 + 3 + 3 > ``ROPE_HEADS``); float16 checks each rounding."""
    gen = torch.Generator().manual_seed(tokens)
    qkv, cos, sin, cache, slots = rope_inputs(
        tokens, heads, kv_heads, head_dim, dtype, "cpu", gen, block_size=3
    )
    ref_cache = cache.clone()
    ref_q, ref_k = torch_rope_store(qkv, heads, kv_heads, head_dim, cos, sin, ref_cache, slots)
    q, k = run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, cache, slots)
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(cache, ref_cache)
    q2, k2 = run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, None, None)
    assert torch.equal(q2, ref_q) and torch.equal(k2, ref_k)
    # Skipping a rounding (float32 products summed, rounded once) changes float16 results: the check bites.
    if dtype == torch.float16:
        qk32 = apply_rope(
            qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim).float(),
            cos.float(),
            sin.float(),
        )
        assert not torch.equal(qk32[:, :heads].half(), ref_q) or tokens == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_kv_with_head_norms_interpreted(tf, dtype, monkeypatch):
    """Qwen3's per-head q/k RMSNorm before RoPE, as ``triton_norm`` computes it on the unfused path."""
    monkeypatch.setattr(layers, "triton_usable", lambda x: True)  # RMSNorm takes triton_norm (interpreted)
    heads, kv_heads, head_dim, tokens = 3, 2, 64, 6
    gen = torch.Generator().manual_seed(11)
    qkv, cos, sin, cache, slots = rope_inputs(
        tokens, heads, kv_heads, head_dim, dtype, "cpu", gen, block_size=4
    )
    norms = head_norms(head_dim, dtype, "cpu", gen)
    ref_cache = cache.clone()
    ref_q, ref_k = torch_rope_store(qkv, heads, kv_heads, head_dim, cos, sin, ref_cache, slots, norms)
    q, k = run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, cache, slots, norms)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(cache, ref_cache)
    swapped = run_fused(tf, qkv, heads, kv_heads, head_dim, cos, sin, None, None, norms[::-1])
    assert not torch.equal(swapped[0], ref_q)  # the q and k weights are told apart


def test_engine_takes_fused_kernels_where_usable_interpreted(tf, tiny_model, monkeypatch):
    """With the kernels usable (patched to accept CPU tensors here) the engine's decoder (Qwen3 with
    head_dim 64: fused q/k norms, SwiGLU) runs them and generates what the unfused path generates; ``FUSED_KERNELS = False``
    keeps them out."""
    monkeypatch.setattr(layers, "fused_kernels_usable", lambda x: layers.FUSED_KERNELS)
    calls = []
    for name in ("rope_store_kv", "silu_and_mul"):
        kernel = getattr(tf, name)
        monkeypatch.setattr(
            tf, name, lambda *a, _k=kernel, _n=name, **kw: (calls.append(_n), _k(*a, **kw))[1]
        )
    path = tiny_model("qwen3", num_hidden_layers=1, head_dim=64)
    prompts = [PROMPTS[0], PROMPTS[3]]
    fused = generate(path, "float32", "cpu", True, monkeypatch, prompts, new_tokens=4, sample=False)
    assert {"rope_store_kv", "silu_and_mul"} <= set(calls)
    calls.clear()
    unfused = generate(path, "float32", "cpu", False, monkeypatch, prompts, new_tokens=4, sample=False)
    assert calls == []
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, unfused, strict=True):
        assert tokens == ref_tokens  # exp and rsqrt are numpy's here: log-probs agree to float32 noise
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_qwen3_fuses_its_head_norms_only_where_bit_equal(head_dim):
    """head_dim 32: the kernel gets the heads already normalised (unfused norms) and no norms to apply."""
    from tidal.rollout.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
    from tidal.testing.tiny import tiny_config

    args = Qwen3ForCausalLM.args_from_hf_config(tiny_config("qwen3", head_dim=head_dim))
    attention = Qwen3Attention(args, 0)
    with torch.no_grad():
        attention.q_norm.weight.uniform_(0.5, 1.5)
    qkv = torch.randn(3, (args.num_heads + 2 * args.num_kv_heads) * head_dim)
    heads, norms = attention.fused_qk_heads(qkv)
    if head_dim == 32:
        assert norms is None and torch.equal(heads, attention.qk_heads(qkv))
    else:
        assert norms == (attention.q_norm, attention.k_norm)
        assert torch.equal(heads, Attention.qk_heads(attention, qkv))  # raw heads: the kernel normalises
