// HiF4 and MXFP4 quantization of one part (8 consecutive bf16 values) of a unit / block, given the maximum |x| of
// the whole unit (HiF4: 64 values = 8 parts) or block (MXFP4: 32 values = 4 parts): the dequantized values in
// bf16, bit for bit megatron_fp4.formats (SPEC section 2) and the Triton kernels (megatron_fp4/kernels/quantize.py:
// _hif4_units, _mx_units), whose scale arithmetic this follows line by line.
//
// Host and device code: megatron_fp4/kernels/csrc/quant_both.cu runs it on the GPU, tests/test_cuda_quantize.py
// compiles it with the host C++ compiler and checks it against the PyTorch reference on the CPU. Every fp32 product is
// rounded on its own (__fmul_rn on the device, -ffp-contract=off on the host): a fused multiply-add would change
// the rounding decisions.
#pragma once
#include <stdint.h>

#include <cmath>
#include <cstring>
#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

#ifdef __CUDACC__
#define QM_FN __host__ __device__ __forceinline__
#else
#define QM_FN inline
#endif

namespace qm {

QM_FN float as_f(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

QM_FN uint32_t as_u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

QM_FN float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

QM_FN uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
QM_FN uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// Unsigned maximum of each 16-bit half.
QM_FN uint32_t vmax2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vmaxu2(a, b);
#else
  return umax(a & 0xFFFFu, b & 0xFFFFu) | (umax(a >> 16, b >> 16) << 16);
#endif
}

// fma(a, b, c) where the product a * b is exact, so that one rounding of the sum is what a separate multiply and
// add would give (one FFMA on the device).
QM_FN float fma_exact(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// A part is 8 consecutive bf16 values in 4 words (value 2i in the low half of word i, as in memory).
// The largest |x| bits (16-bit bf16 pattern) of a part: on |x| bits integer order is value order, Inf and NaN
// above every finite value.
QM_FN uint32_t part_max(const uint32_t w[4]) {
  const uint32_t m =
      vmax2(vmax2(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu), vmax2(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
  return umax(m & 0xFFFFu, m >> 16);
}

// Round fp32 to bf16, ties to even (either sign, Inf kept; not NaN: a NaN's payload could carry into the sign),
// result in fp32.
QM_FN float bf16_rne(float v) {
  uint32_t b = as_u(v);
  return as_f((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

// Two finite or infinite fp32 values rounded to bf16 to nearest even, as one word (lo in the low half): bf16_rne's
// bits; on the device the hardware conversion (cvt.rn.bf16x2.f32, one instruction for both).
QM_FN uint32_t bf16x2_rne(float lo, float hi) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return (as_u(bf16_rne(lo)) >> 16) | (as_u(bf16_rne(hi)) & 0xFFFF0000u);
#endif
}

// Round to the nearest integer, ties to even (exact for |v| < 2^23).
QM_FN float rint_(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

QM_FN float pow2(int e) { return as_f((uint32_t)(e + 127) << 23); }  // e in [-126, 127]

// Two fp32 values (exact in bf16, non-negative) -> one word, the sign bits of the part's word w put back, or
// the NaN pair for a NaN/Inf unit.
QM_FN uint32_t pack(float lo, float hi, uint32_t w, bool bad) {
#ifdef __CUDA_ARCH__
  const uint32_t v = __byte_perm(as_u(lo), as_u(hi), 0x7632) | (w & 0x80008000u);
#else
  const uint32_t v = (as_u(lo) >> 16) | (as_u(hi) & 0xFFFF0000u) | (w & 0x80008000u);
#endif
  return bad ? 0x7FC07FC0u : v;
}

// HiF4's level 1 (SPEC 2.1 steps 2-4) of a unit whose largest |x| is vmax (0 for a NaN/Inf unit): returns r =
// bf16_rne(1 / E6M2), in [2^-16, 2^48]; rb: E6M2's fp32 bits.
QM_FN float hif4_scale(float vmax, uint32_t& rb) {
  float sf = bf16_rne(mul(vmax, 0.142578125f));
  sf = sf < 3.552713678800501e-15f ? 3.552713678800501e-15f : (sf > 49152.0f ? 49152.0f : sf);
  const uint32_t sb = as_u(sf);
  rb = (sb + 0xFFFFFu + ((sb >> 21) & 1u)) & 0xFFE00000u;  // E6M2: RNE to 2 mantissa bits
  const int e = (int)((rb >> 23) & 0xFFu) - 127;
  const int m2 = (int)((rb >> 21) & 3u);
  const float recip = m2 == 0 ? 1.0f : (m2 == 1 ? 0.80078125f : (m2 == 2 ? 0.66796875f : 0.5703125f));
  return mul(recip, pow2(-e));
}

// SPEC 2.1 step 5 for group g (of two, 4 values each) of an 8-value part (one E1_8 group): E1_8 + E1_16, from the
// groups' largest |x| (fp32 bits b16) and r.
QM_FN int hif4_shift(const uint32_t b16[2], float r, int g) {
  const bool e18 = mul(as_f(umax(b16[0], b16[1])), r) >= 4.0f;
  float p16 = mul(as_f(b16[g]), r);
  if (e18) p16 = mul(p16, 0.5f);
  return (int)e18 + (int)(p16 >= 2.0f);
}

// HiF4: N parts of one 64-value unit (each part 8 values aligned to 8 = one E1_8 group, two E1_16 groups), bmax
// the unit's largest |x| (bf16 bits). SPEC 2.1 steps 2-7; a NaN/Inf unit dequantizes to NaN.
// The element step needs bf16 inputs: |x| and r = bf16(1 / E6M2) have 8 significant bits each, so 4m = |x| r
// 2^(2 - shift) is exact, and so is 4m + 8.5 where it matters (4m >= 2^-5; below, k = 0 either way): k =
// floor(4m + 0.5) (ties away from zero) is the integer part of 4m + 8.5, minus 8, which masking its low mantissa
// bits gives (the value in [8, 16) has 20 fraction bits); min(., 15.5) caps k at 7.
template <int N>
QM_FN void hif4_parts(const uint32_t w[4 * N], uint32_t bmax, uint32_t out[4 * N]) {
  const bool bad = bmax >= 0x7F80u;
  uint32_t rb;
  const float r = hif4_scale(bad ? 0.0f : as_f(bmax << 16), rb);
#pragma unroll
  for (int pt = 0; pt < N; ++pt) {
    const uint32_t* wp = w + 4 * pt;
    uint32_t aw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) aw[i] = wp[i] & 0x7FFF7FFFu;
    uint32_t b16[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const uint32_t m = vmax2(aw[2 * g], aw[2 * g + 1]);
      b16[g] = umax(m & 0xFFFFu, m >> 16) << 16;
    }
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int shift = hif4_shift(b16, r, g);
      const float rp = as_f(as_u(r) + (uint32_t)((2 - shift) << 23));  // r 2^(2 - shift): 4m = |x| rp
      const float gs = as_f(rb + (uint32_t)((shift - 2) << 23));  // E6M2 2^shift / 4 (>= 2^-50, normal)
      const float ngs = mul(gs, -8.0f);
#pragma unroll
      for (int i = 2 * g; i < 2 * g + 2; ++i) {
        float v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float ax = as_f(h ? aw[i] & 0xFFFF0000u : aw[i] << 16);
          float t = fma_exact(ax, rp, 8.5f);
          t = t > 15.5f ? 15.5f : t;
          v[h] = fma_exact(as_f(as_u(t) & 0xFFF00000u), gs, ngs);  // (8 + k - 8) gs
        }
        out[4 * pt + i] = pack(v[0], v[1], wp[i], bad);
      }
    }
  }
}

// The E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6) nearest to non-negative s, ties to even, saturating at 6 (kernels/
// quantize.py: _e2m1_code, as a value). E2M1's spacing is 0.5 below 2, 1 in [2, 4), 2 from 4: adding M = 2^22,
// 2^23 or 2^24 (s's power of 2, clamped to [1, 4], times 2^22) rounds s to that spacing, ties to even (the sum's
// last bit is the code's mantissa bit), and subtracting M again is exact.
QM_FN float e2m1_round(float s) {
  uint32_t e = as_u(s) & 0x7F800000u;
  e = e < 0x3F800000u ? 0x3F800000u : (e > 0x40800000u ? 0x40800000u : e);
  const float m = as_f(e + (22u << 23));
  const float q = (s + m) - m;
  return q > 6.0f ? 6.0f : q;
}

// The scale exponent X in [-127, 127] of a block whose largest |x| has the (finite) fp32 bits ab.
QM_FN int mx_x32(uint32_t ab, bool rceil) {
  const int eb = (int)(ab >> 23);
  int X = eb - 129;
  if (rceil) X += (int)((ab & 0x7FFFFFu) > 0x400000u);
  if (eb == 0) X = -127;
  return X < -127 ? -127 : (X > 127 ? 127 : X);
}

// The same of a block whose largest |x| has the (finite) bf16 bits bmax.
QM_FN int mx_x(uint32_t bmax, bool rceil) { return mx_x32(bmax << 16, rceil); }

// MXFP4: N parts of one 32-value block, bmax the block's largest |x| (bf16 bits) (SPEC 2.2; rceil: NVIDIA's
// never-clipping scale). A NaN/Inf block dequantizes to NaN.
template <int N>
QM_FN void mx_parts(const uint32_t w[4 * N], uint32_t bmax, bool rceil, uint32_t out[4 * N]) {
  const bool bad = bmax >= 0x7F80u;
  const int X = mx_x(bad ? 0u : bmax, rceil);
  const float inv = as_f((uint32_t)(127 - X) << 23);  // 2^-X (X <= 126 for finite blocks)
  const float px = X == -127 ? 5.877471754111438e-39f : as_f((uint32_t)(X + 127) << 23);
#pragma unroll
  for (int i = 0; i < 4 * N; ++i) {
    float v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float ax = as_f(h ? w[i] & 0x7FFF0000u : (w[i] & 0x7FFFu) << 16);
      v[h] = mul(e2m1_round(mul(ax, inv)), px);  // E2M1 value 2^X
    }
    out[i] = pack(v[0], v[1], w[i], bad);
  }
}

// MXFP4's FP8 form (the GEMM modes "fp8" / "fp8_fast"; megatron_fp4/kernels/quantize.py: _mx_e5m2, _mx_e4m3, fp8_rows):
// every value of a row relative to the row scale 2^S, S = clamp(the row's largest block exponent - TOP, -126, 127) over
// its finite blocks (rmax: the largest |x| bits of those blocks, 0 if none); TOP 13 maps the largest block's 6 * 2^X
// to E5M2's 1.5 * 2^15, TOP 6 to E4M3's 384.
QM_FN int fp8_row_s(uint32_t rmax, bool rceil, bool e4m3) {
  const int s = mx_x(rmax, rceil) - (e4m3 ? 6 : 13);
  return s < -126 ? -126 : (s > 127 ? 127 : s);
}

// FP8 magnitude bits of the E2M1 value q (0, 0.5, ..., 6) of a block of scale 2^X, relative to 2^S: E5M2 in its
// normal range, E4M3 (fn) with its subnormals; a value the form cannot hold is 0 and clears ok (the GEMMs read it
// flushed: an approximate mode). q 2^X at or above 2^128 (rceil scales of the largest bf16 values) is fp32's Inf
// in the reference, so E5M2's Inf here and E4M3's NaN (not held: ok cleared).
QM_FN uint32_t fp8_of(float q, int X, int S, bool e4m3, bool& ok) {
  if (q == 0.0f) return 0u;
  const uint32_t qb = as_u(q);
  const int e = (int)(qb >> 23) - 127, E = e + X - S;  // q 2^(X - S) = (1 + m / 2) 2^E
  const uint32_t m = (qb >> 22) & 1u;
  if (e + X >= 128) {
    if (!e4m3) return 0x7Cu;
    ok = false;
    return 0x7Fu;
  }
  if (!e4m3) {
    if (E >= -14 && E <= 15) return ((uint32_t)(E + 15) << 2) | (m << 1);
  } else {
    if (E >= -6) return ((uint32_t)(E + 7) << 3) | (m << 2);  // E <= 8: q 2^d <= 384
    if (E >= -8) return (2u + m) << (E + 8);                    // subnormal k 2^-9, k = (2 + m) 2^(E + 8)
    if (E == -9 && m == 0u) return 1u;
  }
  ok = false;
  return 0u;
}

// Two FP8 values (value order, low byte first) of exactly representable fp32 values a, b (0 and -0 included): the
// hardware conversion on the device (one instruction per pair; satfinite, the only form the hardware has, changes
// no value here: every value is finite and within range), the same bits from the fields on the host.
QM_FN uint32_t fp8_pair(float a, float b, bool e4m3) {
#ifdef __CUDA_ARCH__
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
#else
  uint32_t out = 0u;
  for (int h = 0; h < 2; ++h) {
    const uint32_t vb = as_u(h ? b : a), sign = (vb >> 24) & 0x80u, ab = vb & 0x7FFFFFFFu;
    const int e = (int)(ab >> 23) - 127;
    uint32_t m = 0u;
    if (ab != 0u) {
      if (!e4m3) m = ((uint32_t)(e + 15) << 2) | ((ab >> 21) & 3u);
      else if (e >= -6) m = ((uint32_t)(e + 7) << 3) | ((ab >> 20) & 7u);
      else m = (uint32_t)(as_f(ab) * 512.0f);  // subnormal: k 2^-9
    }
    out |= (sign | m) << (8 * h);
  }
  return out;
#endif
}

// The values of N parts of one block (mx_fp8_parts' fast path): q 2^d for p = 2^d, CHECK: whether values may
// fall out of the FP8 form (flushed to a signed zero, ok cleared).
template <int N, bool CHECK>
QM_FN void fp8_block(const uint32_t w[4 * N], float inv, float p, bool e4m3, uint32_t out[2 * N], bool& ok) {
  bool flushed = false;
#pragma unroll
  for (int i = 0; i < 4 * N; ++i) {
    float v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t half = h ? w[i] >> 16 : w[i] & 0xFFFFu;
      float a = mul(e2m1_round(mul(as_f((half & 0x7FFFu) << 16), inv)), p);
      if (CHECK) {
        const bool keep = e4m3 ? (a >= 0.015625f || mul(a, 512.0f) == rint_(mul(a, 512.0f)))
                               : a >= 6.103515625e-05f;
        flushed |= !keep && a != 0.0f;
        a = keep ? a : 0.0f;
      }
      v[h] = as_f(as_u(a) | ((half & 0x8000u) << 16));
    }
    const uint32_t pair = fp8_pair(v[0], v[1], e4m3);
    if (i & 1) out[i >> 1] |= pair << 16;
    else out[i >> 1] = pair;
  }
  if (flushed) ok = false;
}

// N parts of one MXFP4 block as FP8 bytes (4 per word, value order) relative to 2^S (fp8_row_s); a NaN/Inf block
// is NaN (0x7F); each value keeps x's sign (flushed values and zeros too). ok: cleared where a value was flushed.
// Each value is q 2^d (d = X - S, exact in fp32) kept where the form holds it (E5M2: >= 2^-14; E4M3: >= 2^-6, or
// a multiple of its subnormal step 2^-9), then converted in pairs; blocks of X = 126 (rceil only), where q 2^X
// can overflow fp32 as the reference's values do, take fp8_of.
template <int N>
QM_FN void mx_fp8_parts(const uint32_t w[4 * N], uint32_t bmax, bool rceil, int S, bool e4m3, uint32_t out[2 * N],
                        bool& ok) {
  const bool bad = bmax >= 0x7F80u;
  const int X = mx_x(bad ? 0u : bmax, rceil);
  const float inv = as_f((uint32_t)(127 - X) << 23);  // 2^-X (X <= 126 for finite blocks)
  if (bad) {
#pragma unroll
    for (int i = 0; i < 2 * N; ++i) out[i] = 0x7F7F7F7Fu;
    return;
  }
  if (X >= 126) {  // bit by bit
#pragma unroll
    for (int i = 0; i < 2 * N; ++i) out[i] = 0u;
#pragma unroll
    for (int i = 0; i < 4 * N; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t half = h ? w[i] >> 16 : w[i] & 0xFFFFu;
        const float q = e2m1_round(mul(as_f((half & 0x7FFFu) << 16), inv));
        out[i >> 1] |= (((half >> 8) & 0x80u) | fp8_of(q, X, S, e4m3, ok)) << (8 * (2 * (i & 1) + h));
      }
    }
    return;
  }
  const int d = X - S < -64 ? -64 : X - S;  // below 2^-64 every value is flushed either way
  // The block's smallest nonzero value, 0.5 2^d, is held when d >= -13 (E5M2) / -8 (E4M3): no check needed then
  if (d >= (e4m3 ? -8 : -13)) {
    fp8_block<N, false>(w, inv, pow2(d), e4m3, out, ok);
  } else {
    fp8_block<N, true>(w, inv, pow2(d), e4m3, out, ok);
  }
}

// N parts (8 values each, 4 words) of one unit / block of format F (0 HiF4, 1 MXFP4, 2 MXFP4 rceil), bmax the
// unit's largest |x| (the maximum of every part's part_max).
template <int F, int N>
QM_FN void quant_parts(const uint32_t w[4 * N], uint32_t bmax, uint32_t out[4 * N]) {
  if (F == 0) {
    hif4_parts<N>(w, bmax, out);
  } else {
    mx_parts<N>(w, bmax, F == 2, out);
  }
}

// ---- Rollout-ResQ 2:4 in its bf16-sum form (SPEC 4; megatron_fp4/kernels/resq.py: the resq kernel's EXPAND=3) ----
// bf16(deq Q(x) + S(deq Q(r))), r = x - deq Q(x) in fp32. r can need more significant bits than bf16 holds, so its
// quantization takes fp32 values and follows the Triton tile functions (kernels/quantize.py: _hif4_tile, _mx_tile)
// operation by operation, each product rounded on its own; S keeps the 2 largest magnitude codes of every 4 (ties:
// the lower index) and the dropped values add +0, as the kernel's. Per part of 8 values, in two steps around the
// residual unit's maximum (which spans the unit's parts): resq_residual, then resq_sum.

// The largest |r| of 8 fp32 values as fp32 bits (integer order is value order on |r| bits, Inf and NaN above every
// finite value).
QM_FN uint32_t part_max32(const float r[8]) {
  uint32_t m = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = umax(m, as_u(r[i]) & 0x7FFFFFFFu);
  return m;
}

// floor(m p + 1/2) for m >= 0 and p in {1, 2, 4}: the Triton tile's 4m = (|x| r) p (the product by p is exact: a
// power of 2, far from overflow), rounded half up (floor, then + 1 where the fraction is >= 1/2). On the device one
// FFMA rounded toward -inf and a floor: rounding down never lifts a sum to the next integer and keeps one that
// reaches it (the integers are fp32 values), so the floor is the exact sum's. On the host the sum in double is exact
// where its floor could differ from the exact sum's (m p, 24 significant bits, in [2^-28, 2^24]).
QM_FN float round_half_up(float m, float p) {
#ifdef __CUDA_ARCH__
  return floorf(__fmaf_rd(m, p, 0.5f));
#else
  return (float)std::floor((double)m * p + 0.5);
#endif
}

// HiF4 of 8 fp32 values (one E1_8 group, two E1_16 groups) of a finite unit whose largest |r| has the fp32 bits
// bmax: the dequantized values (r's sign) and their magnitude codes k (0..7), as floats.
QM_FN void hif4_part32(const float x[8], uint32_t bmax, float v[8], float k[8]) {
  uint32_t rb;
  const float r = hif4_scale(as_f(bmax), rb);
  uint32_t b16[2];
#pragma unroll
  for (int g = 0; g < 2; ++g)
    b16[g] = umax(umax(as_u(x[4 * g]) & 0x7FFFFFFFu, as_u(x[4 * g + 1]) & 0x7FFFFFFFu),
                  umax(as_u(x[4 * g + 2]) & 0x7FFFFFFFu, as_u(x[4 * g + 3]) & 0x7FFFFFFFu));
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    const int shift = hif4_shift(b16, r, g);
    const float pw = shift == 0 ? 4.0f : (shift == 1 ? 2.0f : 1.0f);
    const float gs = as_f(rb + (uint32_t)((shift - 2) << 23));  // E6M2 2^shift / 4
#pragma unroll
    for (int i = 4 * g; i < 4 * g + 4; ++i) {
      float kf = round_half_up(mul(as_f(as_u(x[i]) & 0x7FFFFFFFu), r), pw);
      kf = kf > 7.0f ? 7.0f : kf;
      k[i] = kf;
      v[i] = as_f(as_u(mul(kf, gs)) | (as_u(x[i]) & 0x80000000u));
    }
  }
}

