"""benchmarks/bench_rollout.py --append: a grid measured over several GPU calls collects in one results file."""

import os
import sys

import torch

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


def test_sglang_rows_flush_the_prefix_cache_before_every_timed_generate(monkeypatch):
    """The timed generates repeat the same prompts: without a flush SGLang's radix cache would skip their prefill
    (session 26 measured the 7B rows that way, 16% faster than with the prefill), the native engine never does."""
    import types

    import bench_rollout
    from megatron_fp4.rollout import sglang_engine

    calls, backends = [], []

    class Engine:
        last_generate_stats = {"seconds": 1.0, "tokens_per_s": 4.0}

        def __init__(self, *args, **kwargs):
            backends.append(kwargs["attention_backend"])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def flush_cache(self):
            calls.append("flush")

        def generate(self, prompts, params):
            calls.append("generate")
            return [types.SimpleNamespace(token_ids=[1, 2], logprobs=[-0.5, -0.25]) for _ in prompts]

        def update_weights(self, named):
            calls.append("sync")
            return types.SimpleNamespace(total_seconds=0.1)

    monkeypatch.setattr(sglang_engine, "SGLangRolloutEngine", Engine)
    monkeypatch.setattr(bench_rollout, "export_hf", lambda model, args, path: path)
    monkeypatch.setattr("megatron_fp4.rollout.teacher_forced_logprobs", lambda m, p, t, prec: [[-0.5, -0.25]] * len(p))
    a = types.SimpleNamespace(work_dir="/tmp/unused", profile=False, check_samples=2, batch=2, precisions="bf16",
                              repeats=2, prompt_len=4, new_tokens=2, sglang_attention_backend="triton")
    model = types.SimpleNamespace(named_parameters=lambda: iter(()))
    from megatron_fp4.rollout.precision import get_weight_cache

    weight = torch.zeros(4, 4)
    get_weight_cache(model).get_prepared(weight, "kernels:hif4", lambda w: torch.zeros(2 ** 18))  # the check's
    rows, saved = [], []
    bench_rollout.sglang_rows(a, "qwen2.5-1.5b", model, None, [[5, 6, 7, 8]] * 2, None, rows,
                              lambda: saved.append(len(rows)))
    assert calls == ["generate", "flush", "generate", "flush", "generate", "sync", "generate"]
    assert rows[0]["prefix_cache"] == "flushed before each generate" and rows[0]["tokens_per_s"] == 4.0
    assert rows[0]["seconds_all"] == [1.0, 1.0]  # every timed generate, not only their median
    assert backends == ["triton"] and rows[0]["path"] == "sglang" and rows[0]["attention_backend"] == "triton"
    assert saved == [1]
    # the teacher-forced check's FP4 weights are dropped before the next Engine (session 29: 96 GiB after two rows)
    assert len(get_weight_cache(model)) == 0 and "check_weights_freed_gib" in rows[0]

    # a row that runs out of GPU memory is recorded with its error, saved, and the next precision still runs
    # (session 29's 7B call lost its two measured rows to the third one's OOM)
    class OOMEngine(Engine):
        def __init__(self, path, precision, **kwargs):
            if precision.label != "bf16":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.05 GiB")

    monkeypatch.setattr(sglang_engine, "SGLangRolloutEngine", OOMEngine)
    a.precisions = "w4a16/hif4,bf16"
    rows, saved = [], []
    bench_rollout.sglang_rows(a, "qwen2.5-1.5b", model, None, [[5, 6, 7, 8]] * 2, None, rows,
                              lambda: saved.append(len(rows)))
    assert saved == [1, 2] and "OutOfMemoryError" in rows[0]["error"] and "tokens_per_s" not in rows[0]
    assert rows[1]["precision"] == "bf16" and rows[1]["tokens_per_s"] == 4.0

    # --sglang-attention-backend reaches the Engine, and its rows get their own path (--append keeps both)
    monkeypatch.setattr(sglang_engine, "SGLangRolloutEngine", Engine)
    a.precisions, a.sglang_attention_backend, rows = "bf16", "fa3", []
    bench_rollout.sglang_rows(a, "qwen2.5-1.5b", model, None, [[5, 6, 7, 8]] * 2, None, rows, lambda: None)
    assert backends[-1] == "fa3" and rows[0]["path"] == "sglang+fa3"


