// The decode step's SwiGLU fused with Rollout-ResQ 2:4's bf16-sum quantize: fc2's operand in W4A4 + ResQ 2:4 (bf16
// sum), made by rollout/static_decode.py unless MEGATRON_FP4_FUSED_SWIGLU_RESQ=0. out [B, FP] = resq_sum(y),
// y = bf16(bf16(silu(a0)) * a1), a0 / a1 = the gate / up halves of fc1's output a: fp32 split-K partial sums
// [S, B, 2F] as the decode GEMM stores them (added in split order, then rounded to bf16), or bf16 [B, 2F]. The SwiGLU
// arithmetic is the Triton kernel's (megatron_fp4/kernels/decode_ops.py: _swiglu_kernel) as Triton 3.6 lowers it for
// sm_90 (its PTX: mul by log2 e, ex2.approx.f32, add 1, div.full.f32, cvt.rn.bf16.f32, mul.rn.bf16x2), so y is that
// kernel's bits; the ResQ sum is quant_math.h's (resq_residual, resq_sum), as resq_sum.cu's. Each thread holds 8
// columns; a unit's lanes meet by shuffles. F must be a multiple of 8.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FMT
#define FMT 0
#endif

#include "resq_lanes.h"

#define THREADS 128
__device__ __forceinline__ float round_bf16(float v) {  // cvt.rn.bf16.f32, back to fp32
  return __bfloat162float(__float2bfloat16_rn(v));
}

// silu(a) rounded to bf16, as Triton lowers a / (1 + exp(-a)): exp by ex2.approx.f32 of -a * log2(e) (fp32 log2 e,
// 0x3FB8AA3B), the division by div.full.f32
__device__ __forceinline__ float silu_bf16(float a) {
  float e, s;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(-a, __uint_as_float(0x3FB8AA3Bu))));
  asm("div.full.f32 %0, %1, %2;" : "=f"(s) : "f"(a), "f"(__fadd_rn(e, 1.0f)));
  return round_bf16(s);
}

template <typename T>
__global__ void __launch_bounds__(THREADS) swiglu_resq_kernel(const T* __restrict__ a, uint16_t* __restrict__ out,
                                                              int F, int FP, int splits, long long lda,
                                                              long long lds, long long ldo) {
  const long long row = blockIdx.x;
  const int c = (blockIdx.y * THREADS + threadIdx.x) * 8;  // (a unit's lanes: all < FP or none)
  uint32_t w[4] = {0u, 0u, 0u, 0u};
  if (c < F) {
    float g[8], u[8], t[8];
    load8(a + row * lda + c, g);
    load8(a + row * lda + F + c, u);
    for (int s = 1; s < splits; ++s) {  // the splits in order, fp32
      load8(a + s * lds + row * lda + c, t);
#pragma unroll
      for (int i = 0; i < 8; ++i) g[i] = __fadd_rn(g[i], t[i]);
      load8(a + s * lds + row * lda + F + c, t);
#pragma unroll
      for (int i = 0; i < 8; ++i) u[i] = __fadd_rn(u[i], t[i]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 s2 =
          __floats2bfloat162_rn(silu_bf16(round_bf16(g[2 * i])), silu_bf16(round_bf16(g[2 * i + 1])));
      const __nv_bfloat162 u2 = __floats2bfloat162_rn(u[2 * i], u[2 * i + 1]);
      const __nv_bfloat162 y2 = __hmul2_rn(s2, u2);  // mul.rn.bf16x2
      w[i] = *reinterpret_cast<const uint32_t*>(&y2);
    }
  }
  uint32_t o[4];
  resq_sum_part(w, o);
  if (c < FP) *reinterpret_cast<uint4*>(out + row * ldo + c) = make_uint4(o[0], o[1], o[2], o[3]);
}

// a: fp32 splits [splits, B, 2F] (a_fp32 1; rows lda apart, splits lds apart) or bf16 [B, 2F] (a_fp32 0, splits 1);
// out: bf16 [B, FP] (FP: F padded to the format's block).
extern "C" int swiglu_resq_launch(const void* a, int a_fp32, void* out, int B, int F, int FP, int splits,
                                  long long lda, long long lds, long long ldo, void* stream) {
  const dim3 grid(B, (FP / 8 + THREADS - 1) / THREADS);
  if (a_fp32)
    swiglu_resq_kernel<float><<<grid, THREADS, 0, (cudaStream_t)stream>>>((const float*)a, (uint16_t*)out, F, FP,
                                                                          splits, lda, lds, ldo);
  else
    swiglu_resq_kernel<uint16_t><<<grid, THREADS, 0, (cudaStream_t)stream>>>((const uint16_t*)a, (uint16_t*)out, F,
                                                                             FP, 1, lda, lds, ldo);
  return (int)cudaGetLastError();
}