// MXFP4 of 8 fp32 values of a finite block whose largest |r| has the fp32 bits bmax: the dequantized values (r's
// sign) and their E2M1 magnitudes (in code order).
QM_FN void mx_part32(const float x[8], uint32_t bmax, bool rceil, float v[8], float k[8]) {
  const int X = mx_x32(bmax, rceil);
  const float inv = as_f((uint32_t)(127 - X) << 23);  // 2^-X (X <= 126 for finite blocks)
  const float px = X == -127 ? 5.877471754111438e-39f : as_f((uint32_t)(X + 127) << 23);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    k[i] = e2m1_round(mul(as_f(as_u(x[i]) & 0x7FFFFFFFu), inv));
    v[i] = as_f(as_u(mul(k[i], px)) | (as_u(x[i]) & 0x80000000u));
  }
}

// Whether value i of 4 is among the 2 largest magnitudes m (ties: the lower index), as resq.py's _keep24; m are
// HiF4's codes 0..7 or E2M1's magnitudes, non-negative fp32 values with at most 3 significant bits. Each value's key
// (m's bits, which order them, with 3 - i in the low bits, zero in m's) is unique and orders the values as the rule
// does: the kept ones are those at or above the second-largest key, which a min/max network finds (no branch).
QM_FN void keep24(const float m[4], bool keep[4]) {
  uint32_t key[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) key[i] = as_u(m[i]) | (uint32_t)(3 - i);
  const uint32_t hi01 = umax(key[0], key[1]), lo01 = umin(key[0], key[1]), hi23 = umax(key[2], key[3]),
                 lo23 = umin(key[2], key[3]);
  const uint32_t second = umax(umin(hi01, hi23), umax(lo01, lo23));
#pragma unroll
  for (int i = 0; i < 4; ++i) keep[i] = key[i] >= second;
}