def test_profile_short_names_say_what_torchs_templated_kernels_compute():
    """--profile's top kernels: torch's templated names (all elementwise kernels alike in their first 90 characters)
    shortened to the kernel, the operation, the dtypes and a cast; plain names kept."""
    from kernel_profile import short_name

    copy = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(float)#1}, "
            "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned "
            "int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, "
            "at::native::direct_copy_kernel_cuda)")
    add = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
           "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
    softmax = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
               "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)")
    assert short_name(copy) == "unrolled_elementwise_kernel<direct_copy_kernel_cuda>[float] with cast"
    assert short_name(add) == "vectorized_elementwise_kernel<CUDAFunctor_add>[BFloat16]"
    assert short_name(softmax) == "cunn_SoftMaxForward<SoftMaxForwardEpilogue>[float]"
    for plain in ("nvjet_sm90_tst_96x64_64x10_4x1_v_bz_splitK_TNN", "_add_rms_norm_kernel"):
        assert short_name(plain) == plain


def test_profile_families_name_the_rollout_kernels():
    """--profile sorts a decode step's kernels into families (the FP4 decode GEMMs before the other GEMMs)."""
    from kernel_profile import family

    assert [family(n) for n in ("w4_wgmma_kernel", "_w4_decode_kernel", "sm90_xmma_gemm_bf16bf16_bf16f32",
                                "_resq_kernel", "quant_both_kernel", "resq_sum_kernel", "flash_fwd_kernel",
                                "_add_rms_norm_kernel", "_rope_kv_kernel", "something_else")] == [
        "fp4 decode gemm", "fp4 decode gemm", "gemm", "fp4 quantize", "fp4 quantize", "fp4 quantize", "attention",
        "norm / rope / swiglu", "norm / rope / swiglu", "other"]
    assert family("_split_sum_kernel") == "copy/cast"  # (what it replaced: a zero-fill and a cast)


def test_sglang_profile_reads_the_engines_trace_by_family(tmp_path):
    """--profile on an SGLang row: the Engine's scheduler writes a Chrome trace (gzip) that may still be half written
    when stop_profile returns; its kernel events are summed by family as the native rows' (CPU events ignored)."""
    import gzip
    import json
    import threading
    import time

    import bench_rollout

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "w4_wgmma_kernel", "dur": 3000.0},
        {"cat": "kernel", "name": "w4_wgmma_kernel", "dur": 2000.0},
        {"cat": "kernel", "name": "_split_sum_kernel", "dur": 400.0},
        {"cat": "kernel", "name": "nvjet_sm90_tst_64x32_64x16_4x2_h_bz_TNT", "dur": 1250.0},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 999.0},
        {"ph": "M", "name": "process_name"}]}
    calls = []

    def finish(path):  # the scheduler finishes the file a moment after stop_profile returned
        time.sleep(0.5)
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)

    class Engine:  # sglang.Engine's profiler methods, as SGLangRolloutEngine.engine holds it
        def start_profile(self, output_dir=None, with_stack=None, record_shapes=None):  # (ProfileReq's fields)
            calls.append("start")
            self.dir = output_dir

        def stop_profile(self):
            calls.append("stop")
            path = os.path.join(self.dir, "1764900000-TP-0.trace.json.gz")
            with open(path, "wb") as f:  # its first bytes only: not yet readable
                f.write(gzip.compress(json.dumps(trace).encode())[:20])
            threading.Thread(target=finish, args=(path,)).start()

    class Rollout:
        engine = Engine()

        def flush_cache(self):
            calls.append("flush")

        def generate(self, prompts, params):
            calls.append("generate")

    r = Rollout()
    folder = tmp_path / "profile" / "w4a16_hif4"
    out = bench_rollout._sglang_profile(r, [[1, 2]], None, str(folder), wait_s=30)
    assert calls == ["flush", "start", "generate", "stop"]
    assert out["families_ms"] == {"fp4 decode gemm": 5.0, "gemm": 1.25, "copy/cast": 0.4}
    assert out["top_kernels_ms"][0] == ["w4_wgmma_kernel", 2, 5.0]
    assert out["files"] == ["1764900000-TP-0.trace.json.gz"]
    # no trace at all: an error in the row, not an exception (the row's speed is still measured)
    Engine.stop_profile = lambda self: None
    assert "no trace file" in bench_rollout._sglang_profile(r, [[1, 2]], None, str(folder), wait_s=0.1)["error"]
