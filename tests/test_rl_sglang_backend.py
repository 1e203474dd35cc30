"""``pretrain_rl.py --rollout-backend sglang`` on the CPU, against tests/fake_sglang.py's stand-in for the Engine.

The fake is an independent implementation (HF transformers' model, its own sampling loop), so these runs check the
driver's side of the wiring: the Engine's arguments, the policy's weights pushed after every update under HF names
(the train-rollout logprob mismatch of an fp32 run is rounding only), the memory released while the policy trains and
the weights pushed again after it is restored (--offload-rollout), and evaluations in other precisions and the
underflow diagnostics on the native engine with the policy's weights. SGLang itself (the Engine, our kernels inside
it) is tested on the GPU (tests/test_sglang.py) and its arguments against SGLang's ServerArgs
(tests/test_sglang_plugin.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from megatron_fp4.sglang_plugin.loader import REQUANTIZING_LOADER  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--num-synthetic-examples", "600", "--eval-samples", "16",
        "--rollout-batch-size", "4", "--group-size", "4", "--micro-batch-size", "16", "--sft-iters", "3",
        "--sft-batch-size", "16", "--max-response-length", "4", "--seed", "7", "--train-iters", "2"]


def _run(tmp_path, name, args, fake=True, nproc=1):
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path,  # keeps SGLang's own folders on a GPU machine
           "OMP_NUM_THREADS": "1", "FAKE_SGLANG_LOG": str(tmp_path / f"{name}.engine.jsonl")}
    log = tmp_path / f"{name}.jsonl"
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               os.path.join(ROOT, "tests", "fake_sglang.py" if fake else "../pretrain_rl.py")]
    else:
        cmd = ([sys.executable, "-c", "import fake_sglang; fake_sglang.run_driver()"] if fake
               else [sys.executable, os.path.join(ROOT, "pretrain_rl.py")])
    result = tmp_path / f"{name}.result.json"
    r = subprocess.run([*cmd, *TINY, *args, "--log-jsonl", str(log), "--results-json", str(result)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows.append({"kind": "result", **json.loads(result.read_text())})
    engine_log = tmp_path / f"{name}.engine.jsonl"
    calls = [json.loads(line) for line in engine_log.read_text().splitlines()] if engine_log.exists() else []
    return r, rows, calls


def _rows(rows, kind):
    return [r for r in rows if r.get("kind") == kind]


def test_policy_weights_reach_the_engine_after_every_update(tmp_path):
    """fp32 training and bf16 rollout: the Engine starts from config.json alone with the flags' arguments, gets the
    policy's weights (every HF tensor) before the first evaluation and after each step, and the train-rollout
    logprob mismatch of every step is rounding only: the Engine computes with the policy's weights."""
    r, rows, calls = _run(tmp_path, "sglang", ["--rollout-backend", "sglang", "--rollout-precision", "bf16",
                                               "--resq", "none", "--no-fp4-train", "--sglang-mem-fraction-static",
                                               "0.3", "--sglang-base-port", "31000"])
    assert "rollout: bf16 (sglang)" in r.stdout
    start = calls[0]
    assert start["op"] == "start" and start["files"] == ["config.json"]
    kw = start["kwargs"]
    assert (kw["load_format"], kw["mem_fraction_static"], kw["port"], kw["nccl_port"]) == ("dummy", 0.3, 31000, 31008)
    assert kw["dtype"] == "float32" and kw["skip_tokenizer_init"] and "quantization" not in kw
    ops = [c["op"] for c in calls]
    assert ops.count("update") == 3 and ops.index("update") < ops.index("generate")  # initial sync + one per step
    assert "release" not in ops  # no --offload-rollout
    for i, c in enumerate(calls):
        if c["op"] == "update":  # the whole tiny model in one bucket, then the prefix cache flushed
            assert c["missing"] == [] and c["load_format"] == REQUANTIZING_LOADER and not c["flush_cache"]
            assert calls[i + 1]["op"] == "flush_cache"
    train = _rows(rows, "train")
    assert [t["step"] for t in train] == [1, 2]
    for t in train:
        assert t["logp_abs_diff_max"] < 1e-4, t["logp_abs_diff_max"]


