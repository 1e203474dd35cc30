"""Reference quantizer speed on this machine: quantize / fake_quantize of a 4096x4096 bf16 tensor per format.

    python benchmarks/bench_formats.py [--size 4096] [--repeats 3]

Prints a table and writes benchmarks/results/formats_cpu.json (median seconds of ``--repeats`` runs).
"""

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date

import torch

from megatron_fp4.formats import get_format


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "formats_cpu.json"))
    args = p.parse_args()
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = []
    print(f"{'format':<8}{'quantize s':>12}{'fake_quantize s':>17}{'dequantize s':>14}")
    for name in ("hif4", "mxfp4", "nvfp4"):
        fmt = get_format(name)
        qt = fmt.quantize(x)
        row = dict(format=name,
                   quantize_s=_median_seconds(lambda: fmt.quantize(x), args.repeats),
                   fake_quantize_s=_median_seconds(lambda: fmt.fake_quantize(x), args.repeats),
                   dequantize_s=_median_seconds(qt.dequantize, args.repeats))
        rows.append(row)
        print(f"{name:<8}{row['quantize_s']:>12.3f}{row['fake_quantize_s']:>17.3f}{row['dequantize_s']:>14.3f}")
    result = dict(benchmark="bench_formats", date=date.today().isoformat(), shape=[args.size, args.size],
                  dtype="bfloat16", threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                  torch=torch.__version__, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
