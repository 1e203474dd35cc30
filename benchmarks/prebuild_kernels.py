"""Compile the CUDA decode kernels on a machine without a GPU (nvcc is enough) into one archive that a device call
carries and ``benchmarks/h200_checks.sh`` unpacks into the build folder, so that a fresh GPU machine compiles none
of them (43 configurations by default, more with --tiles: 1-3 minutes of 16 cores there, the device time of every
first call of a session).

    python3 benchmarks/prebuild_kernels.py [--tiles '[{"NATURAL": 1, "MINB": 3}]'] [--ntoks 8,16,32,64]
        [--out .device_carry/kernels.tar.xz]

then carry ``.device_carry`` (ignored by git) with the call. What it compiles is :func:`cuda_decode.prebuild`'s: every
default tile of both kernels and formats at every token bucket, plus ``--tiles`` at ``--ntoks``. The libraries are
keyed by a hash of the sources and defines (``_nvcc.compile_library``), so a carried one serves only the source it
was built from; the archive of a stale tree is harmless (its libraries are never looked up). They link the CUDA
runtime statically (glibc 2.34 or newer where they run: h200_checks.sh loads each one and drops any that does not
load, which then builds on first use).
"""

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", default="[]",
                   help="a JSON list of tiles besides the defaults (dicts of tile keys; with NATURAL 1, keys over the "
                        "natural tile's), e.g. '[{\"NATURAL\": 1, \"MINB\": 3}]'")
    p.add_argument("--ntoks", default="8,16,32,64", help="token buckets of --tiles, among 8,16,32,64 (default: all)")
    p.add_argument("--out", default=".device_carry/kernels.tar.xz", help="the archive (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        tiles = json.loads(args.tiles)
    except json.JSONDecodeError as e:
        p.error(f"--tiles must be a JSON list of objects ({e})")
    if not isinstance(tiles, list) or not all(isinstance(t, dict) for t in tiles):
        p.error(f"--tiles must be a JSON list of objects, got {args.tiles!r}")
    try:
        ntoks = tuple(int(v) for v in args.ntoks.split(","))
    except ValueError:
        ntoks = ()
    if not ntoks or any(m not in (8, 16, 32, 64) for m in ntoks):
        p.error(f"--ntoks must be token buckets among 8,16,32,64 separated by commas, got {args.ntoks!r}")
    from megatron_fp4.kernels import _nvcc, cuda_decode

    if _nvcc.nvcc() is None:
        p.error("needs nvcc (CUDA's compiler) on PATH or under CUDA_HOME")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        with mock.patch.dict(os.environ, MEGATRON_FP4_BUILD_DIR=d):  # (only this run's libraries go into the archive)
            n = cuda_decode.prebuild(tiles, ntoks=ntoks)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = f"{args.out}.tmp"
        with tarfile.open(tmp, "w:xz", preset=9) as tar:
            for name in sorted(os.listdir(d)):
                tar.add(os.path.join(d, name), arcname=name)
        os.replace(tmp, args.out)
    print(f"{n} configurations compiled in {time.time() - t0:.0f} s: {args.out} "
          f"({os.path.getsize(args.out) / 1e6:.2f} MB); carry its folder with the device call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
