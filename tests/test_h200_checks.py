"""benchmarks/h200_checks.sh, the GPU machine's check script: a wrong part is refused with the usage line, and every
test selection and benchmark flag it names still exists here (a renamed test or flag would otherwise surface only
in a device call)."""

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "h200_checks.sh")


def _commands(prefix: str) -> list[list[str]]:
    text = open(SCRIPT).read().replace("\\\n", " ")
    return [shlex.split(line.strip())[1:] for line in text.splitlines() if line.strip().startswith(prefix)]


def test_a_wrong_part_prints_the_usage():
    r = subprocess.run(["bash", SCRIPT, "train"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: bash benchmarks/h200_checks.sh train-tests|train-bench" in r.stderr


def test_its_test_selections_collect_tests():
    selections = _commands("run_tests ")
    assert len(selections) == 11
    for args in selections:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and re.search(r"\d+ tests? collected", r.stdout), (args, r.stdout[-500:])


def test_its_benchmark_flags_exist():
    runs = _commands("python3 benchmarks/")
    runs += [c[c.index("python3") + 1:] for c in _commands("ncu ") if "python3" in c]  # the profiled program's flags
    assert len(runs) == 16
    for args in runs:
        help_text = subprocess.run([sys.executable, os.path.join(ROOT, args[0]), "--help"], cwd=ROOT,
                                   capture_output=True, text=True).stdout
        for flag in (a for a in args[1:] if a.startswith("--")):
            assert flag in help_text, (args[0], flag)


def test_profile_target_refuses_bad_input_naming_the_flag():
    target = os.path.join(ROOT, "benchmarks", "profile_decode.py")
    for args, flag in ((["--m", "80"], "--m must be in 1..64"), (["--shape", "3584"], "--shape must be KxN"),
                       (["--format", "nvfp4"], "--format: invalid choice"), (["--tile", "{KERNEL"], "--tile must be")):
        r = subprocess.run([sys.executable, target, *args], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and flag in r.stderr, (args, r.stderr[-300:])


def _stand_ins(tmp_path, tools: dict, out=None) -> dict:
    """Stand-in tools (name -> the shell script's body) first on PATH, a site folder that already holds megatron-core:
    the environment h200_checks.sh runs with here (results into ``out``, else tmp_path). Called again, it rewrites
    the tools it is given."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    for d in (bin_dir, site / "megatron"):
        d.mkdir(parents=True, exist_ok=True)
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SITE_DIR": str(site), "OUT": str(out or tmp_path),
            "PREBUILT_KERNELS": str(tmp_path / "no_prebuilt_kernels.tar.xz")}  # (not this checkout's .device_carry)


def test_decode_profile_runs_every_case_with_stand_in_tools(tmp_path):
    """decode-profile on a machine without a GPU: stand-ins for nvidia-smi and ncu (its report without the lines the
    summary greps for), a site folder that already holds megatron-core. Every case still runs and leaves its files:
    a grep that finds nothing must not end the script (set -e), as it did on the H200 after the first case."""
    out = tmp_path / "out"
    out.mkdir()
    env = _stand_ins(tmp_path, {"nvidia-smi": "echo 'stand-in GPU'\n", "ncu": "echo \"ncu stand-in $*\"\n"}, out)
    r = subprocess.run(["bash", SCRIPT, "decode-profile"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    cases = ["hif4_m16_null", "mxfp4_m16_null", "hif4_m64_null", "mxfp4_m64_null"]
    assert r.stdout.count("== decode_profile_") == 4
    for case in cases:
        for suffix in (".log", ".txt", "_sass.csv"):
            assert (out / f"decode_profile_{case}{suffix}").exists(), (case, suffix, sorted(os.listdir(out)))
    # DECODE_PROFILE_CASES replaces the list; a tile's digits tell its files apart
    env["DECODE_PROFILE_CASES"] = 'mxfp4 64 {"KERNEL":"wgmma","WGS":4}\nhif4 16 {"KERNEL":"wgmma","WGS":2}'
    r = subprocess.run(["bash", SCRIPT, "decode-profile"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.count("== decode_profile_") == 2, r.stderr[-2000:]
    assert (out / "decode_profile_mxfp4_m64_wgmma4.txt").exists() and (out / "decode_profile_hif4_m16_wgmma2.txt").exists()


def test_a_failing_test_selection_does_not_end_the_part(tmp_path):
    """decode-tests with stand-ins (nvidia-smi; a python3 whose pytest fails): both test selections and the benchmark
    after them still run, and the part ends with status 1 naming the failed selections (a device call tells all it
    can, not just the first failure)."""
    log = tmp_path / "calls.log"
    env = _stand_ins(tmp_path, {"nvidia-smi": "echo 'stand-in GPU'\n",
                                "python3": f'echo "$*" >> {log}\ncase "$1 $2" in "-m pytest") exit 3;; esac\n'})
    r = subprocess.run(["bash", SCRIPT, "decode-tests"], capture_output=True, text=True, env=env, timeout=120)
    calls = log.read_text().splitlines()
    assert r.returncode == 1, r.stderr[-2000:]
    assert [c.split()[0] for c in calls] == ["-", "-m", "-m", "benchmarks/bench_decode_ops.py"], calls
    assert "h200_checks.sh decode-tests: FAILED:" in r.stderr
    assert "pytest -m gpu tests/test_cuda_decode.py tests/test_rollout_static.py (exit 3)" in r.stderr
    assert "pytest tests/test_decode_ops.py" in r.stderr


def test_require_h200_stops_at_once_on_another_gpu(tmp_path):
    """REQUIRE_H200=1: on an H100 (a stand-in nvidia-smi) the part ends with status 3 before it installs or runs
    anything, naming the GPU; on an H200 it goes on (here into decode-bench's benchmark, which a stand-in python3
    records)."""
    log = tmp_path / "python3.log"
    for name, code in (("NVIDIA H100 80GB HBM3", 3), ("NVIDIA H200", 0)):
        env = dict(_stand_ins(tmp_path, {"nvidia-smi": f"echo '{name}'\n", "python3": f'echo "$*" >> {log}\n'}),
                   REQUIRE_H200="1")
        r = subprocess.run(["bash", SCRIPT, "decode-bench"], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == code, (name, r.stderr[-1000:])
        if code:
            assert "REQUIRE_H200" in r.stderr and name in r.stderr and not log.exists()
    assert "benchmarks/bench_kernels.py --decode" in log.read_text()


def test_prebuilt_kernels_are_unpacked_and_one_that_does_not_load_is_dropped(tmp_path):
    """An archive of prebuild_kernels.py (PREBUILT_KERNELS) goes into the build folder before the part runs; a library
    that does not load on that machine (here: not a library) is removed, so that it builds on first use instead."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to make a loadable library")
    src = tmp_path / "k.c"
    src.write_text("int k(void) { return 7; }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(tmp_path / "w4_good.so")], check=True)
    (tmp_path / "w4_bad.so").write_text("not a library")
    with tarfile.open(tmp_path / "kernels.tar.xz", "w:xz") as tar:
        for name in ("w4_good.so", "w4_bad.so"):
            tar.add(tmp_path / name, arcname=name)
    build = tmp_path / "build"
    env = dict(_stand_ins(tmp_path, {"nvidia-smi": "echo 'stand-in GPU'\n", "ncu": "true\n"}),
               PREBUILT_KERNELS=str(tmp_path / "kernels.tar.xz"), MEGATRON_FP4_BUILD_DIR=str(build),
               DECODE_PROFILE_CASES="hif4 16 null")
    r = subprocess.run(["bash", SCRIPT, "decode-profile"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prebuilt kernels: 1 unpacked, 1 dropped" in r.stdout and "w4_bad.so" in r.stdout, r.stdout[-1000:]
    assert sorted(os.listdir(build)) == ["w4_good.so"]


def test_prebuild_kernels_archives_what_prebuild_compiles(tmp_path, monkeypatch, capsys):
    """benchmarks/prebuild_kernels.py: every library cuda_decode.prebuild compiles (nvcc stood in for: each build
    writes its file) in one tar.xz, flat; the environment's build folder untouched and restored; bad arguments
    refused naming the flag."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import prebuild_kernels
    from megatron_fp4.kernels import _nvcc

    builds = itertools.count()

    def fake_compile(source, defines, arch="90a"):  # (prebuild calls it from several threads)
        path = os.path.join(_nvcc.build_dir(), f"{source}_{next(builds)}.so")
        open(path, "w").write(repr(sorted(defines.items())))
        return path

    monkeypatch.setattr(_nvcc, "compile_library", fake_compile)
    monkeypatch.setattr(_nvcc, "nvcc", lambda: "/stand-in/nvcc")
    monkeypatch.setenv("MEGATRON_FP4_BUILD_DIR", str(tmp_path / "mine"))
    out = tmp_path / "carry" / "kernels.tar.xz"
    assert prebuild_kernels.main(["--tiles", '[{"NATURAL": 1, "MINB": 3}]', "--ntoks", "16", "--out", str(out)]) == 0
    compiled = int(re.search(r"(\d+) configurations compiled", capsys.readouterr().out).group(1))
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert compiled > 40 and len(names) == compiled and all(n.endswith(".so") and "/" not in n for n in names)
    assert os.environ["MEGATRON_FP4_BUILD_DIR"] == str(tmp_path / "mine") and not (tmp_path / "mine").exists()
    for args, message in ((["--tiles", "{"], "--tiles must be"), (["--ntoks", "12"], "--ntoks must be")):
        with pytest.raises(SystemExit):
            prebuild_kernels.main(args)
        assert message in capsys.readouterr().err
