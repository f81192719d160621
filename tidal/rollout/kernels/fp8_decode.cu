// Paged decode attention over an FP8 (e4m3) KV cache, in CUDA C compiled at run time by NVRTC
// (cuda_fp8_decode.py). One query token per sequence; the cache is runner/kv_cache.py's:
// [blocks, block_size, kv_heads, HEAD_DIM] bytes for keys and for values, and a float32 scale per
// token and kv head for each.
//
// Why not Triton (triton_attention.py): Triton's tensor-core path for 8-bit tiles rearranges them in
// registers (single-byte shared-memory loads) and converts every element twice, and at batch 256 its
// kernel read the cache at 1.5-1.7 TB/s where the bf16 cache's reads 3.4-3.7. Here every byte goes from
// a 16-byte asynchronous copy (global to shared, several chunks ahead of the math) to a 16-byte shared read
// into the registers that are the MMA's operands; nothing is rearranged through memory:
//
// * Logits: S^T [16 tokens x 8 queries] = K [16 x D] . Q^T [D x 8] with mma.m16n8k16 (fp16 in, fp32
//   out). The 8 columns hold the GQA group's query heads (GROUP <= 8), so no MMA row is padding. Which
//   head dimension sits at which k position of the MMA is free, as long as K and Q agree: thread
//   (g = lane / 4, t = lane % 4) takes 16 bytes at t * 16 of every 64 of its tokens' key rows (keys g
//   and g + 8), and converts each pair of bytes with one cvt (e4m3 -> fp16 is exact).
// * Probabilities: online softmax in base 2 per query column; each 8 x 8 tile of probabilities (times
//   the value scales) is transposed into the second product's operand layout by one movmatrix.
// * Output: O^T [D x 8] += V^T [D x 16 tokens] . P^T [16 tokens x 8 queries], bf16 in, fp32 out. The
//   MMA wants each register to hold two tokens' values of one dimension, so thread (g, t) reads
//   dimensions [g * D/8, (g + 1) * D/8) of tokens 2t, 2t+1, 2t+8, 2t+9 (16- or 8-byte reads), pairs their
//   bytes with one prmt, and turns each e4m3 byte into a bf16 by moving its bits (sign to bit 15,
//   exponent and mantissa shifted by 4): that bf16 is exactly the e4m3 value times 2^-120, subnormals
//   and zero included. The probabilities x value scales take 2^VSHIFT (VSHIFT = 100) before they are
//   rounded to bf16, and the output 2^(120 - VSHIFT) at the end: products stay far from fp32's
//   subnormals, and a value scale would have to pass 2^28 to overflow bf16.
//
// Each CTA takes one (sequence, kv head, context split); its warps take every WARPS-th 16-token chunk
// of the split and merge their online softmaxes through shared memory at the end. A split writes the
// same float32 partial output and log-sum-exp as the Triton kernel, merged by its merge kernel.
//
// Measured (H200, bench/decode_attention.py, batch 256, ~384 tokens of context): 0.039 ms a call at the
// 7B shape (2.6 TB/s), against 0.059 for the Triton kernel over a bf16 cache and 0.068 over this one.
// A build with 3 stages took 0.041 ms; with its math removed its copies alone took 0.038, with its copies
// removed its math alone 0.029: what bounds it is streaming short contexts (each warp's ~6 chunks barely
// fill its pipeline) more than the math. At 1,536 tokens: 0.109 ms (3.8 TB/s, a plain read of the same bytes
// 3.86), after the logits' two accumulation chains and the swizzled rows below took it from 0.119.
//
// Compile-time constants (prepended by the loader): HEAD_DIM (64 or 128), GROUP (query heads per kv
// head, <= 8), BLOCK_SIZE (token slots a page, a multiple of 16), WARPS, Q_FP16 (1: fp16 queries and
// output, 0: bf16), BT_INT64 (block table / context lengths as int64), STAGES (chunks a warp has in
// flight + 1: its shared-memory pipeline's depth, >= 2), MIN_BLOCKS (CTAs an SM must hold: a
// register budget), HEADS_FIRST (1: the grid's x is the kv head, y the sequence), KSTRIDE, VSTRIDE,
// STAGE_BYTES (a pipeline stage's layout, below), ROPE (1: RoPE and the KV store of the step's own token
// inside the kernel, fp8_decode_rope.cu; unsplit contexts only).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#if BT_INT64
typedef long long index_t;
#else
typedef int index_t;
#endif