@pytest.mark.slow
def test_one_engine_per_tensor_parallel_group(tmp_path):
    """TP = 2 under torchrun: the group's first rank alone starts an Engine (tp_size 2) and generates; the policy's
    TP shards are gathered and merged for every push, so the fp32 train-rollout mismatch is rounding only."""
    _, rows, calls = _run(tmp_path, "tp2", ["--rollout-backend", "sglang", "--rollout-precision", "bf16", "--resq",
                                            "none", "--no-fp4-train", "--tensor-model-parallel-size", "2"], nproc=2)
    starts = [c for c in calls if c["op"] == "start"]
    assert len(starts) == 1 and starts[0]["kwargs"]["tp_size"] == 2
    assert {c["pid"] for c in calls} == {starts[0]["pid"]}  # every Engine call from that one rank
    assert [c["op"] for c in calls].count("update") == 3
    assert all(c["missing"] == [] for c in calls if c["op"] == "update")
    train = _rows(rows, "train")
    assert [t["step"] for t in train] == [1, 2]
    for t in train:
        assert t["logp_abs_diff_max"] < 1e-4, t["logp_abs_diff_max"]


@pytest.mark.slow
def test_pipeline_parallel_engine_on_the_first_stage(tmp_path):
    """PP = 2 under torchrun: the first stage alone starts an Engine (tp_size 1) holding the whole depth; every push
    carries both stages' layers (gathered over the pipeline) and the later stage trains on the first stage's samples,
    so the fp32 train-rollout mismatch is rounding only (the native engine beside it: tests/test_pp_gather.py)."""
    pp2 = ["--pipeline-model-parallel-size", "2"]
    _, rows, calls = _run(tmp_path, "pp2", [*pp2, "--rollout-backend", "sglang", "--rollout-precision", "bf16",
                                            "--resq", "none", "--no-fp4-train"], nproc=2)
    starts = [c for c in calls if c["op"] == "start"]
    assert len(starts) == 1 and starts[0]["kwargs"]["tp_size"] == 1
    assert {c["pid"] for c in calls} == {starts[0]["pid"]}  # every Engine call from the first stage's rank
    updates = [c for c in calls if c["op"] == "update"]
    assert len(updates) == 3 and all(c["missing"] == [] for c in updates)
    train = _rows(rows, "train")
    assert [t["step"] for t in train] == [1, 2]
    for t in train:
        assert t["logp_abs_diff_max"] < 1e-4, t["logp_abs_diff_max"]


def test_offload_and_diagnostics_on_the_native_engine(tmp_path):
    """FP4 rollout with --offload-rollout: the Engine's memory is released for each training phase and restored
    before the weights are pushed again (the fake's released weights are NaN: a missed push would show as
    non-finite logprobs); ``accuracy_bf16`` and the underflow rates come from the native engine with the policy's
    weights: the warm-start ``accuracy_bf16`` equals a native-backend run's."""
    common = ["--rollout-precision", "w4a4", "--resq", "2:4", "--log-underflow-interval", "2"]
    r, rows, calls = _run(tmp_path, "sglang", [*common, "--rollout-backend", "sglang", "--offload-rollout"])
    assert "(sglang)" in r.stdout
    ops = [c["op"] for c in calls]
    assert calls[0]["kwargs"]["enable_memory_saver"] and calls[0]["kwargs"]["quantization"] == "megatron_fp4"
    assert ops.count("release") == 2 and ops.count("resume") == 2
    for i in (i for i, op in enumerate(ops) if op == "release"):
        assert ops[i + 1:i + 4] == ["resume", "update", "flush_cache"]  # nothing runs on released memory
    for t in _rows(rows, "train"):
        assert t["logp_abs_diff_max"] < 1e3  # finite: the engine sampled with real weights
    _, native_rows, _ = _run(tmp_path, "native", [*common, "--rollout-backend", "native"], fake=False)
    warm = _rows(rows, "result")[0]["warm_start"]
    native_warm = _rows(native_rows, "result")[0]["warm_start"]
    assert warm["accuracy_bf16"] == native_warm["accuracy_bf16"]
    underflow = _rows(rows, "underflow")
    assert [u["step"] for u in underflow] == [0, 2]
    native_underflow = _rows(native_rows, "underflow")
    assert underflow[0] == native_underflow[0]  # same policy weights at step 0, same native measurement

    # the native engine under --offload-rollout: released and restored around every update, same run
    _, offload_rows, _ = _run(tmp_path, "native_offload", [*common, "--rollout-backend", "native",
                                                           "--offload-rollout"], fake=False)

    def untimed(rs):
        return [{k: v for k, v in r.items() if not k.endswith(("_s", "_per_s", "seconds"))} for r in rs
                if r["kind"] != "result"]

    assert untimed(offload_rows) == untimed(native_rows)


