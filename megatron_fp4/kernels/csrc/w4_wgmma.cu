// Decode GEMM on Hopper's warpgroup MMA: out[M, N] (+)= x[M, K] . deq(W[N, K])^T for packed HiF4 / MXFP4 weights
// in the decode layout (megatron_fp4/kernels/cuda_decode.py: to_decode_layout, the same layout as w4_decode.cu),
// M <= 64.
//
// Built per configuration by megatron_fp4/kernels/cuda_decode.py (nvcc, cached): -DFMT=0 (HiF4) | 1 (MXFP4), -DWIDE
// (MXFP4 block scales above 2^1), -DNTOK (token tile: the wgmma N, 8 | 16 | 32 | 64), -DWGS (warpgroups per block),
// -DDEPTH (chunks of weights in flight per warp, in registers), -DXST (shared-memory stages of activation chunks),
// -DMINB (blocks per SM the registers must allow), -DPRODUCER (1: one extra warp stages the activations), -DLEAN (1:
// the same numbers in fewer instructions per chunk, 157 instead of 197 for HiF4 and 146 instead of 175 for MXFP4 in
// the M = 16 producer tile's loop by cuobjdump's count: each weight prefetch issued after the chunk's wgmmas, into
// the registers its dequantized words left (no copy that waits for the load), the B descriptors by addition, and
// HiF4's mask-and-bias in one LOP3; Nsight Compute found the M = 16 loop issue-bound, docs/PERFORMANCE.md), -DXPAIR
// (1: the activation staging's loads read whole sectors, see load_x), -DWRING (1, with PRODUCER=1: the weights too come
// through the shared-memory ring, by bulk asynchronous copies; see below), -DNATURAL (1, with WRING: the weights in
// the natural K order of to_decode_layout(natural=True), the activations brought unpermuted by a 2-D TMA
// with the 128-byte swizzle, one per chunk; the default layout, cuda_decode.NATURAL_TILE), -DCLUSTER (1, with WRING:
// deterministic split-K through a thread-block cluster, see Split-K below), -DWTMA (1, with NATURAL: the producer
// warp brings the block's weight codes and metadata by two 3-D TMAs per chunk beside the activations' one, so the
// consumer warps issue no copies; NATURAL_TILE's since session 28), -DWJIT (1, with WRING: each consumer warp reads
// its words of chunk c from the ring in iteration c itself, not DEPTH chunks ahead, see below). XPAIR, WRING, NATURAL,
// CLUSTER, WTMA and WJIT are tile keys: docs/PERFORMANCE.md (sessions 25-28) has what each measured (and, session 53,
// WST: a ring of the weights' own with a second producer warp, 5-30% slower everywhere on an H100, removed).
//
// Each warpgroup owns one 64-row tile of W (four 16-row slabs of the decode layout, one per warp). Per 64-value chunk
// of K a warp loads its slab's codes (one 16-byte load per lane), dequantizes them exactly into the BF16 A fragment of
// wgmma m64nNk16 (per warp the same fragment as mma.m16n8k16's, so w4_device.h serves both kernels) and the
// warpgroup issues four wgmma with A from registers and the activations (B, N = NTOK tokens) from shared memory,
// fp32 accumulation. The wgmmas of chunk c run while the warps dequantize chunk c + 1 (two A register sets; one
// wgmma group in flight).
//
// The decode layout permutes the MMA's K order within each k16 step (MMA k 2t + i <-> K 4t + i, MMA k 2t + 8 + i <->
// K 4t + 2 + i; the NATURAL layout does not, see below), so the activations are staged in that order (store_x): the bf16 pairs of K {0,1}, {4,5}, {8,9},
// {12,13} of a step form the first 8x8 core matrix and {2,3}, {6,7}, {10,11}, {14,15} the second (K-major, no
// swizzle: core matrix (token group ng, K half kh) at byte (ng * 2 + kh) * 128 of the step, LBO 128, SBO 256).
// Staging goes through registers, one chunk ahead: loaded in one iteration, stored to shared memory in the next,
// read by the wgmmas XST - 2 iterations later. Tokens past M repeat token M - 1 (their sums are never stored).
// PRODUCER=1: the staging moves to one extra warp (the block's last), which runs ahead through a ring of XST stages
// and meets the warpgroups at named barriers (stage s full: barrier 1 + s, empty: 1 + XST + s) instead of a block
// barrier per chunk. Only that warp then executes fence.proxy.async, which compiles to a MEMBAR that waits for all
// of the executing thread's loads in flight: in the PRODUCER=0 form every warp drains its weight prefetch there.
// WRING=1 (with PRODUCER=1): each ring stage also holds the block's codes and metadata of its chunk (in a second ring
// after the activations' stages, see WSTAGE_BYTES). Each consumer
// warp copies its own slab's there with cp.async.bulk (lane 0 the 512 bytes of codes, lane 1 the metadata), XST
// chunks ahead, as soon as it has used the words the stage held before; the copies complete on the stage's
// mbarrier, which the producer's 32 lanes arrive on once the activations are stored (the first with the stage's
// byte count). So the bytes in flight are the ring's (XST stages in dynamic shared memory), not the registers'
// (DEPTH chunks: at M = 64 the accumulators leave room for 2 only and Nsight Compute found half the cycles waiting on
// global loads). The consumers wait on the stage's mbarrier and read their slab's words from shared memory DEPTH
// chunks ahead; "stage empty" stays a named barrier (1 + s).
// WJIT=1 (with WRING): a consumer waits for chunk c's stage and reads its words in iteration c, right before it
// dequantizes them (shared memory is a few dozen cycles away; the previous chunk's wgmmas run meanwhile). A stage is
// freed in iteration c + 1 either way, so the producer requests chunk c + XST - 1 in iteration c: without WJIT the
// consumers wait for chunk c + DEPTH then, XST - DEPTH - 1 stages behind the newest request (3 of the default 6:
// session 56's profile found the 16-token loop waiting for its stages' data); with WJIT chunk c, XST - 1 behind.
// The same shared memory keeps DEPTH more stages in flight.
// NATURAL=1 (with WRING): the weights' MMA K order is K's own, so the activations need no permutation: the producer's
// lane 0 brings each chunk of all tokens with one 2-D TMA (x as a [M, K] bf16 tensor map, 64 x NTOK boxes, 128-byte
// swizzle: a token's 64 values in one 128-byte row, 8 rows per 1024-byte atom, rows past M zero-filled) and arrives
// on the stage's mbarrier with its byte count; the wgmmas read B through swizzle-mode descriptors. Nothing is staged
// through registers. HiF4 then needs two exponent factors per row and step (w4_device.h).
// The output is fp32, or with obf16 bf16 (the sums rounded to nearest even: torch's .to(bfloat16) of the fp32 result)
// wherever each output is stored once (no atomic split-K).
// Split-K: blockIdx.y takes chunks [y * cps, (y + 1) * cps); with gridDim.y > 1 partial sums are added atomically
// into a zeroed fp32 output; or, with partial (a launch argument), each split stores its own partial sums into
// out[y] of an fp32 [gridDim.y, M, ldo] output (no atomics, no zeroed output: the reader sums the splits in order,
// e.g. the engine's fused residual-add + RMSNorm and SwiGLU kernels; deterministic); or with -DCLUSTER=1 (WRING)
// deterministically: the split blocks of a row tile form one
// thread-block cluster (launched as (1, split, 1), split <= 8), each leaves its partial sums in its shared memory (the
// ring, free by then), and after a cluster barrier each block sums a 1/split share of the tile's outputs over the
// cluster's blocks in rank order (distributed shared memory) and stores them: no atomics, no zeroed output, the same
// bits on every run.
#include <cuda.h>  // CUtensorMap (NATURAL)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled (NATURAL)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef NTOK
#define NTOK 64
#endif
#ifndef WGS
#define WGS 2
#endif
#ifndef DEPTH
#define DEPTH 4
#endif
#ifndef XST
#define XST 4
#endif
#ifndef MINB
#define MINB 2  // blocks per SM the register allocation must allow
#endif
#ifndef PRODUCER
#define PRODUCER 0
#endif
#ifndef LEAN
#define LEAN 0  // (HiF4 takes LEAN=1 at 9-16 tokens on large weights: cuda_decode.LARGE_M16_TILES)
#endif
#ifndef WRING
#define WRING 0
#endif
#ifndef NATURAL
#define NATURAL 0
#endif
#ifndef CLUSTER
#define CLUSTER 0
#endif
#ifndef WTMA
#define WTMA 0
#endif
#ifndef WJIT
#define WJIT 0
#endif
#if WJIT && !WRING
#error "WJIT needs WRING (the words come from the ring's stages)"
#endif
#define FAHEAD (WJIT ? 0 : DEPTH)  // chunks between the one whose words a FETCH reads and the one being multiplied
#if WTMA && !NATURAL
#error "WTMA needs NATURAL (the producer's TMA path)"
#endif
#if NATURAL && !WRING
#error "NATURAL needs WRING"
#endif
#if CLUSTER && (!WRING || XST > 14)
#error "CLUSTER needs WRING (its partial sums reuse the ring) and XST <= 14 (named barrier 15)"
#endif
#if DEPTH % 2 || XST < 3 || (PRODUCER && !WRING && 2 * XST > 15) || PRODUCER > 1
#error "DEPTH must be even (the two A register sets alternate per chunk), XST >= 3 (PRODUCER: <= 7, 2 XST + 1 barriers), \
PRODUCER 0 or 1"
#endif
#if WRING && (!PRODUCER || (!WJIT && XST < DEPTH + 2) || XST > 15)
#error "WRING needs PRODUCER=1 and XST <= 15, without WJIT also DEPTH + 2 <= XST (a consumer waits for chunk \
c + DEPTH before it frees c - 1)"
#endif

