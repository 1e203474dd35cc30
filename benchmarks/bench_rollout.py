"""Native rollout engine benchmark: tokens/s, weight-sync time and rollout/teacher-forced logprob mismatch for
every rollout precision of the paper's table, on a randomly initialized Qwen2.5-shaped megatron-core GPTModel.

    python benchmarks/bench_rollout.py --shape qwen2.5-0.5b --batch 64 --new-tokens 256

Prints a table and writes benchmarks/results/bench_rollout.json. Numbers use the PyTorch reference quantizers
(fake-quantize + dense GEMM), not FP4 kernels: they measure the engine, not FP4 GEMM speed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=512),
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--formats", default="hif4,mxfp4")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--kernels", action="store_true", help="serve covered rollout GEMMs with the Triton kernels")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_rollout.json"))
    a = ap.parse_args()

    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.resq import RolloutPrecision, paper_rollout_precisions
    from megatron_fp4.rollout import (NativeRolloutEngine, RolloutUnderflowMonitor, SamplingParams,
                                      teacher_forced_logprobs)

    initialize_parallel(1, 1, seed=0)
    kernels_on = False
    if a.kernels:
        from megatron_fp4.rollout.kernels_backend import register_kernel_backend
        kernels_on = register_kernel_backend()
        print(f"kernel backend registered: {kernels_on}")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    args = GPTModelArgs(**SHAPES[a.shape], max_seq_len=a.prompt_len + a.new_tokens + 8, add_qkv_bias=True,
                        params_dtype=dtype, init_method_std=0.02)
    model = build_gpt_model(args)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.prompt_len // 2, a.prompt_len + 1, (a.batch,), generator=g).tolist()
    prompts = [torch.randint(10, args.vocab_size, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)

    precisions = {"BF16": RolloutPrecision("bf16")}
    for fmt in a.formats.split(","):
        for name, p in paper_rollout_precisions(fmt).items():
            if p.mode != "bf16":
                precisions[f"{name} [{fmt}]"] = p
        precisions[f"FP4 + ResQ dense [{fmt}]"] = RolloutPrecision("w4a4", fmt, "dense")
        precisions[f"FP4 + OCC [{fmt}]"] = RolloutPrecision("w4a4", fmt, activation_method="occ")

    rows = []
    engine = NativeRolloutEngine(model, RolloutPrecision("bf16"))
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    for name, p in precisions.items():
        engine.set_precision(p)
        sync = engine.update_weights(model.named_parameters())
        samples = engine.generate(prompts, params)
        st = dict(engine.last_generate_stats)
        sub = list(range(min(8, len(prompts))))
        ref = teacher_forced_logprobs(model, [prompts[i] for i in sub], [samples[i].token_ids for i in sub], p)
        diffs = torch.tensor([abs(x - y) for i, r in zip(sub, ref) for x, y in zip(samples[i].logprobs, r)])
        row = dict(name=name, precision=p.label, tokens_per_s=st["tokens_per_s"], seconds=st["seconds"],
                   generated_tokens=st["generated_tokens"], weight_sync_s=sync.total_seconds,
                   weight_quantize_s=sync.quantize_seconds, logp_mismatch_mean=float(diffs.mean()),
                   logp_mismatch_max=float(diffs.max()))
        rows.append(row)
        print(f"{name:28s} {st['tokens_per_s']:10.1f} tok/s  sync {sync.total_seconds:7.3f}s "
              f"(quant {sync.quantize_seconds:6.3f}s)  |dlogp| mean {row['logp_mismatch_mean']:.2e} "
              f"max {row['logp_mismatch_max']:.2e}", flush=True)

    kernel_check = []
    if kernels_on:
        # kernels vs the PyTorch reference on the same model: greedy tokens and logprobs
        from megatron_fp4.rollout.kernels_backend import unregister_kernel_backend, register_kernel_backend
        greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
        sub = prompts[:8]
        for fmt in a.formats.split(","):
            for p in (RolloutPrecision("w4a4", fmt), RolloutPrecision("w4a4", fmt, "2:4"),
                      RolloutPrecision("w4a16", fmt)):
                engine.set_precision(p)
                t0 = time.perf_counter(); ker = engine.generate(sub, greedy); tk = time.perf_counter() - t0
                unregister_kernel_backend()
                engine.set_precision(p)
                t0 = time.perf_counter(); ref = engine.generate(sub, greedy); tr = time.perf_counter() - t0
                tf = teacher_forced_logprobs(model, sub, [s.token_ids for s in ker], p)
                register_kernel_backend()
                same = sum(x.token_ids == y.token_ids for x, y in zip(ker, ref)) / len(sub)
                d = max(abs(x - y) for s, r in zip(ker, tf) for x, y in zip(s.logprobs, r))
                kernel_check.append(dict(precision=p.label, identical_greedy=same, max_logp_diff_vs_reference=d,
                                         kernel_s=tk, reference_s=tr))
                print(f"kernels {p.label:22s} identical greedy {same:.2f}  max|dlogp| vs reference {d:.2e}  "
                      f"{tk:.2f}s vs {tr:.2f}s", flush=True)

    underflow = {}
    for fmt in a.formats.split(","):
        engine.set_precision(RolloutPrecision("w4a4", fmt))
        with RolloutUnderflowMonitor(model, fmt, "2:4") as mon:
            engine.generate(prompts[:8], SamplingParams(max_new_tokens=16, seed=0))
        underflow[fmt] = mon.collect()
        worst = sorted(underflow[fmt].items(), key=lambda kv: -kv[1]["fp4"])[:4]
        for n, r in worst:
            print(f"underflow {fmt} {n:45s} fp4 {r['fp4']:.3f}  resq2:4 {r['resq']:.3f}")

    info = dict(shape=a.shape, batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, dtype=a.dtype,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                date=time.strftime("%Y-%m-%d"), torch=torch.__version__, kernels=kernels_on)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(info=info, rows=rows, kernel_check=kernel_check, underflow=underflow), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
