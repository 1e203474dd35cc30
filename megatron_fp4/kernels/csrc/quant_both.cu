// A training operand's two exact BF16 expansions from one read: x [R, K] (bf16, row-major) quantized along K into
// ex [R, KP] and along R into ext [K, RP] (the expansion of x^T: what the wgrad GEMM reads of X and dY), for HiF4
// (FMT 0) or MXFP4 (1; 2: rceil scales). Built by megatron_fp4/kernels/cuda_quantize.py (nvcc, cached).
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
//
// MXFP4's FP8 form (quant_fp8_launch; the GEMM modes "fp8" / "fp8_fast"): rows and columns each in E5M2 or E4M3
// (X: E5M2 rows, E4M3 columns; dY: E5M2 both; a weight: E4M3 both), each relative to its row's power-of-two
// scale, which needs the whole row (and column) first: phase 0 runs the same tiles and only takes every row's and
// column's largest finite-block |x| (atomicMax), phase 1 writes the bytes (16 per thread and row or column), the
// scales and the "nothing flushed" flags.
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

// The FP8 form's per-row (r*) and per-column (c*) arrays: the largest finite-block |x| bits (zeroed before phase
// 0), the scale exponents S, 2^S (may be null: not written) and the flags "no value flushed".
struct Fp8Out {
  uint32_t *rmax, *cmax;
  int *rexp, *cexp;
  float *rscale, *cscale;
  int8_t *rok, *cok;
};

__device__ __forceinline__ void store16(uint8_t* dst, const uint32_t o[4]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
}

// The largest |x| bits of the finite blocks among this lane's and lane ^ other's (0 for NaN/Inf blocks).
__device__ __forceinline__ uint32_t finite_max(uint32_t bmax, int other) {
  const uint32_t m = bmax >= 0x7F80u ? 0u : bmax;
  return qm::umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, other));
}

// OUT 0: both exact BF16 expansions (ex, ext bf16). OUT 1-4 (MXFP4): the FP8 form, OUT = 1 + 2 (rows E4M3) +
// (columns E4M3), E5M2 otherwise, in phase PHASE (0: maxima, 1: bytes; ex, ext hold bytes).
template <int OUT, int PHASE>
__global__ void __launch_bounds__(128) quant_both_kernel(const uint16_t* __restrict__ x, void* __restrict__ ex,
                                                         void* __restrict__ ext, int R, int K, int KP, int RP,
                                                         long long ldx, long long lde, long long ldt, Fp8Out f8) {
  __shared__ uint4 tile[64 * 8];
  const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
  const int t = threadIdx.x, lane = t & 31;
  constexpr bool rceil = FMT == 2, rows_e4m3 = OUT >= 3, cols_e4m3 = OUT == 2 || OUT == 4;

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
    const uint32_t bmax = unit_max(words_max(w), 1);
    if constexpr (OUT == 0) {
      uint32_t o[8];
      qm::quant_parts<FMT, 2>(w, bmax, o);
      if (r < R && c < KP) store32(static_cast<uint16_t*>(ex) + r * lde + c, o);
    } else if constexpr (PHASE == 0) {
      const uint32_t m = finite_max(bmax, 2);  // the tile row's two blocks
      if (q == 0 && r < R) {
        atomicMax(f8.rmax + r, m);
        if (blockIdx.x == 0) f8.rok[r] = 1;
      }
    } else {
      const int S = qm::fp8_row_s(r < R ? f8.rmax[r] : 0u, rceil, rows_e4m3);
      uint32_t o[4];
      bool ok = true;
      qm::mx_fp8_parts<2>(w, bmax, rceil, S, rows_e4m3, o, ok);
      if (r < R) {
        if (c < KP) store16(static_cast<uint8_t*>(ex) + r * lde + c, o);
        if (!ok) f8.rok[r] = 0;
        if (blockIdx.x == 0 && q == 0) {
          f8.rexp[r] = S;
          if (f8.rscale) f8.rscale[r] = qm::pow2(S);
        }
      }
    }
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
  const uint32_t ma = unit_max(words_max(a), 8), mb = unit_max(words_max(b), 8);
  const int cc = c0 + 2 * (8 * wp + p), rt = r0 + 16 * j;
  if constexpr (OUT == 0) {
    uint32_t oa[8], ob[8];
    qm::quant_parts<FMT, 2>(a, ma, oa);
    qm::quant_parts<FMT, 2>(b, mb, ob);
    if (rt < RP) {
      if (cc < K) store32(static_cast<uint16_t*>(ext) + cc * ldt + rt, oa);
      if (cc + 1 < K) store32(static_cast<uint16_t*>(ext) + (cc + 1) * ldt + rt, ob);
    }
  } else if constexpr (PHASE == 0) {
    const uint32_t fa = finite_max(ma, 16), fb = finite_max(mb, 16);  // the tile column's two blocks
    if (j == 0) {
      if (cc < K) atomicMax(f8.cmax + cc, fa);
      if (cc + 1 < K) atomicMax(f8.cmax + cc + 1, fb);
      if (blockIdx.y == 0 && cc < K) f8.cok[cc] = 1;
      if (blockIdx.y == 0 && cc + 1 < K) f8.cok[cc + 1] = 1;
    }
  } else {
    const int Sa = qm::fp8_row_s(cc < K ? f8.cmax[cc] : 0u, rceil, cols_e4m3);
    const int Sb = qm::fp8_row_s(cc + 1 < K ? f8.cmax[cc + 1] : 0u, rceil, cols_e4m3);
    uint32_t oa[4], ob[4];
    bool oka = true, okb = true;
    qm::mx_fp8_parts<2>(a, ma, rceil, Sa, cols_e4m3, oa, oka);
    qm::mx_fp8_parts<2>(b, mb, rceil, Sb, cols_e4m3, ob, okb);
    uint8_t* e = static_cast<uint8_t*>(ext);
    if (cc < K) {
      if (rt < RP) store16(e + cc * ldt + rt, oa);
      if (!oka) f8.cok[cc] = 0;
      if (blockIdx.y == 0 && j == 0) {
        f8.cexp[cc] = Sa;
        if (f8.cscale) f8.cscale[cc] = qm::pow2(Sa);
      }
    }
    if (cc + 1 < K) {
      if (rt < RP) store16(e + (cc + 1) * ldt + rt, ob);
      if (!okb) f8.cok[cc + 1] = 0;
      if (blockIdx.y == 0 && j == 0) {
        f8.cexp[cc + 1] = Sb;
        if (f8.cscale) f8.cscale[cc + 1] = qm::pow2(Sb);
      }
    }
  }
}