#define VSHIFT 100
// 2^VSHIFT and 2^(120 - VSHIFT) as floats (exponent fields; folded at compile time)
#define VSCALE_UP __int_as_float((127 + VSHIFT) << 23)
#define VSCALE_DOWN __int_as_float((127 + 120 - VSHIFT) << 23)
#define KB (HEAD_DIM / 4)   // key bytes a thread reads from each of its 2 tokens
#define VB (HEAD_DIM / 8)   // value bytes a thread reads from each of its 4 tokens
#define KSTEPS (HEAD_DIM / 16)
#define MTILES (HEAD_DIM / 16)
#define CHUNK 16
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx, as Triton's exp; exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u16 pair) {
  u32 out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(pair));
  return out;
}

// bf16x2 (lo: byte k of a, hi: byte k of b), each the e4m3 byte's value times 2^-120, exactly.
template <int k>
__device__ __forceinline__ u32 e4m3_pair_to_bf16x2(u32 a, u32 b) {
  u32 x;
  // byte 1 <- a.byte k, byte 3 <- b.byte k (bytes 0 and 2 are masked off below)
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(x) : "r"(a), "r"(b), "n"(((4 + k) << 12) | ((4 + k) << 8) | (k << 4) | k));
  return (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
}

__device__ __forceinline__ u32 pack_f32x2(float lo, float hi, bool fp16) {
  u32 out;
  if (fp16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  }
  return out;
}

__device__ __forceinline__ float to_f32(u16 bits) {
  float out;
#if Q_FP16
  asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
#else
  out = __uint_as_float(((u32)bits) << 16);
#endif
  return out;
}

__device__ __forceinline__ u16 from_f32(float x) {
  u16 out;
#if Q_FP16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(x));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
#endif
  return out;
}

__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 out;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(x));
  return out;
}

__device__ __forceinline__ float warp_max_over_rows(float x) {  // over the 8 lanes sharing lane % 4
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// A warp's pipeline stage holds a 16-token chunk: 16 key rows of KSTRIDE bytes, 16 value rows of VSTRIDE,
// then 16 key and 16 value scales; STAGE_BYTES in all (the loader defines the three: it sizes the shared
// memory from them). A warp's 16-byte reads must hit distinct banks: with heads of 128 the rows are
// unpadded and the byte column c of row r is stored at c ^ KSWZ(r) (keys: rows g and g + 1, read together,
// land in opposite halves of 128 bytes) or c ^ VSWZ(r) (values: rows 2t, t = 0..3, read together, land 32
// bytes apart); heads of 64 pad their value rows instead (cuda_fp8_decode.Variant), since a 64-byte row
// cannot be permuted into the other half of 128.
#if HEAD_DIM == 128
#define KSWZ(r) (((r) & 1) << 6)
#define VSWZ(r) ((((r) >> 1) & 3) << 5)
#else
#define KSWZ(r) 0
#define VSWZ(r) 0
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

// The warp copies one 16-token chunk (key/value rows from byte `row0`, scales from `srow0`) into a stage:
// 16-byte copies that bypass registers, so several chunks can be in flight while the warp computes.
__device__ __forceinline__ void copy_chunk(u8* stage, const u8* kc, const u8* vc, const float* ksc,
                                           const float* vsc, long long row0, long long srow0, int row_stride,
                                           int srow_stride, int lane) {
  constexpr int PIECES = HEAD_DIM / 16;  // 16-byte pieces a row
#pragma unroll
  for (int i = 0; i < 16 * PIECES / 32; ++i) {
    const int p = lane + 32 * i, r = p / PIECES, col = (p % PIECES) * 16;
    const long long src = row0 + (long long)r * row_stride + col;
    cp_async16(smem_addr(stage + r * KSTRIDE + (col ^ KSWZ(r))), kc + src);
    cp_async16(smem_addr(stage + 16 * KSTRIDE + r * VSTRIDE + (col ^ VSWZ(r))), vc + src);
  }
  const float* scales = lane < 16 ? ksc : vsc;  // lanes 0-15: key scales, 16-31: value scales
  cp_async4(smem_addr(stage + 16 * (KSTRIDE + VSTRIDE) + 4 * lane),
            scales + srow0 + (long long)(lane % 16) * srow_stride);
}

// One chunk's bytes (as 4-byte words) and scales, as this thread reads them from its stage.
struct Chunk {
  u32 k[2][KB / 4];    // key tokens g and g+8: KB bytes each
  u32 v[4][VB / 4];    // value tokens 2t, 2t+1, 2t+8, 2t+9: VB bytes each
  float ks[2], vs[2];  // key and value scales of tokens g and g+8
};

template <int N>  // N words from 16-byte-aligned shared memory, in 16- or 8-byte reads
__device__ __forceinline__ void read_words(u32* dst, const u8* src) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const uint4 x = reinterpret_cast<const uint4*>(src)[i];
    dst[4 * i] = x.x, dst[4 * i + 1] = x.y, dst[4 * i + 2] = x.z, dst[4 * i + 3] = x.w;
  }
  if (N % 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(src + 16 * (N / 4));
    dst[N - 2] = x.x, dst[N - 1] = x.y;
  }
}

