"""Benchmark the Triton FP4 kernels against cuBLAS on one GPU; prints one table, writes JSON.

    PYTHONPATH=. python benchmarks/bench_kernels.py [--out benchmarks/results/kernels_h200.json] [--quick]

Shapes: Qwen2.5-3B/7B linears (K, N) x tokens M. Timings: triton.testing.do_bench medians with inputs rotated
through more than the L2 cache. GEMM outputs are bf16 (as cuBLAS), except the packed-weight decode kernels
(fp32, split-K atomics).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from megatron_fp4.kernels import decode_gemm as gm  # noqa: E402

from megatron_fp4.kernels.decode_gemm import w4_matmul  # noqa: E402
from megatron_fp4.kernels.gemm import mm_expanded  # noqa: E402
from megatron_fp4.kernels.packed_gemm import packed_matmul  # noqa: E402
from megatron_fp4.kernels.quantize import Expanded, expand_packed, quantize  # noqa: E402
from megatron_fp4.kernels.resq import resq_quantize  # noqa: E402

SHAPES = [(2048, 2048), (2048, 11008), (11008, 2048), (3584, 18944), (18944, 3584)]  # (K, N)
MS = [16, 64, 4096, 16384]
L2_BYTES = 60 * 2 ** 20


def bench(fn_list, warmup=10, rep=30, graph=False):
    """Median ms of calling the functions of fn_list in rotation (one per call); graph=True replays a CUDA graph
    (decode-sized calls, where Python launch overhead would otherwise dominate)."""
    i = [0]

    def run():
        fn_list[i[0] % len(fn_list)]()
        i[0] += 1

    if graph:
        for f in fn_list:
            f()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(run, rep=rep, return_mode="median")
    return triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")


def copies_for(nbytes):
    return max(1, min(16, int(3 * L2_BYTES // max(nbytes, 1)) + 1))


def ceilings():
    n = 1 << 29  # 1 GiB of bytes
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    copy_gbs = 2 * n / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    bf16_tflops = 2 * 8192 ** 3 / ms / 1e9
    del src, dst, a, b
    return copy_gbs, bf16_tflops


def bench_quantize(rows=16384, K=3584):
    out = []
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    xt = torch.randn(K, rows, device="cuda", dtype=torch.bfloat16)  # quantized along dim 0
    for fmt, meta in (("hif4", 4 / 64), ("mxfp4", 1 / 32)):
        cases = [
            ("pack", lambda: quantize(x, fmt), 2 + 0.5 + meta),
            ("pack+expand", lambda: quantize(x, fmt, expand="native"), 2 + 0.5 + meta + (2 if fmt == "hif4" else 1)),
            ("pack dim0", lambda: quantize(xt, fmt, dim=0), 2 + 0.5 + meta),
            ("resq 2:4 pack+expand", lambda: resq_quantize(x, fmt, expand="native"),
             2 + 2 * (0.5 + meta) + 2 * (2 if fmt == "hif4" else 1)),
            ("resq 2:4 pack+bf16 sum", lambda: resq_quantize(x, fmt, expand="sum"), 2 + 2 * (0.5 + meta) + 2),
        ]
        for name, fn, bpe in cases:
            ms = bench([fn], graph=True)  # kernel time: host overhead (autotuner, allocations) replayed away
            out.append({"kernel": f"quantize {fmt} {name}", "rows": rows, "K": K, "ms": ms,
                        "GB/s": bpe * rows * K / ms / 1e6, "config": _best_config(fmt, name)})
    return out


#: (tokens, K) of the training linears' X and dY on the Qwen2.5-1.5B shape (bench_train.py's 4 x 2048 step): X of
#: qkv/proj/fc1 and dY of proj/fc2 (1536), dY of qkv (2048), X of fc2 (8960), dY of fc1 (17920).
TRAIN_OPERANDS = [(8192, 1536), (8192, 2048), (8192, 8960), (8192, 17920)]


def bench_training_operands(operands=TRAIN_OPERANDS):
    """A training operand X [tokens, K] quantized into both GEMM layouts (along K and along tokens) by
    ``megatron_fp4.kernels.quantize.quantize_both_layouts`` (``KernelBackend.quantize_both``, and a weight's refresh,
    ``requantize_both``): the CUDA kernel where nvcc is there (BF16 expansions; MXFP4's FP8 forms: a maxima pass
    then the writing pass, X: E5M2 rows and E4M3 columns, dY: E5M2 both, W: E4M3 both), against the Triton passes
    it replaces (MXFP4's row kernel + column kernel, or its FP8 row kernel on x and x^T; HiF4's row pass writing
    x^T too + the row kernel on x^T); the row pass alone; and the column pass alone both ways: the column kernel on
    the row-major x against a tiled transposed copy + the row kernel. (The one-pass Triton kernel that wrote both
    layouts from one read ran at 600-780 GB/s, 1.3-2.4x slower than two passes at every width, and was removed in
    session 16.) Kernel time from CUDA graph replays; GB/s counts 2 bytes read and 4 written per value (FP8: 2
    written; one pass alone: 4)."""
    from megatron_fp4.kernels.quantize import _quantize_columns, _row_major, quantize, quantize_both_layouts
    from megatron_fp4.formats import get_format

    out = []
    for rows, K in operands:
        xs = [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * rows * K))]
        for fmt in ("hif4", "mxfp4"):
            f = get_format(fmt)
            modes = ("exact", "fp8 X", "fp8 dY", "fp8 W") if fmt == "mxfp4" else ("exact",)
            for mode in modes:
                # the FP8 forms: X (E5M2 rows, E4M3 X^T: wgrad's second operand), dY (E5M2 both), a weight W
                # (E4M3 W and W^T: the persistent weights' refresh, ``KernelBackend.requantize_both``)
                ex = {"exact": ("bf16", "bf16"), "fp8 X": ("native", "e4m3"), "fp8 dY": ("native", "native"),
                      "fp8 W": ("e4m3", "e4m3")}[mode]
                ms = bench([lambda x=x: quantize_both_layouts(x, f, expand=ex) for x in xs], graph=True)
                gb = (6 if mode == "exact" else 4) * rows * K / 1e6  # bytes counted, in MB
                tri = bench([lambda x=x: quantize_both_layouts(x, f, backend="triton", expand=ex) for x in xs],
                            graph=True)
                row = {"fmt": fmt, "mode": mode, "rows": rows, "K": K, "both_layouts_us": ms * 1e3,
                       "both_layouts_GBps": gb / ms, "both_layouts_triton_us": tri * 1e3,
                       "both_layouts_triton_GBps": gb / tri}
                if mode == "exact":
                    rows_only = bench([lambda x=x: quantize(x, f, expand="bf16", packed=False) for x in xs], graph=True)
                    row.update(row_pass_us=rows_only * 1e3, row_pass_GBps=4 * rows * K / rows_only / 1e6)
                    col = bench([lambda x=x: _quantize_columns(x.t(), f, None) for x in xs], graph=True)
                    col_t = bench([lambda x=x: quantize(_row_major(x.t()), f, expand="bf16", packed=False)
                                   for x in xs], graph=True)
                    row.update(col_kernel_us=col * 1e3, transpose_then_rows_us=col_t * 1e3,
                               col_kernel_GBps=4 * rows * K / col / 1e6,
                               transpose_then_rows_GBps=4 * rows * K / col_t / 1e6)
                print(f"  {fmt:<6s} {mode:<6s} {rows} x {K:<6d} both layouts {row['both_layouts_us']:7.1f} us "
                      f"({row['both_layouts_GBps']:5.0f} GB/s) (Triton passes {row['both_layouts_triton_us']:7.1f} us)"
                      + (f"; row pass {row['row_pass_us']:7.1f} us; column pass: column kernel "
                          f"{row['col_kernel_us']:7.1f} us "
                          f"({row['col_kernel_GBps']:5.0f} GB/s), transposed copy + rows "
                          f"{row['transpose_then_rows_us']:7.1f} us ({row['transpose_then_rows_GBps']:5.0f} GB/s)"
                          if mode == "exact" else ""), flush=True)
                out.append(row)
    return out


def sweep_quantize(rows=16384, K=3584):
    """GB/s of the row quantize kernel (pack only) for every tile config autotuning chooses from."""
    from megatron_fp4.kernels import quantize as qm

    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    out = []
    for fmt, meta in (("hif4", 4 / 64), ("mxfp4", 1 / 32)):
        for cfg in qm._ROW_CFGS:
            ms = bench([lambda: quantize(x, fmt, config=cfg)], graph=True)
            gbs = (2 + 0.5 + meta) * rows * K / ms / 1e6
            out.append({"fmt": fmt, "config": list(cfg), "us": ms * 1e3, "GB/s": gbs})
            print(f"  quantize sweep {fmt} (rows, K step, warps, prefetch)={cfg}: {ms * 1e3:.1f} us {gbs:.0f} GB/s",
                  flush=True)
    return out


def _best_config(fmt, name):
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels import resq as rm

    t = rm._resq_tuned if "resq" in name else (qm._hif4_quant_tuned if fmt == "hif4" else qm._mx_quant_tuned)
    return str(getattr(t, "best_config", None))


def _cublas_fp8(xq, wq, sa, sb):
    return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def bench_gemms(shapes, ms_list, skip_packed_large=False, on_row=None):
    rows = []
    for (K, N) in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wbytes = N * K * 2
        nw = copies_for(N * K // 2)  # rotate the packed weights through > L2
        ws = [w] + [torch.randn_like(w) * 0.02 for _ in range(min(nw, copies_for(wbytes)) - 1)]
        prep = {}
        for fmt in ("mxfp4", "hif4"):
            qs = [quantize(wi, fmt, expand="native") for wi in ws]
            prep[fmt] = qs
        w8 = [wi.to(torch.float8_e4m3fn) for wi in ws]
        sbw = torch.ones(1, N, device="cuda", dtype=torch.float32)
        for M in ms_list:
            flops = 2 * M * N * K
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            nx = len(ws)
            xs = [x] + [torch.randn_like(x) for _ in range(nx - 1)] if M <= 64 else [x]
            res = {"K": K, "N": N, "M": M}

            def rec(name, ms):
                res[name] = {"ms": ms, "TFLOP/s": flops / ms / 1e9}

            # kernel time by CUDA-graph replay (the e2e prefill columns: as launched, host overhead included)
            rec("cublas_bf16", bench([lambda i=i: xs[i % len(xs)] @ ws[i].t() for i in range(len(ws))], graph=True))
            x8 = x.to(torch.float8_e4m3fn)
            sa = torch.ones(M, 1, device="cuda", dtype=torch.float32)
            rec("cublas_fp8_rowwise", bench([lambda i=i: _cublas_fp8(x8, w8[i], sa, sbw) for i in range(len(ws))],
                                            graph=True))
            for fmt in ("mxfp4", "hif4"):
                qs = prep[fmt]
                if M <= 64:  # the decode kernel: packed weights x BF16 (W4A16) or the exact BF16 expansions of
                    # the FP4 activations (W4A4; ResQ adds the residual's on the same weight read)
                    exs = [quantize(xi, fmt, expand="bf16")[1].values for xi in xs]
                    rr = [resq_quantize(xi, fmt, expand="bf16") for xi in xs]
                    n = len(qs)
                    rec(f"{fmt}_w4a4_gemm", bench([lambda i=i: w4_matmul(exs[i % len(xs)], qs[i][0], wide=False)
                                                   for i in range(n)], graph=True))
                    rec(f"{fmt}_w4a4_e2e", bench([lambda i=i: w4_matmul(quantize(xs[i % len(xs)], fmt, expand="bf16")[1]
                                                                        .values, qs[i][0], wide=False)
                                                  for i in range(n)], graph=True))
                    rec(f"{fmt}_resq24_gemm", bench([lambda i=i: w4_matmul(rr[i % len(xs)][2].values, qs[i][0],
                                                                           rr[i % len(xs)][3].values, wide=False)
                                                     for i in range(n)], graph=True))
                    rec(f"{fmt}_resq24_e2e", bench([lambda i=i: (lambda t: w4_matmul(t[2].values, qs[i][0], t[3].values,
                                                                                      wide=False))(
                        resq_quantize(xs[i % len(xs)], fmt, expand="bf16")) for i in range(n)], graph=True))
                    rec(f"{fmt}_resq24sum_e2e", bench([lambda i=i: w4_matmul(resq_quantize(
                        xs[i % len(xs)], fmt, expand="sum")[2].values, qs[i][0], wide=False) for i in range(n)],
                        graph=True))  # ResQ as one GEMM on bf16(Q(X) + S(Q(R))): the W4A4 GEMM's size
                    rec(f"{fmt}_w4a16", bench([lambda i=i: w4_matmul(xs[i % len(xs)], qs[i][0], wide=False)
                                               for i in range(n)], graph=True))
                else:
                    q0 = qs[0][0]
                    # weights expanded once per update: BF16 (exact) or, for MXFP4 FP8, E4M3 (cuBLAS's FP8 GEMM
                    # multiplies the kernel's E5M2 activations by E4M3, promoting partial sums unless fast)
                    modes = [("exact", "bf16", 0)]
                    if fmt == "mxfp4":
                        modes += [("fp8", "e4m3", 32), ("fp8fast", "e4m3", 0)]
                    for mode, w_mode, promote in modes:
                        e0 = expand_packed(q0, w_mode)
                        ex_mode = "bf16" if w_mode == "bf16" else "native"
                        qx, ex = quantize(x, fmt, expand=ex_mode)
                        rec(f"{fmt}_w4a4_gemm_{mode}", bench([lambda: mm_expanded(
                            ex, e0, out_dtype=torch.bfloat16, promote=promote)], graph=True))
                        rec(f"{fmt}_w4a4_e2e_{mode}", bench([lambda: mm_expanded(quantize(
                            x, fmt, expand=ex_mode, packed=False)[1], e0, out_dtype=torch.bfloat16,
                            promote=promote)]))
                        q, r, eq, er = resq_quantize(x, fmt, expand=ex_mode)
                        rec(f"{fmt}_resq24_gemm_{mode}", bench([lambda: mm_expanded(
                            eq, e0, er, out_dtype=torch.bfloat16, promote=promote)], graph=True))
                        rec(f"{fmt}_resq24_e2e_{mode}", bench([lambda: (lambda t: mm_expanded(
                            t[2], e0, t[3], out_dtype=torch.bfloat16, promote=promote))(
                            resq_quantize(x, fmt, expand=ex_mode))]))
                        if mode == "exact":
                            rec(f"{fmt}_resq24sum_e2e", bench([lambda: mm_expanded(resq_quantize(
                                x, fmt, expand="sum")[2], e0, out_dtype=torch.bfloat16)]))
                            rec(f"{fmt}_w4a16", bench([lambda: mm_expanded(Expanded(x), e0, out_dtype=torch.bfloat16)],
                                                      graph=True))
                        if mode == "exact" and fmt == "hif4":  # the other implementation of the same BF16 GEMMs
                            rec("bf16_gemm_triton", bench([lambda: mm_expanded(ex, e0, out_dtype=torch.bfloat16,
                                                                               impl="triton")], graph=True))
                            rec("bf16_resq24_gemm_cublas", bench([lambda: mm_expanded(
                                eq, e0, er, out_dtype=torch.bfloat16, impl="cublas")], graph=True))
                    if not skip_packed_large and M == 4096:
                        qx = quantize(x, fmt)
                        rec(f"{fmt}_w4a4_packed_prologue", bench([lambda: packed_matmul(qx, q0,
                                                                                        out_dtype=torch.bfloat16)]))
            rows.append(res)
            if on_row is not None:
                on_row(rows)
            print(f"  done K={K} N={N} M={M}", flush=True)
    return rows


def sweep_decode():
    """Time the decode kernel over tile configs (largest 7B shape, M = 16 and 64, both formats) and make the
    fastest per format and M the default (megatron_fp4.kernels.decode_gemm.DECODE_CONFIGS) for the table."""
    from megatron_fp4.kernels import decode_gemm as gm

    out = []
    K, N = 3584, 18944
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
    cands = [{"BN": bn, "num_warps": w, "num_stages": st, "SPLIT": sp, "PREFETCH": pf, "XPERM": xp}
             for bn, w, st, sp, pf, xp in ((64, 4, 1, 8, False, False), (64, 4, 1, 8, True, False),
                                           (64, 4, 1, 4, True, False), (128, 4, 1, 4, True, False),
                                           (64, 4, 4, 4, False, True), (64, 4, 1, 4, True, True),
                                           (64, 4, 1, 8, True, True), (128, 8, 1, 4, True, True),
                                           (64, 4, 1, 16, True, False), (64, 4, 2, 4, True, True))]
    qs = {fmt: [quantize(w, fmt) for w in ws] for fmt in ("hif4", "mxfp4")}
    for M in (16, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        tot = {fmt: [0.0] * len(cands) for fmt in ("hif4", "mxfp4")}
        for ci, cfg in enumerate(cands):
            for fmt in ("hif4", "mxfp4"):
                try:
                    ms = bench([lambda i=i: w4_matmul(x, qs[fmt][i], config=cfg, wide=False) for i in range(len(ws))],
                               graph=True)
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    print("config failed", cfg, type(e).__name__, str(e)[:200])
                out.append({"fmt": fmt, "M": M, **cfg, "us": ms * 1e3})
                tot[fmt][ci] = ms if ms == ms else float("inf")
                print(f"  decode sweep {fmt} M={M} {cfg}: {ms * 1e3:.1f} us", flush=True)
        for fmt, t in tot.items():
            best = min(range(len(cands)), key=lambda c: t[c])
            gm.DECODE_CONFIGS[fmt, M] = cands[best]
            print(f"  decode default {fmt} M<={M}: {cands[best]}", flush=True)
    return out


#: Tiles of the CUDA decode kernels timed by --decode-sweep (megatron_fp4.kernels.cuda_decode: KERNEL and its tile
#: keys).
#: NATURAL_TILE as the sweep spells it (its own copy: an environment override of the default does not move the sweep)
_NAT = dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=6, MINB=2, LEAN=1, WRING=1, NATURAL=1, WTMA=1)
SWEEP_TILES = (
    *(dict(KERNEL="mma", SPW=spw, DEPTH=depth, WARPS=warps, PER_SM=per_sm) for spw, depth, warps, per_sm in
      ((2, 2, 8, 4), (1, 4, 4, 4))),
    *(dict(KERNEL="wgmma", WGS=wgs, DEPTH=depth, XST=4, MINB=minb) for wgs, depth, minb in
      ((2, 2, 2), (2, 4, 2), (2, 2, 3), (1, 4, 3), (1, 2, 4))),
    *(dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=4, MINB=minb, SPLIT=split) for minb in (2, 3) for split in (1, 3, 9)),
    # the producer-warp form: the tiles ptxas compiles without spills or serialized wgmmas at M = 16 (at M = 64 only
    # WGS 2, DEPTH 4, MINB 1 does)
    *(dict(KERNEL="wgmma", PRODUCER=1, WGS=wgs, DEPTH=depth, XST=4, MINB=minb) for wgs, depth, minb in
      ((2, 4, 1), (1, 4, 3), (2, 2, 2), (2, 2, 3), (1, 2, 4))),
    # LEAN (session 24: 13-17% fewer instructions per chunk by the SASS count) on the M = 16 default, the M = 64
    # default and the producer tile that compiles clean at both M
    dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3, LEAN=1),
    dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=4, XST=4, MINB=1, LEAN=1),
    dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=4, MINB=2, LEAN=1),
    # XPAIR (session 25: the activation staging reads whole sectors) and four warpgroups sharing each staged
    # activation chunk (half the activation traffic per weight byte of WGS 2: at M = 64 Nsight Compute found 206 MB of
    # L2 traffic for 36 MB of weights)
    dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=3, LEAN=1, XPAIR=1),
    dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=4, MINB=2, LEAN=1, XPAIR=1),
    dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=4, MINB=2, LEAN=1, XPAIR=1),
    dict(KERNEL="wgmma", WGS=4, DEPTH=2, XST=4, MINB=1),
    dict(KERNEL="wgmma", WGS=4, DEPTH=2, XST=4, MINB=1, XPAIR=1),
    dict(KERNEL="wgmma", WGS=4, DEPTH=2, XST=4, MINB=1, XPAIR=1, LEAN=1),
    *(dict(KERNEL="wgmma", PRODUCER=1, WGS=4, DEPTH=2, XST=4, MINB=1, XPAIR=1, LEAN=1, **split)
      for split in ({}, dict(SPLIT=3), dict(SPLIT=14))),
    # WRING (session 25: the weights through the shared-memory ring by bulk copies that each consumer warp issues
    # for its slab; the consumers load nothing from global memory)
    dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=6, MINB=3, LEAN=1, WRING=1),
    dict(KERNEL="wgmma", PRODUCER=1, WGS=4, DEPTH=2, XST=6, MINB=1, XPAIR=1, LEAN=1, WRING=1),
    # NATURAL (session 25: weights in natural K order, the activations by TMA), each tile against NATURAL_TILE
    # (WTMA=1 since session 28; tiles here name WTMA=0 to run the consumers' own bulk copies)
    *({**_NAT, **keys} for keys in (dict(WTMA=0), dict(WGS=4, XST=6, MINB=1), dict(XST=4, MINB=3))),
    # NATURAL_TILE with a forced split-K (session 26: on 3584x18944 at 64 tokens SPLIT 4 beat the balanced split's 7
    # by 8%; session 28: SPLIT 3 by 10-11%, and the balanced split now counts the atomic epilogue per token)
    *({**_NAT, "SPLIT": split} for split in (1, 2, 3, 4, 8)),
    # NATURAL_TILE with the deterministic split-K of a thread-block cluster (session 27: 7-62% slower than the atomic
    # split at the balanced split, 7 on 3584x18944; is it the cluster's size? clusters of 2 and 4 pack a GPC evenly)
    *({**_NAT, "CLUSTER": 1, **split} for split in ({}, dict(SPLIT=2), dict(SPLIT=4))),
)
DECODE_SHAPES = [(3584, 18944), (18944, 3584), (1536, 8960), (8960, 1536), (1536, 2048), (1536, 1536)]  # (K, N)


#: Tiles of the decode-sized activation quantizers swept by ``--decode-quantize``: (rows per program, K per step,
#: warps, prefetch, programs per row block; 0: :func:`megatron_fp4.kernels._common.k_split`'s, 64: one per K tile).
DECODE_QUANT_TILES = [(1, 1024, 4, 0, 0), (1, 1024, 4, 0, 64), (1, 512, 4, 0, 0), (1, 512, 4, 0, 64),
                      (1, 512, 2, 0, 64), (1, 256, 2, 0, 64), (1, 256, 1, 0, 64), (1, 128, 1, 0, 64),
                      (2, 512, 4, 0, 64), (1, 1024, 8, 0, 64), (1, 512, 4, 1, 0)]


def bench_decode_quantize(ks=(3584, 18944), ms_list=(16, 64), tiles=DECODE_QUANT_TILES):
    """The decode step's activation quantizers alone, per tile (CUDA-graph replays, inputs rotated): W4A4's exact
    BF16 expansion (``quantize(expand="bf16", packed=False)``) and ResQ 2:4's bf16 sum with and without its packed
    outputs (``resq_quantize(expand="sum", packed=...)``). Every tile's output is checked bit for bit against the
    default tile's (and that one, once per case, against the PyTorch reference). Rows: {"kernel", "fmt", "K", "M",
    "tile" (None: the default), "impl" (what ran: "cuda" for the ResQ sum's default where
    ``cuda_quantize.resq_sum`` serves, else "triton"), "us", "exact"}."""
    from megatron_fp4.formats import get_format
    from megatron_fp4.kernels import cuda_quantize
    from megatron_fp4.kernels.quantize import quantize_reference
    from megatron_fp4.kernels.resq import resq_quantize_reference

    cuda_sum = cuda_quantize.available(cuda_quantize.RESQ_SOURCE)

    rows = []
    for K in ks:
        for M in ms_list:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(8)]
            for fmt in ("hif4", "mxfp4"):
                cases = {
                    "w4a4 bf16": lambda x, c: quantize(x, fmt, expand="bf16", packed=False, config=c)[1].values,
                    "resq sum": lambda x, c: resq_quantize(x, fmt, expand="sum", packed=False, config=c)[2].values,
                    "resq sum+packed": lambda x, c: resq_quantize(x, fmt, expand="sum", config=c)[2].values,
                }
                refs = {"w4a4 bf16": quantize_reference(xs[0], get_format(fmt), -1, "bf16")[1].values,
                        "resq sum": resq_quantize_reference(xs[0], get_format(fmt), "sum")[2].values}
                for name, fn in cases.items():
                    default = fn(xs[0], None)
                    ref = refs.get(name, refs["resq sum"])
                    ok_ref = bool(torch.equal(default.view(torch.int16), ref.view(torch.int16)))
                    for tile in [None] + (list(tiles) if name != "resq sum+packed" else []):
                        got = fn(xs[0], tile)
                        exact = bool(torch.equal(got.view(torch.int16), default.view(torch.int16))) and ok_ref
                        us = 1e3 * bench([lambda i=i: fn(xs[i], tile) for i in range(len(xs))], graph=True)
                        impl = "cuda" if cuda_sum and tile is None and name == "resq sum" else "triton"
                        rows.append({"kernel": name, "fmt": fmt, "K": K, "M": M, "tile": tile, "impl": impl,
                                     "us": us, "exact": exact})
                        print(f"  {name:16s} {fmt:5s} K={K:5d} M={M:2d} {impl:6s} {str(tile):22s} {us:7.2f} us"
                              f"{'' if exact else '  NOT EXACT'}", flush=True)
    return rows


def bench_decode(shapes, ms_list=(16, 64), sweep=False, sweep_keys=None, sweep_tiles=None):
    """Issue 20's decode table: the CUDA decode kernel (megatron_fp4.kernels.cuda_decode) against cuBLAS BF16 (and the
    Triton decode kernel), W4A16, W4A4 on the exact BF16 expansion (GEMM alone and quantize + GEMM) and ResQ 2:4 in its
    bf16-sum form (quantize + GEMM), both formats; every column a CUDA-graph replay with weights rotated through
    more than the L2. Each CUDA result is checked against the fp64 product of the same operands. ``sweep_tiles``: the
    tiles to sweep instead of :data:`SWEEP_TILES` (then on every shape, as with ``sweep_keys``)."""
    from megatron_fp4.kernels import cuda_decode as cd
    from megatron_fp4.kernels.dispatch import prepare_weight

    tiles = (list(sweep_tiles) if sweep_tiles else
             [t for t in SWEEP_TILES if not sweep_keys or any(t.get(k) for k in sweep_keys)]) if sweep else []
    t0 = time.perf_counter()  # every configuration compiled in parallel first (on first use each compiles alone)
    built = cd.prebuild(tiles, ntoks=tuple(sorted({cd._ntok(m) for m in ms_list})))
    print(f"  {built} CUDA decode configurations built in {time.perf_counter() - t0:.0f} s", flush=True)
    rows, sweep_rows = [], []
    for (K, N) in shapes:
        nw = copies_for(N * K // 2)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(max(2, nw))]
        wb = ws[: min(len(ws), copies_for(N * K * 2))]
        preps = {fmt: [prepare_weight(w, fmt) for w in ws] for fmt in ("hif4", "mxfp4")}
        for M in ms_list:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(len(ws))]
            res = {"K": K, "N": N, "M": M}

            def rec(name, ms):
                res[name] = {"ms": ms, "TFLOP/s": 2 * M * N * K / ms / 1e9}

            rec("cublas_bf16", bench([lambda i=i: xs[i] @ wb[i % len(wb)].t() for i in range(len(ws))], graph=True))
            for fmt in ("hif4", "mxfp4"):
                ps = preps[fmt]
                n = len(ps)
                # both layouts of each weight: the default one (ps[i].decode) serves the "_cuda" columns; the
                # per-kernel columns and the sweep's tiles read the permuted layout, its NATURAL tiles the natural one
                layouts = {nat: [p.decode if p.decode.natural == nat else cd.to_decode_layout(p.packed, p.wide,
                                                                                               natural=nat)
                                 for p in ps] for nat in (False, True)}
                exs = [quantize(xi, fmt, expand="bf16")[1].values for xi in xs]
                sums = [resq_quantize(xi, fmt, expand="sum", packed=False)[2].values for xi in xs]
                # exactness: the CUDA kernel against the fp64 product of the same operands
                ref = exs[0].double() @ ps[0].packed.dequantize().double().t()
                for kernel in ("mma", "wgmma"):
                    got = cd.w4_decode(exs[0], layouts[False][0], config={"KERNEL": kernel}).double()
                    res[f"{fmt}_{kernel}_relerr"] = float((got - ref).norm() / ref.norm())
                rec(f"{fmt}_w4a16_cuda", bench([lambda i=i: cd.w4_decode(xs[i], ps[i].decode) for i in range(n)],
                                               graph=True))
                # the split sums as stored ([splits, M, N] fp32: no zero-fill; the engine's fused kernels add them)
                rec(f"{fmt}_w4a16_stored_cuda", bench([lambda i=i: cd.w4_decode(xs[i], ps[i].decode, out_dtype=None)
                                                       for i in range(n)], graph=True))
                rec(f"{fmt}_w4a4_gemm_cuda", bench([lambda i=i: cd.w4_decode(exs[i], ps[i].decode)
                                                    for i in range(n)], graph=True))
                rec(f"{fmt}_w4a4_e2e_cuda", bench([lambda i=i: cd.w4_decode(
                    quantize(xs[i], fmt, expand="bf16")[1].values, ps[i].decode) for i in range(n)], graph=True))
                rec(f"{fmt}_resq24sum_e2e_cuda", bench([lambda i=i: cd.w4_decode(
                    resq_quantize(xs[i], fmt, expand="sum", packed=False)[2].values, ps[i].decode)
                    for i in range(n)], graph=True))
                rec(f"{fmt}_resq24sum_gemm_cuda", bench([lambda i=i: cd.w4_decode(sums[i], ps[i].decode)
                                                         for i in range(n)], graph=True))
                for kernel in ("mma", "wgmma"):  # the GEMM alone on each kernel (the columns above: the default)
                    rec(f"{fmt}_w4a4_gemm_{kernel}", bench([lambda i=i: cd.w4_decode(
                        exs[i], layouts[False][i], config={"KERNEL": kernel}) for i in range(n)], graph=True))
                rec(f"{fmt}_w4a16_triton", bench([lambda i=i: w4_matmul(xs[i], ps[i].packed, wide=ps[i].wide)
                                                  for i in range(n)], graph=True))
                if sweep and (sweep_keys or sweep_tiles or (K, N) in ((3584, 18944), (18944, 3584))):
                    for cfg in tiles:
                        dws = layouts[bool(cfg.get("NATURAL"))]
                        try:
                            ms = bench([lambda i=i: cd.w4_decode(exs[i], dws[i], config=cfg)
                                        for i in range(n)], graph=True)
                        except Exception as e:  # noqa: BLE001
                            ms = float("nan")
                            print("  config failed", cfg, type(e).__name__, str(e)[:300], flush=True)
                        # (the tile as the kernel ran it: a natural one over its token bucket's default)
                        tile = cd.natural_tile(cfg, cd._ntok(M)) if cfg.get("NATURAL") else cfg
                        sweep_rows.append({"K": K, "N": N, "M": M, "fmt": fmt, **tile, "us": ms * 1e3})
                        print(f"  cuda decode sweep {fmt} {K}x{N} M={M} {tile}: {ms * 1e3:.1f} us", flush=True)
            rows.append(res)
            base = res["cublas_bf16"]["ms"]
            print(f"  K={K} N={N} M={M}: " + " ".join(
                f"{k}={v['ms'] * 1e3:.1f}({base / v['ms']:.2f}x)" for k, v in res.items() if isinstance(v, dict)),
                flush=True)
    return rows, sweep_rows


def decode_markdown(d):
    """Markdown of a decode results JSON (bench_decode), with issue 20's targets."""
    cols = [("cublas_bf16", "cuBLAS bf16"), ("hif4_w4a16_cuda", "HiF4 W4A16"),
            ("hif4_w4a16_stored_cuda", "HiF4 W4A16 split sums as stored"), ("hif4_w4a4_gemm_cuda", "HiF4 W4A4"),
            ("hif4_w4a4_e2e_cuda", "HiF4 quant+W4A4"), ("hif4_resq24sum_e2e_cuda", "HiF4 ResQ bf16-sum quant+GEMM"),
            ("mxfp4_w4a16_cuda", "MXFP4 W4A16"), ("mxfp4_w4a16_stored_cuda", "MXFP4 W4A16 split sums as stored"),
            ("mxfp4_w4a4_gemm_cuda", "MXFP4 W4A4"),
            ("mxfp4_w4a4_e2e_cuda", "MXFP4 quant+W4A4"),
            ("mxfp4_resq24sum_e2e_cuda", "MXFP4 ResQ bf16-sum quant+GEMM"),
            ("hif4_w4a16_triton", "HiF4 W4A16 (Triton)"), ("mxfp4_w4a16_triton", "MXFP4 W4A16 (Triton)"),
            ("hif4_w4a4_gemm_mma", "HiF4 W4A4 mma.sync"), ("hif4_w4a4_gemm_wgmma", "HiF4 W4A4 wgmma"),
            ("mxfp4_w4a4_gemm_mma", "MXFP4 W4A4 mma.sync"), ("mxfp4_w4a4_gemm_wgmma", "MXFP4 W4A4 wgmma")]
    lines = ["| K x N | M | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in d["decode"]:
        base = r["cublas_bf16"]["ms"]
        cells = [f"{r[k]['ms'] * 1e3:.1f} ({base / r[k]['ms']:.2f}x)" if k in r else "" for k, _ in cols]
        lines.append(f"| {r['K']}x{r['N']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(path):
    """Render a results JSON as the markdown tables of docs/PERFORMANCE.md (no GPU needed)."""
    d = json.load(open(path))
    lines = [f"GPU: {d['gpu']}; {d['date']}; torch {d['torch']}, triton {d['triton']}; copy {d['copy_GBps']:.0f} GB/s; "
             f"cuBLAS bf16 8192^3 {d['cublas_bf16_8192_TFLOPs']:.0f} TFLOP/s", "",
             "| quantize kernel (16384 x 3584 bf16) | us | GB/s | % of copy |", "|---|---|---|---|"]
    for r in d["quantize"]:
        lines.append(f"| {r['kernel']} | {r['ms'] * 1e3:.1f} | {r['GB/s']:.0f} | {100 * r['GB/s'] / d['copy_GBps']:.0f}% |")
    big = [("cublas_bf16", "cuBLAS bf16"), ("cublas_fp8_rowwise", "cuBLAS fp8 rowwise"),
           ("mxfp4_w4a4_gemm_exact", "MXFP4 exact (bf16)"), ("mxfp4_w4a4_gemm_fp8", "MXFP4 fp8"),
           ("mxfp4_w4a4_gemm_fp8fast", "MXFP4 fp8 fast-acc"), ("hif4_w4a4_gemm_exact", "HiF4 exact (bf16)"),
           ("bf16_gemm_triton", "HiF4 exact, Triton GEMM"),
           ("mxfp4_resq24_gemm_exact", "MXFP4 ResQ 2:4 exact"), ("mxfp4_resq24_gemm_fp8", "MXFP4 ResQ fp8"),
           ("hif4_resq24_gemm_exact", "HiF4 ResQ 2:4 exact"), ("bf16_resq24_gemm_cublas", "HiF4 ResQ, 2 cuBLAS"),
           ("hif4_w4a16", "W4A16 (HiF4)"),
           ("hif4_w4a4_e2e_exact", "HiF4 quant+GEMM"), ("hif4_resq24_e2e_exact", "HiF4 ResQ quant+GEMM"),
           ("hif4_resq24sum_e2e", "HiF4 ResQ bf16-sum quant+GEMM"), ("mxfp4_w4a4_e2e_exact", "MXFP4 quant+GEMM"),
           ("mxfp4_resq24sum_e2e", "MXFP4 ResQ bf16-sum quant+GEMM"), ("mxfp4_w4a4_e2e_fp8", "MXFP4 quant+fp8"),
           ("hif4_w4a4_packed_prologue", "HiF4 packed-prologue"),
           ("mxfp4_w4a4_packed_prologue", "MXFP4 packed-prologue")]
    small = [("cublas_bf16", "cuBLAS bf16"), ("cublas_fp8_rowwise", "cuBLAS fp8 rowwise"),
             ("mxfp4_w4a4_gemm", "MXFP4 W4A4"), ("mxfp4_resq24_gemm", "MXFP4 ResQ 2:4"),
             ("mxfp4_w4a16", "MXFP4 W4A16"), ("hif4_w4a4_gemm", "HiF4 W4A4"), ("hif4_resq24_gemm", "HiF4 ResQ 2:4"),
             ("hif4_w4a16", "HiF4 W4A16"), ("mxfp4_w4a4_e2e", "MXFP4 quant+W4A4"),
             ("hif4_w4a4_e2e", "HiF4 quant+W4A4"), ("hif4_resq24_e2e", "HiF4 ResQ quant+GEMM"),
             ("hif4_resq24sum_e2e", "HiF4 ResQ bf16-sum quant+GEMM"), ("mxfp4_resq24_e2e", "MXFP4 ResQ quant+GEMM"),
             ("mxfp4_resq24sum_e2e", "MXFP4 ResQ bf16-sum quant+GEMM")]
    for title, cols, sel in (("Prefill/training sizes (M >= 4096)", big, lambda m: m > 64),
                             ("Decode sizes (M <= 64, CUDA-graph replay)", small, lambda m: m <= 64)):
        lines += ["", f"{title}: time in us (speedup over cuBLAS bf16)", "",
                  "| K x N | M | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
        for r in d["gemm"]:
            if not sel(r["M"]):
                continue
            base = r["cublas_bf16"]["ms"]
            cells = [f"{r[k]['ms'] * 1e3:.1f} ({base / r[k]['ms']:.2f}x)" if k in r else "" for k, _ in cols]
            lines.append(f"| {r['K']}x{r['N']} | {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _decode_ms(p: argparse.ArgumentParser, args) -> list:
    """--decode-ms as token counts (the parser's error on anything but comma-separated counts in 1..64)."""
    try:
        ms = [int(m) for m in args.decode_ms.split(",")]
    except ValueError:
        ms = []
    if not ms or not all(1 <= m <= 64 for m in ms):
        p.error(f"--decode-ms takes comma-separated token counts in 1..64, got {args.decode_ms!r}")
    return ms


def _sweep_tiles(p, text):
    """``--sweep-tiles``' JSON list as natural tiles (each object's keys with NATURAL=1: at each token count over that
    bucket's default tile, :func:`~megatron_fp4.kernels.cuda_decode.natural_tile`, as the engine runs it; at 64
    tokens :data:`~megatron_fp4.kernels.cuda_decode.NATURAL_TILE_AT_64`'s keys too), or None; a parser error naming
    the option and the allowed keys on anything else."""
    if not text:
        return None
    from megatron_fp4.kernels import cuda_decode as cd

    try:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            raise ValueError("not a non-empty JSON list")
        return [dict(cd.natural_tile_override(json.dumps(t)), NATURAL=1) for t in items]
    except ValueError as e:
        p.error(f"--sweep-tiles takes a JSON list of objects with integer keys among "
                f"{', '.join(cd.NATURAL_TILE_KEYS)}, got {text!r} ({e})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", metavar="JSON", help="print the markdown tables of a results JSON and exit")
    p.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    p.add_argument("--quick", action="store_true", help="one shape, two M")
    p.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's tile configs")
    p.add_argument("--sweep-quantize", action="store_true", help="also time every quantize tile config")
    p.add_argument("--quantize-only", action="store_true", help="only the quantize kernels (no GEMMs)")
    p.add_argument("--no-quantize", action="store_true", help="skip the quantize kernels (GEMMs only)")
    p.add_argument("--shapes", help="comma-separated KxN subset of the default shapes, e.g. 2048x2048,3584x18944")
    p.add_argument("--decode", action="store_true",
                   help="only issue 20's decode table (CUDA decode kernel vs cuBLAS BF16 at M = 16 and 64) "
                        "-> --out (default benchmarks/results/decode_h200.json)")
    p.add_argument("--decode-sweep", action="store_true", help="with --decode: also sweep the CUDA kernel's tiles")
    p.add_argument("--sweep-keys", help="with --decode-sweep: only the tiles that set one of these keys, e.g. "
                                        "NATURAL,WRING (then on every shape, not only the 7B MLP ones)")
    p.add_argument("--sweep-tiles", metavar="JSON",
                   help="with --decode-sweep: sweep these natural-layout tiles instead, on every shape: a JSON list of "
                        "objects over NATURAL_TILE's keys (those MEGATRON_FP4_DECODE_NATURAL_TILE takes), each over the "
                        "token count's default tile (at 64 tokens one warpgroup, three blocks, seven stages), e.g. "
                        "'[{\"SPLIT\": 2}, {\"WGS\": 2, \"XST\": 6, \"MINB\": 2}]'")
    p.add_argument("--decode-ms", default="16,64",
                   help="with --decode or --decode-quantize: token counts (comma-separated, 1..64)")
    p.add_argument("--decode-quantize", action="store_true",
                   help="only the decode step's activation quantizers (W4A4 expansion, ResQ 2:4 bf16 sum) per tile, "
                        "K 3584 and 18944 at --decode-ms tokens -> --out (default "
                        "benchmarks/results/decode_quantize_h200.json)")
    p.add_argument("--training-operands", action="store_true",
                   help="only the training operands' quantization into both GEMM layouts, and the column pass two "
                        "ways (Qwen2.5-1.5B's X and dY at 8192 tokens) -> --out (default "
                        "benchmarks/results/training_quant_h200.json)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="write --out as these results files' GEMM rows in one file (runs split over GPUs), exit")
    args = p.parse_args()
    if args.markdown:
        d = json.load(open(args.markdown))
        print(decode_markdown(d) if "decode" in d else markdown(args.markdown))
        return
    if args.decode:
        ms = _decode_ms(p, args)
        sweep_tiles = _sweep_tiles(p, args.sweep_tiles)
        out = args.out if args.out != p.get_default("out") else "benchmarks/results/decode_h200.json"
        t0 = time.time()
        dev = torch.cuda.get_device_name()
        copy_gbs, bf16_peak = ceilings()
        shapes = DECODE_SHAPES
        if args.shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows, sweep_rows = bench_decode(shapes, ms_list=tuple(ms), sweep=args.decode_sweep,
                                        sweep_keys=args.sweep_keys.split(",") if args.sweep_keys else None,
                                        sweep_tiles=sweep_tiles)
        from megatron_fp4.kernels import cuda_decode as cd
        d = {"gpu": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
             "triton": triton.__version__, "copy_GBps": copy_gbs, "cublas_bf16_8192_TFLOPs": bf16_peak,
             "wgmma_max_weight": cd.WGMMA_MAX_WEIGHT, "large_m16_tiles": cd.LARGE_M16_TILES,
             "decode_layout": "natural" if cd.natural_layout() else "permuted", "natural_tile": cd.NATURAL_TILE,
             "tiles": {f"{f} M<={m}": v for (f, m), v in cd.DECODE_TILES.items()},
             "wgmma_tiles": {f"{f} M<={m}": v for (f, m), v in cd.WGMMA_TILES.items()}, "decode": rows,
             "sweep": sweep_rows, "wall_s": time.time() - t0,
             "env": {k: v for k, v in os.environ.items() if k.startswith("MEGATRON_FP4_")}}  # (A/B switches)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as fh:
            json.dump(d, fh, indent=1)
        print(decode_markdown(d))
        print(f"wrote {out} in {time.time() - t0:.0f} s")
        return
    if args.decode_quantize or args.training_operands:  # one table of rows each
        name = "decode_quantize" if args.decode_quantize else "training_quant"
        out = args.out if args.out != p.get_default("out") else f"benchmarks/results/{name}_h200.json"
        ms = _decode_ms(p, args) if args.decode_quantize else None  # (--training-operands takes no token counts)
        t0 = time.time()
        d = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "torch": torch.__version__, "triton": triton.__version__}
        if args.decode_quantize:
            d.update(tiles=DECODE_QUANT_TILES, rows=bench_decode_quantize(ms_list=tuple(ms)))
        else:
            d.update(copy_GBps=ceilings()[0], rows=bench_training_operands())
        d["wall_s"] = time.time() - t0
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as fh:
            json.dump(d, fh, indent=1)
        print(f"wrote {out} in {d['wall_s']:.0f} s")
        return
    if args.merge:
        parts = [json.load(open(f)) for f in args.merge]
        merged = dict(parts[0], gemm=[r for d in parts for r in d["gemm"]], merged_from=args.merge)
        merged["quantize"] = next((d["quantize"] for d in parts if d["quantize"]), [])
        with open(args.out, "w") as fh:
            json.dump(merged, fh, indent=1)
        print(f"wrote {args.out} ({len(merged['gemm'])} GEMM rows from {len(parts)} files)")
        return
    torch.manual_seed(0)
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    copy_gbs, bf16_peak = ceilings()
    print(f"GPU {dev}; copy {copy_gbs:.0f} GB/s; cuBLAS bf16 8192^3 {bf16_peak:.0f} TFLOP/s", flush=True)
    qsweep = sweep_quantize() if args.sweep_quantize else []
    qrows = [] if args.no_quantize else bench_quantize()
    sweep = sweep_decode() if args.sweep else []
    shapes = [] if args.quantize_only else SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        wanted = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        unknown = [w for w in wanted if w not in SHAPES]
        if unknown:
            p.error(f"--shapes: {unknown} not among the benchmark shapes {['%dx%d' % s for s in SHAPES]}")
        shapes = [s for s in shapes if s in wanted]
    ms_list = [16, 4096] if args.quick else MS
    result = {"gpu": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": copy_gbs, "cublas_bf16_8192_TFLOPs": bf16_peak,
              "quantize": qrows, "quantize_sweep": qsweep, "decode_sweep": sweep,
              "decode_defaults": {f"{f} M<={m}": v for (f, m), v in gm.DECODE_CONFIGS.items()}, "gemm": []}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def dump(rows):
        result["gemm"] = rows
        result["wall_s"] = time.time() - t0
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    grows = bench_gemms(shapes, ms_list, on_row=dump)
    dump(grows)
    print("\nQuantize kernels (bf16 input, 16384 x 3584):")
    for r in qrows:
        print(f"  {r['kernel']:<40s} {r['ms'] * 1e3:9.1f} us {r['GB/s']:8.0f} GB/s ({100 * r['GB/s'] / copy_gbs:.0f}% of copy)")
    keys = sorted({k for r in grows for k in r if k not in ("K", "N", "M")},
                  key=lambda k: (not k.startswith("cublas"), k))
    print("\nGEMMs: time us (speedup vs cuBLAS bf16)")
    for r in grows:
        base = r["cublas_bf16"]["ms"]
        cells = [f"{k}={r[k]['ms'] * 1e3:.1f}({base / r[k]['ms']:.2f}x)" for k in keys if k in r]
        print(f"K={r['K']:>5} N={r['N']:>5} M={r['M']:>5}: " + " ".join(cells))
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
