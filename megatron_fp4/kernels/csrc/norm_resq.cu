// The decode step's residual add + RMSNorm fused with Rollout-ResQ 2:4's bf16-sum quantize: for one
// row per block, s = x + d (d: the previous linear's output: fp32 split-K partial sums [S, B, N] added in split
// order then rounded to bf16, or bf16 [B, N], or none) is stored, and out [B, NP] = resq_sum(y) with
// y = bf16((s * r) * w), r = 1 / sqrt(mean(s^2) + eps): what the qkv and fc1 linears multiply in W4A4 + ResQ 2:4
// (bf16 sum). The norm is the Triton kernel's (megatron_fp4/kernels/decode_ops.py: _add_rms_norm_kernel) as
// Triton 3.6 lowers it for sm_90, so y is that kernel's bits: its blocked layout (8 consecutive columns per thread,
// BLOCK = next power of two >= N split into REPS = BLOCK / (8 * threads) strips of 8 * threads columns), the sum
// of squares as its PTX has it (fma over the thread's values in order, the first as fma(e0, e0, e1 * e1); then a
// butterfly over the warp's lanes, 16 .. 1; then one over the warps' sums), div.full.f32 by N and a contractible
// add.f32 of eps (one FFMA in SASS: mean_eps), sqrt.approx.ftz.f32, div.full.f32 of 1 by that, and s as add.bf16 of x
// and d. The ResQ sum is quant_math.h's, as
// resq_sum.cu's: a unit's parts are consecutive lanes (the strips are multiples of 64 columns). N must be a
// multiple of 8; blockDim.x = 32 * warps with the Triton kernel's warps (decode_ops._norm_warps).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FMT
#define FMT 0
#endif

#include "resq_lanes.h"

// mean(s^2) + eps as the Triton kernel's SASS has it: its PTX is div.full.f32 then a plain (contractible) add.f32, and
// ptxas fuses the division's final multiply with the add into one FFMA, rcp(N) * tot + eps rounded once. An add.rn
// here (__fadd_rn) kept two roundings and gave r one unit in the last place apart in some rows (session 47).
__device__ __forceinline__ float mean_eps(float tot, float n, float eps) {
  float d;
  asm("{\n .reg .f32 q;\n div.full.f32 q, %1, %2;\n add.f32 %0, q, %3;\n}" : "=f"(d) : "f"(tot), "f"(n), "f"(eps));
  return d;
}

__device__ __forceinline__ float div_full(float a, float b) {
  float d;
  asm("div.full.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ float sqrt_approx_ftz(float a) {
  float d;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(a));
  return d;
}

__device__ __forceinline__ uint16_t bf16_bits(__nv_bfloat16 h) { return *reinterpret_cast<const uint16_t*>(&h); }
__device__ __forceinline__ __nv_bfloat16 as_bf16(uint16_t b) { return *reinterpret_cast<const __nv_bfloat16*>(&b); }

