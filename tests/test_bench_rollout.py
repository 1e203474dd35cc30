"""benchmarks/bench_rollout.py --append: a grid measured over several GPU calls collects in one results file."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_rollout import merge_results  # noqa: E402


def _row(backend, precision, batch, tps):
    return dict(backend=backend, shape="qwen2.5-1.5b", precision=precision, batch=batch, path=backend,
                tokens_per_s=tps)


def test_append_replaces_same_rows_and_keeps_others():
    old = dict(info={"date": "a"}, rows=[_row("native", "bf16", 64, 1.0), _row("sglang", "bf16", 64, 2.0)],
               checks=[{"what": "x"}])
    new = dict(info={"date": "b"}, rows=[_row("sglang", "bf16", 64, 3.0), _row("sglang", "bf16", 256, 4.0)],
               checks=[])
    out = merge_results(old, new)
    assert out["info"] == [{"date": "a"}, {"date": "b"}]
    assert [(r["backend"], r["batch"], r["tokens_per_s"]) for r in out["rows"]] == [
        ("native", 64, 1.0), ("sglang", 64, 3.0), ("sglang", 256, 4.0)]
    assert out["checks"] == [{"what": "x"}]
    again = merge_results(out, dict(info={"date": "c"}, rows=[], checks=[]))
    assert [i["date"] for i in again["info"]] == ["a", "b", "c"] and again["rows"] == out["rows"]