__device__ __forceinline__ void read_chunk(Chunk& c, const u8* stage, int g, int t) {
  // Thread t's key bytes: 16 at t * 16 of each 64 of its two rows.
  const u8* krow = stage + g * KSTRIDE;  // rows g and g + 8: the same swizzle
#pragma unroll
  for (int i = 0; i < KB / 16; ++i) {
    const int col = (t * 16 + 64 * i) ^ KSWZ(g);
    read_words<4>(c.k[0] + 4 * i, krow + col);
    read_words<4>(c.k[1] + 4 * i, krow + 8 * KSTRIDE + col);
  }
  const u8* vrows = stage + 16 * KSTRIDE;
  const int vtok[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};  // VSWZ: t's for all four
#pragma unroll
  for (int j = 0; j < 4; ++j) read_words<VB / 4>(c.v[j], vrows + vtok[j] * VSTRIDE + ((g * VB) ^ VSWZ(2 * t)));
  const float* scales = reinterpret_cast<const float*>(stage + 16 * (KSTRIDE + VSTRIDE));
  c.ks[0] = scales[g], c.ks[1] = scales[g + 8];
  c.vs[0] = scales[16 + g], c.vs[1] = scales[24 + g];
}

// Built with ROPE = 1 (the engine's decode step, when its context is not split): q holds the packed projection
// (q heads, then k, then v), whose q heads the kernel rotates and whose k and v heads it rotates, quantizes
// and stores at `slots` itself, as triton_fused.rope_store_kv would before it (fp8_decode_rope.cu, appended).
__device__ void rope_q(u32 (&qw)[KB / 16][8], const u16* cos_row, const u16* sin_row, int t);
__device__ void store_new_kv(const u16* k_row, const u16* v_row, const u16* cos_row, const u16* sin_row,
                             u8* kdst, u8* vdst, float* ks_at, float* vs_at, int lane);

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    fp8_paged_decode(const u16* __restrict__ q, u8* kcache, u8* vcache, float* kscale, float* vscale,
                     const index_t* __restrict__ block_tables, const index_t* __restrict__ context_lens,
                     u16* __restrict__ out, float* __restrict__ part, float* __restrict__ lse, int stride_qb,
                     int stride_qh, int stride_kblk, int stride_kslot, int stride_sblk, int stride_sslot,
                     int stride_btb, int bt_width, double qk_scale_log2, int num_splits,
                     const u16* __restrict__ cos, const u16* __restrict__ sin, int stride_cos,
                     const long long* __restrict__ slots) {
#if HEADS_FIRST  // a sequence's kv heads run side by side: together they read whole cache rows
  const int kvh = blockIdx.x, b = blockIdx.y, num_kv_heads = gridDim.x;
#else
  const int b = blockIdx.x, kvh = blockIdx.y, num_kv_heads = gridDim.y;
#endif
  const int split = blockIdx.z, num_heads = num_kv_heads * GROUP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // q's raw words first, the context length next: neither waits for the other. Key word st of thread t
  // holds dimensions (st / 4) * 64 + t * 16 + (st % 4) * 4 + [0, 4); q's dimensions must match.
  const bool live_q = g < GROUP;
  u32 qw[KB / 16][8];
  {
    const u16* qrow = q + (long long)b * stride_qb + (long long)(kvh * GROUP + (live_q ? g : 0)) * stride_qh;
#pragma unroll
    for (int blk = 0; blk < KB / 16; ++blk) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(qrow + blk * 64 + t * 16) + i);
        qw[blk][4 * i] = x.x, qw[blk][4 * i + 1] = x.y, qw[blk][4 * i + 2] = x.z, qw[blk][4 * i + 3] = x.w;
      }
    }
  }
  // The first split starts at token 0 whatever the context: its first pages load beside the length.
  const index_t* bt = block_tables + (long long)b * stride_btb;
  index_t page_of_lane = 0;
  if (split == 0) {
    const int idx = (warp * CHUNK + lane * WARPS * CHUNK) / BLOCK_SIZE;
    page_of_lane = idx < bt_width ? bt[idx] : 0;
  }
  const int ctx = (int)context_lens[b];
  const int split_len = ((ctx + num_splits - 1) / num_splits + CHUNK - 1) / CHUNK * CHUNK;
  const int lo = split * split_len;
  const int hi = min(lo + split_len, ctx);

  float acc[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF};  // running max of queries 2t, 2t+1 (base-2 logits)
  float l[2] = {0.f, 0.f};              // this thread's share of their denominators

  // The warp's chunks: n = 0, 1, ... at token first + n * step. Lane i holds the page of chunk 32k + i
  // (k: the current batch of 32), handed out by shuffles, so no page lookup waits in the pipeline.
  extern __shared__ __align__(16) u8 smem[];
  u8* stages = smem + warp * STAGES * STAGE_BYTES;
  const int first = lo + warp * CHUNK, step = WARPS * CHUNK;
  const int n_chunks = first < hi ? (hi - first + step - 1) / step : 0;
  auto issue = [&](int n) {  // start copying chunk n into stage n % STAGES (called for n = 0, 1, ...)
    if (n < n_chunks) {
      if (n % 32 == 0 && (n > 0 || split > 0)) {  // the next 32 chunks' pages (split 0's first: above)
        const int c = first + (n + lane) * step;
        page_of_lane = c < hi ? bt[c / BLOCK_SIZE] : 0;
      }
      const long long page = (long long)__shfl_sync(0xffffffffu, page_of_lane, n % 32);
      const int slot0 = (first + n * step) % BLOCK_SIZE;
      const long long row0 = page * stride_kblk + (long long)slot0 * stride_kslot + (long long)kvh * HEAD_DIM;
      const long long srow0 = page * stride_sblk + (long long)slot0 * stride_sslot + kvh;
      copy_chunk(stages + (n % STAGES) * STAGE_BYTES, kcache, vcache, kscale, vscale, row0, srow0,
                 stride_kslot, stride_sslot, lane);
    }
    asm volatile("cp.async.commit_group;");  // one group an index, empty or not: the wait counts them
  };
