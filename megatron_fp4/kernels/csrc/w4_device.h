// Device code shared by the decode GEMMs (w4_decode.cu: mma.sync; w4_wgmma.cu: wgmma): dequantization of the
// decode layout's FP4 codes into BF16 A fragments (mma.m16n8k16 and wgmma m64nNk16 from registers take the same
// fragment per warp) and the chunk metadata loads. Built per -DFMT (0 HiF4, 1 MXFP4), -DWIDE and (HiF4 in natural
// order) -DSUBN. The layout and the bit tricks are described in w4_decode.cu and megatron_fp4/kernels/cuda_decode.py.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FMT
#define FMT 1
#endif
#ifndef WIDE
#define WIDE 0
#endif

#define DINL __device__ __forceinline__
// HiF4 in natural order: codes as bf16 subnormals (cuda_decode.to_decode_layout subnormal, DecodeWeight.subnormal)
#if defined(SUBN) && SUBN && FMT == 0
#define W4_SUBN 1
#else
#define W4_SUBN 0
#endif
#if defined(NATURAL) && NATURAL  // the natural-K-order layout (w4_wgmma.cu NATURAL=1; cuda_decode.to_decode_layout)
#define W4_NATURAL 1
#else
#define W4_NATURAL 0
#endif

// Programmatic dependent launch (cuda_decode.w4_decode with MEGATRON_FP4_PDL=1; megatron_fp4/kernels/_common.py):
// a kernel launched with the attribute may start before the kernel ahead of it in the stream has finished, so it
// first waits for that kernel (all of its work done and visible: before any of this kernel's loads or stores),
// then lets the next kernel launch: in that order, a kernel starts early only beside the one kernel just before
// it, never beside older ones (a weight's requantize, say). The wait is a no-op in a launch without the attribute;
// the trigger is not: it lets the NEXT kernel start early if that one was launched with the attribute, whatever
// ours was (sgl-kernel launches its SiLU-and-mul so on Hopper: in SGLang's profile it then includes the wait for
// our GEMM's tail, docs/PERFORMANCE.md issue 19 session 38). That kernel still waits for ours to finish.
// (Loading weights before the wait was tried and dropped: the kernel just before may be the one writing them.)
DINL void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
static inline void pdl_attribute(cudaLaunchAttribute* a) {  // (host: the launchers)
  a->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a->val.programmaticStreamSerializationAllowed = 1;
}

DINL uint32_t bmul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
DINL uint32_t bfma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// (a & b) | c in one LOP3 (ptxas splits it in two when b and c are both constants; with one kept in a register
// across the loop it is one instruction)
template <uint32_t B>
DINL uint32_t and_or(uint32_t a, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(B), "r"(c));
  return d;
}
// a & m where the compiler cannot move the mask behind a shift (the shift and the add after it then make one IMAD)
DINL uint32_t and_mask(uint32_t a, uint32_t m) {
  uint32_t d;
  asm("and.b32 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(m));
  return d;
}
// One 16-bit half of v in both halves. Spelled as PTX moves of the halves (not a byte permute), ptxas folds them into
// the consuming bf16x2 FMA or multiply as an operand selector (.H0_H0 / .H1_H1): no instruction of its own
// (session 39: 16 PRMTs less per 64-value chunk of the natural HiF4 loop, 4 of MXFP4's).
DINL uint32_t dup_lo(uint32_t v) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}" : "=r"(d) : "r"(v));
  return d;
}
DINL uint32_t dup_hi(uint32_t v) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}" : "=r"(d) : "r"(v));
  return d;
}
// One output of a decode GEMM: fp32, or (obf16) rounded to bf16 to nearest even into a bf16 array at the same index.
DINL void store_out(float* out, size_t i, float v, int obf16) {
  if (obf16) reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else out[i] = v;
}

