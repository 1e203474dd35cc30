// Decode GEMM for packed FP4 weights (HiF4 / MXFP4) on Hopper: out[M, N] (+)= x[M, K] . deq(W[N, K])^T, M <= 64.
//
// Built per configuration by megatron_fp4/kernels/cuda_decode.py (nvcc, cached): -DFMT=0 (HiF4) | 1 (MXFP4), -DWIDE
// (MXFP4 block scales above 2^1), -DNT (token tiles of 8), -DSPW (16-row weight slabs per warp), -DDEPTH (chunks of
// weights in flight per warp, in registers), -DWARPS (warps per block).
//
// The weight is stored in a decode layout (megatron_fp4/kernels/cuda_decode.py: to_decode_layout), made once per weight
// update: for each 16-row slab and 64-value chunk of K, 32 lanes x 16 bytes, lane (g = lane / 4, t = lane % 4) holding
// for each k16 step s the 32-bit word of its mma.m16n8k16 A fragment: nibble j of the low half and nibble j of the
// high half are one bf16x2 register a_j (j = 0: row g, K 16s + 4t + {0, 1}; j = 1: row g + 8, same K; j = 2: row g,
// K 16s + 4t + {2, 3}; j = 3: row g + 8). The MMA's K order is thus permuted (MMA k 2t + i <-> K 4t + i, MMA k
// 2t + 8 + i <-> K 4t + 2 + i); the B fragment (activations, token n = g) takes the same order, which is the
// natural one: one 8-byte load of x[n][16s + 4t .. 16s + 4t + 3]. Each thread's four K per row and step are one
// HiF4 4-group (one micro-exponent) and lie in one MXFP4 block.
// Dequantization (exact in BF16, as the Triton kernel's asm): MXFP4 sign | e2m1 << 6 is the bf16 of
// e2m1 x 2^-126, times f = 2^(X + 126) (WIDE: a second factor); HiF4 (k | magic) fma F - magic F = k F, sign
// xor-ed in, F = E6M2 x 2^(E1_8 + E1_16) / 4.
// The warps of a block (WARPS x SPW slabs) share each activation chunk, staged in shared memory by cp.async
// (XST stages), so that activations are read from L2 once per block rather than once per warp.
// Split-K: blockIdx.y takes chunks [y * cps, (y + 1) * cps); with gridDim.y > 1 partial sums are added atomically
// into a zeroed fp32 output; without split-K the output may be bf16 instead (obf16: rounded to nearest even).
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef NT
#define NT 2
#endif
#ifndef SPW
#define SPW 1
#endif
#ifndef DEPTH
#define DEPTH 4
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef XST
#define XST 4  // shared-memory stages of activation chunks
#endif

#include "w4_device.h"

DINL void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#define XS 80  // bf16 per staged activation row: 64 values + 16 padding (LDS.64 of a warp conflict-free)
#define MT (8 * NT)

DINL void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
DINL void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_>
DINL void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N_)); }

