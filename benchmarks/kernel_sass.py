"""Count the SASS instructions of a Triton kernel's main loop for Hopper (sm_90), on a machine without a GPU.

Device time is scarce; instruction counts are not. Triton compiles for any target without a GPU, and its wheel
ships ptxas and nvdisasm, so an idea for an ALU-bound kernel (the quantize kernels, the decode unpack) can be
checked here before it costs a device call:

    python benchmarks/kernel_sass.py decode --fmt mxfp4 --BN 64 --BM 16 --num-warps 4
    python benchmarks/kernel_sass.py decode --fmt hif4 --res --histogram
    python benchmarks/kernel_sass.py quantize --fmt hif4 --BR 4 --BK 512 --expand 1 --prefetch --num-stages 3
    python benchmarks/kernel_sass.py columns --fmt hif4 --BK 64 --num-warps 4
    python benchmarks/kernel_sass.py resq --fmt hif4 --BR 1 --BK 1024 --num-warps 4 [--packed]
    python benchmarks/kernel_sass.py cuda --fmt hif4 --BM 16 --tile '{"KERNEL": "wgmma", "PRODUCER": 1, "LEAN": 1}'
    python benchmarks/kernel_sass.py cuda --fmt hif4 --BM 64 --tile '{"NATURAL": 1, "SUBN": 0}'
    python benchmarks/kernel_sass.py resq-cuda --fmt hif4

(``cuda``: the CUDA decode GEMMs of megatron_fp4/kernels/csrc, built by nvcc where it exists; ``resq-cuda``: its
ResQ bf16-sum kernel, resq_sum.cu, whose per-thread math the fused SwiGLU and norm kernels share.) Prints the
instructions per loop iteration, per value and the busiest opcodes, the layout conversions in Triton's
GPU IR (each moves values between threads, through shared memory) and ptxas's registers and spills. The loop is
the longest backward branch in the disassembly; a kernel without a loop (columns: the training quantizer's
64-row tile of a transposed operand) counts whole, per value. Pointers and sizes get Triton's
``divisibility=16`` specialization (what a real launch with aligned shapes compiles to; without it loads do not
vectorize and counts mislead). A count is a proxy: run 8's decode kernel was latency-bound, so fewer instructions
stopped helping (docs/PERFORMANCE.md); and it comes from the Triton installed here, which may pick other layouts
than the GPU machine's (3.9 here, 3.6 there: the HiF4 pack-only quantize tile counts 106 per value here, 2.8x its
expanding twin, yet ran faster on the H200), so confirm on the GPU before trusting a difference.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: list, num_warps: int, num_stages: int):
    """The compiled kernel for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def loop_opcodes(cubin: bytes) -> collections.Counter:
    """Opcode counts of the longest loop (label .. backward branch) in a cubin's disassembly."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([nvdisasm, "-c", fh.name], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines) if re.match(r"^\.L_x_\d+:$", ln.strip())}
    exits = [i for i, ln in enumerate(lines) if re.search(r"\bEXIT\b", ln)]
    start, end = 0, -1
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i - 1 and i - labels[m.group(1)] > end - start:  # not the exit trap
            # nor a spin-wait's retry that ptxas moved past the kernel's end (a span with an EXIT in it)
            if not any(labels[m.group(1)] < e < i for e in exits):
                start, end = labels[m.group(1)], i
    if end < 0:  # no loop: the whole kernel
        start, end = 0, len(lines) - 1
    ops = collections.Counter()
    for ln in lines[start:end + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m and not ln.strip().startswith("/* 0x"):
            ops[m.group(1)] += 1
    return ops


def registers(ptx: str) -> str:
    """ptxas's register and spill report of the kernel ("" where this ptxas cannot read the PTX)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as fh:
        fh.write(ptx)
        fh.flush()
        v = subprocess.run([ptxas, "-arch=sm_90a", "-v", fh.name, "-o", os.devnull], capture_output=True,
                           text=True).stderr
    regs, spill = re.search(r"Used (\d+) registers", v), re.search(r"(\d+) bytes spill stores", v)
    return f"; {regs.group(1)} registers, {spill.group(1) if spill else '?'} bytes spilled" if regs else ""


