// HiF4 and MXFP4 quantization of one part (8 consecutive bf16 values) of a unit / block, given the maximum |x| of
// the whole unit (HiF4: 64 values = 8 parts) or block (MXFP4: 32 values = 4 parts): the dequantized values in
// bf16, bit for bit megatron_fp4.formats (SPEC section 2) and the Triton kernels (kernels/quantize.py:
// _hif4_units, _mx_units), whose scale arithmetic this follows line by line.
//
// Host and device code: kernels/csrc/quant_both.cu runs it on the GPU, tests/test_cuda_quantize.py compiles it
// with the host C++ compiler and checks it against the PyTorch reference on the CPU. Every fp32 product is
// rounded on its own (__fmul_rn on the device, -ffp-contract=off on the host): a fused multiply-add would change
// the rounding decisions.
#pragma once
#include <stdint.h>

#include <cmath>
#include <cstring>

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

// Round fp32 to bf16, ties to even (non-negative finite inputs here), result in fp32.
QM_FN float bf16_rne(float v) {
  uint32_t b = as_u(v);
  return as_f((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
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

// HiF4: N parts of one 64-value unit (each part 8 values aligned to 8 = one E1_8 group, two E1_16 groups), bmax
// the unit's largest |x| (bf16 bits). SPEC 2.1 steps 2-7; a NaN/Inf unit dequantizes to NaN.
// The element step needs bf16 inputs: |x| and r = bf16(1 / E6M2) have 8 significant bits each, so 4m = |x| r
// 2^(2 - shift) is exact, and so is 4m + 8.5 where it matters (4m >= 2^-5; below, k = 0 either way): k =
// floor(4m + 0.5) (ties away from zero) is the integer part of 4m + 8.5, minus 8, which masking its low mantissa
// bits gives (the value in [8, 16) has 20 fraction bits); min(., 15.5) caps k at 7.
template <int N>
QM_FN void hif4_parts(const uint32_t w[4 * N], uint32_t bmax, uint32_t out[4 * N]) {
  const bool bad = bmax >= 0x7F80u;
  const float vmax = bad ? 0.0f : as_f(bmax << 16);
  float sf = bf16_rne(mul(vmax, 0.142578125f));
  sf = sf < 3.552713678800501e-15f ? 3.552713678800501e-15f : (sf > 49152.0f ? 49152.0f : sf);
  const uint32_t sb = as_u(sf);
  const uint32_t rb = (sb + 0xFFFFFu + ((sb >> 21) & 1u)) & 0xFFE00000u;  // E6M2: RNE to 2 mantissa bits
  const int e = (int)((rb >> 23) & 0xFFu) - 127;
  const int m2 = (int)((rb >> 21) & 3u);
  const float recip = m2 == 0 ? 1.0f : (m2 == 1 ? 0.80078125f : (m2 == 2 ? 0.66796875f : 0.5703125f));
  const float r = mul(recip, pow2(-e));  // bf16_rne(1 / E6M2), in [2^-16, 2^48]
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
    const bool e18 = mul(as_f(umax(b16[0], b16[1])), r) >= 4.0f;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      float p16 = mul(as_f(b16[g]), r);
      if (e18) p16 = mul(p16, 0.5f);
      const int shift = (int)e18 + (int)(p16 >= 2.0f);
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
// quantize.py: _e2m1_code, as a value): s >= 1 keeps one mantissa bit by an integer add (a carry moves the
// exponent); s < 1 is rint(2 s) / 2 by the 2^23 trick.
QM_FN float e2m1_round(float s) {
  const uint32_t b = as_u(s);
  float hi = as_f((b + 0x1FFFFFu + ((b >> 22) & 1u)) & 0xFFC00000u);
  hi = hi > 6.0f ? 6.0f : hi;
  const float lo = mul(fma_exact(s, 2.0f, 8388608.0f) - 8388608.0f, 0.5f);
  return s < 1.0f ? lo : hi;
}

// MXFP4: N parts of one 32-value block, bmax the block's largest |x| (bf16 bits) (SPEC 2.2; rceil: NVIDIA's
// never-clipping scale). A NaN/Inf block dequantizes to NaN.
template <int N>
QM_FN void mx_parts(const uint32_t w[4 * N], uint32_t bmax, bool rceil, uint32_t out[4 * N]) {
  const bool bad = bmax >= 0x7F80u;
  const uint32_t ab = bad ? 0u : bmax << 16;
  const int eb = (int)(ab >> 23);
  int X = eb - 129;
  if (rceil) X += (int)((ab & 0x7FFFFFu) > 0x400000u);
  if (eb == 0) X = -127;
  X = X < -127 ? -127 : (X > 127 ? 127 : X);
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

}  // namespace qm
