"""What the checkpoint checksums cost: save and load of a 1.5B-parameter state with and without them.

    python benchmarks/bench_checkpoint.py [--params 1.5e9] [--dtype bf16] [--dir /tmp/ckpt_bench] [--kind both]

``--kind rl``: the RL trainer's checkpoints. Saves the state through megatron_fp4.rl.checkpoint.save_checkpoint
(torch.save + fsync + atomic rename; the checksums are computed while the state is written) and loads it back with
load_checkpoint (torch.load + the checksum verification), then does the same with the checksum step switched off.
``--kind safetensors``: a converted checkpoint's (or HF export's) safetensors shard, one file holding the whole
state as ``tools/convert_hf_to_megatron.py`` writes it at TP=PP=1: megatron_fp4.models.safetensors_io.save_safetensors
(checksums into the header, fsync, atomic rename) and SafetensorsFile(...).load_all() (every tensor read and
verified), against the same calls with ``checksums=False`` / ``verify=False``. ``--kind both`` (default) runs both.
Each pair ``--repeats`` times (median; which mode goes first alternates, and the previous checkpoint is deleted
and synced before each timed save). The checksum step alone (digests of every tensor, in memory) is also timed:
on a shared disk, end-to-end save times vary by more than the checksums cost, so the step's share of the time
without checksums is the steadier measure. The page cache is dropped before each load where the OS allows it (root);
otherwise loads read from memory, which makes the checksum's share look larger. Prints a table and writes
benchmarks/results/checkpoint_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_fp4.models import safetensors_io as stio
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


def _order(rep: int) -> tuple[str, str]:
    """Which mode runs first alternates from repeat to repeat: on a shared disk the first of two back-to-back 3 GB
    saves is often the slow one, which would otherwise always be charged to the same mode."""
    return ("checksums", "none") if rep % 2 == 0 else ("none", "checksums")


def _settle(root: Path) -> None:
    """Remove the previous checkpoint and let the filesystem finish with it before the next timed save."""
    shutil.rmtree(root, ignore_errors=True)
    os.sync()
    time.sleep(1.0)


def _bench_rl(state: dict, root: Path, repeats: int, times: dict[str, list[float]]) -> bool:
    """Save/load the state as an RL checkpoint with and without checksums; returns whether caches were dropped."""
    digest, verify = ckpt.tensor_checksums, ckpt.verify_checksums
    cold = False
    for rep in range(repeats):
        for mode in _order(rep):
            if mode == "none":  # the same save and load without the checksum step
                ckpt.tensor_checksums, ckpt.verify_checksums = (lambda s: {}), (lambda *x, **k: None)
            _settle(root)
            t0 = time.perf_counter()
            ckpt.save_checkpoint(root, 1, state)
            times.setdefault(f"save_{mode}", []).append(time.perf_counter() - t0)
            cold = _drop_caches()
            t0 = time.perf_counter()
            ckpt.load_checkpoint(root, 1)
            times.setdefault(f"load_{mode}", []).append(time.perf_counter() - t0)
            ckpt.tensor_checksums, ckpt.verify_checksums = digest, verify
    shutil.rmtree(root, ignore_errors=True)
    return cold


def _bench_safetensors(state: dict, root: Path, repeats: int, times: dict[str, list[float]]) -> bool:
    """Save/load the model tensors as one checksummed safetensors shard, and the same without checksums."""
    tensors = state["model"]
    cold = False
    for rep in range(repeats):
        for mode in _order(rep):
            on = mode == "checksums"
            _settle(root)
            root.mkdir(parents=True)
            path = root / "model.safetensors"
            t0 = time.perf_counter()
            stio.save_safetensors(tensors, path, writer={"writer": "bench"}, checksums=on)
            times.setdefault(f"save_{mode}", []).append(time.perf_counter() - t0)
            cold = _drop_caches()
            t0 = time.perf_counter()
            loaded = stio.SafetensorsFile(path, verify=on).load_all()
            times.setdefault(f"load_{mode}", []).append(time.perf_counter() - t0)
            del loaded
    shutil.rmtree(root, ignore_errors=True)
    return cold


def _checksum_step_seconds(kind: str, state: dict, repeats: int) -> dict[str, float]:
    """Median seconds of the checksum step alone, in memory (what a save adds before writing, and what a load adds
    after reading): on a shared disk this is far steadier than the difference of two end-to-end times."""
    out: dict[str, list[float]] = {"save": [], "load": []}
    for _ in range(repeats):
        if kind == "rl":
            t0 = time.perf_counter()
            table = ckpt._checksum_table(state)
            t1 = time.perf_counter()
            ckpt.verify_checksums({**state, "checksums": table}, Path("/nonexistent/iter_0000001/rank_00000.pt"))
            t2 = time.perf_counter()
        else:
            t0 = time.perf_counter()
            meta = stio.checksum_metadata(state["model"])
            t1 = time.perf_counter()
            want = json.loads(meta[stio.CHECKSUMS_KEY])["tensors"]
            assert all(stio.tensor_digest(k, v) == want[k] for k, v in state["model"].items())
            t2 = time.perf_counter()
        out["save"].append(t1 - t0)
        out["load"].append(t2 - t1)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=1.5e9)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--dir", default="/tmp/megatron_fp4_ckpt_bench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kind", choices=("rl", "safetensors", "both"), default="both")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    load_at_start = os.getloadavg()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    state = _state(int(a.params), dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    kinds = ("rl", "safetensors") if a.kind == "both" else (a.kind,)
    rows = []
    cold = False
    for kind in kinds:
        times: dict[str, list[float]] = {}
        bench = _bench_rl if kind == "rl" else _bench_safetensors
        cold = bench(state, Path(a.dir), a.repeats, times) or cold
        step = _checksum_step_seconds(kind, state, a.repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        for op in ("save", "load"):
            with_, without = med[f"{op}_checksums"], med[f"{op}_none"]
            rows.append({"kind": kind, "op": op, "seconds_with_checksums": with_, "seconds_without": without,
                         "checksum_cost_frac": (with_ - without) / without,
                         "checksum_step_seconds": step[op], "checksum_step_frac": step[op] / without,
                         "gb_per_s_without": nbytes / without / 1e9,
                         "all_seconds": {m: times[f"{op}_{m}"] for m in ("checksums", "none")}})
    print(f"{a.params / 1e9:.2f}B parameters, {a.dtype}: {nbytes / 1e9:.2f} GB; {ckpt.CHECKSUM_ALGORITHM}; "
          f"page cache {'dropped' if cold else 'kept (not root)'} before loads; median of {a.repeats}")
    print(f"{'kind':12} {'op':6} {'with (s)':>10} {'without (s)':>12} {'difference':>11} {'checksum step (s)':>18} "
          f"{'step / without':>15} {'GB/s':>7}")
    for r in rows:
        print(f"{r['kind']:12} {r['op']:6} {r['seconds_with_checksums']:10.2f} {r['seconds_without']:12.2f} "
              f"{100 * r['checksum_cost_frac']:10.1f}% {r['checksum_step_seconds']:18.2f} "
              f"{100 * r['checksum_step_frac']:14.1f}% {r['gb_per_s_without']:7.2f}")
    out = a.out or os.path.join(os.path.dirname(__file__), "results", "checkpoint_cpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    info = {"params": int(a.params), "dtype": a.dtype, "bytes": nbytes, "algorithm": ckpt.CHECKSUM_ALGORITHM,
            "cold_loads": cold, "repeats": a.repeats, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "loadavg_at_start": load_at_start,
            "command": "python benchmarks/bench_checkpoint.py " + " ".join(sys.argv[1:])}
    with open(out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
