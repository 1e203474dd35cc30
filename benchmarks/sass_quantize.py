"""Instruction counts of the training quantize kernels on sm_90, compiled without a GPU; prints a table, writes JSON.

    pip install --no-deps "triton==3.6.0"      # the H200 machine's Triton (other versions emit other code)
    PYTHONPATH=. python benchmarks/sass_quantize.py [--out benchmarks/results/quantize_sass_sm90.json]

The quantize kernels are ALU-bound on the H200 (docs/PERFORMANCE.md), so between GPU sessions the static SASS is a
useful proxy: per kernel specialization, the SASS instructions per thread times the threads, divided by the values
(and directions) one program quantizes; the registers and spill stores ptxas reports; the layout conversions in
Triton's GPU IR (each one moves values between threads through shared memory). Triton's own ``ptxas`` and
``cuobjdump`` (shipped in its wheel) do the work; no CUDA driver is needed. Kernels with a loop count its body once
plus the prologue, so per-value figures of the row kernel are upper bounds. Only a GPU run says how fast a kernel
is: occupancy, latency and memory are not in these numbers.
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
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import quantize as kq  # noqa: E402
from kernels._common import HIF4_RECIP  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
RECIP = dict(R1=HIF4_RECIP[1], R2=HIF4_RECIP[2], R3=HIF4_RECIP[3])
#: Integer arguments Triton specializes as multiples of 16 at the training shapes (8192 tokens, K = 1536 ...).
DIV16 = ("x_ptr", "er_ptr", "ec_ptr", "ex_ptr", "stride_xr", "stride_er", "stride_ec", "R", "K", "RP", "KP")


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int):
    """Triton's compiled kernel of ``kernel`` (a ``@triton.jit`` function, or a wrapper of one) for sm_90."""
    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = getattr(fn, "kernel", None) or fn.fn
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def sass_stats(compiled) -> dict:
    """SASS instruction count, registers, spill stores, shared memory, layout conversions and the commonest opcodes."""
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        with open(ptx, "w") as fh:
            fh.write(compiled.asm["ptx"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        v = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                           capture_output=True, text=True).stderr
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    ops = collections.Counter(
        re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0] for ln in lines)
    regs, spill = re.search(r"Used (\d+) registers", v), re.search(r"(\d+) bytes spill stores", v)
    return {"sass": len(lines), "registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None, "shared_bytes": compiled.metadata.shared,
            "convert_layouts": compiled.asm["ttgir"].count("ttg.convert_layout"), "top": ops.most_common(8)}


def cases():
    """(name, kernel, signature, constexprs, warps, values per program): the training operands' kernels."""
    dual_sig = {n: "i32" for n in ("R", "K", "RP", "KP", "stride_xr", "stride_xk", "stride_er", "stride_ec",
                                   "K_BUCKET")}
    dual_sig.update(x_ptr="*bf16", er_ptr="*bf16", ec_ptr="*bf16")
    for fmt, code in (("hif4", 0), ("mxfp4", 1)):
        for w in (2, 4, 8):  # the one-pass kernel: a 64 x 64 tile, quantized along both dimensions
            yield (f"one-pass {fmt}", kq._dual_quant_kernel, dual_sig, dict(FMT=code, B=64, stride_xk=1, **RECIP), w,
                   2 * 64 * 64)
    row_sig = {n: "i32" for n in ("R", "K", "KP", "stride_xr", "stride_xk", "stride_cr", "stride_sr", "stride_er",
                                  "K_BUCKET")}
    row_sig.update(x_ptr="*bf16", codes_ptr="*u8", scales_ptr="*i32", ex_ptr="*bf16")
    for br, bk, w in ((8, 256, 4), (16, 128, 4)):  # the row kernel, BF16 expansion only (the training form)
        yield (f"row hif4 {br}x{bk}", kq._hif4_quant_kernel, row_sig,
               dict(EXPAND=2, BR=br, BK=bk, PREFETCH=0, PACKED=0, stride_xk=1, **RECIP), w, br * bk)
    row_sig = dict(row_sig, rexp_ptr="*i32", rok_ptr="*i8")
    for br, bk, w in ((8, 256, 4),):
        yield (f"row mxfp4 {br}x{bk}", kq._mx_quant_kernel, row_sig,
               dict(RCEIL=False, EXPAND=2, BR=br, BK=bk, PREFETCH=0, PACKED=0, stride_xk=1), w, br * bk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "quantize_sass_sm90.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'kernel':<22} {'warps':>5} {'SASS':>6} {'per value':>9} {'regs':>5} {'spill B':>7} {'cvt':>4}")
    for name, kernel, sig, const, warps, values in cases():
        s = sass_stats(compile_sm90(kernel, sig, const, warps))
        row = dict(kernel=name, warps=warps, per_value=round(s["sass"] * warps * 32 / values, 1), **s)
        rows.append(row)
        print(f"{name:<22} {warps:>5} {s['sass']:>6} {row['per_value']:>9} {s['registers']!s:>5} "
              f"{s['spill_bytes']!s:>7} {s['convert_layouts']:>4}", flush=True)
    info = {"triton": triton.__version__, "target": "sm_90 (cuda 90, warp 32)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "benchmarks/sass_quantize.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"info": info, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
