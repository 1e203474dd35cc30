"""CUDA time of one step by kernel family, for the benchmarks' ``--profile`` (bench_train.py, bench_rollout.py).

torch.profiler records every kernel, those replayed inside CUDA graphs too (their aten ops are hidden there: only an
eager step says which op launched what).
"""

from __future__ import annotations

import os
import re

import torch

#: Kernel families, matched in order against lower-cased kernel names: the FP4 decode GEMMs (the CUDA kernels
#: w4_wgmma / w4_decode, the Triton _w4_decode_kernel) before the other GEMMs; the quantizers (ResQ's too).
FAMILIES = (("fp4 decode gemm", ("w4_",)), ("fp4 quantize", ("quant", "resq")),
            ("attention", ("flash", "fmha", "attention", "sdpa")),
            ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
            ("norm / rope / swiglu", ("norm", "rope", "swiglu")),
            ("softmax", ("softmax",)), ("reduce", ("reduce",)), ("copy/cast", ("copy", "cast", "convert", "split_sum")),
            ("elementwise", ("elementwise", "vectorized", "unrolled")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


#: Words of torch's templated kernel names that say nothing about what the kernel computes (:func:`short_name`).
_GENERIC = frozenset((
    "void at native std c10 array char int unsigned long float double bool const operator lambda ul BFloat16 Half "
    "TensorIteratorBase TensorIterator TrivialOffsetCalculator OffsetCalculator memory detail gpu_kernel_impl "
    "gpu_kernel_impl_nocast func_wrapper_t ReduceOp ArrayRef gpu_index_kernel LoadWithCast StoreWithCast "
    "LoadWithoutCast StoreWithoutCast OpaqueType").split())
_DTYPES = frozenset(("BFloat16", "Half", "float", "double", "long", "bool"))


def short_name(name: str) -> str:
    """A kernel's name without its template boilerplate: torch's ``void at::native::elementwise_kernel<128, 4,
    at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(...)...>`` (cut at 90 characters, all
    elementwise kernels look alike) -> ``elementwise_kernel<direct_copy_kernel_cuda>[BFloat16]``: the kernel, the
    first word of its template arguments that names an operation, the dtypes named, and whether it loads or stores
    with a cast. Names without template arguments (cuBLAS's, Triton's) stay as they are."""
    name = name.replace("(anonymous namespace)::", "")
    head = re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0].split("::")[-1].strip()
    rest = name[len(name.split("<", 1)[0]):] if "<" in name else ""
    words = re.findall(r"[A-Za-z_]\w*", rest)
    inner = next((w for w in words if w not in _GENERIC), None)
    dtypes = list(dict.fromkeys(w for w in words if w in _DTYPES))
    return (head + (f"<{inner}>" if inner else "") + (f"[{','.join(dtypes)}]" if dtypes else "")
            + (" with cast" if "WithCast" in rest else ""))


def _summary(kernels: dict[str, list], fams: dict[str, float]) -> dict:
    """families_ms (descending) and the 30 top kernels as [name, calls, ms]."""
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]
    return {"families_ms": {k: round(v, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[n[:120], calls, round(ms, 2)] for n, (calls, ms) in top]}


def _add(kernels: dict[str, list], fams: dict[str, float], name: str, ms: float) -> None:
    fam = family(name)
    fams[fam] = fams.get(fam, 0.0) + ms
    k = kernels.setdefault(short_name(name), [0, 0.0])
    k[0] += 1
    k[1] += ms


def trace_kernels(paths) -> dict:
    """:func:`profile_step`'s families and top kernels from Chrome trace files that torch.profiler exported in another
    process (``.json`` or ``.json.gz``; e.g. an SGLang Engine's scheduler after ``start_profile`` / ``stop_profile``):
    the events of category "kernel", durations in microseconds. ``files`` says which files were read."""
    import gzip
    import json

    kernels: dict[str, list] = {}
    fams: dict[str, float] = {}
    for path in paths:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as f:
            events = json.load(f)
        for ev in events.get("traceEvents", events) if isinstance(events, dict) else events:
            if isinstance(ev, dict) and ev.get("cat") == "kernel" and "dur" in ev:
                _add(kernels, fams, ev.get("name", "?"), float(ev["dur"]) / 1e3)
    return {**_summary(kernels, fams), "files": [os.path.basename(str(p)) for p in paths]}


def profile_step(step) -> dict:
    """CUDA time (ms) of one call of ``step`` by kernel family; its top kernels by :func:`short_name` as [name, calls,
    ms] (the calls say per what a kernel runs: 28 layers x 128 steps = 3,584 is once per layer and decode step); and
    the top aten ops by their own CUDA time with their input shapes (which op launched the copy/cast and elementwise
    kernels: an eager step only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    fams: dict[str, float] = {}
    kernels: dict[str, list] = {}  # short name -> [calls, ms]
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            _add(kernels, fams, ev.name, ev.device_time_total / 1e3)
    ops = [[e.key, str(e.input_shapes)[:160], e.count, round(e.self_device_time_total / 1e3, 2)]
           for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    return {**_summary(kernels, fams),
            "top_ops_ms": sorted(ops, key=lambda r: -r[3])[:16]}  # [op, input shapes, calls, own CUDA ms]