extern "C" int quant_both_launch(const void* x, void* ex, void* ext, int R, int K, int KP, int RP, long long ldx,
                                 long long lde, long long ldt, void* stream) {
  dim3 grid((K + 63) / 64, (R + 63) / 64);
  quant_both_kernel<0, 0><<<grid, 128, 0, (cudaStream_t)stream>>>((const uint16_t*)x, ex, ext, R, K, KP, RP, ldx,
                                                                  lde, ldt, Fp8Out{});
  return (int)cudaGetLastError();
}

template <int OUT>
static void launch_fp8(dim3 grid, cudaStream_t st, const uint16_t* x, void* ex, void* ext, int R, int K, int KP,
                       int RP, long long ldx, long long lde, long long ldt, const Fp8Out& f8) {
  quant_both_kernel<OUT, 0><<<grid, 128, 0, st>>>(x, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8);
  quant_both_kernel<OUT, 1><<<grid, 128, 0, st>>>(x, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8);
}

// MXFP4 only (FMT 1, 2): ex [R, KP] and ext [K, RP] bytes, E4M3 where rows_e4m3 / cols_e4m3 (else E5M2); the
// per-row and per-column arrays as Fp8Out says (rmax and cmax zeroed; rscale, cscale may be null).
extern "C" int quant_fp8_launch(const void* x, void* ex, void* ext, int R, int K, int KP, int RP, long long ldx,
                                long long lde, long long ldt, void* rmax, void* cmax, void* rexp, void* cexp,
                                void* rscale, void* cscale, void* rok, void* cok, int rows_e4m3, int cols_e4m3,
                                void* stream) {
#if FMT == 0
  return 1;  // cudaErrorInvalidValue: HiF4 has no FP8 form
#else
  dim3 grid((K + 63) / 64, (R + 63) / 64);
  const Fp8Out f8{(uint32_t*)rmax, (uint32_t*)cmax, (int*)rexp,    (int*)cexp,
                  (float*)rscale,  (float*)cscale,  (int8_t*)rok,  (int8_t*)cok};
  cudaStream_t st = (cudaStream_t)stream;
  const uint16_t* xx = (const uint16_t*)x;
  switch (1 + 2 * (rows_e4m3 != 0) + (cols_e4m3 != 0)) {
    case 1: launch_fp8<1>(grid, st, xx, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8); break;
    case 2: launch_fp8<2>(grid, st, xx, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8); break;
    case 3: launch_fp8<3>(grid, st, xx, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8); break;
    default: launch_fp8<4>(grid, st, xx, ex, ext, R, K, KP, RP, ldx, lde, ldt, f8); break;
  }
  return (int)cudaGetLastError();
#endif
}
