"""A profiling target for Nsight Compute: a few launches of the CUDA decode GEMM (megatron_fp4.kernels.cuda_decode) on
one random weight, with its default tile or the one given (a tile with a KERNEL and no NATURAL=1 runs on the permuted
layout, one with NATURAL=1 on the natural one). ``bash benchmarks/h200_checks.sh decode-profile`` runs it
under ``ncu``; alone it only launches the kernel and prints the time of one launch.

    python3 benchmarks/profile_decode.py --format hif4 --shape 3584x18944 --m 16 [--tile '{"KERNEL": "mma"}']
"""

import argparse
import json
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=["hif4", "mxfp4"], default="hif4")
    p.add_argument("--shape", default="3584x18944", help="K x N of the weight (default: a Qwen2.5-7B MLP weight)")
    p.add_argument("--m", type=int, default=16, help="tokens, 1..64 (default 16)")
    p.add_argument("--tile", default=None,
                   help="a tile override as JSON (cuda_decode.w4_decode's config; null: the default)")
    p.add_argument("--iters", type=int, default=3, help="launches (default 3: ncu skips the first two)")
    args = p.parse_args(argv)
    try:
        K, N = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must be KxN, e.g. 3584x18944, got {args.shape!r}")
    if not 1 <= args.m <= 64:
        p.error(f"--m must be in 1..64 (the decode kernels' range), got {args.m}")
    try:
        tile = json.loads(args.tile) if args.tile else None
    except json.JSONDecodeError as e:
        p.error(f"--tile must be a JSON object, e.g. '{{\"KERNEL\": \"mma\"}}' ({e})")
    if tile is not None and not isinstance(tile, dict):
        p.error(f"--tile must be a JSON object, got {args.tile!r}")

    import torch

    from megatron_fp4.kernels import cuda_decode as cd
    from megatron_fp4.kernels.dispatch import prepare_weight

    if not cd.available():
        sys.exit("profile_decode.py: the CUDA decode kernels need a Hopper GPU (sm_90) and nvcc")
    torch.manual_seed(0)
    pw = prepare_weight(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02, args.format)
    dw = pw.decode  # the default layout; a tile naming a KERNEL without NATURAL reads the permuted one
    natural = bool((tile or {}).get("NATURAL")) or (dw.natural and "KERNEL" not in (tile or {}))
    if natural != dw.natural:
        dw = cd.to_decode_layout(pw.packed, pw.wide, natural=natural)
    x = torch.randn(args.m, K, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.iters):
        start.record()
        cd.w4_decode(x, dw, config=tile)
        end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3
    print(f"{args.format} {K}x{N} M={args.m} tile={tile or 'default'}: last launch {us:.1f} us")


if __name__ == "__main__":
    main()
