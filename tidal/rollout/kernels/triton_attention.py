"""Paged decode attention as a Triton kernel (GPU only; imported lazily by ``runner/attention.py``).

One query token per sequence attends to its keys/values straight from the paged cache: each program
takes one (sequence, kv head, context split), walks the block table for the live context only (the loop
bound is the sequence's own length, read on device, so no padding is read and the launch shape depends
only on the batch size: it can live in a CUDA graph), and keeps an online softmax over ``BLOCK_N``-token
chunks. All query heads of a GQA group are one ``tl.dot`` operand, so each K/V byte is read once.

Split-K ("flash-decoding"): when batch x kv heads is too small to fill the GPU, the context is cut into
``num_splits`` pieces whose partial results (normalised output + log-sum-exp) a second kernel merges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tidal.accel import sm_count
from tidal.rollout.kernels import cuda_fp8_decode
from tidal.rollout.kernels.triton_e4m3 import store_e4m3_row
from tidal.rollout.models.triton_fused import rope_half

MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it gains in parallelism
MAX_SPLITS = 16
# Over an FP8 cache the kernel takes 214 registers a thread uncapped (its e4m3 tiles are converted in
# registers), so two 4-warp programs fit an SM; capped at 160 (a few bytes spilled), three do. H200
# (bench/decode_attention.py --sweep --grid_maxnreg, session 22), ms a call, uncapped -> 160 (-> 168):
# 7B B=256 0.0752 -> 0.0682 (0.0667), 0.5B B=256 0.0269 -> 0.0255 (0.0280); 8 sequences, 16 splits, even.
FP8_MAXNREG = 160
# An FP8 cache's decode steps take the CUDA kernel of cuda_fp8_decode.py where it covers them (read at each
# call; False: always this file's Triton kernel, which bench/decode_attention.py times beside it).
FP8_CUDA_KERNEL = True
# ... for calls whose context is split at most this many ways. With 16 splits (8 sequences in a CUDA graph)
# the Triton kernel was the faster (bench/decode_attention.py, 7b_b8_graph: 0.0160 ms against 0.0164).
FP8_CUDA_MAX_SPLITS = 1
# With ``rope`` (the engine's decode step), the CUDA kernel's ROPE build rotates and stores the step's keys and
# values itself (fp8_decode_rope.cu) instead of a ``rope_store_kv`` launch before it: the same bits (read at
# each call; False: the launch before it; bench/profile_decode.py --cuda_rope both profiles each).
FP8_CUDA_ROPE = True


@dataclass(frozen=True)
class Tiles:
    """Launch settings of the decode kernel: ``block_n`` context tokens per inner step (any KV block
    size works: pages are looked up per token; None: ``chunk``), warps and software-pipelining stages."""

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # a cap on registers per thread (0: none; None: FP8_MAXNREG over an FP8 cache)

    def options(self, itemsize: int) -> dict:
        """Launch options beyond warps and stages, for a cache of ``itemsize`` bytes an element."""
        cap = FP8_MAXNREG if self.maxnreg is None and itemsize == 1 else self.maxnreg
        return {"maxnreg": cap} if cap else {}

    def chunk(self, head_dim: int, itemsize: int, num_splits: int) -> int:
        """128 tokens for heads of <= 64 dimensions read whole (no context splits) where the pipelined K
        and V tiles fit 128 KB of shared memory, else 64. bench/decode_attention.py at B=256, 0.5B shape
        (2 KV heads of 64): 11-14% faster at contexts of 384-608, 3% at 160, 2% slower at 2,560; even at
        7B (heads of 128); 10% slower on split contexts (8 sequences, 16 splits). An FP8 cache (one byte an
        element) takes 128 wherever it fits (session 21, fp16 logits): 9% faster than 64 at the 7B shape, 4% at
        0.5B (B=256), 19% with 16 splits (8 sequences)."""
        if self.block_n:
            return self.block_n
        fits = 128 * head_dim * itemsize * 2 * self.num_stages <= 128 * 1024
        if itemsize == 1:
            return 128 if fits else 64
        return 128 if head_dim <= 64 and num_splits == 1 and fits else 64


TILES = Tiles()


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    sink_ptr,
    ks_ptr,
    vs_ptr,
    stride_cos,
    stride_qb,
    stride_qh,
    stride_kblk,
    stride_kslot,
    stride_khead,
    stride_sblk,
    stride_sslot,
    stride_btb,
    scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    ROPE: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
    DOT16: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(ctx_ptr + b)
    start = 0
    base = 0
    if HAS_WINDOW:  # only the last `window` keys: skip whole chunks before the window
        start = tl.maximum(ctx - window, 0)
        base = (start // BLOCK_N) * BLOCK_N
    # Each sequence cuts its own live context into NUM_SPLITS pieces of whole chunks. Read on the device,
    # so a CUDA graph (whose block tables are as wide as the longest allowed sequence) still gives every
    # split a share of the actual context, not of the table's width.
    split_len = tl.cdiv(tl.cdiv(ctx - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = base + split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    if ROPE:
        # q_ptr is the packed qkv projection before RoPE (k heads after the q heads, then v): rotate q here,
        # and the one program whose range holds the step's own position (ctx - 1) rotates its k and
        # stores k and v into the cache, as ``rope_store_kv`` would, before the loop below reads them.
        first = d < HEAD_DIM // 2
        partner = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
        c = tl.load(cos_ptr + b * stride_cos + d).to(tl.float32)
        s_ = tl.load(sin_ptr + b * stride_cos + d).to(tl.float32)
        q_partner = tl.load(q_rows + partner[None, :], mask=(g < GROUP)[:, None], other=0.0)
        q = rope_half(q, q_partner, c[None, :], s_[None, :], first[None, :])
        owner = tl.minimum((tl.maximum(ctx - 1, 0) - base) // tl.maximum(split_len, 1), NUM_SPLITS - 1)
        if split == owner:  # a padding row (ctx 0) stores into its padding slot, as rope_store_kv does
            k_row = q_ptr + b * stride_qb + (num_heads + kvh) * stride_qh
            v_row = q_ptr + b * stride_qb + (num_heads + tl.num_programs(1) + kvh) * stride_qh
            k_new = rope_half(tl.load(k_row + d), tl.load(k_row + partner), c, s_, first)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            dst = (slot // BLOCK_SIZE) * stride_kblk + (slot % BLOCK_SIZE) * stride_kslot + kvh * stride_khead
            if FP8:  # e4m3 rows with their scales (runner/kv_cache.py), rope_store_kv's bits
                s_dst = (slot // BLOCK_SIZE) * stride_sblk + (slot % BLOCK_SIZE) * stride_sslot + kvh
                store_e4m3_row(k_ptr + dst + d, ks_ptr + s_dst, k_new, d < HEAD_DIM)
                store_e4m3_row(v_ptr + dst + d, vs_ptr + s_dst, tl.load(v_row + d), d < HEAD_DIM)
            else:
                tl.store(k_ptr + dst + d, k_new)
                tl.store(v_ptr + dst + d, tl.load(v_row + d))
        tl.debug_barrier()  # the loop's loads (other threads of this program) read what was just stored
    q_dot = q  # the logits' dot operand: q itself, or (DOT16, see paged_decode_attention) q * scale in fp16
    if DOT16:
        q_dot = (q.to(tl.float32) * scale).to(tl.float16)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Every chunk visited holds at least one live key, so m is finite after the first one.
    for t0 in range(lo, hi, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        live = (offs < hi) & (offs >= start)
        page = tl.load(bt_ptr + b * stride_btb + offs // BLOCK_SIZE, mask=offs < hi, other=0)
        kv_off = page.to(tl.int64) * stride_kblk + (offs % BLOCK_SIZE) * stride_kslot + kvh * stride_khead
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q_dot, tl.trans(k.to(q_dot.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q_dot, tl.trans(k.to(q_dot.dtype)))
        if not DOT16:
            s = s * scale
        # FP8: each key's dequantization scale multiplies its logit (k = e4m3 row * scale)
        s_off = page.to(tl.int64) * stride_sblk + (offs % BLOCK_SIZE) * stride_sslot + kvh  # unused if not
        if FP8:
            s = s * tl.load(ks_ptr + s_off, mask=live, other=0.0)[None, :]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
        p_v = p
        if FP8:  # and each value's scale its probability
            p_v = p * tl.load(vs_ptr + s_off, mask=live, other=0.0)[None, :]
        # DOT16: bf16 for an fp16 q too, as probability x value scale may be far below fp16's normals
        pv_dtype = tl.bfloat16 if DOT16 else q.dtype
        if IEEE:
            pv = tl.dot(p_v.to(pv_dtype), v.to(pv_dtype), input_precision="ieee")
        else:
            pv = tl.dot(p_v.to(pv_dtype), v.to(pv_dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new

    nonempty = denom > 0
    out = acc / tl.where(nonempty, denom, 1.0)[:, None]
    row = b * num_heads + heads
    if NUM_SPLITS == 1:
        if SINKS:
            lse = m + tl.log(tl.where(nonempty, denom, 1.0))
            out = out * sink_share(lse, tl.load(sink_ptr + heads, mask=g < GROUP, other=0.0))[:, None]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
    else:
        part = row * NUM_SPLITS + split
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def sink_share(lse, sink):
    """The share of a softmax that keys with log-sum-exp ``lse`` keep once a sink logit joins its
    denominator (gpt-oss): ``e^lse / (e^lse + e^sink)``; 0 where ``lse`` is -inf (no key)."""
    return 1.0 / (1.0 + tl.exp(sink.to(tl.float32) - lse))


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    sink_ptr,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SINKS: tl.constexpr,
):
    row = tl.program_id(0)  # one (sequence or token, head): rows are head-minor
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s)
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    total = tl.sum(w, 0)
    parts = tl.load(part_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    if SINKS:
        out = out * sink_share(
            top + tl.log(tl.where(total > 0, total, 1.0)), tl.load(sink_ptr + row % num_heads)
        )
    tl.store(out_ptr + row * HEAD_DIM + d, out)


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partial outputs [rows * heads * splits, head_dim] and their log-sum-exps of a launch that
    splits the keys of each (row, head) ``num_splits`` ways; ``out`` [rows, heads, head_dim] itself (never
    read) when the keys are not split."""
    if num_splits <= 1:
        return out, out
    rows, num_heads, head_dim = out.shape
    part = torch.empty(rows * num_heads * num_splits, head_dim, dtype=torch.float32, device=out.device)
    lse = torch.empty(rows * num_heads * num_splits, dtype=torch.float32, device=out.device)
    return part, lse


