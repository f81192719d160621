// The decode step's own token inside fp8_paged_decode (built with ROPE = 1; the loader appends this file to
// fp8_decode.cu): RoPE on the query heads, and the key and value heads rotated (keys), quantized and stored
// into the FP8 cache. Bit for bit what triton_fused.rope_store_kv computes and stores before an unfused
// call, so that fusing changes no sample: every product and sum rounded as torch's apply_rope rounds it
// (to the model dtype, with no fused multiply-add), and kv_cache.quantize_heads' arithmetic for the e4m3
// bytes (a row's absolute maximum times fl32(1/448) as its scale; each value times the IEEE reciprocal of
// the scale, clamped to +-448, rounded to nearest even).

// One value of the rotate-half RoPE, given its partner (dimension d +- HEAD_DIM / 2) and its cos/sin.
__device__ __forceinline__ u16 rope_value(u16 x, u16 partner, float c, float s, bool first_half) {
  const float rot = first_half ? -to_f32(partner) : to_f32(partner);
  const float a = to_f32(from_f32(__fmul_rn(to_f32(x), c)));
  const float b = to_f32(from_f32(__fmul_rn(rot, s)));
  return from_f32(__fadd_rn(a, b));
}

__device__ __forceinline__ u32 rope_word(u32 x, u32 partner, u32 c, u32 s, bool first_half) {
  const u16 lo = rope_value((u16)(x & 0xffffu), (u16)(partner & 0xffffu), to_f32((u16)(c & 0xffffu)),
                            to_f32((u16)(s & 0xffffu)), first_half);
  const u16 hi = rope_value((u16)(x >> 16), (u16)(partner >> 16), to_f32((u16)(c >> 16)),
                            to_f32((u16)(s >> 16)), first_half);
  return (u32)lo | ((u32)hi << 16);
}

// The thread's query words (dimensions blk * 64 + t * 16 + [0, 16), as the kernel loads them), rotated in
// place. Heads of 128: a thread holds both halves of each pair; heads of 64: thread t ^ 2 holds the partner.
__device__ void rope_q(u32 (&qw)[KB / 16][8], const u16* cos_row, const u16* sin_row, int t) {
  u32 cw[KB / 16][8], sw[KB / 16][8], pw[KB / 16][8];
#pragma unroll
  for (int blk = 0; blk < KB / 16; ++blk) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 c = __ldg(reinterpret_cast<const uint4*>(cos_row + blk * 64 + t * 16) + i);
      const uint4 s = __ldg(reinterpret_cast<const uint4*>(sin_row + blk * 64 + t * 16) + i);
      cw[blk][4 * i] = c.x, cw[blk][4 * i + 1] = c.y, cw[blk][4 * i + 2] = c.z, cw[blk][4 * i + 3] = c.w;
      sw[blk][4 * i] = s.x, sw[blk][4 * i + 1] = s.y, sw[blk][4 * i + 2] = s.z, sw[blk][4 * i + 3] = s.w;
    }
  }
#pragma unroll
  for (int blk = 0; blk < KB / 16; ++blk) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      pw[blk][j] = HEAD_DIM == 128 ? qw[blk ^ (KB / 16 - 1)][j] : __shfl_xor_sync(0xffffffffu, qw[blk][j], 2);
  }
#pragma unroll
  for (int blk = 0; blk < KB / 16; ++blk) {
    const bool first_half = HEAD_DIM == 128 ? blk == 0 : t < 2;
#pragma unroll
    for (int j = 0; j < 8; ++j) qw[blk][j] = rope_word(qw[blk][j], pw[blk][j], cw[blk][j], sw[blk][j], first_half);
  }
}

__device__ __forceinline__ u8 e4m3_byte(float x) {  // x already within +-448
  u16 out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.f), "f"(x));  // x: the low byte
  return (u8)(out & 0xffu);
}

#define PAIRS (HEAD_DIM / 64)  // dimensions of each half a lane holds: lane * PAIRS + [0, PAIRS)

// A row of HEAD_DIM values (this lane's: x[j] at dimension lane * PAIRS + j, x[PAIRS + j] at that + HEAD_DIM
// / 2) quantized with the row's own scale; bytes and scale stored.
__device__ __forceinline__ void store_row(const float* x, u8* row, float* scale_at, int lane) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 2 * PAIRS; ++j) amax = fmaxf(amax, fabsf(x[j]));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = amax > 0.f ? __fmul_rn(amax, __fdiv_rn(1.f, 448.f)) : 1.f;
  const float inverse = fminf(__fdiv_rn(1.f, scale), 3.4028234663852886e38f);
#pragma unroll
  for (int j = 0; j < 2 * PAIRS; ++j) {
    const int d = lane * PAIRS + j % PAIRS + (j / PAIRS) * (HEAD_DIM / 2);
    row[d] = e4m3_byte(fminf(fmaxf(__fmul_rn(x[j], inverse), -448.f), 448.f));
  }
  if (lane == 0) *scale_at = scale;
}

// The token's key head (rotated) and value head into the cache, by one warp. The fence and the warp's
// barrier make the stores visible to the copies that read them back in this warp's last chunk.
__device__ void store_new_kv(const u16* k_row, const u16* v_row, const u16* cos_row, const u16* sin_row,
                             u8* kdst, u8* vdst, float* ks_at, float* vs_at, int lane) {
  float k[2 * PAIRS], v[2 * PAIRS];
#pragma unroll
  for (int j = 0; j < PAIRS; ++j) {
    const int d = lane * PAIRS + j, e = d + HEAD_DIM / 2;
    const u16 k1 = k_row[d], k2 = k_row[e];
    k[j] = to_f32(rope_value(k1, k2, to_f32(cos_row[d]), to_f32(sin_row[d]), true));
    k[PAIRS + j] = to_f32(rope_value(k2, k1, to_f32(cos_row[e]), to_f32(sin_row[e]), false));
    v[j] = to_f32(v_row[d]);
    v[PAIRS + j] = to_f32(v_row[e]);
  }
  store_row(k, kdst, ks_at, lane);
  store_row(v, vdst, vs_at, lane);
  __threadfence_block();
  __syncwarp();
}