#if ROPE  // the step's own key and value, stored by the warp whose last chunk holds them (fp8_decode_rope.cu)
  const int newest = ctx > 0 ? ctx - 1 : 0;  // a padding row (no context) stores into its padding slot
  const bool stores = warp == (newest / CHUNK) % WARPS;
  const bool early = (newest - first) / step < STAGES - 1;  // its chunk is among the first copies
  const u16* own = q + (long long)b * stride_qb + (long long)(num_heads + kvh) * stride_qh;
  const u16 *cos_row = cos + (long long)b * stride_cos, *sin_row = sin + (long long)b * stride_cos;
  auto store = [&]() {
    const long long slot = slots[b], page = slot / BLOCK_SIZE, at = slot % BLOCK_SIZE;
    const long long row = page * stride_kblk + at * stride_kslot + (long long)kvh * HEAD_DIM;
    const long long srow = page * stride_sblk + at * stride_sslot + kvh;
    store_new_kv(own, own + (long long)num_kv_heads * stride_qh, cos_row, sin_row, kcache + row, vcache + row,
                 kscale + srow, vscale + srow, lane);
  };
  if (stores && early) store();
#endif
#pragma unroll
  for (int n = 0; n < STAGES - 1; ++n) issue(n);
#if ROPE  // a later chunk: its store overlaps the first copies
  if (stores && !early) store();
  rope_q(qw, cos_row, sin_row, t);