@pytest.mark.gpu
def test_real_engine_in_the_driver(tmp_path):
    """With a GPU, SGLang and the plug-in: two GRPO steps on a real Engine (bf16, HiF4 W4A4 + ResQ 2:4, memory
    released while training): the run ends normally and every step's train-rollout mismatch is finite and below
    what an unrelated policy would give."""
    from megatron_fp4.rollout.sglang_engine import sglang_start_problem

    why = sglang_start_problem()
    if why is not None:
        pytest.skip(why)
    args = ["--rollout-backend", "sglang", "--bf16", "--rollout-precision", "w4a4", "--resq", "2:4",
            "--offload-rollout", "--sglang-mem-fraction-static", "0.3", "--hidden-size", "256",
            "--ffn-hidden-size", "512", "--num-attention-heads", "4"]
    r, rows, _ = _run(tmp_path, "real", args, fake=False)
    assert "(sglang)" in r.stdout
    train = _rows(rows, "train")
    assert [t["step"] for t in train] == [1, 2]
    for t in train:
        assert 0 <= t["logp_abs_diff_mean"] < 0.5, t


def test_sglang_layout_checks_name_the_flag(monkeypatch):
    """Where SGLang could start: pipeline parallelism, a TP size that does not divide the processes per node and
    Engine ports over torchrun's MASTER_PORT are refused at parse time, naming the flag."""
    from megatron_fp4.rl.arguments import load_args, validate_args
    from megatron_fp4.rollout import sglang_engine

    monkeypatch.setattr(sglang_engine, "sglang_start_problem", lambda needs_plugin=True: None)

    def check(argv, world_size=1, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return validate_args(load_args(["--rollout-backend", "sglang", *argv]), world_size=world_size)

    assert check(["--pipeline-model-parallel-size", "2"], world_size=2, LOCAL_WORLD_SIZE="2")  # the first stage's
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 2 must divide the processes per node \(3\)"):
        check(["--tensor-model-parallel-size", "2"], world_size=4, LOCAL_WORLD_SIZE="3")
    with pytest.raises(ValueError, match="--sglang-base-port=30000: .* include torchrun's MASTER_PORT 30020"):
        check([], MASTER_PORT="30020", LOCAL_WORLD_SIZE="2")
    assert check(["--sglang-base-port", "31000"], MASTER_PORT="30020", LOCAL_WORLD_SIZE="2").sglang_base_port == 31000


def test_sglang_server_args_pass_through(monkeypatch):
    """--sglang-server-args: a JSON object of further ServerArgs fields reaches the Engine's arguments; bad JSON, a
    non-object, a field the driver sets (naming its flag) and, where SGLang is installed, a field ServerArgs does not
    have (with close matches) are refused at parse time."""
    import torch

    from megatron_fp4.rl.arguments import load_args, rl_config, validate_args
    from megatron_fp4.rl.rollout_manager import sglang_engine_kwargs
    from megatron_fp4.rollout import sglang_engine

    monkeypatch.setattr(sglang_engine, "sglang_start_problem", lambda needs_plugin=True: None)
    monkeypatch.setattr(sglang_engine, "sglang_server_args_fields",
                        lambda: ["chunked_prefill_size", "max_running_requests", "port", "mem_fraction_static",
                                 "disable_prefill_cuda_graph"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def check(value):
        return validate_args(load_args(["--rollout-backend", "sglang", "--sglang-server-args", value]))

    args = check('{"chunked_prefill_size": 4096, "max_running_requests": 256}')
    kwargs = sglang_engine_kwargs(rl_config(args).rollout, torch.bfloat16, seed=0)
    assert (kwargs["chunked_prefill_size"], kwargs["max_running_requests"]) == (4096, 256)
    default = rl_config(check("")).rollout
    kwargs = sglang_engine_kwargs(default, torch.bfloat16, seed=0)
    assert "chunked_prefill_size" not in kwargs and kwargs["disable_prefill_cuda_graph"] is True
    # decode graphs up to one step's samples, at most 512
    assert kwargs["cuda_graph_max_bs_decode"] == min(default.rollout_batch_size * default.group_size, 512)
    args = check('{"disable_prefill_cuda_graph": false}')
    assert sglang_engine_kwargs(rl_config(args).rollout, torch.bfloat16, seed=0)["disable_prefill_cuda_graph"] is False
    with pytest.raises(ValueError, match=r"--sglang-server-args is not valid JSON"):
        check("{chunked_prefill_size: 4096}")
    with pytest.raises(ValueError, match=r"--sglang-server-args must be a JSON object"):
        check("[1, 2]")
    with pytest.raises(ValueError, match=r"'port' is set by --sglang-base-port; 'mem_fraction_static' is set by "
                                         r"--sglang-mem-fraction-static"):
        check('{"port": 1, "mem_fraction_static": 0.5}')
    with pytest.raises(ValueError, match=r"not SGLang ServerArgs fields: 'chunked_prefil_size' \(did you mean "
                                         r"'chunked_prefill_size'\?\)"):
        check('{"chunked_prefil_size": 4096}')