// Step 1 of a part (8 bf16 values, 4 words w) of a unit of format F whose largest |x| has the bf16 bits bmax: deq
// Q(x) as bf16 words q (quant_parts) and the residual r = x - deq Q(x) in fp32. Returns the largest |r| of the part
// (fp32 bits); the unit's is the maximum over its parts.
template <int F>
QM_FN uint32_t resq_residual(const uint32_t w[4], uint32_t bmax, uint32_t q[4], float r[8]) {
  quant_parts<F, 1>(w, bmax, q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[2 * i] = as_f(w[i] << 16) - as_f(q[i] << 16);
    r[2 * i + 1] = as_f(w[i] & 0xFFFF0000u) - as_f(q[i] & 0xFFFF0000u);
  }
  return part_max32(r);
}

// Step 2: the part's bf16 sum bf16(deq Q(x) + S(deq Q(r))) as 4 words, rbmax the residual unit's largest |r| (fp32
// bits). A residual unit holding NaN or Inf (deq Q(x) NaN, or Inf where an rceil scale overflows fp32) quantizes to
// NaN, so its sums are NaN (0x7FC0, as torch's); every other unit's sums are finite (finite deq Q(x) and residual).
template <int F>
QM_FN void resq_sum(const uint32_t q[4], const float r[8], uint32_t rbmax, uint32_t out[4]) {
  float v[8], k[8];
  if (F == 0) {
    hif4_part32(r, rbmax, v, k);
  } else {
    mx_part32(r, rbmax, F == 2, v, k);
  }
  bool keep[8];
  keep24(k, keep);
  keep24(k + 4, keep + 4);
  const bool bad = rbmax >= 0x7F800000u;
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float qv = as_f(i & 1 ? q[i >> 1] & 0xFFFF0000u : q[i >> 1] << 16);
    s[i] = qv + (keep[i] ? v[i] : 0.0f);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = bad ? 0x7FC07FC0u : bf16x2_rne(s[2 * i], s[2 * i + 1]);
}

}  // namespace qm
