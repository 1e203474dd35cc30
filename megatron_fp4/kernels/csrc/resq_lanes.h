// Device helpers of the ResQ bf16-sum kernels (resq_sum.cu, swiglu_resq.cu): each thread holds one part of 8
// consecutive values; a unit's parts are consecutive lanes (HiF4: 8 per 64-value unit, MXFP4: 4 per
// 32-value block), whose maxima meet by __shfl_xor. Include after defining FMT.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "quant_math.h"

constexpr int UNIT_LANES = FMT == 0 ? 8 : 4;

__device__ __forceinline__ uint32_t unit_max(uint32_t v) {
#pragma unroll
  for (int s = 1; s < UNIT_LANES; s <<= 1) v = qm::umax(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  return v;
}

// The ResQ bf16 sum of one part w (8 bf16 values, two a word, the lower first) into o (the unit's lanes together)
__device__ __forceinline__ void resq_sum_part(const uint32_t w[4], uint32_t o[4]) {
  uint32_t q[4];
  float r[8];
  const uint32_t rmax = unit_max(qm::resq_residual<FMT>(w, unit_max(qm::part_max(w)), q, r));
  qm::resq_sum<FMT>(q, r, rmax, o);
}

// 8 values at p (16-byte aligned) as fp32: fp32 or bf16 (uint16_t) elements
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p)), hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}

__device__ __forceinline__ void load8(const uint16_t* p, float v[8]) {
  const uint4 w = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(ws[i] << 16);
    v[2 * i + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
  }
}
