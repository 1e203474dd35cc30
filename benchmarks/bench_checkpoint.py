"""What the checkpoint checksums cost: save and load of a 1.5B-parameter state with and without them.

    python benchmarks/bench_checkpoint.py [--params 1.5e9] [--dtype bf16] [--dir /tmp/ckpt_bench]

Saves the state through megatron_fp4.rl.checkpoint.save_checkpoint (torch.save + fsync + atomic rename; the
checksums are computed while the state is written) and loads it back with load_checkpoint (torch.load + the
checksum verification), then does the same with the checksum step switched off, each ``--repeats`` times (median).
The page cache is dropped before each load where the OS allows it (root); otherwise loads read from memory, which
makes the checksum's share look larger. Prints a table and writes benchmarks/results/checkpoint_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from megatron_fp4.rl import checkpoint as ckpt


def _state(params: int, dtype: torch.dtype) -> dict:
    """A model-like state: 28 layers of 7 tensors plus an embedding, ``params`` values in all."""
    per = params // (28 * 7 + 1)
    g = torch.Generator().manual_seed(0)
    model = {f"decoder.layers.{i}.w{j}": torch.randn(per, generator=g).to(dtype) for i in range(28) for j in range(7)}
    model["embedding.word_embeddings.weight"] = torch.randn(params - per * 28 * 7, generator=g).to(dtype)
    return {"model": model, "step": 1}


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=1.5e9)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--dir", default="/tmp/megatron_fp4_ckpt_bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    state = _state(int(a.params), dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    root = Path(a.dir)
    times: dict[str, list[float]] = {}
    digest, verify = ckpt.tensor_checksums, ckpt.verify_checksums
    cold = False
    for _ in range(a.repeats):
        for mode in ("checksums", "none"):
            if mode == "none":  # the same save and load without the checksum step
                ckpt.tensor_checksums, ckpt.verify_checksums = (lambda s: {}), (lambda *x, **k: None)
            shutil.rmtree(root, ignore_errors=True)
            t0 = time.perf_counter()
            ckpt.save_checkpoint(root, 1, state)
            times.setdefault(f"save_{mode}", []).append(time.perf_counter() - t0)
            cold = _drop_caches()
            t0 = time.perf_counter()
            ckpt.load_checkpoint(root, 1)
            times.setdefault(f"load_{mode}", []).append(time.perf_counter() - t0)
            ckpt.tensor_checksums, ckpt.verify_checksums = digest, verify
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for op in ("save", "load"):
        with_, without = med[f"{op}_checksums"], med[f"{op}_none"]
        rows.append({"op": op, "seconds_with_checksums": with_, "seconds_without": without,
                     "checksum_cost_frac": (with_ - without) / without, "gb_per_s_without": nbytes / without / 1e9})
    print(f"{a.params / 1e9:.2f}B parameters, {a.dtype}: {nbytes / 1e9:.2f} GB; {ckpt.CHECKSUM_ALGORITHM}; "
          f"page cache {'dropped' if cold else 'kept (not root)'} before loads; median of {a.repeats}")
    print(f"{'op':6} {'with (s)':>10} {'without (s)':>12} {'cost':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['op']:6} {r['seconds_with_checksums']:10.2f} {r['seconds_without']:12.2f} "
              f"{100 * r['checksum_cost_frac']:7.1f}% {r['gb_per_s_without']:7.2f}")
    out = a.out or os.path.join(os.path.dirname(__file__), "results", "checkpoint_cpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    info = {"params": int(a.params), "dtype": a.dtype, "bytes": nbytes, "algorithm": ckpt.CHECKSUM_ALGORITHM,
            "cold_loads": cold, "repeats": a.repeats, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    with open(out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
