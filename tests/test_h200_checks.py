"""benchmarks/h200_checks.sh, the GPU machine's check script: a wrong part is refused with the usage line, and every
test selection and benchmark flag it names still exists here (a renamed test or flag would otherwise surface only
in a device call)."""

import os
import re
import shlex
import subprocess
import sys

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
    assert len(selections) == 10
    for args in selections:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and re.search(r"\d+ tests? collected", r.stdout), (args, r.stdout[-500:])


def test_its_benchmark_flags_exist():
    runs = _commands("python3 benchmarks/")
    runs += [c[c.index("python3") + 1:] for c in _commands("ncu ") if "python3" in c]  # the profiled program's flags
    assert len(runs) == 15
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
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SITE_DIR": str(site), "OUT": str(out or tmp_path)}


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