def decode_case(fmt: str, BN: int, BM: int, res: bool, wide: bool, prefetch: bool, xperm: bool):
    """(kernel, signature, constexprs, divisible args, weight values per loop iteration) of the decode GEMM."""
    from megatron_fp4.kernels import decode_gemm

    fn = decode_gemm._w4_decode_kernel
    signature = {"x_ptr": "*bf16", "r_ptr": "*bf16", "b_ptr": "*i16", "bs_ptr": "*i32" if fmt == "hif4" else "*u8",
                 "c_ptr": "*fp32", "M": "i32", "N": "i32", "KH2": "i32", "stride_xm": "i32", "stride_rm": "i32",
                 "stride_bn": "i32", "stride_bsn": "i32", "stride_cm": "i32"}
    constexprs = dict(FMT=0 if fmt == "hif4" else 1, HAS_RES=res, SPLIT_K=2, WIDE=wide, ASM=True, F32=False,
                      XPERM=xperm, PREFETCH=prefetch, BN=BN, BM=BM)
    divisible = [k for k in signature if k not in ("M",)]
    return fn, signature, constexprs, divisible, BN * 64


def quantize_case(fmt: str, BR: int, BK: int, expand: int, prefetch: bool, unpacked: bool = False,
                  transpose: bool = False):
    """(kernel, signature, constexprs, divisible args, values per loop iteration) of the row quantize kernel
    (``unpacked``: the expansion only, as the training GEMMs read it; a row-major x, unit stride specialized;
    ``transpose``: HiF4's row pass also writing x's transposed copy, ``quantize_both_layouts``)."""
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels._common import TILE_RECIP

    sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*i32" if fmt == "hif4" else "*u8",
           "ex_ptr": "*bf16" if expand == 2 or (fmt == "hif4" and expand) else "*u8"}
    if fmt == "hif4":
        fn = qm._hif4_quant_kernel
        sig.update({"xt_ptr": "*bf16", "stride_tr": "i32"})
        const = dict(EXPAND=bool(expand), BR=BR, BK=BK, **TILE_RECIP, PREFETCH=int(prefetch), WRITE_T=int(transpose))
    else:
        fn = qm._mx_quant_kernel
        sig.update({"rexp_ptr": "*i32", "rok_ptr": "*i8"})
        const = dict(RCEIL=False, EXPAND=expand, BR=BR, BK=BK, PREFETCH=int(prefetch))
    const["PACKED"] = int(not unpacked)
    if unpacked:
        const["stride_xk"] = 1
    sig.update({k: "i32" for k in ("R", "K", "KP", "stride_xr", "stride_xk", "stride_cr", "stride_sr", "stride_er",
                                   "K_BUCKET")})
    divisible = [k for k in sig if k not in ("stride_xk", "K_BUCKET")]  # R too: 8192 tokens, as in training
    return fn, sig, const, divisible, BR * BK


def resq_case(fmt: str, BR: int, BK: int, packed: bool):
    """(kernel, signature, constexprs, divisible args, values per loop iteration) of the fused ResQ quantize kernel
    in its bf16-sum form (``resq_quantize(expand="sum")``: the decode GEMMs' operand), with or without its packed
    Q(X) and S(Q(R)) (``packed``)."""
    from megatron_fp4.kernels import resq
    from megatron_fp4.kernels._common import TILE_RECIP

    scale = "*i32" if fmt == "hif4" else "*u8"
    sig = {"x_ptr": "*bf16", "qc_ptr": "*u8", "qs_ptr": scale, "rc_ptr": "*u8", "rs_ptr": scale, "ex_ptr": "*bf16",
           "exr_ptr": "*bf16", "rexp_ptr": "*u8", "rok_ptr": "*u8"}
    sig.update({k: "i32" for k in ("R", "K", "KP", "stride_xr", "stride_xk", "stride_cr", "stride_sr", "stride_er",
                                   "K_BUCKET")})
    const = dict(FMT=0 if fmt == "hif4" else 1, EXPAND=3, BR=BR, BK=BK, **TILE_RECIP, PREFETCH=0, PDL=False,
                 PACKED=int(packed), stride_xk=1)
    divisible = [k for k in sig if k not in ("stride_xk", "K_BUCKET", "R")]
    return resq._resq_kernel, sig, const, divisible, BR * BK