#endif

  // Q^T fragments (the B operand), pre-scaled by softmax scale x log2(e), in fp16 (columns >= GROUP: 0),
  // converted while the first chunks are in flight.
  u32 qf[KSTEPS][2];
  {
    const float s = live_q ? (float)qk_scale_log2 : 0.f;
#pragma unroll
    for (int blk = 0; blk < KB / 16; ++blk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 lo = qw[blk][2 * j], hi = qw[blk][2 * j + 1];
        qf[4 * blk + j][0] = pack_f32x2(to_f32(lo & 0xffffu) * s, to_f32(lo >> 16) * s, true);
        qf[4 * blk + j][1] = pack_f32x2(to_f32(hi & 0xffffu) * s, to_f32(hi >> 16) * s, true);
      }
    }
  }
  for (int n = 0; n < n_chunks; ++n) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));  // chunk n's copies (this lane's) landed
    __syncwarp();  // ... and every lane's; every lane is done reading the stage chunk n - 1 used
    issue(n + STAGES - 1);
    Chunk c;
    read_chunk(c, stages + (n % STAGES) * STAGE_BYTES, g, t);
    const int c0 = first + n * step;

    // Logits of tokens g (s[0], s[1]) and g+8 (s[2], s[3]) for queries 2t, 2t+1. Even and odd k-steps
    // accumulate apart: two chains of dependent MMAs instead of one twice as long (at 1,536 tokens of
    // context the one chain cost 5% of the kernel's time: docs/benchmarks.md, session 28).
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int st = 0; st < KSTEPS; ++st) {
      const u32 w0 = c.k[0][st], w1 = c.k[1][st];
      const u32 a[4] = {e4m3x2_to_f16x2((u16)(w0 & 0xffffu)), e4m3x2_to_f16x2((u16)(w1 & 0xffffu)),
                        e4m3x2_to_f16x2((u16)(w0 >> 16)), e4m3x2_to_f16x2((u16)(w1 >> 16))};
      mma_f16(st % 2 ? s_odd : s, a, qf[st][0], qf[st][1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += s_odd[i];
    const bool live0 = c0 + g < hi, live1 = c0 + g + 8 < hi;
    s[0] = live0 ? s[0] * c.ks[0] : NEG_INF;
    s[1] = live0 ? s[1] * c.ks[0] : NEG_INF;
    s[2] = live1 ? s[2] * c.ks[1] : NEG_INF;
    s[3] = live1 ? s[3] * c.ks[1] : NEG_INF;

    float p[4], alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float m_new = fmaxf(m[j], warp_max_over_rows(fmaxf(s[j], s[j + 2])));
      alpha[j] = fast_exp2(m[j] - m_new);
      p[j] = fast_exp2(s[j] - m_new);
      p[j + 2] = fast_exp2(s[j + 2] - m_new);
      l[j] = l[j] * alpha[j] + p[j] + p[j + 2];
      m[j] = m_new;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // a max moved: rescale O^T
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {  // columns 2t (acc 0, 2) and 2t + 1 (acc 1, 3)
        acc[i][0] *= alpha[0], acc[i][2] *= alpha[0];
        acc[i][1] *= alpha[1], acc[i][3] *= alpha[1];
      }
    }
    // P^T x value scales, bf16, transposed into the B operand: (tokens 2t, 2t+1 | 2t+8, 2t+9; query g).
    // (a dead token's scale is never multiplied: 0 x NaN would poison the product)
    const float vs0 = live0 ? c.vs[0] * VSCALE_UP : 0.f, vs1 = live1 ? c.vs[1] * VSCALE_UP : 0.f;
    const u32 b0 = transpose8x8(pack_f32x2(p[0] * vs0, p[1] * vs0, false));
    const u32 b1 = transpose8x8(pack_f32x2(p[2] * vs1, p[3] * vs1, false));

#pragma unroll
    for (int w = 0; w < VB / 4; ++w) {  // word w: dimensions g * VB + 4w .. +3, i.e. m-tiles 2w and 2w+1
      const u32 v0 = c.v[0][w], v1 = c.v[1][w], v2 = c.v[2][w], v3 = c.v[3][w];
      mma_bf16(acc[2 * w], e4m3_pair_to_bf16x2<0>(v0, v1), e4m3_pair_to_bf16x2<1>(v0, v1),
               e4m3_pair_to_bf16x2<0>(v2, v3), e4m3_pair_to_bf16x2<1>(v2, v3), b0, b1);
      mma_bf16(acc[2 * w + 1], e4m3_pair_to_bf16x2<2>(v0, v1), e4m3_pair_to_bf16x2<3>(v0, v1),
               e4m3_pair_to_bf16x2<2>(v2, v3), e4m3_pair_to_bf16x2<3>(v2, v3), b0, b1);
    }
  }

  // Merge the warps: each warp's max, denominator and O^T go through shared memory (the stages' bytes,
  // once every warp is done with them).
  float(*sm_m)[8] = reinterpret_cast<float(*)[8]>(smem);
  float(*sm_l)[8] = sm_m + WARPS;
  float(*sm_acc)[8][HEAD_DIM] = reinterpret_cast<float(*)[8][HEAD_DIM]>(sm_l + WARPS);
  __syncthreads();
  l[0] = warp_sum_over_rows(l[0]);
  l[1] = warp_sum_over_rows(l[1]);
  if (g == 0) {
    sm_m[warp][2 * t] = m[0];
    sm_m[warp][2 * t + 1] = m[1];
    sm_l[warp][2 * t] = l[0];
    sm_l[warp][2 * t + 1] = l[1];
  }
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {  // acc[i] = O^T rows g*VB + 2i (c0, c1) and g*VB + 2i + 1 (c2, c3)
    const int d = g * VB + 2 * i;
    sm_acc[warp][2 * t][d] = acc[i][0];
    sm_acc[warp][2 * t + 1][d] = acc[i][1];
    sm_acc[warp][2 * t][d + 1] = acc[i][2];
    sm_acc[warp][2 * t + 1][d + 1] = acc[i][3];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += WARPS * 32) {
    const int qi = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float top = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, sm_m[w][qi]);
    float total = 0.f, o = 0.f;
    if (top != NEG_INF) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = fast_exp2(sm_m[w][qi] - top);
        total += f * sm_l[w][qi];
        o += f * sm_acc[w][qi][d];
      }
    }
    const float val = total > 0.f ? o / total * VSCALE_DOWN : 0.f;
    const long long row = (long long)b * num_heads + kvh * GROUP + qi;
    if (num_splits == 1) {
      out[row * HEAD_DIM + d] = from_f32(val);
    } else {
      part[(row * num_splits + split) * HEAD_DIM + d] = val;
      if (d == 0) lse[row * num_splits + split] = total > 0.f ? (top + log2f(total)) * 0.6931471805599453f : NEG_INF;
    }
  }
}
