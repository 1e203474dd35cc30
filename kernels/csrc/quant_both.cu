// A training operand's two exact BF16 expansions from one read: x [R, K] (bf16, row-major) quantized along K into
// ex [R, KP] and along R into ext [K, RP] (the expansion of x^T: what the wgrad GEMM reads of X and dY), for HiF4
// (FMT 0) or MXFP4 (1; 2: rceil scales). Built by kernels/cuda_quantize.py (nvcc, cached).
//
// One block of 128 threads per 64 x 64 tile; each thread quantizes 16 values of a unit at a time (two parts of 8,
// quant_math.h), so the unit's scale arithmetic is shared by 16 values:
//  - row pass: thread t owns values 16 (t % 4) .. + 15 (two 16-byte loads) of rows t / 4 and t / 4 + 32; a HiF4
//    unit (64 values) is 4 consecutive lanes, an MXFP4 block (32) 2 of them: their maxima meet by __shfl_xor. The
//    thread stores its quantized values (32 contiguous bytes) and puts the raw tile in shared memory.
//  - column pass: lane (j = lane / 8, p = lane % 8) of warp w reads, for the two columns 2 (8w + p) and 2 (8w + p)
//    + 1, the 16 consecutive rows 16j .. 16j + 15 (one 32-bit word per row; byte permutes make each column's
//    bf16 pairs), so the lanes with the same p hold a column's HiF4 unit (j = 0-1 and 2-3 its MXFP4 blocks),
//    and each column's 16 quantized values are 32 bytes (the 4 lanes of a column write 128 contiguous bytes).
// Shared memory: row r's 16-byte chunk c sits at chunk c ^ ((r / 8) % 8) (XOR swizzle), so that the column
// pass's loads hit 32 distinct banks.
// Rows past R and columns past K read as zeros (the formats' zero padding). K must be a multiple of 8 and x's
// rows 16-byte aligned (the host wrapper checks it).
#include <cuda_runtime.h>
#include <stdint.h>

#include "quant_math.h"

#ifndef FMT
#define FMT 0
#endif

// The maximum of v over the lanes lane ^ (first * {1, 2, ...}) that hold one unit of 64 (HiF4) or 32 values.
__device__ __forceinline__ uint32_t unit_max(uint32_t v, int first) {
  constexpr int lanes = FMT == 0 ? 4 : 2;
#pragma unroll
  for (int s = 1; s < lanes; s <<= 1) v = qm::umax(v, __shfl_xor_sync(0xFFFFFFFFu, v, s * first));
  return v;
}

__device__ __forceinline__ uint32_t words_max(const uint32_t w[8]) {
  return qm::umax(qm::part_max(w), qm::part_max(w + 4));
}

__device__ __forceinline__ void store32(uint16_t* dst, const uint32_t o[8]) {
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

extern "C" __global__ void __launch_bounds__(128) quant_both_kernel(const uint16_t* __restrict__ x,
                                                                     uint16_t* __restrict__ ex,
                                                                     uint16_t* __restrict__ ext, int R, int K,
                                                                     int KP, int RP, long long ldx, long long lde,
                                                                     long long ldt) {
  __shared__ uint4 tile[64 * 8];
  const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
  const int t = threadIdx.x, lane = t & 31;

  // Row pass: chunks 2q and 2q + 1 (16 values) of rows t / 4 and t / 4 + 32.
  const int q = t & 3, c = c0 + 16 * q;
  uint4 v[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + (t >> 2) + 32 * h;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      v[h][k] = make_uint4(0u, 0u, 0u, 0u);
      if (r < R && c + 8 * k < K) v[h][k] = __ldg(reinterpret_cast<const uint4*>(x + r * ldx + c + 8 * k));
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = (t >> 2) + 32 * h, r = r0 + rr;
    tile[rr * 8 + ((2 * q) ^ ((rr >> 3) & 7))] = v[h][0];
    tile[rr * 8 + ((2 * q + 1) ^ ((rr >> 3) & 7))] = v[h][1];
    const uint32_t w[8] = {v[h][0].x, v[h][0].y, v[h][0].z, v[h][0].w, v[h][1].x, v[h][1].y, v[h][1].z, v[h][1].w};
    uint32_t o[8];
    qm::quant_parts<FMT, 2>(w, unit_max(words_max(w), 1), o);
    if (r < R && c < KP) store32(ex + r * lde + c, o);
  }
  __syncthreads();

  // Column pass: rows 16j + i of column pair 8 wp + p.
  const int wp = t >> 5, j = lane >> 3, p = lane & 7;
  const int chunk = 2 * wp + (p >> 2);
  const uint32_t* tw = reinterpret_cast<const uint32_t*>(tile);
  uint32_t a[8], b[8];
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const int sw = (2 * j + (i >> 3)) & 7;  // ((16 j + i) / 8) % 8
    const uint32_t w0 = tw[(16 * j + i) * 32 + ((chunk ^ sw) << 2) + (p & 3)];
    const uint32_t w1 = tw[(16 * j + i + 1) * 32 + ((chunk ^ sw) << 2) + (p & 3)];
    a[i / 2] = __byte_perm(w0, w1, 0x5410);
    b[i / 2] = __byte_perm(w0, w1, 0x7632);
  }
  uint32_t oa[8], ob[8];
  qm::quant_parts<FMT, 2>(a, unit_max(words_max(a), 8), oa);
  qm::quant_parts<FMT, 2>(b, unit_max(words_max(b), 8), ob);
  const int cc = c0 + 2 * (8 * wp + p), rt = r0 + 16 * j;
  if (rt < RP) {
    if (cc < K) store32(ext + cc * ldt + rt, oa);
    if (cc + 1 < K) store32(ext + (cc + 1) * ldt + rt, ob);
  }
}

extern "C" int quant_both_launch(const void* x, void* ex, void* ext, int R, int K, int KP, int RP, long long ldx,
                                 long long lde, long long ldt, void* stream) {
  dim3 grid((K + 63) / 64, (R + 63) / 64);
  quant_both_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>((const uint16_t*)x, (uint16_t*)ex, (uint16_t*)ext, R, K,
                                                            KP, RP, ldx, lde, ldt);
  return (int)cudaGetLastError();
}