// T: the delta's element type (float: split sums; uint16_t: bf16); HAS_DELTA false: s = x (nothing stored).
template <typename T, bool HAS_DELTA, int REPS>
__global__ void __launch_bounds__(512) norm_resq_kernel(const uint16_t* __restrict__ x, const T* __restrict__ d,
                                                        const uint16_t* __restrict__ w, uint16_t* __restrict__ s_out,
                                                        uint16_t* __restrict__ out, uint16_t* __restrict__ y_out,
                                                        int N, int NP, int splits, float eps, long long ldx,
                                                        long long ldd, long long lds, long long ld_split,
                                                        long long ldo, long long ldy) {
  __shared__ float warp_sums[16];
  const long long row = blockIdx.x;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  uint16_t sv[REPS][8];
  float acc = 0.0f;
#pragma unroll
  for (int rep = 0; rep < REPS; ++rep) {
    const int c = (rep * blockDim.x + threadIdx.x) * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    if (c < N) {
      load8(x + row * ldx + c, v);
      if (HAS_DELTA) {
        float dv[8], t[8];
        load8(d + row * ldd + c, dv);
        for (int k = 1; k < splits; ++k) {
          load8(d + k * ld_split + row * ldd + c, t);
#pragma unroll
          for (int i = 0; i < 8; ++i) dv[i] = __fadd_rn(dv[i], t[i]);
        }
        uint16_t sb[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          sb[i] = bf16_bits(__hadd(__float2bfloat16_rn(v[i]), __float2bfloat16_rn(dv[i])));  // add.bf16
          v[i] = __uint_as_float(uint32_t(sb[i]) << 16);
        }
        *reinterpret_cast<uint4*>(s_out + row * lds + c) =
            make_uint4(sb[0] | uint32_t(sb[1]) << 16, sb[2] | uint32_t(sb[3]) << 16, sb[4] | uint32_t(sb[5]) << 16,
                       sb[6] | uint32_t(sb[7]) << 16);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sv[rep][i] = uint16_t(__float_as_uint(v[i]) >> 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // (Triton's first add, sq0 + sq1, contracted as fma(e0, e0, e1 * e1))
      if (rep == 0 && i == 0) acc = __fmaf_rn(v[0], v[0], __fmul_rn(v[1], v[1]));
      else if (rep > 0 || i > 1) acc = __fmaf_rn(v[i], v[i], acc);
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, off));
  if (lane == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  // every warp reduces the warps' sums itself (the butterfly gives every lane of a group the same bits)
  float tot = warp_sums[lane & (warps - 1)];
  for (int off = warps >> 1; off >= 1; off >>= 1) tot = __fadd_rn(tot, __shfl_xor_sync(0xFFFFFFFFu, tot, off));
  const float r = div_full(1.0f, sqrt_approx_ftz(mean_eps(tot, float(N), eps)));
#pragma unroll
  for (int rep = 0; rep < REPS; ++rep) {
    const int c = (rep * blockDim.x + threadIdx.x) * 8;
    uint32_t y[4] = {0u, 0u, 0u, 0u};
    if (c < N) {
      float wv[8];
      load8(w + c, wv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = __fmul_rn(__fmul_rn(__uint_as_float(uint32_t(sv[rep][2 * i]) << 16), r), wv[2 * i]);
        const float b = __fmul_rn(__fmul_rn(__uint_as_float(uint32_t(sv[rep][2 * i + 1]) << 16), r), wv[2 * i + 1]);
        y[i] = bf16_bits(__float2bfloat16_rn(a)) | uint32_t(bf16_bits(__float2bfloat16_rn(b))) << 16;
      }
      if (y_out) *reinterpret_cast<uint4*>(y_out + row * ldy + c) = make_uint4(y[0], y[1], y[2], y[3]);
    }
    uint32_t o[4];
    resq_sum_part(y, o);
    if (c < NP) *reinterpret_cast<uint4*>(out + row * ldo + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

template <typename T, bool HAS_DELTA>
static int launch_reps(int reps, const void* x, const void* d, const void* w, void* s, void* out, void* y, int B,
                       int N, int NP, int splits, float eps, int threads, long long ldx, long long ldd, long long lds,
                       long long ld_split, long long ldo, long long ldy, cudaStream_t stream) {
  const auto args = [&](auto kernel) {
    kernel<<<B, threads, 0, stream>>>((const uint16_t*)x, (const T*)d, (const uint16_t*)w, (uint16_t*)s,
                                      (uint16_t*)out, (uint16_t*)y, N, NP, splits, eps, ldx, ldd, lds, ld_split, ldo,
                                      ldy);
  };
  if (reps == 1) args(norm_resq_kernel<T, HAS_DELTA, 1>);
  else if (reps == 2) args(norm_resq_kernel<T, HAS_DELTA, 2>);
  else if (reps == 4) args(norm_resq_kernel<T, HAS_DELTA, 4>);
  else return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}

// x: bf16 [B, N] (rows ldx apart); d: delta_kind 0 none, 1 fp32 splits [splits, B, N] (rows ldd, splits ld_split
// apart), 2 bf16 [B, N]; w: bf16 [N]; s: bf16 [B, N] (x + d; not written without a delta); out: bf16 [B, NP];
// y: null, or bf16 [B, N] (rows ldy apart) for the normed values too; threads = 32 * the Triton kernel's warps,
// reps = BLOCK / (8 * threads).
extern "C" int norm_resq_launch(const void* x, const void* d, int delta_kind, const void* w, void* s, void* out,
                                void* y, int B, int N, int NP, int splits, float eps, int threads, int reps,
                                long long ldx, long long ldd, long long lds, long long ld_split, long long ldo,
                                long long ldy, void* stream) {
  const cudaStream_t st = (cudaStream_t)stream;
  if (delta_kind == 1)
    return launch_reps<float, true>(reps, x, d, w, s, out, y, B, N, NP, splits, eps, threads, ldx, ldd, lds,
                                    ld_split, ldo, ldy, st);
  if (delta_kind == 2)
    return launch_reps<uint16_t, true>(reps, x, d, w, s, out, y, B, N, NP, 1, eps, threads, ldx, ldd, lds, 0, ldo,
                                       ldy, st);
  return launch_reps<uint16_t, false>(reps, x, d, w, s, out, y, B, N, NP, 1, eps, threads, ldx, ldd, lds, 0, ldo,
                                      ldy, st);
}