#include "w4_device.h"

#define CONSUMERS (WGS * 128)                 // the warpgroups' threads
#define THREADS (CONSUMERS + 32 * PRODUCER)  // + the producer warp
#define STAGERS (PRODUCER ? 32 : THREADS)    // threads that stage the activations
#define STEP_BYTES (NTOK * 32)      // one k16 step of B: NTOK tokens x 16 bf16
#define STAGE_BYTES (4 * STEP_BYTES)  // one 64-value chunk
#define SLABS (WGS * 4)               // 16-row weight slabs per block (one per consumer warp)
#define META_BYTES (META_WORDS * 4)
// WRING: the ring is XST stages of activations (STAGE_BYTES each, aligned to RALIGN: NATURAL 1024, the 128-byte
// swizzle's period, else 128), then XST stages of weights: the slabs' codes (512 bytes each), then their metadata
// (WSTAGE_BYTES, 128-byte aligned for the TMA). Stage s of both is one stage of the pipeline (one mbarrier).
// Kept apart, neither pads the other to RALIGN: at 64 tokens a stage takes 10.1 KB (MXFP4) / 10.4 KB (HiF4), not 11.
#define RALIGN (NATURAL ? 1024 : 128)
#define WSTAGE_BYTES ((SLABS * (512 + META_BYTES) + 127) / 128 * 128)
#define WRING0 (XST * STAGE_BYTES)  // WRING: the weights' first stage, in bytes from the ring's start
#define RING_BYTES (XST * (STAGE_BYTES + (WRING ? WSTAGE_BYTES : 0)))
static_assert(STAGE_BYTES % RALIGN == 0, "every stage's activations aligned");
#if CLUSTER
static_assert(NTOK / 2 * CONSUMERS * 4 <= RING_BYTES, "CLUSTER: the partial sums must fit the ring");
#endif

