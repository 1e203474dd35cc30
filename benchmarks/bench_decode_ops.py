"""The native engine's fused decode-step kernels (megatron_fp4/kernels/decode_ops.py) one by one against what they
replace, at a decode batch of a Qwen2.5 shape: GPU time per call inside a CUDA graph (as the engine replays them),
what that is per 128-token generate, and the kernel's output against its twin's. One table, JSON under
benchmarks/results/.

    PYTHONPATH=. python3 benchmarks/bench_decode_ops.py --shapes qwen2.5-1.5b,qwen2.5-7b --batch 64 --cache 256 \\
        --out benchmarks/results/decode_ops_h200.json

Ops (per decode step: the norms twice a layer, the others once a layer or once a step): ``add_rms_norm`` (residual add
+ RMSNorm; ``add_rms_norm_8splits``: the FP4 steps' form, the residual as 8 fp32 split-K partial sums, against
split_sum first), ``rope_attention`` (RoPE, the K/V writes and the attention over each cache up to its position, against
both the RoPE kernel + SDPA with a mask, the ``MEGATRON_FP4_DECODE_ATTENTION=sdpa`` path, and the PyTorch twin),
``swiglu``, ``sample`` (temperature 1: the head's bf16 logits to a token and its logprob), ``record_tokens`` (the
step's bookkeeping) and, on a GPU with nvcc, ``swiglu_resq_{hif4,mxfp4}`` (W4A4 + ResQ 2:4 bf16 sum: fc2's operand
in one CUDA kernel against the Triton SwiGLU then the ResQ quantize, which it must equal bit for bit). Random bf16
data (fp32 on a CPU, where Triton's interpreter runs and only ``--shapes tiny`` makes sense: the times then say
nothing). ``check`` is each implementation's largest difference from the twin,
relative as the tests measure it (max |impl - twin| / (1 + |twin|); ``sample``: the fraction of tokens that differ;
``record_tokens``: of the states after one step, the kernel only), ``ok`` whether it is within the tests' tolerance
(:data:`TOLERANCE`); a failed check exits with status 1 after the JSON is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # Triton's interpreter, switched on before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_rollout import SHAPES  # noqa: E402


def time_us(fn, reps: int, device) -> float:
    """Microseconds per call of ``fn``: ``reps`` calls captured in one CUDA graph and replayed (kernels compiled
    before), or timed eagerly off a GPU."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


#: The largest ``check`` that passes, per dtype of the run (bf16: what tests/test_decode_ops.py allows a fused bf16
#: computation against the twin's op-by-op roundings), for the sampled tokens (a token may differ only where the
#: uniform falls within fp32 rounding of a CDF step) and for the ops that must give their twin's bits (0).
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-5, "sample": 0.05, "swiglu_resq_hif4": 0.0,
             "swiglu_resq_mxfp4": 0.0}


