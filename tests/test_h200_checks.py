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
    assert len(selections) == 3
    for args in selections:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and re.search(r"\d+ tests? collected", r.stdout), (args, r.stdout[-500:])


def test_its_benchmark_flags_exist():
    runs = _commands("python3 benchmarks/")
    runs += [c[c.index("python3") + 1:] for c in _commands("ncu ") if "python3" in c]  # the profiled program's flags
    assert len(runs) == 6
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