#if FMT == 1
// MXFP4 chunk state: bf16x2 factors per (row g / g + 8, block 0 / 1), duplicated in both halves.
struct Scales {
  uint32_t f[2][2];
#if WIDE
  uint32_t h[2][2];
#endif
};
// Two E8M0 bytes in the 16-bit halves -> bf16 bits of 2^(s - 1). The NaN code 255 gives a finite stand-in (no test
// here: cuda_decode.w4_decode writes NaN into the output columns of the rows that hold one, DecodeWeight.nan_rows).
DINL uint32_t mx_pair(uint32_t p) {
#if WIDE
  const uint32_t lo = p & 0xFFFF, hi = p >> 16;
  return (min(lo + 126u, 254u) << 7) | (min(hi + 126u, 254u) << 23);
#else
  return (p + 0x007E007Eu) << 7;
#endif
}
#if WIDE
DINL uint32_t mx_pair2(uint32_t p) {  // the second factor 2^(max(s + 126 - 254, 0)) (bf16 bits)
  uint32_t lo = p & 0xFFFF, hi = p >> 16;
  lo = ((lo + 126u > 254u ? lo + 126u - 254u : 0u) + 127u) << 7;
  hi = ((hi + 126u > 254u ? hi + 126u - 254u : 0u) + 127u) << 7;
  return lo | (hi << 16);
}
#endif
DINL Scales make_scales(uint32_t m) {  // m: bytes [s(g, b0), s(g, b1), s(g + 8, b0), s(g + 8, b1)]
  Scales S;
  const uint32_t p0 = __byte_perm(m, 0, 0x7270);  // lo = byte 0, hi = byte 2 (16-bit halves, zero-extended)
  const uint32_t p1 = __byte_perm(m, 0, 0x7371);  // lo = byte 1, hi = byte 3
  const uint32_t f0 = mx_pair(p0), f1 = mx_pair(p1);
  S.f[0][0] = dup_lo(f0); S.f[1][0] = dup_hi(f0); S.f[0][1] = dup_lo(f1); S.f[1][1] = dup_hi(f1);
#if WIDE
  const uint32_t h0 = mx_pair2(p0), h1 = mx_pair2(p1);
  S.h[0][0] = dup_lo(h0); S.h[1][0] = dup_hi(h0); S.h[0][1] = dup_lo(h1); S.h[1][1] = dup_hi(h1);
#endif
  return S;
}
// Pair J of a code word as bf16x2 bits of (code value x 2^-126): signs at bits 15 and 31, each code's e1 e0 m at
// 8..6 and 24..22 (a code of exponent 0 becomes a bf16 subnormal, the exact value again).
#if W4_NATURAL  // natural layout: the bits sit where a rotation and one mask place them (cuda_decode._MX_ROT)
DINL uint32_t rotr(uint32_t w, int r) { return __funnelshift_r(w, w, r); }
template <int J>
DINL uint32_t mx_bits(uint32_t w) {
  if (J == 0) return w & 0x81C081C0u;
  if (J == 1) return rotr(w, 4) & 0x81C081C0u;
  if (J == 2) return rotr(w, 10) & 0x81C081C0u;
  return (rotr(w, 6) & 0x81808180u) | (rotr(w, 14) & 0x00400040u);
}
#else  // nibble J of each half (sign in its top bit)
template <int J>
DINL uint32_t mx_bits(uint32_t w) {
  const uint32_t src = w << (12 - 4 * J);
  return ((src >> 6) & 0x01C001C0u) | (src & 0x80008000u);
}
#endif
template <int J>
DINL uint32_t mx_val(uint32_t w, const Scales& S, int blk) {
  uint32_t a = bmul(mx_bits<J>(w), S.f[J & 1][blk]);
#if WIDE
  a = bmul(a, S.h[J & 1][blk]);
#endif
  return a;
}
DINL void dequant(uint32_t w, const Scales& S, int s, uint32_t* a) {
  const int blk = s >> 1;
  a[0] = mx_val<0>(w, S, blk);
  a[1] = mx_val<1>(w, S, blk);
  a[2] = mx_val<2>(w, S, blk);
  a[3] = mx_val<3>(w, S, blk);
}
#else
// HiF4 chunk state: E (2-bit exponent sums e(row g, step s) at bits 2s, e(row g + 8, s) at 16 + 2s) and the
// bf16 bits of E6M2 / 4 for rows g (low half) and g + 8 (high half). In natural K order a lane's two value pairs of a
// row and step (K 2t, 2t + 1 and 2t + 8, 2t + 9) lie in different 4-value groups: E for the first (ea), E for the
// second (eb).
struct Scales {
#if W4_NATURAL && W4_SUBN
  uint32_t ea, eb, base;  // base: E6M2 x 2^127 (see dequant)
#elif W4_NATURAL
  uint32_t ea, eb, base, nbase;  // nbase: -136 x base (exact: see dequant)
#else
  uint32_t e, base;
#endif
#if defined(LEAN) && LEAN
  uint32_t k128, k8;  // the bf16x2 bits of 128 and 8 (see dequant)
#endif
};
#if W4_NATURAL
struct MetaT {  // the chunk metadata a lane needs
  uint32_t e;   // exponent-sum bytes (g, first pair), (g, second pair), (g + 8, first), (g + 8, second)
  uint32_t cp;  // E6M2 codes of rows g (low byte), g + 8
};
DINL Scales make_scales(MetaT m) {
  Scales S;
  S.ea = __byte_perm(m.e, 0, 0x7270);  // bytes 0, 2 -> the halves
  S.eb = __byte_perm(m.e, 0, 0x7371);  // bytes 1, 3
  const uint32_t cp = __byte_perm(m.cp, 0, 0x7170);  // E6M2 codes in the two halves
#else
typedef uint32_t MetaT;
DINL Scales make_scales(uint32_t m) {  // m: low 16 bits: e bits (lane); high 16 bits: E6M2 codes of rows g, g + 8
  Scales S;
  S.e = __byte_perm(m, 0, 0x7170);      // e bits of row g -> low half, row g + 8 -> high half
  const uint32_t cp = __byte_perm(m, 0, 0x7372);  // E6M2 codes in the two halves
#endif
  // (the NaN code 255 gives a finite stand-in, as mx_pair's; the subnormal layout stores 0 in its place)
#if W4_SUBN
  S.base = ((((cp >> 2) & 0x003F003Fu) + 0x00CE00CEu) << 7) | ((cp & 0x00030003u) << 5);
#else
  S.base = ((((cp >> 2) & 0x003F003Fu) + 0x004D004Du) << 7) | ((cp & 0x00030003u) << 5);
#endif
#if W4_NATURAL && !W4_SUBN
  S.nbase = bmul(S.base, 0xC308C308u);  // (bf16x2 -136: 0xC308)
#endif
#if defined(LEAN) && LEAN
  asm("mov.b32 %0, 0x43004300;" : "=r"(S.k128));
  asm("mov.b32 %0, 0x41004100;" : "=r"(S.k8));
#endif
  return S;
}
#if W4_SUBN
// Natural layout, codes as bf16 subnormals (cuda_decode._hif4_subnormal_position): the lane's word rotated right by
// 4j and masked (0x80708070) holds pair j's codes as a bf16x2 whose halves carry the sign at bit 15 and the magnitude
// k at bits 4..6 (exponent field 0: the value k x 2^-129, a subnormal); one multiply by F' = E6M2 x 2^(e + 127)
// gives k x E6M2 x 2^(e - 2) = (k / 4) x 2^e x E6M2, exact, the sign with it (mul.rn.bf16x2 keeps subnormal inputs,
// as MXFP4's codes of exponent 0 rely on too). F' is finite while E6M2 x 2^e < 2, which the layout checks for every
// unit (else it keeps the offset binary below). No -136 F, so two integer multiply-adds fewer per step than that.
// F' = base + (e << 7) adds e to the exponent field as there (no carry leaves a half: c + e + 206 <= 254).
DINL void dequant(uint32_t w, const Scales& S, int s, uint32_t* a) {
  const uint32_t ea = and_mask(S.ea, 0x00030003u << (2 * s)), eb = and_mask(S.eb, 0x00030003u << (2 * s));
  const int sh = 7 - 2 * s;
  const uint32_t fp = S.base + (ea << sh), fp2 = S.base + (eb << sh);
  a[0] = bmul(w & 0x80708070u, dup_lo(fp));
  a[1] = bmul(__funnelshift_r(w, w, 4) & 0x80708070u, dup_hi(fp));
  a[2] = bmul(__funnelshift_r(w, w, 8) & 0x80708070u, dup_lo(fp2));
  a[3] = bmul(__funnelshift_r(w, w, 12) & 0x80708070u, dup_hi(fp2));
}
#elif W4_NATURAL
// Natural layout: nibble j of each half is pair j's code in offset binary o = 8 + value (cuda_decode._HIF4_OFFSET),
// rows g (j = 0, 2) and g + 8 (j = 1, 3), the first (j < 2) and the second (j >= 2) 4-value group of the step:
// bf16(128 + o) x F - 136 F = (o - 8) F in one FMA, exact (136 F has at most 5 + 3 significant bits), no sign step.
// The factors F = base x 2^e and -136 F = nbase x 2^e both by adding e to the exponent field of the two halves' bf16
// (base and nbase are exact: E6M2 / 4 has 2 significant bits, 136 F at most 5 + 3; their exponents stay within
// 77..150, so no carry leaves a half), the mask before the shift (the shift and the add are then one IMAD for F and
// one for -136 F); the halves are broadcast to both halves of the bf16x2 operands by dup_lo / dup_hi, which ptxas
// folds into the FMA's operand selectors (.H0_H0 / .H1_H1).
DINL void dequant(uint32_t w, const Scales& S, int s, uint32_t* a) {
  const uint32_t ea = and_mask(S.ea, 0x00030003u << (2 * s)), eb = and_mask(S.eb, 0x00030003u << (2 * s));
  const int sh = 7 - 2 * s;
  const uint32_t fp = S.base + (ea << sh), fp2 = S.base + (eb << sh), np = S.nbase + (ea << sh),
                 np2 = S.nbase + (eb << sh);
  const uint32_t fg = dup_lo(fp), fh = dup_hi(fp), fg2 = dup_lo(fp2), fh2 = dup_hi(fp2);
  const uint32_t ng = dup_lo(np), nh = dup_hi(np), ng2 = dup_lo(np2), nh2 = dup_hi(np2);
#if defined(LEAN) && LEAN
  const uint32_t k128 = S.k128;
  a[0] = bfma(and_or<0x000F000Fu>(w, k128), fg, ng);
  a[1] = bfma(and_or<0x000F000Fu>(w >> 4, k128), fh, nh);
  a[2] = bfma(and_or<0x000F000Fu>(w >> 8, k128), fg2, ng2);
  a[3] = bfma(and_or<0x000F000Fu>(w >> 12, k128), fh2, nh2);
#else
  a[0] = bfma((w & 0x000F000Fu) | 0x43004300u, fg, ng);
  a[1] = bfma(((w >> 4) & 0x000F000Fu) | 0x43004300u, fh, nh);
  a[2] = bfma(((w >> 8) & 0x000F000Fu) | 0x43004300u, fg2, ng2);
  a[3] = bfma(((w >> 12) & 0x000F000Fu) | 0x43004300u, fh2, nh2);
#endif
}
#else
// Permuted layout: nibble = sign (bit 3) and magnitude (bits 0..2); the magic bf16 128 (bits 0..2) or 8 (bits
// 4..6) and one FMA make the magnitude times F, an XOR the sign.
DINL void dequant(uint32_t w, const Scales& S, int s, uint32_t* a) {
  const uint32_t fp = S.base + (((S.e >> (2 * s)) & 0x00030003u) << 7);
  const uint32_t fg = dup_lo(fp), fh = dup_hi(fp);
  const uint32_t n128 = bmul(fg, 0xC300C300u), n8 = bmul(fh, 0xC100C100u);
  const uint32_t t = w >> 8;
#if defined(LEAN) && LEAN
  const uint32_t k128 = S.k128, k8 = S.k8;
  a[0] = bfma(and_or<0x00070007u>(w, k128), fg, n128) ^ ((w << 12) & 0x80008000u);
  a[1] = bfma(and_or<0x00700070u>(w, k8), fh, n8) ^ ((w << 8) & 0x80008000u);
  a[2] = bfma(and_or<0x00070007u>(t, k128), fg, n128) ^ ((w << 4) & 0x80008000u);
  a[3] = bfma(and_or<0x00700070u>(t, k8), fh, n8) ^ (w & 0x80008000u);
#else
  a[0] = bfma((w & 0x00070007u) | 0x43004300u, fg, n128) ^ ((w << 12) & 0x80008000u);
  a[1] = bfma((w & 0x00700070u) | 0x41004100u, fh, n8) ^ ((w << 8) & 0x80008000u);
  a[2] = bfma((t & 0x00070007u) | 0x43004300u, fg, n128) ^ ((w << 4) & 0x80008000u);
  a[3] = bfma((t & 0x00700070u) | 0x41004100u, fh, n8) ^ (w & 0x80008000u);
#endif
}
#endif
#endif

#if FMT == 1
typedef uint32_t MetaT;
#define META_WORDS 8  // 32-bit words per (slab, chunk)
DINL uint32_t load_meta(const uint32_t* __restrict__ p, int lane) { return __ldg(p + (lane >> 2)); }
DINL uint32_t load_meta_shared(const uint32_t* p, int lane) { return p[lane >> 2]; }
#elif W4_NATURAL
// 80 bytes: 16 x 32-bit e bits (one per lane pair t, t ^ 1: the same 4-groups), 8 x 16-bit E6M2 codes (per g)
#define META_WORDS 20
DINL MetaT load_meta_shared(const uint32_t* p, int lane) {
  return MetaT{p[lane >> 1], (uint32_t)reinterpret_cast<const uint16_t*>(p)[32 + (lane >> 2)]};
}
#else
#define META_WORDS 20  // 80 bytes: 32 x 16-bit e bits (per lane), 8 x 16-bit E6M2 codes (per g)
DINL uint32_t load_meta(const uint32_t* __restrict__ p, int lane) {
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  return (uint32_t)__ldg(q + lane) | ((uint32_t)__ldg(q + 32 + (lane >> 2)) << 16);
}
DINL uint32_t load_meta_shared(const uint32_t* p, int lane) {  // the same words from shared memory
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  return (uint32_t)q[lane] | ((uint32_t)q[32 + (lane >> 2)] << 16);
}
#endif