def columns_case(fmt: str, BC: int):
    """(kernel, signature, constexprs, divisible args, values per program: 64 rows x BC columns) of the column
    kernel (``megatron_fp4.kernels.quantize``'s exact expansion of a transposed view, read from the row-major
    tensor)."""
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels._common import TILE_RECIP

    sig = {"x_ptr": "*bf16", "ec_ptr": "*bf16"}
    sig.update({k: "i32" for k in ("R", "K", "RP", "stride_xr", "stride_ec", "R_BUCKET")})
    const = dict(FMT=0 if fmt == "hif4" else 1, BC=BC, **TILE_RECIP)
    divisible = [k for k in sig if k not in ("R_BUCKET",)]
    return qm._col_quant_kernel, sig, const, divisible, 64 * BC


def cuda_case(fmt: str, BM: int, tile: dict, wide: bool) -> tuple:
    """The CUDA decode GEMM (megatron_fp4.kernels.cuda_decode) of a 7B MLP weight at ``BM`` tokens with ``tile``
    (KERNEL and tile keys; none: the default launch's), compiled by nvcc for sm_90a: (cubin bytes, weight values
    per thread and loop iteration, the defines, ptxas's report)."""
    from megatron_fp4.kernels import cuda_decode as cd

    fmt_id, ntok = int(fmt == "mxfp4"), cd._ntok(BM)
    if not tile and cd.natural_layout():  # the default layout's tile, as w4_decode picks it (HiF4: the subnormal
        tile = cd.natural_tile({"SUBN": 1}, ntok)  # codes, which a weight of values below ~3.5 takes)
    elif tile.get("NATURAL"):  # keys over the default natural tile's
        tile = cd.natural_tile(tile, ntok)
    kernel, config = cd._choose(18944, 3584, ntok, tile or None, fmt_id)
    cfg = cd._tile(kernel, fmt_id, ntok, config)
    defines = cd._defines(kernel, fmt_id, wide, ntok, cfg)
    cubin, report = nvcc_cubin("cuda", cd._SOURCES[kernel], defines)
    # per loop iteration each thread holds DEPTH chunks of 64 values of 16 rows (wgmma: its warp's slab; mma.sync:
    # SPW slabs), spread over the warp's 32 lanes
    values = cfg["DEPTH"] * (1 if kernel == "wgmma" else cfg["SPW"]) * 16 * 64 // 32
    return cubin, values, {"KERNEL": kernel, **defines}, report