// Stage activation chunk c (MT rows x 64 values; rows past M repeat row M - 1) into a shared-memory tile.
DINL void stage_x(uint16_t* tile, const uint16_t* __restrict__ x, int M, int ldx, int c) {
  for (int idx = threadIdx.x; idx < MT * 8; idx += WARPS * 32) {
    const int r = idx >> 3, seg = idx & 7;
    const int m = min(r, M - 1);
    cp_async16(tile + r * XS + seg * 8, x + (size_t)m * ldx + (size_t)c * 64 + seg * 8);
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4_decode_kernel(const uint4* __restrict__ codes, const uint32_t* __restrict__ meta, const uint16_t* __restrict__ x,
                 float* __restrict__ out, int M, int N, int S, int C, int ldx, int ldo, int cps, int obf16,
                 int partial) {
  __shared__ __align__(16) uint16_t xs[XST][MT * XS];
  pdl_enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int slab0 = (blockIdx.x * WARPS + warp) * SPW;
  const bool active = slab0 < S;  // idle warps still stage activations and meet the barriers
  const int c0 = blockIdx.y * cps;
  const int nch = min(C, c0 + cps) - c0;
  if (nch <= 0) return;  // block-uniform

  const uint4* wp[SPW];
  const uint32_t* mp[SPW];
#pragma unroll
  for (int j = 0; j < SPW; ++j) {
    const size_t unit = (size_t)min(slab0 + j, S - 1) * C + c0;
    wp[j] = codes + unit * 32 + lane;
    mp[j] = meta + unit * META_WORDS;
  }
  float acc[SPW][NT][4];
#pragma unroll
  for (int j = 0; j < SPW; ++j)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[j][i][r] = 0.f;

#pragma unroll
  for (int st = 0; st < XST - 1; ++st) {
    if (st < nch) stage_x(xs[st], x, M, ldx, c0 + st);
    cp_commit();
  }
  uint4 wq[DEPTH][SPW];
  uint32_t mq[DEPTH][SPW];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (active && d < nch) {
#pragma unroll
      for (int j = 0; j < SPW; ++j) {
        wq[d][j] = __ldg(wp[j] + d * 32);
        mq[d][j] = load_meta(mp[j] + d * META_WORDS, lane);
      }
    }
  }

  for (int k = 0; k < nch; k += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int kk = k + d;
      if (kk < nch) {  // block-uniform
        cp_wait<XST - 2>();
        __syncthreads();  // chunk kk staged by all threads; the stage refilled next was read by everyone
        if (kk + XST - 1 < nch) stage_x(xs[(kk + XST - 1) % XST], x, M, ldx, c0 + kk + XST - 1);
        cp_commit();
        if (active) {
          uint4 w[SPW];
          uint32_t mt[SPW];
#pragma unroll
          for (int j = 0; j < SPW; ++j) { w[j] = wq[d][j]; mt[j] = mq[d][j]; }
          if (kk + DEPTH < nch) {
#pragma unroll
            for (int j = 0; j < SPW; ++j) {
              wq[d][j] = __ldg(wp[j] + (d + DEPTH) * 32);
              mq[d][j] = load_meta(mp[j] + (d + DEPTH) * META_WORDS, lane);
            }
          }
          const uint16_t* tile = xs[kk % XST] + g * XS + 4 * t;
          Scales sc[SPW];
#pragma unroll
          for (int j = 0; j < SPW; ++j) sc[j] = make_scales(mt[j]);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint2 b[NT];
#pragma unroll
            for (int i = 0; i < NT; ++i) b[i] = *reinterpret_cast<const uint2*>(tile + i * 8 * XS + 16 * s);
#pragma unroll
            for (int j = 0; j < SPW; ++j) {
              const uint32_t word = s == 0 ? w[j].x : (s == 1 ? w[j].y : (s == 2 ? w[j].z : w[j].w));
              uint32_t a[4];
              dequant(word, sc[j], s, a);
#pragma unroll
              for (int i = 0; i < NT; ++i) mma(acc[j][i], a[0], a[1], a[2], a[3], b[i].x, b[i].y);
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < SPW; ++j) { wp[j] += DEPTH * 32; mp[j] += DEPTH * META_WORDS; }
  }
  cp_wait<0>();
  if (!active) return;

  const bool atomic = gridDim.y > 1 && !partial;
  if (partial) out += (size_t)blockIdx.y * M * ldo;  // this split's own [M, ldo] partial sums, stored (w4_wgmma.cu)
#pragma unroll
  for (int j = 0; j < SPW; ++j) {
    const int n0 = (slab0 + j) * 16 + g;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int m0 = 8 * i + 2 * t;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = n0 + (r >> 1) * 8, m = m0 + (r & 1);
        if (n < N && m < M) {
          if (atomic) atomicAdd(out + (size_t)m * ldo + n, acc[j][i][r]);
          else store_out(out, (size_t)m * ldo + n, acc[j][i][r], obf16);
        }
      }
    }
  }
}

extern "C" int w4_decode_launch(const void* codes, const void* meta, const void* x, void* out, int M, int N, int S,
                                int C, int ldx, int ldo, int split, int cps, int obf16, int partial, int pdl,
                                void* stream) {
  if (obf16 && split > 1) return (int)cudaErrorInvalidValue;  // partial sums need fp32
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((S + WARPS * SPW - 1) / (WARPS * SPW), split);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  cfg.attrs = attr;
  if (pdl) pdl_attribute(&attr[cfg.numAttrs++]);
  return (int)cudaLaunchKernelEx(&cfg, w4_decode_kernel, (const uint4*)codes, (const uint32_t*)meta,
                                 (const uint16_t*)x, (float*)out, M, N, S, C, ldx, ldo, cps, obf16, partial);
}