def merge_splits(
    part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None, num_splits: int
) -> None:
    """Combine each (row, head)'s ``num_splits`` partial results (``split_buffers``) into ``out`` [rows, heads,
    head_dim], weighted by their log-sum-exps (and scaled by the sink's share with ``sinks``); nothing to
    do for one split, whose kernel wrote ``out`` itself."""
    if num_splits <= 1:
        return
    rows, num_heads, head_dim = out.shape
    _merge_kernel[(rows * num_heads,)](
        part,
        lse,
        out,
        out if sinks is None else sinks,  # unused without sinks
        num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        SINKS=sinks is not None,
    )


def scale_halves(
    kv_scales: torch.Tensor | None, layer_cache: torch.Tensor, unused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(k scales, v scales, block stride, slot stride) of an FP8 layer cache's scales [2, blocks,
    block_size, kv_heads] (checked against the cache), or ``unused`` twice and zero strides for a cache in
    the model dtype (the kernels then never read them)."""
    if kv_scales is None:
        return unused, unused, 0, 0
    assert layer_cache.dtype == torch.float8_e4m3fn and kv_scales.is_contiguous()
    assert kv_scales.shape == layer_cache.shape[:-1] and kv_scales.dtype == torch.float32
    return kv_scales[0], kv_scales[1], kv_scales.stride(1), kv_scales.stride(2)


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Split the context only while (sequence, kv head) programs would leave SMs idle (power of two)."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and batch * num_kv_heads * splits < 2 * num_sms
        and max_tokens >= 2 * splits * MIN_SPLIT_TOKENS
    ):
        splits *= 2
    return splits


def rope_then_store(
    heads: torch.Tensor, num_heads: int, layer_cache: torch.Tensor, rope: RopeInputs, kv_scales
) -> torch.Tensor:
    """``triton_fused.rope_store_kv`` on the packed projection ``heads`` [batch, heads + 2 kv_heads, d]:
    k and v stored into the cache at ``rope.slot_mapping`` -> the rotated q [batch, heads, d]."""
    from tidal.rollout.models.triton_fused import rope_store_kv

    num_kv_heads = layer_cache.shape[3]
    qk, v = heads[:, : num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads :]
    q, _ = rope_store_kv(
        qk, v, rope.cos, rope.sin, num_heads, layer_cache, rope.slot_mapping, layer_scales=kv_scales
    )
    return q


@dataclass(frozen=True)
class RopeInputs:
    """What the decode kernel needs to do ``rope_store_kv``'s work itself: cos/sin [batch, head_dim] of each
    row's position (model dtype) and each row's KV cache slot."""

    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    rope: RopeInputs | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, heads, d]; layer_cache [2, blocks, block_size, kv_heads, d] -> out [batch, heads * d].

    ``block_tables`` [batch, width] and ``context_lens`` [batch] are int32/int64 device tensors; a row
    with context length 0 (a CUDA-graph padding row) reads nothing and returns zeros. ``tiles``: launch
    settings other than ``TILES`` (bench/decode_attention.py sweeps them).

    With ``rope``, q is the packed projection before RoPE, [batch, heads + 2 kv_heads, d] (q heads, then k,
    then v; no q/k norms): the kernel does ``triton_fused.rope_store_kv``'s work too (q and k rotated, k and
    v stored at ``rope.slot_mapping``), bit-equal to running that kernel first.

    ``sinks`` [heads] (gpt-oss): one more logit per head in the softmax denominator, with no value; the
    output is scaled by ``sink_share`` of the keys' log-sum-exp (after the splits' merge, if split).

    ``kv_scales`` [2, blocks, block_size, kv_heads] (float32): the cache is FP8 (``runner/kv_cache.py``);
    keys and values are dequantized as they are read (and, with ``rope``, the step's own are quantized as
    they are stored). With a bf16/fp16 q the logits' dot runs in fp16, where every e4m3 key is exact and
    the conversion is one instruction a pair of elements (bf16 needs two more): q takes the softmax scale
    before it is rounded to fp16, so it overflows only past |q| = 65504 x sqrt(head_dim), and keeps 3 more
    bits than in bf16. The probabilities x value scales stay in bf16 (in fp16 a value row of ~1e-3 would
    fall into the subnormals). 12% faster than bf16 for both dots on the H200 at the 7B shape
    (bench/decode_attention.py). Unsplit calls that ``cuda_fp8_decode`` covers go to its CUDA kernel
    instead (0.039 against 0.068 ms at that shape); given ``tiles``, this kernel runs all the same.
    """
    triton_tiles = tiles is not None  # launch settings given: the Triton kernel even over an FP8 cache
    tiles = tiles or TILES
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = layer_cache.shape
    if rope is not None:
        num_heads -= 2 * num_kv_heads  # the k and v heads after the q heads
    assert cache_dim == head_dim and q.stride(-1) == 1 and layer_cache.is_contiguous()
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two for the Triton decode kernel"
    group = num_heads // num_kv_heads
    if num_splits is None:
        max_tokens = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, sm_count(q.device))
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    part, lse = split_buffers(out, num_splits)
    # The CUDA kernel for FP8 caches (cuda_fp8_decode), where it covers the call and compiles.
    cuda_variant = cuda_kernel = None
    if kv_scales is not None and not triton_tiles and FP8_CUDA_KERNEL and num_splits <= FP8_CUDA_MAX_SPLITS:
        cuda_variant = cuda_fp8_decode.variant_for(q, num_heads, layer_cache, block_tables, window, sinks)
    if (  # its ROPE build rotates and stores itself (chosen before compiling: one build per call site)
        cuda_variant is not None
        and rope is not None
        and FP8_CUDA_ROPE
        and cuda_fp8_decode.rope_fusable(rope, num_splits)
    ):
        cuda_variant = replace(cuda_variant, rope=1)
    if cuda_variant is not None:
        cuda_kernel = cuda_fp8_decode.compiled(cuda_variant, q.device)
    if cuda_kernel is not None:
        fused = cuda_variant.rope == 1
        if rope is not None and not fused:  # rotate and store first (the same bits as the fused path)
            q = rope_then_store(q, num_heads, layer_cache, rope, kv_scales)
        args = (q, layer_cache, kv_scales, block_tables, context_lens, scale, out, part, lse, num_splits)
        cuda_fp8_decode.fp8_paged_decode(cuda_variant, cuda_kernel, *args, rope=rope if fused else None)
        merge_splits(part, lse, out, sinks, num_splits)
        return out.view(batch, num_heads * head_dim)
    if rope is not None:
        cos, sin, slots = rope.cos.contiguous(), rope.sin.contiguous(), rope.slot_mapping
    else:
        cos = sin = slots = out  # unused
    sink_arg = out if sinks is None else sinks  # unused without sinks
    k, v = layer_cache[0], layer_cache[1]
    ks, vs, stride_sblk, stride_sslot = scale_halves(kv_scales, layer_cache, out)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k,
        v,
        block_tables,
        context_lens,
        out,
        part,
        lse,
        cos,
        sin,
        slots,
        sink_arg,
        ks,
        vs,
        cos.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        stride_sblk,
        stride_sslot,
        block_tables.stride(0),
        scale,
        window or 0,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.chunk(head_dim, layer_cache.element_size(), num_splits),
        NUM_SPLITS=num_splits,
        HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32,
        ROPE=rope is not None,
        SINKS=sinks is not None,
        FP8=kv_scales is not None,
        DOT16=kv_scales is not None and q.dtype != torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **tiles.options(layer_cache.element_size()),
        # RoPE's mul_rn / add_rn keep denormals, as rope_store_kv (and torch) do; libdevice is used for
        # nothing else here.
        enable_reflect_ftz=rope is None,
    )
    merge_splits(part, lse, out, sinks, num_splits)
    return out.view(batch, num_heads * head_dim)