template <int N_>
DINL void wgmma_rs(float* d, const uint32_t* a, uint64_t desc);
template <>
DINL void wgmma_rs<8>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3} "
      ", {%4, %5, %6, %7}, %8, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
DINL void wgmma_rs<16>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7} "
      ", {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
DINL void wgmma_rs<32>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15} "
      ", {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <>
DINL void wgmma_rs<64>(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
      ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// Named barriers (0 is __syncthreads'): the warps that arrive do not wait; THREADS threads complete one.
DINL void bar_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory"); }
DINL void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory"); }

// mbarriers (WRING) and the bulk copy that completes on one
DINL void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
DINL void mbar_arrive(uint32_t bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory"); }
DINL void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
DINL void mbar_wait(uint32_t bar, uint32_t parity) {  // until the phase of this parity has completed
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}"
      ::"r"(bar), "r"(parity) : "memory");
}
DINL void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
DINL void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x0, int x1, uint32_t bar) {  // box at (x0, x1)
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x0), "r"(x1), "r"(bar) : "memory");
}
DINL void tma_load_3d(uint32_t dst, const CUtensorMap* map, int x0, int x1, int x2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x0), "r"(x1), "r"(x2), "r"(bar) : "memory");
}

DINL void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DINL void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N_>
DINL void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N_) : "memory"); }
// Thread-block clusters (CLUSTER): a barrier of all the cluster's threads (release / acquire: shared-memory writes
// before it are visible to the cluster's reads after it), the block's rank, and a float of another block's shared memory.
DINL void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
DINL uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
DINL float ld_cluster(uint32_t addr, uint32_t rank) {  // addr: a shared::cta address of this block's
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
// The producer warp's part in the CLUSTER epilogue's two cluster barriers (every thread of a cluster takes part).
DINL void producer_cluster_barriers() {
#if CLUSTER
  if (gridDim.y > 1) {
    cluster_sync();
    cluster_sync();
  }
#endif
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmmas.
DINL void pin(float* d) {
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major B step at shared address addr: unswizzled (core matrices of 8 tokens x
// 16 bytes, LBO 128, SBO 256), or NATURAL's 128-byte swizzle (a token's 64 values in one 128-byte row, 8 rows per
// 1024-byte atom: LBO unused (1), SBO 1024, layout type 1; a k16 step starts 32 bytes further into the rows).
#define STEP_ADV (NATURAL ? 32 : STEP_BYTES)  // bytes from one k16 step's B start address to the next's
DINL uint64_t b_desc(uint32_t addr) {
#if NATURAL
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
#else
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
#endif
}

// Activation staging through registers: the 32 bytes of one (token, k16 step) (16 values, natural K order: bf16 pairs
// w0..w7) are stored as the token's row of the step's first core matrix (pairs w0, w2, w4, w6) and of its second
// (w1, w3, w5, w7): the MMA's K order, two 16-byte stores.
// XPAIR=0: one thread loads all 32 bytes (two 16-byte loads). Pair index p: token % 8 in the low 3 bits (8 lanes store
// 128 contiguous bytes), then the step, then token / 8. Each load instruction reads half of every 32-byte sector it
// touches (Nsight Compute: a third of the sectors excess at M = 64).
// XPAIR=1: lanes l and l ^ 8 load the two halves (one 16-byte load each: every sector whole in one instruction), swap
// two words with a shuffle, and each stores one core-matrix row. Half index h: token % 8 in the low 3 bits, the half
// in bit 3, then the step, then token / 8.
#ifndef XPAIR
#define XPAIR 0
#endif
#define PAIRS (NTOK * 4)
#if XPAIR
#define XLOADS (2 * PAIRS)  // 16-byte loads per chunk; a multiple of 32: a warp loads all or none
#else
#define XLOADS PAIRS
#endif
#define XLOADS_PER_THREAD ((XLOADS + STAGERS - 1) / STAGERS)
struct XRegs {
  uint4 v[XLOADS_PER_THREAD][XPAIR ? 1 : 2];
};
// sid: the thread's index among the STAGERS staging threads.
DINL void load_x(XRegs& r, const uint4* __restrict__ x, int M, int ldx16, int c, int sid) {
#pragma unroll
  for (int i = 0; i < XLOADS_PER_THREAD; ++i) {
    const int p = sid + i * STAGERS;
    if (XLOADS % STAGERS == 0 || p < XLOADS) {
#if XPAIR
      const int m = min((p >> 6) * 8 + (p & 7), M - 1), s = (p >> 4) & 3;
      r.v[i][0] = __ldg(x + (size_t)m * ldx16 + c * 8 + s * 2 + ((p >> 3) & 1));
#else
      const int m = min((p >> 5) * 8 + (p & 7), M - 1), s = (p >> 3) & 3;
      const uint4* src = x + (size_t)m * ldx16 + c * 8 + s * 2;
      r.v[i][0] = __ldg(src);
      r.v[i][1] = __ldg(src + 1);
#endif
    }
  }
}
DINL void store_x(const XRegs& r, uint8_t* stage, int sid) {
#pragma unroll
  for (int i = 0; i < XLOADS_PER_THREAD; ++i) {
    const int p = sid + i * STAGERS;
    if (XLOADS % STAGERS == 0 || p < XLOADS) {  // warp-uniform (XPAIR: the shuffles need the whole warp)
#if XPAIR
      // half 0 (pairs w0..w3) sends w1, w3 and builds (w0, w2, w4, w6); half 1 (w4..w7) sends w4, w6 and builds
      // (w1, w3, w5, w7)
      const uint4 v = r.v[i][0];
      const bool h1 = (p >> 3) & 1;
      const uint32_t s0 = __shfl_xor_sync(0xFFFFFFFFu, h1 ? v.x : v.y, 8);
      const uint32_t s1 = __shfl_xor_sync(0xFFFFFFFFu, h1 ? v.z : v.w, 8);
      uint8_t* dst = stage + ((p >> 4) & 3) * STEP_BYTES + (p >> 6) * 256 + ((p >> 3) & 1) * 128 + (p & 7) * 16;
      *reinterpret_cast<uint4*>(dst) = h1 ? make_uint4(s0, s1, v.y, v.w) : make_uint4(v.x, v.z, s0, s1);
#else
      uint8_t* dst = stage + ((p >> 3) & 3) * STEP_BYTES + (p >> 5) * 256 + (p & 7) * 16;
      const uint4 a = r.v[i][0], b = r.v[i][1];
      *reinterpret_cast<uint4*>(dst) = make_uint4(a.x, a.z, b.x, b.z);
      *reinterpret_cast<uint4*>(dst + 128) = make_uint4(a.y, a.w, b.y, b.w);
#endif
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // these generic stores -> the wgmmas' reads
}

#define EMPTY_BAR(s) ((WRING ? 1 : 1 + XST) + (s))  // named barrier: the consumers have retired stage s

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
w4_wgmma_kernel(const uint4* __restrict__ codes, const uint32_t* __restrict__ meta, const uint4* __restrict__ x,
                float* __restrict__ out, int M, int N, int S, int C, int ldx16, int ldo, int cps, int obf16,
                int partial
#if NATURAL
                , const __grid_constant__ CUtensorMap xmap  // x [M, C * 64] bf16, box 64 x NTOK, 128-byte swizzle
#endif
#if WTMA  // codes [S, C, 512 bytes], meta [S, C, META_BYTES] as 8-byte words; boxes of one chunk of SLABS slabs
                , const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap mmap
#endif
) {
#if WRING
  extern __shared__ __align__(128) uint8_t xs_raw[];  // RING_BYTES (+ RALIGN - 128 to align it)
  uint8_t* const xs = xs_raw + ((RALIGN - ((uint32_t)__cvta_generic_to_shared(xs_raw) & (RALIGN - 1))) & (RALIGN - 1));
  __shared__ __align__(8) uint64_t full[XST];
  const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(full);
#else
  __shared__ __align__(128) uint8_t xs[XST * STAGE_BYTES];
#endif
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int warp = __shfl_sync(0xFFFFFFFFu, threadIdx.x >> 5, 0);  // warp-uniform, as ptxas can see
  const int g = lane >> 2, t = lane & 3;
  const int c0 = blockIdx.y * cps;
  const int nch = min(C, c0 + cps) - c0;
  if (nch <= 0) return;  // block-uniform
#if WRING
  if (threadIdx.x < XST) mbar_init(full0 + threadIdx.x * 8, NATURAL ? 1 : 32);  // the producer's arrivals
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
#endif
#if PRODUCER
  if (warp == CONSUMERS / 32) {  // the producer: chunk c into stage c % XST once the wgmmas of chunk c - XST retired
#if NATURAL  // chunk c's activations by one TMA (lane 0's) once the stage is empty; tokens past M read as zeros
    // (their sums are never stored)
    for (int c = 0; c < nch; ++c) {
      const int s = c % XST;
      if (c >= XST) bar_sync(EMPTY_BAR(s));
      if (lane == 0) {
        const uint32_t ring = (uint32_t)__cvta_generic_to_shared(xs);
        mbar_arrive_tx(full0 + s * 8, STAGE_BYTES + SLABS * (512 + META_BYTES));
        tma_load_2d(ring + s * STAGE_BYTES, &xmap, (c0 + c) * 64, 0, full0 + s * 8);
#if WTMA  // the block's slabs (rows past S read as zeros: an idle warpgroup's, never stored)
        const uint32_t wdst = ring + WRING0 + s * WSTAGE_BYTES;
        tma_load_3d(wdst, &wmap, 0, c0 + c, blockIdx.x * SLABS, full0 + s * 8);
        tma_load_3d(wdst + SLABS * 512, &mmap, 0, c0 + c, blockIdx.x * SLABS, full0 + s * 8);
#endif
      }
    }
    producer_cluster_barriers();
    return;
#endif
    XRegs xr;
    load_x(xr, x, M, ldx16, c0, lane);
    for (int c = 0; c < nch; ++c) {
      const int s = c % XST;
      if (c >= XST) bar_sync(EMPTY_BAR(s));
      store_x(xr, xs + s * STAGE_BYTES, lane);
#if WRING  // the stage is full once these arrivals and the consumers' copies' bytes are in
      __syncwarp();
      if (lane == 0) mbar_arrive_tx(full0 + s * 8, SLABS * (512 + META_BYTES));
      else mbar_arrive(full0 + s * 8);
#else
      bar_arrive(1 + s);
#endif
      if (c + 1 < nch) load_x(xr, x, M, ldx16, c0 + c + 1, lane);
    }
    producer_cluster_barriers();
    return;
  }
#endif
  const int slab = (blockIdx.x * WGS + (warp >> 2)) * 4 + (warp & 3);
  const bool active = slab < S;  // S is a multiple of 4: a warpgroup is active as a whole
  const uint32_t xs0 = (uint32_t)__cvta_generic_to_shared(xs);
#if LEAN
  const uint64_t desc0 = b_desc(xs0);
#endif

  // FETCH(d, rel, kc): chunk kc (rel chunks past wp / mp) into wq[d], mq[d]
#if WRING  // from this warp's slab in the chunk's stage, once the stage is full
  const uint8_t* wsm = xs + WRING0 + warp * 512 + lane * 16;
  const uint32_t* msm = reinterpret_cast<const uint32_t*>(xs + WRING0 + SLABS * 512 + warp * META_BYTES);
#if !WTMA  // (WTMA: the producer's TMAs bring the weights too)
  // COPY(kc): lane 0 copies this warp's slab's codes of chunk kc into the chunk's stage, lane 1 its metadata
  const size_t cunit = (size_t)min(slab, S - 1) * C + c0;
  const bool cmeta = lane == 1;
  const uint8_t* csrc = cmeta ? reinterpret_cast<const uint8_t*>(meta + cunit * META_WORDS)
                              : reinterpret_cast<const uint8_t*>(codes + cunit * 32);
  const uint32_t cbytes = cmeta ? META_BYTES : 512;
  const uint32_t cdst = xs0 + WRING0 + (cmeta ? SLABS * 512 + warp * META_BYTES : warp * 512);
#define COPY(kc) \
  if (lane < 2) bulk_copy(cdst + ((kc) % XST) * WSTAGE_BYTES, csrc + (size_t)(kc) * cbytes, cbytes, full0 + ((kc) % XST) * 8)
#pragma unroll 1
  for (int kc = 0; kc < min(XST, nch); ++kc) COPY(kc);
#endif
// FETCH_AT(d, st, ph): from stage st once its mbarrier has completed phase parity ph
#define FETCH_AT(d, st, ph)                                                  \
  {                                                                          \
    mbar_wait(full0 + (st) * 8, (ph));                                       \
    wq[d] = *reinterpret_cast<const uint4*>(wsm + (st) * WSTAGE_BYTES);      \
    mq[d] = load_meta_shared(msm + (st) * (WSTAGE_BYTES / 4), lane);         \
  }
#define FETCH(d, rel, kc) FETCH_AT(d, (kc) % XST, ((kc) / XST) & 1)
#define FETCH_NEXT(d) FETCH_AT(d, fs, fph)  // chunk kk + FAHEAD (the ring indices below)
#else
  const size_t unit = (size_t)min(slab, S - 1) * C + c0;
  const uint4* wp = codes + unit * 32 + lane;
  const uint32_t* mp = meta + unit * META_WORDS;
#define FETCH(d, rel, kc)                                  \
  {                                                        \
    wq[d] = __ldg(wp + (rel) * 32);                        \
    mq[d] = load_meta(mp + (rel) * META_WORDS, lane);      \
  }
#define FETCH_NEXT(d) FETCH(d, d + DEPTH, kk + DEPTH)
#endif
  float acc[NTOK / 2];
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) acc[i] = 0.f;

#if !PRODUCER
  XRegs xr;
#pragma unroll
  for (int st = 0; st < XST - 2; ++st) {
    if (st < nch) {
      load_x(xr, x, M, ldx16, c0 + st, threadIdx.x);
      store_x(xr, xs + st * STAGE_BYTES, threadIdx.x);
    }
  }
  if (XST - 2 < nch) load_x(xr, x, M, ldx16, c0 + XST - 2, threadIdx.x);  // stored in iteration 0
#endif
  uint4 wq[DEPTH];
  MetaT mq[DEPTH];
#if !WJIT  // the first DEPTH chunks' words (WJIT reads each in its own iteration)
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (d < nch) FETCH(d, d, d);
  }
#endif
  uint32_t a[2][4][4];  // [chunk parity][k16 step][fragment register]
  // The ring's indices carried from chunk to chunk (no division per chunk): cs = kk % XST, ps = (kk - 1) % XST,
  // fs = (kk + FAHEAD) % XST and fph the parity of (kk + FAHEAD) / XST (the phase its FETCH waits for).
  int cs = 0, ps = XST - 1, fs = FAHEAD % XST, fph = (FAHEAD / XST) & 1;

  for (int k = 0; k < nch; k += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int kk = k + d;
      if (kk < nch) {  // block-uniform
#if WJIT
        FETCH_NEXT(d);  // chunk kk itself
#endif
        const uint4 w = wq[d];
        const Scales sc = make_scales(mq[d]);
#if !LEAN && !WJIT
        if (kk + DEPTH < nch) FETCH_NEXT(d);
#endif
        dequant(w.x, sc, 0, a[d & 1][0]);
        dequant(w.y, sc, 1, a[d & 1][1]);
        dequant(w.z, sc, 2, a[d & 1][2]);
        dequant(w.w, sc, 3, a[d & 1][3]);
#if WRING  // chunk kk's stage was full (FETCH waited for it); its words are used: refill this warp's slab of it
#if !WTMA  // (WTMA: the producer does)
        if (kk + XST < nch) {
          __syncwarp();
          COPY(kk + XST);
        }
#endif
#elif PRODUCER
        bar_sync(1 + cs);  // chunk kk staged by the producer
#else
        __syncthreads();  // chunk kk staged by all threads; every warpgroup has retired the wgmmas of chunk kk - 2
        if (kk + XST - 2 < nch) store_x(xr, xs + ((kk + XST - 2) % XST) * STAGE_BYTES, threadIdx.x);
        if (kk + XST - 1 < nch) load_x(xr, x, M, ldx16, c0 + kk + XST - 1, threadIdx.x);
#endif
        // Every warpgroup issues its wgmmas (an idle one multiplies a clamped slab and stores nothing): a wgmma
        // under a thread-dependent branch makes ptxas serialize all of them.
#if LEAN  // the descriptors by addition to the first stage's (the address field is bits 0-13, in 16-byte units)
        const uint64_t stage = desc0 + (uint32_t)(cs * (STAGE_BYTES >> 4));
#define B_DESC(s) (stage + (s) * (STEP_ADV >> 4))
#else
        const uint32_t stage = xs0 + cs * STAGE_BYTES;
#define B_DESC(s) b_desc(stage + (s) * STEP_ADV)
#endif
        wgmma_fence();
        pin(acc);
#pragma unroll
        for (int s = 0; s < 4; ++s) wgmma_rs<NTOK>(acc, a[d & 1][s], B_DESC(s));
#undef B_DESC
        wgmma_commit();
        pin(acc);
#if LEAN && !WJIT  // the prefetch once w is dequantized: it reuses w's registers (no copy that waits for the load)
        if (kk + DEPTH < nch) FETCH_NEXT(d);
#endif
        wgmma_wait<1>();  // chunk kk - 1's group has retired: its A registers and stage are free
#if PRODUCER
        if (kk >= 1 && kk - 1 + XST < nch) bar_arrive(EMPTY_BAR(ps));  // (the producer waits for it)
#endif
        ps = cs;
        cs = cs + 1 == XST ? 0 : cs + 1;
        if (++fs == XST) {
          fs = 0;
          fph ^= 1;
        }
      }
    }
#if !WRING
    wp += DEPTH * 32;
    mp += DEPTH * META_WORDS;
#endif
  }
#undef FETCH
#undef FETCH_AT
#undef FETCH_NEXT
#undef COPY
  wgmma_wait<0>();
  pin(acc);
#if CLUSTER
  if (gridDim.y > 1) {  // deterministic split-K through the cluster (see the header); gridDim.y is the cluster size
    asm volatile("bar.sync 15, %0;" ::"n"(CONSUMERS) : "memory");  // every consumer is done with the ring
    float* part = reinterpret_cast<float*>(xs);  // element j of consumer thread i at [j * CONSUMERS + i]
#pragma unroll
    for (int j = 0; j < NTOK / 2; ++j) part[j * CONSUMERS + threadIdx.x] = acc[j];
    cluster_sync();
    const int total = NTOK / 2 * CONSUMERS, share = (total + gridDim.y - 1) / gridDim.y;
    const int e0 = (int)cluster_rank() * share, e1 = min(total, e0 + share);
    const uint32_t part0 = (uint32_t)__cvta_generic_to_shared(part);
    for (int e = e0 + threadIdx.x; e < e1; e += CONSUMERS) {
      const int j = e / CONSUMERS, i = e % CONSUMERS, w = i >> 5, l = i & 31;  // element j of thread i's acc
      const int n = ((blockIdx.x * WGS + (w >> 2)) * 4 + (w & 3)) * 16 + (l >> 2) + ((j & 3) >> 1) * 8;
      const int m = 8 * (j >> 2) + 2 * (l & 3) + (j & 1);
      if (n < N && m < M) {
        float sum = 0.f;
        for (uint32_t r = 0; r < gridDim.y; ++r) sum += ld_cluster(part0 + e * 4, r);  // in rank order
        store_out(out, (size_t)m * ldo + n, sum, obf16);
      }
    }
    cluster_sync();  // no block leaves while another may still read its shared memory
    return;
  }
#endif
  if (!active) return;

  const bool atomic = gridDim.y > 1 && !partial;
  if (partial) out += (size_t)blockIdx.y * M * ldo;  // this split's own [M, ldo] partial sums, stored
  const int n0 = slab * 16 + g;
#pragma unroll
  for (int i = 0; i < NTOK / 8; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = n0 + (r >> 1) * 8, m = 8 * i + 2 * t + (r & 1);
      if (n < N && m < M) {
        if (atomic) atomicAdd(out + (size_t)m * ldo + n, acc[4 * i + r]);
        else store_out(out, (size_t)m * ldo + n, acc[4 * i + r], obf16);
      }
    }
  }
}

#if NATURAL
// x's tensor map for the TMA: [M, K] bf16 rows ldx apart, boxes of 64 values x NTOK tokens, 128-byte swizzle, rows
// past M read as zeros. cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda). Returns 0, a
// cudaError of the lookup, 999 (the driver has no such entry point) or 1000 + the CUresult of the encoding.
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(int* err) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
      *err = e != cudaSuccess ? (int)e : 999;
      return nullptr;
    }
    encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
  }
  return encode;
}
static int encode_x_map(CUtensorMap* map, const void* x, int M, int K, int ldx) {
  int err = 0;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(&err);
  if (!encode) return err;
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M};
  const cuuint64_t strides[1] = {(cuuint64_t)ldx * 2};
  const cuuint32_t box[2] = {64, NTOK}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(x), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 1000 + (int)r;
}
#endif
#if WTMA
// A weight array [S, C, bytes] (codes: 512 bytes per slab and chunk; meta: META_BYTES) as 8-byte words, boxes of one
// chunk of SLABS slabs (slabs past S read as zeros), no swizzle: they land as the stage's [slab][bytes] block.
static int encode_w_map(CUtensorMap* map, const void* w, int S, int C, int bytes) {
  int err = 0;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(&err);
  if (!encode) return err;
  const cuuint64_t dims[3] = {(cuuint64_t)bytes / 8, (cuuint64_t)C, (cuuint64_t)S};
  const cuuint64_t strides[2] = {(cuuint64_t)bytes, (cuuint64_t)bytes * C};
  const cuuint32_t box[3] = {(cuuint32_t)bytes / 8, 1, SLABS}, elem[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT64, 3, const_cast<void*>(w), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 1000 + (int)r;
}
#endif

// The kernel's dynamic shared memory in bytes (WRING: the ring, over the 48 KB default, allowed once per library),
// or minus the CUDA error of allowing it.
static int dynamic_smem() {
#if WRING
  const int smem = RING_BYTES + RALIGN - 128;
  static bool smem_allowed = false;
  if (!smem_allowed) {
    const cudaError_t err = cudaFuncSetAttribute(w4_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return -(int)err;
    smem_allowed = true;
  }
  return smem;
#else
  return 0;
#endif
}

// How many blocks of this kernel an SM of the current device runs at once (registers, shared memory and threads:
// what the hardware allows, which may exceed MINB, __launch_bounds__' floor) into *blocks; returns a CUDA error.
extern "C" int w4_wgmma_blocks_per_sm(int* blocks) {
  const int smem = dynamic_smem();
  if (smem < 0) return -smem;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, w4_wgmma_kernel, THREADS, smem);
}

extern "C" int w4_wgmma_launch(const void* codes, const void* meta, const void* x, void* out, int M, int N, int S,
                               int C, int ldx, int ldo, int split, int cps, int obf16, int partial, int pdl,
                               void* stream) {
  if (obf16 && split > 1 && !CLUSTER) return (int)cudaErrorInvalidValue;  // partial sums need fp32
  dim3 grid((S / 4 + WGS - 1) / WGS, split);
#if NATURAL
  CUtensorMap xmap;
  if (const int err = encode_x_map(&xmap, x, M, C * 64, ldx)) return err;
#endif
#if WTMA
  CUtensorMap wmap, mmap;
  if (const int err = encode_w_map(&wmap, codes, S, C, 512)) return err;
  if (const int err = encode_w_map(&mmap, meta, S, C, META_BYTES)) return err;
#endif
  const int smem = dynamic_smem();
  if (smem < 0) return -smem;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
#if CLUSTER
  if (split > 1) {  // the split blocks of a row tile in one cluster
    if (split > 8) return (int)cudaErrorInvalidValue;  // (the portable cluster size; cuda_decode caps the split)
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs].val.clusterDim.x = 1;
    attr[cfg.numAttrs].val.clusterDim.y = split;
    attr[cfg.numAttrs].val.clusterDim.z = 1;
    ++cfg.numAttrs;
  }
#endif
  if (pdl) pdl_attribute(&attr[cfg.numAttrs++]);
  return (int)cudaLaunchKernelEx(&cfg, w4_wgmma_kernel, (const uint4*)codes, (const uint32_t*)meta, (const uint4*)x,
                                 (float*)out, M, N, S, C, ldx / 8, ldo, cps, obf16, CLUSTER ? 0 : partial
#if NATURAL
                                 , xmap
#endif
#if WTMA
                                 , wmap, mmap
#endif
  );
}
