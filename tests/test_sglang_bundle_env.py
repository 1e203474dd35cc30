"""tools/sglang_bundle_env.sh: the offline SGLang bundle is unpacked once, its pinned wheels installed beside it,
and the plug-in's entry point registered there (read from setup.py), so SGLang's scheduler processes find it."""

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "sglang_bundle_env.sh")


def _bundle(tmp_path):
    """A stand-in bundle: a tar.xz holding one module, and one pinned wheel (as build_sglang_bundle.sh writes)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "fake_sglang_mod.py").write_text("VALUE = 1\n")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with tarfile.open(bundle / "sglang-0.0-py312-test.tar.xz", "w:xz") as tar:
        tar.add(src / "fake_sglang_mod.py", arcname="fake_sglang_mod.py")
    with zipfile.ZipFile(bundle / "pinned-1.0-py3-none-any.whl", "w") as z:
        z.writestr("pinned.py", "PINNED = 2\n")
        z.writestr("pinned-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pinned\nVersion: 1.0\n")
        z.writestr("pinned-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n")
        z.writestr("pinned-1.0.dist-info/RECORD", "")
    return bundle


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_bundle_env_unpacks_once_and_registers_the_plugin(tmp_path):
    bundle, target = _bundle(tmp_path), tmp_path / "target"
    probe = ("import fake_sglang_mod, pinned; from importlib.metadata import entry_points; "
             "print([e.value for e in entry_points(group='sglang.srt.plugins')])")
    cmd = (f"source {SCRIPT} {bundle} {target} && echo PYTHONPATH=$PYTHONPATH && "
           f"PYTHONPATH={target} {sys.executable} -c \"{probe}\"")
    for _ in range(2):  # the second time the unpacked bundle is kept (a warm machine between calls)
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert r.returncode == 0, r.stderr
        assert f"PYTHONPATH={ROOT}:{target}\n" in r.stdout
        assert "['megatron_fp4.sglang_plugin:register']" in r.stdout
    assert (target / ".unpacked").exists()


def test_bundle_env_says_what_failed(tmp_path):
    r = subprocess.run(["bash", "-c", f"source {SCRIPT} {tmp_path / 'missing'} {tmp_path / 't'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unpacking" in r.stderr and "missing" in r.stderr
    r = subprocess.run(["bash", "-c", f"source {SCRIPT}"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage: source tools/sglang_bundle_env.sh BUNDLE_DIR" in r.stderr
