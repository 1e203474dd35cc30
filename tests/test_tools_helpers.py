"""Helpers of the tools/ tests: tiny random Qwen2 / Llama models built and saved locally (no downloads)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: name -> tiny architecture; dims keep TP=2 and PP=2 possible.
VARIANTS = {
    # Qwen2.5-like: qkv biases, GQA, tied embeddings
    "qwen2_tied": dict(arch="qwen2", vocab=96, hidden=64, inter=96, layers=2, heads=4, kv=2, tie=True,
                       theta=50000.0, eps=1e-5),
    # untied, 4 layers, 8 heads / 2 KV heads, saved as a sharded checkpoint (index.json)
    "qwen2_untied": dict(arch="qwen2", vocab=128, hidden=64, inter=128, layers=4, heads=8, kv=2, tie=False,
                         theta=1e6, eps=1e-6, shard="40KB"),
    # Llama with GQA and head_dim * heads != hidden
    "llama": dict(arch="llama", vocab=112, hidden=64, inter=96, layers=2, heads=4, kv=2, head_dim=32, tie=False,
                  theta=10000.0, eps=1e-5),
    # bf16 weights and an odd vocabulary (padded at TP=2)
    "llama_bf16": dict(arch="llama", vocab=97, hidden=64, inter=96, layers=2, heads=4, kv=4, tie=True,
                       theta=500000.0, eps=1e-5, dtype=torch.bfloat16),
}


def randomize_hf_weights(model, seed: int) -> None:
    """Random weights that give O(1) logits: norms near 1, biases and matrices small, drawn in parameter order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def make_hf_model(name: str, path: Path, seed: int = 0):
    """Build the tiny model ``name`` with random weights (O(1) logits), save_pretrained it to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    v = VARIANTS[name]
    common = dict(vocab_size=v["vocab"], hidden_size=v["hidden"], intermediate_size=v["inter"],
                  num_hidden_layers=v["layers"], num_attention_heads=v["heads"], num_key_value_heads=v["kv"],
                  tie_word_embeddings=v["tie"], rms_norm_eps=v["eps"], max_position_embeddings=64,
                  rope_theta=v["theta"])
    if v["arch"] == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=v.get("head_dim", v["hidden"] // v["heads"])))
    randomize_hf_weights(model, seed)
    model = model.to(v.get("dtype", torch.float32)).eval()
    kwargs = {"max_shard_size": v["shard"]} if "shard" in v else {}
    model.save_pretrained(str(path), **kwargs)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tool(script: str, *args: str, nproc: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run tools/<script> (under torchrun with ``nproc`` processes when nproc > 0); returns the finished process."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    cmd += [str(REPO / "tools" / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=env)