def nvcc_cubin(mode: str, source: str, defines: dict) -> tuple:
    """(cubin bytes, ptxas's report) of ``csrc/<source>`` with ``defines``, compiled by nvcc for sm_90a (``mode``:
    the command's kernel argument, for its messages)."""
    from megatron_fp4.kernels import _nvcc

    if _nvcc.nvcc() is None:
        raise SystemExit(f"kernel_sass.py {mode}: needs nvcc (CUDA's compiler) on PATH or CUDA_HOME")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "k.cubin")
        r = subprocess.run(_nvcc.command(source, defines, out, "90a", "-cubin", "-Xptxas", "-v"),
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"kernel_sass.py {mode}: nvcc failed:\n{r.stderr[-2000:]}")
        return open(out, "rb").read(), r.stdout + r.stderr


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=["decode", "quantize", "resq", "columns", "cuda", "resq-cuda"],
                   help="decode: the decode GEMM (megatron_fp4.kernels.decode_gemm.w4_matmul); quantize: the row "
                        "quantize kernel; resq: the fused ResQ quantize kernel's bf16 sum (--BR, --BK, --packed); "
                        "columns: the column kernel (a transposed view's exact expansion, --BK "
                        "columns per program); cuda: the CUDA decode GEMM on a 7B MLP weight (nvcc; --BM tokens, "
                        "--tile); resq-cuda: the CUDA ResQ bf16-sum kernel (nvcc; whole, 8 values per thread)")
    p.add_argument("--fmt", choices=["hif4", "mxfp4"], default="mxfp4")
    p.add_argument("--BN", type=int, default=64, help="weight rows per program")
    p.add_argument("--BM", type=int, default=16, help="token columns (16, 32 or 64)")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=1)
    p.add_argument("--res", action="store_true", help="with the ResQ residual operand")
    p.add_argument("--wide", action="store_true", help="MXFP4 two-factor path (block scales above 2^1)")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--xperm", action="store_true")
    p.add_argument("--BR", type=int, default=8, help="quantize: rows per program")
    p.add_argument("--BK", type=int, default=256, help="quantize: K values per step; columns: columns per program")
    p.add_argument("--expand", type=int, choices=[0, 1, 2], default=0,
                   help="quantize: 0 none, 1 native, 2 bf16 (HiF4: any nonzero is its bf16 expansion)")
    p.add_argument("--unpacked", action="store_true", help="quantize: the expansion only (PACKED=0, training)")
    p.add_argument("--packed", action="store_true", help="resq: also the packed Q(X) and S(Q(R)) (PACKED=1)")
    p.add_argument("--transpose", action="store_true",
                   help="quantize, HiF4 with --unpacked: the row pass also writes x's transposed copy")
    p.add_argument("--tile", default=None,
                   help='cuda: a tile as JSON, e.g. \'{"KERNEL": "wgmma", "LEAN": 1}\' (default: the default '
                        "launch's)")
    p.add_argument("--histogram", action="store_true", help="print every opcode's count")
    args = p.parse_args(argv)
    if args.BM not in (16, 32, 64):
        p.error(f"--BM {args.BM} is not valid; allowed values: 16, 32, 64")
    if args.kernel == "resq-cuda":
        # the CUDA ResQ bf16-sum kernel (csrc/resq_sum.cu): one part of 8 values per thread
        cubin, report = nvcc_cubin("resq-cuda", "resq_sum.cu", {"FMT": int(args.fmt == "mxfp4")})
        ops = loop_opcodes(cubin)  # (no loop: the whole kernel)
        n = sum(ops.values())
        regs = re.search(r"Used (\d+) registers", report)
        print(f"resq-cuda {args.fmt}: {n} instructions, 8 values per thread -> {n / 8:.2f} per value per thread; "
              f"{regs.group(1) if regs else '?'} registers")
        top = ops.most_common() if args.histogram else ops.most_common(12)
        print("  " + ", ".join(f"{k} {v}" for k, v in top))
        main.convert_layouts = 0  # (a Triton notion)
        return n / 8
    if args.kernel == "cuda":
        try:
            tile = json.loads(args.tile) if args.tile else {}
        except json.JSONDecodeError as e:
            p.error(f"--tile must be a JSON object ({e})")
        if not isinstance(tile, dict):
            p.error(f"--tile must be a JSON object, got {args.tile!r}")
        cubin, values, defines, report = cuda_case(args.fmt, args.BM, tile, args.wide)
        ops = loop_opcodes(cubin)
        n = sum(ops.values())
        regs, spill = re.search(r"Used (\d+) registers", report), re.search(r"(\d+) bytes spill stores", report)
        print(f"cuda {defines}: {n} instructions per loop iteration, {values} values per thread -> "
              f"{n / values:.2f} per value per thread; {regs.group(1) if regs else '?'} registers, "
              f"{spill.group(1) if spill else '?'} bytes spilled")
        top = ops.most_common() if args.histogram else ops.most_common(12)
        print("  " + ", ".join(f"{k} {v}" for k, v in top))
        main.convert_layouts = 0  # (a Triton notion)
        return n / values
    if args.kernel == "decode":
        fn, sig, const, div, values = decode_case(args.fmt, args.BN, args.BM, args.res, args.wide, args.prefetch,
                                                  args.xperm)
    elif args.kernel == "quantize":
        if args.unpacked and not args.expand:
            p.error("--unpacked needs --expand 1 or 2 (the expansion is all the kernel writes then)")
        fn, sig, const, div, values = quantize_case(args.fmt, args.BR, args.BK, args.expand, args.prefetch,
                                                    args.unpacked, args.transpose)
    elif args.kernel == "resq":
        fn, sig, const, div, values = resq_case(args.fmt, args.BR, args.BK, args.packed)
    else:
        fn, sig, const, div, values = columns_case(args.fmt, args.BK)
    compiled = compile_sm90(fn, sig, const, div, args.num_warps, args.num_stages)
    ops = loop_opcodes(compiled.asm["cubin"])
    n = sum(ops.values())
    per_thread = values / (32 * args.num_warps)
    convert = compiled.asm["ttgir"].count("ttg.convert_layout")
    print(f"{args.kernel} {const}: {n} instructions per loop iteration, {values} values "
          f"-> {n / per_thread:.2f} per value per thread; shared memory {compiled.metadata.shared} bytes; "
          f"{convert} layout conversions{registers(compiled.asm['ptx'])}")
    top = ops.most_common() if args.histogram else ops.most_common(12)
    print("  " + ", ".join(f"{k} {v}" for k, v in top))
    main.convert_layouts = convert  # for tests
    return n / per_thread


if __name__ == "__main__":
    main()
