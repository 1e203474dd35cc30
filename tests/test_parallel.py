"""megatron-core integration under torchrun/gloo on CPU: a tiny FP4 GPTModel gives the same loss and gradients
at TP=1, TP=2, PP=2 and DP=2 (and PP=2 with tied embeddings), trains with megatron-core's optimizer, and is bit-identical to megatron-core's
local spec when no recipe is active. The work happens in tests/dist/gpt_parallel.py (two launches in all)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "dist", "gpt_parallel.py")
STEPS = 20


pytestmark = pytest.mark.slow  # two launches, about a minute on 2 cores


def _run(cmd, timeout=600, **env_changes):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env_changes)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt_parallel"))
    _run([sys.executable, SCRIPT, "--layouts", "ref,ref@mxfp4,ref_tied,ref_bf16", "--out", out, "--steps", str(STEPS)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run(torchrun + [SCRIPT, "--layouts", "hp:tp2,pp2,dp2,tp2@mxfp4,pp2_tied,linears", "--out", out,
                     "--steps", str(STEPS)])
    return {f[:-3]: torch.load(os.path.join(out, f), weights_only=False) for f in os.listdir(out)}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("layout,ref", [("hp_tp2", "ref"), ("pp2", "ref"), ("dp2", "ref"),
                                        ("tp2_mxfp4", "ref_mxfp4"), ("pp2_tied", "ref_tied")])
def test_same_loss_and_grads_across_layouts(results, layout, ref):
    r, base = results[layout], results[ref]
    assert r["world"] == 2 and base["world"] == 1
    assert abs(r["loss0"] - base["loss0"]) <= 1e-5 * abs(base["loss0"])
    grads = dict(r["grads0"])
    if layout == "pp2_tied":  # the last stage's copy of the tied embedding carries the same (summed) grad
        assert torch.equal(grads.pop("output_layer.weight"), grads["embedding.word_embeddings.weight"])
    assert set(grads) == set(base["grads0"])
    assert len(base["grads0"]) == (30 if layout == "pp2_tied" else 31)
    for name, g in base["grads0"].items():
        assert g.norm() > 0, name
        assert _rel(grads[name], g) < 1e-5, name


@pytest.mark.parametrize("layout", ["ref", "ref_mxfp4", "ref_tied", "ref_bf16", "hp_tp2", "pp2", "dp2", "tp2_mxfp4",
                                    "pp2_tied"])
def test_loss_decreases_with_megatron_optimizer(results, layout):
    losses = results[layout]["train_losses"]
    assert len(losses) == STEPS + 1
    assert losses[-1] < 0.5 * losses[0]
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= STEPS * 3 // 4


def test_bf16_model_runs_fp4(results):
    """bf16 parameters (Float16Module + megatron's mixed-precision optimizer): same parameters, FP4 GEMMs on bf16
    operands. FP4 rounding amplifies bf16-vs-fp32 differences, so only the scale of the loss is compared."""
    r, base = results["ref_bf16"], results["ref"]
    assert set(r["grads0"]) == set(base["grads0"])
    assert abs(r["loss0"] - base["loss0"]) < 0.05 * base["loss0"]


def test_fp4_is_active_and_no_recipe_is_bit_identical_to_megatron(results):
    r = results["hp_tp2"]
    assert r["hp_fp4_linears"] == 16  # 4 layers x (qkv, proj, fc1, fc2)
    assert r["hp_fp4_spec_loss"] == r["hp_local_spec_loss"]
    assert set(r["hp_fp4_spec_grads"]) == set(r["hp_local_spec_grads"])  # identical parameter names
    for name, g in r["hp_local_spec_grads"].items():
        assert torch.equal(r["hp_fp4_spec_grads"][name], g), name
    assert abs(r["hp_fp4_spec_loss"] - r["loss0"]) > 1e-4  # the FP4 model computes something else
    # an fp4_autocast block overrides the config's recipe: off -> megatron-core's numbers, bit for bit
    assert r["autocast_off_loss"] == r["hp_local_spec_loss"]
    assert abs(r["autocast_mxfp4_loss"] - results["tp2_mxfp4"]["loss0"]) <= 1e-5 * r["loss0"]


def test_tp2_linears_sequence_parallel_and_bitwise_off(results):
    r = results["linears"]
    assert r["off_equal_all_ranks"]
    assert r["fp4_vs_full_worst_all_ranks"] < 1e-5
    assert min(r["fp4_vs_megatron_sp"] + r["fp4_vs_megatron_nosp"]) > 1e-2


def test_high_precision_layers_follow_global_layer_number(results):
    for layout in ("ref", "pp2", "hp_tp2"):
        numbers = results[layout]["layer_numbers"]
        assert sorted({n for n, _ in numbers.values()}) == [1, 2, 3, 4]
        for name, (number, fp4) in numbers.items():
            assert fp4 == (number in (2, 3)), (layout, name)
    # under PP=2 the second stage's local layers 0/1 are global layers 3/4
    pp = results["pp2"]["layer_numbers"]
    assert pp["rank1:decoder.layers.0.mlp.linear_fc1"][0] == 3


def test_underflow_diagnostics_on_gpt(results):
    rates = results["ref"]["underflow"]
    assert len(rates) == 16
    assert all(0.0 <= v < 1.0 for v in rates.values())
    assert any(v > 0 for v in rates.values())
    # DP=2 (one micro-batch per replica, counts summed over the DP group) sees exactly the TP=1 inputs
    assert results["dp2"]["underflow"] == rates


@pytest.mark.gpu
def test_cuda_matches_cpu_with_kernels(tmp_path):
    """The same model on one GPU, FP4 GEMMs through the kernels (ops.kernels_backend), equals the CPU reference run."""
    pytest.importorskip("triton")
    _run([sys.executable, SCRIPT, "--layouts", "ref", "--out", str(tmp_path / "gpu"), "--steps", "2", "--kernels"])
    _run([sys.executable, SCRIPT, "--layouts", "ref", "--out", str(tmp_path / "cpu"), "--steps", "2"],
         CUDA_VISIBLE_DEVICES="")
    gpu = torch.load(tmp_path / "gpu" / "ref.pt", weights_only=False)
    cpu = torch.load(tmp_path / "cpu" / "ref.pt", weights_only=False)
    assert gpu["kernel_gemm_calls"] > 0 and cpu["kernel_gemm_calls"] == 0
    assert abs(gpu["loss0"] - cpu["loss0"]) <= 1e-5 * cpu["loss0"]
    for name, g in cpu["grads0"].items():
        assert _rel(gpu["grads0"][name], g) < 1e-5, name
