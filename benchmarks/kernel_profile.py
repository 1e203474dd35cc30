"""CUDA time of one step by kernel family, for the benchmarks' ``--profile`` (bench_train.py, bench_rollout.py).

torch.profiler records every kernel, those replayed inside CUDA graphs too (their aten ops are hidden there: only an
eager step says which op launched what).
"""

from __future__ import annotations

import torch

#: Kernel families, matched in order against lower-cased kernel names: the FP4 decode GEMMs (the CUDA kernels
#: w4_wgmma / w4_decode, the Triton _w4_decode_kernel) before the other GEMMs; the quantizers (ResQ's too).
FAMILIES = (("fp4 decode gemm", ("w4_",)), ("fp4 quantize", ("quant", "resq")),
            ("attention", ("flash", "fmha", "attention", "sdpa")),
            ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
            ("norm / rope / swiglu", ("norm", "rope", "swiglu")),
            ("softmax", ("softmax",)), ("reduce", ("reduce",)), ("copy/cast", ("copy", "cast", "convert")),
            ("elementwise", ("elementwise", "vectorized", "unrolled")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_step(step) -> dict:
    """CUDA time (ms) of one call of ``step`` by kernel family, its top kernels, and the top aten ops by their own
    CUDA time with their input shapes (which op launched the copy/cast and elementwise kernels: an eager step only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3  # ms
    fams: dict[str, float] = {}
    for name, ms in kernels.items():
        fam = family(name)
        fams[fam] = fams.get(fam, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    ops = [[e.key, str(e.input_shapes)[:160], e.count, round(e.self_device_time_total / 1e3, 2)]
           for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    return {"families_ms": {k: round(v, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[n[:90], round(ms, 2)] for n, ms in top],
            "top_ops_ms": sorted(ops, key=lambda r: -r[3])[:16]}  # [op, input shapes, calls, own CUDA ms]
