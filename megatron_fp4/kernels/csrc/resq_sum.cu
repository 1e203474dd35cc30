// Rollout-ResQ 2:4's one GEMM operand (resq_combine "bf16"): out [R, KP] = bf16(deq Q(x) + S(deq Q(x - deq Q(x))))
// for x [R, K] (bf16, row-major) along K, HiF4 (FMT 0) or MXFP4 (1; 2: rceil scales). Built by
// megatron_fp4/kernels/cuda_quantize.py (nvcc, cached); the unit math is quant_math.h's (resq_residual, resq_sum),
// which the CPU tests check against the PyTorch reference.
//
// What a decode step runs before each ResQ linear (4 per layer, M <= 64 rows): small inputs, so the kernel is made
// for parallelism and few instructions rather than for bandwidth. Each thread holds one part (8 values: one 16-byte
// load and store); a unit's parts are consecutive lanes (HiF4: 8 per 64-value unit, MXFP4: 4 per 32-value block),
// whose maxima (of |x|, then of the residual |r|) meet by __shfl_xor. Block (row, j) of 128 threads covers columns
// 1024 j .. 1024 j + 1023 of one row. Columns past K read as zeros (the formats' zero padding); K must be a multiple
// of 8, x's rows 16-byte aligned (the host wrapper checks it).
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FMT
#define FMT 0
#endif

#include "resq_lanes.h"

#define THREADS 128
__global__ void __launch_bounds__(THREADS) resq_sum_kernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ out,
                                                           int K, int KP, long long ldx, long long ldo) {
  const long long row = blockIdx.x;
  const int c = (blockIdx.y * THREADS + threadIdx.x) * 8;  // the part's first column (a unit's lanes: all < KP or none)
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (c < K) v = __ldg(reinterpret_cast<const uint4*>(x + row * ldx + c));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t o[4];
  resq_sum_part(w, o);
  if (c < KP) *reinterpret_cast<uint4*>(out + row * ldo + c) = make_uint4(o[0], o[1], o[2], o[3]);
}

extern "C" int resq_sum_launch(const void* x, void* out, int R, int K, int KP, long long ldx, long long ldo,
                               void* stream) {
  const dim3 grid(R, (KP / 8 + THREADS - 1) / THREADS);
  resq_sum_kernel<<<grid, THREADS, 0, (cudaStream_t)stream>>>((const uint16_t*)x, (uint16_t*)out, K, KP, ldx, ldo);
  return (int)cudaGetLastError();
}
