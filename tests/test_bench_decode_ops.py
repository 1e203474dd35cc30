"""benchmarks/bench_decode_ops.py on the CPU (Triton's interpreter, the tiny shape): every fused decode-step kernel
is timed beside what it replaces and checked against its twin; bad flags name the flag and the allowed values."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
pytest.importorskip("triton")

import bench_decode_ops  # noqa: E402


def test_every_op_is_timed_against_its_twin_and_checked(tmp_path, capsys):
    out = tmp_path / "ops.json"
    bench_decode_ops.main(["--shapes", "tiny", "--batch", "3", "--cache", "16", "--reps", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["info"]["batch"] == 3 and "bench_decode_ops.py --shapes tiny" in doc["info"]["command"]
    rows = {(r["op"], r["impl"]): r for r in doc["rows"]}
    assert set(rows) == {("add_rms_norm", "kernel"), ("add_rms_norm", "twin"), ("add_rms_norm_8splits", "kernel"),
                         ("add_rms_norm_8splits", "split_sum + kernel"), ("add_rms_norm_8splits", "twin"),
                         ("rope_attention", "kernel"),
                         ("rope_attention", "rope kernel + sdpa"), ("rope_attention", "twin"), ("swiglu", "kernel"),
                         ("swiglu", "twin"), ("sample", "kernel"), ("sample", "twin"), ("record_tokens", "kernel"),
                         ("record_tokens", "twin")}
    for (op, impl), r in rows.items():
        assert r["us"] > 0 and r["ms_per_generate"] == pytest.approx(r["us"] * r["per_step"] * 128 / 1e3)
        if impl == "twin":
            assert r["vs_twin"] == 1.0 and r["check"] is None and r["ok"] is None
        elif impl == "kernel" or op != "record_tokens":  # fp32 in the interpreter: agreeing with the twins to rounding
            assert r["check"] <= 1e-5 and r["ok"] is True, (op, impl)
    assert rows[("add_rms_norm", "kernel")]["per_step"] == 2 * 2 and rows[("sample", "kernel")]["per_step"] == 1
    assert "rope kernel + sdpa" in capsys.readouterr().out


def test_a_kernel_off_its_twin_fails_the_run_after_the_json(tmp_path, monkeypatch, capsys):
    from megatron_fp4.kernels import decode_ops

    swiglu = decode_ops.swiglu
    monkeypatch.setattr(decode_ops, "swiglu", lambda a: swiglu(a) * 1.01)
    out = tmp_path / "ops.json"
    with pytest.raises(SystemExit, match=r"beyond the tests' tolerance: tiny swiglu \(kernel\)$"):
        bench_decode_ops.main(["--shapes", "tiny", "--batch", "3", "--cache", "16", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["check"] > 1e-3) for r in rows if r["ok"] is False] == [("swiglu", True)]
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--shapes", "qwen9"], "--shapes: qwen9 not valid; allowed values: tiny"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_bad_flags_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_decode_ops.main(flags)
    assert message in capsys.readouterr().err