def _diff(a, b) -> float:
    """max |a - b| / (1 + |b|): within t exactly where torch.testing.assert_close(a, b, atol=t, rtol=t) passes."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / (1 + b.abs())).max().item()


def bench_shape(name: str, batch: int, cache: int, reps: int, device) -> list[dict]:
    """The rows of one shape: one per (op, implementation)."""
    import torch.nn.functional as F

    from megatron_fp4.kernels import decode_ops

    cfg = SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    h, ffn, L = cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["num_layers"]
    heads, ng, V = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["vocab_size"]
    hd, G = h // heads, heads // ng

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x, delta = randn(batch, h), randn(batch, h)
    parts = (torch.randn(8, batch, h, generator=g, device=device) / math.sqrt(8)).float()
    norm = torch.nn.RMSNorm(h, eps=1e-6).to(device)
    qkv = randn(1, batch, ng, G + 2, hd)
    kc, vc = randn(batch, ng, cache, hd), randn(batch, ng, cache, hd)
    pos = torch.randint(cache // 2, cache, (batch,), generator=g, device=device)
    ang = torch.outer(torch.arange(cache, dtype=torch.float32), 1e-4 ** (torch.arange(0, hd, 2) / hd))
    emb = torch.cat((ang, ang), dim=-1).to(device)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    valid = (torch.arange(cache, device=device)[None, :] <= pos[:, None]).view(batch, 1, 1, -1)
    scale = 1.0 / math.sqrt(hd)
    a = randn(batch, 2 * ffn)
    logits = randn(batch, V, scale=3.0).to(torch.bfloat16 if device.type == "cuda" else dtype)
    u = torch.rand(batch, generator=g, device=device)
    long = dict(dtype=torch.long, device=device)
    state = dict(done=torch.zeros(batch, dtype=torch.bool, device=device), n_gen=torch.zeros(batch, **long),
                 out_tok=torch.zeros(batch, 128, **long), out_lp=torch.zeros(batch, 128, device=device),
                 stopped=torch.zeros(batch, dtype=torch.bool, device=device),
                 limit=torch.full((batch,), 1 << 30, **long), tok=torch.zeros(batch, **long), pos=pos.clone())
    tok, lp = torch.randint(0, V, (batch,), generator=g, **long), torch.rand(batch, generator=g, device=device)
    stop = torch.tensor([-1], **long)

    def record_check() -> float:  # one step of each on copies of the same state
        got, want = ({k: v.clone() for k, v in state.items()} for _ in range(2))
        decode_ops.record_tokens(got, tok, lp, stop)
        decode_ops.record_tokens_reference(want, tok, lp, stop)
        return max(_diff(got[k], want[k]) for k in state)

    def rope_sdpa():
        q = decode_ops.rope_kv_write(qkv, cos, sin, kc, vc, pos, G)
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=valid, scale=scale)

    # op -> (calls per decode step, {implementation: fn}; the twin last, the others checked against it)
    ops = {
        "add_rms_norm": (2 * L, {"kernel": lambda: decode_ops.add_rms_norm(x, delta, norm)[0],
                                 "twin": lambda: decode_ops.add_rms_norm_reference(x, delta, norm)[0]}),
        # the FP4 steps' form: delta as the decode GEMM's fp32 split sums (8: 7B proj at 64 tokens; fc2 takes 9),
        # read by the norm kernel itself, or first added and rounded by split_sum (the same numbers, one more launch)
        "add_rms_norm_8splits": (2 * L, {
            "kernel": lambda: decode_ops.add_rms_norm(x, parts, norm)[0],
            "split_sum + kernel": lambda: decode_ops.add_rms_norm(x, decode_ops.split_sum(parts, x.dtype), norm)[0],
            "twin": lambda: decode_ops.add_rms_norm_reference(x, parts, norm)[0]}),
        "rope_attention": (L, {
            "kernel": lambda: decode_ops.rope_attention(qkv, cos, sin, kc, vc, pos, G, scale),
            "rope kernel + sdpa": rope_sdpa,
            "twin": lambda: decode_ops.rope_attention_reference(qkv, cos, sin, kc, vc, pos, G, scale)}),
        "swiglu": (L, {"kernel": lambda: decode_ops.swiglu(a), "twin": lambda: decode_ops.swiglu_reference(a)}),
        "sample": (1, {"kernel": lambda: decode_ops.sample(logits, u),
                       "twin": lambda: decode_ops.sample_reference(logits, u)}),
        "record_tokens": (1, {"kernel": lambda: decode_ops.record_tokens(state, tok, lp, stop),
                              "twin": lambda: decode_ops.record_tokens_reference(state, tok, lp, stop)}),
    }
    from megatron_fp4.kernels import cuda_quantize

    if device.type == "cuda" and cuda_quantize.available(cuda_quantize.SWIGLU_RESQ_SOURCE):
        from megatron_fp4.kernels.resq import resq_quantize

        # W4A4 + ResQ 2:4 (bf16 sum)'s operand of fc2 from fc1's fp32 split sums (2 splits): one kernel, or the
        # Triton SwiGLU and the ResQ quantize (its twin here: the same bits are the check)
        a2 = torch.randn(2, batch, 2 * ffn, generator=g, device=device)
        for fmt in ("hif4", "mxfp4"):
            ops[f"swiglu_resq_{fmt}"] = (L, {
                "kernel": lambda fmt=fmt: cuda_quantize.swiglu_resq(a2, fmt),
                "twin": lambda fmt=fmt: resq_quantize(decode_ops.swiglu(a2, torch.bfloat16, splits=True), fmt,
                                                      expand="sum", packed=False)[2].values})
    rows = []
    for op, (per_step, impls) in ops.items():
        if op == "record_tokens":  # (in place)
            checks = {"kernel": record_check()}
        else:  # every implementation against the twin
            outs = {k: fn() for k, fn in impls.items()}
            checks = {k: ((o[0] != outs["twin"][0]).float().mean().item() if op == "sample" else _diff(o, outs["twin"]))
                      for k, o in outs.items() if k != "twin"}
        twin_us = None
        for impl in reversed(list(impls)):  # the twin first: the kernels' speed-up against it
            us = time_us(impls[impl], reps, device)
            twin_us = twin_us or us
            check = checks.get(impl)
            rows.append(dict(shape=name, op=op, impl=impl, us=us, per_step=per_step,
                             ms_per_generate=us * per_step * 128 / 1e3, vs_twin=twin_us / us, check=check,
                             ok=None if check is None else check <= TOLERANCE.get(op, TOLERANCE[dtype])))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b",
                    help=f"comma-separated, of {', '.join(SHAPES)} (default: qwen2.5-1.5b,qwen2.5-7b)")
    ap.add_argument("--batch", type=int, default=64, help="sequences per decode step (default 64)")
    ap.add_argument("--cache", type=int, default=256, help="cache rows per sequence (default 256: prompt 128 + 128)")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph (default 20)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "decode_ops.json"))
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {', '.join(bad) or 'none given'} not valid; allowed values: {', '.join(SHAPES)}")
    for flag in ("batch", "cache", "reps"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in shapes:
        rows += bench_shape(name, a.batch, a.cache, a.reps, device)
    print(f"{'shape':14s} {'op':20s} {'implementation':20s} {'us/call':>9s} {'ms/generate':>12s} {'vs twin':>8s} "
          f"{'check':>9s}")
    for r in rows:
        check = "" if r["check"] is None else f"{r['check']:.2e}" + ("" if r["ok"] else " FAIL")
        print(f"{r['shape']:14s} {r['op']:20s} {r['impl']:20s} {r['us']:9.2f} {r['ms_per_generate']:12.2f} "
              f"{r['vs_twin']:7.2f}x {check:>9s}")
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), batch=a.batch,
                cache=a.cache, reps=a.reps, command="python3 benchmarks/bench_decode_ops.py " + " ".join(
                    sys.argv[1:] if argv is None else argv))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    failed = [f"{r['shape']} {r['op']} ({r['impl']})" for r in rows if r["ok"] is False]
    if failed:
        sys.exit(f"bench_decode_ops.py: differs from the twin beyond the tests' tolerance: {', '.join(failed)}")


if __name__ == "__main__":
    main()
