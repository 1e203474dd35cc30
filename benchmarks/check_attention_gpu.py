"""GPU check of issue 21's attention and log-prob paths on the Qwen2.5-1.5B shape: SDPA core attention against
megatron-core's unfused DotProductAttention, and the chunked (vocab-parallel) log-probs / entropy against the
full-vocabulary reference; prints a table and writes JSON.

    PYTHONPATH=. python benchmarks/check_attention_gpu.py --json benchmarks/results/attention_logprobs_h200.json
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/check_attention_gpu.py --json ...   # TP=2 log-probs too

Attention (bf16, hidden 1536, 12 heads, 2 KV groups, head dim 128, seq 2048, batch 4): forward + backward of both
modules on the same inputs and upstream gradient; max / mean |difference| of the output and of dq, dk, dv, and each
one's relative error against the fp32 unfused result; which SDPA kernel ran (from the profiler's kernel names:
flash, efficient, cudnn or math) and which backends accept the shape when forced one at a time; time and peak
memory of forward + backward; THD-packed sequences (the varlen path) against one SDPA call per sequence. Then a
2-layer GPTModel of the 1.5B shape (random weights) built with each backend: logits and parameter gradients
compared; and the SDPA model on a THD pack of uneven sequences (forward + backward) against one forward per
sequence.

Log-probs (bf16 logits [4 x 2048, 151936], std 2, random targets): megatron_fp4.rl.logprobs against
grpo.token_logprobs / entropy_from_logits (log_softmax of an fp32 copy): max |difference| of log-probs, entropy and
the logits' gradient, whether they are bit-identical (expected at TP = 1), time and the peak memory above the logits.
Under torchrun with N processes each rank holds 1/N of the vocabulary and the reference is computed from the full
logits on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPE = dict(hidden=1536, heads=12, groups=2, head_dim=128, seq=2048, batch=4, vocab=151936, ffn=8960)
#: --cpu-smoke: the same code on a tiny shape on the CPU (no timings, profiler or memory), to check the script.
SMOKE = dict(hidden=64, heads=4, groups=2, head_dim=16, seq=24, batch=2, vocab=96, ffn=128)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _timed(fn, repeats: int = 5) -> tuple[float, float]:
    """(median ms, peak MiB above the memory in use before) of fn(); None, None on the CPU."""
    if not torch.cuda.is_available():
        return None, None
    fn()
    torch.cuda.synchronize()
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return sorted(times)[len(times) // 2], peak


def _kernel_family(names: list[str]) -> str:
    low = " ".join(n.lower() for n in names)
    for key, family in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient"),
                        ("cutlass", "efficient")):
        if key in low:
            return family
    return "math (no fused attention kernel)"


def _config(s: dict, dtype: torch.dtype):
    from megatron_fp4.models import GPTModelArgs, gpt_transformer_config

    args = GPTModelArgs(num_layers=2, hidden_size=s["hidden"], ffn_hidden_size=s["ffn"], num_attention_heads=s["heads"],
                        num_query_groups=s["groups"], kv_channels=s["head_dim"], vocab_size=s["vocab"],
                        max_seq_len=s["seq"], add_qkv_bias=True, params_dtype=dtype)
    return args, gpt_transformer_config(args)


def check_attention(s: dict, out: dict) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from megatron_fp4.parallel import SDPADotProductAttention

    dev = _device()
    mods = {}
    for dtype in (torch.bfloat16, torch.float32):
        _, cfg = _config(s, dtype)
        kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        mods[dtype] = DotProductAttention(**kw).to(dev), SDPADotProductAttention(**kw).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(s["seq"], s["batch"], s["heads"], s["head_dim"], device=dev, generator=g)
    k = torch.randn(s["seq"], s["batch"], s["groups"], s["head_dim"], device=dev, generator=g)
    v = torch.randn(s["seq"], s["batch"], s["groups"], s["head_dim"], device=dev, generator=g)
    up = torch.randn(s["seq"], s["batch"], s["heads"] * s["head_dim"], device=dev, generator=g)

    def run(module, dtype):
        qq, kk, vv = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
        o = module(qq, kk, vv, None)
        o.backward(up.to(dtype))
        return o.detach(), qq.grad, kk.grad, vv.grad

    ref32 = run(mods[torch.float32][0], torch.float32)
    local, sdpa = run(mods[torch.bfloat16][0], torch.bfloat16), run(mods[torch.bfloat16][1], torch.bfloat16)
    sdpa32 = run(mods[torch.float32][1], torch.float32)
    rows = {}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        rows[name] = {"sdpa_vs_unfused_bf16": _diff(sdpa[i], local[i]),
                      "rel_err_vs_fp32_unfused": {"sdpa_bf16": _rel(sdpa[i], ref32[i]),
                                                  "unfused_bf16": _rel(local[i], ref32[i])},
                      "sdpa_vs_unfused_fp32": _diff(sdpa32[i], ref32[i])}
    out["attention"] = rows
    del ref32, sdpa32
    if dev.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(mods[torch.bfloat16][1], torch.bfloat16)
            torch.cuda.synchronize()
        names = sorted({e.key for e in prof.key_averages()})
        ops = [n for n in names if n.startswith("aten::") and ("attention" in n or "sdpa" in n)]
        kernels = [n for n in names if not n.startswith("aten::")
                   and any(x in n.lower() for x in ("flash", "fmha", "attention", "cudnn", "sdpa"))]
        out["sdpa_kernel_ran"] = _kernel_family(kernels)
        out["sdpa_aten_ops"] = ops
        out["sdpa_kernel_names"] = [n[:160] for n in kernels[:12]]
    forced = {}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                run(mods[torch.bfloat16][1], torch.bfloat16)
            forced[backend] = "ok"
        except Exception as e:  # noqa: BLE001 - report why a backend refuses the shape
            forced[backend] = f"refused: {str(e).splitlines()[0][:160]}"
    out["sdpa_backends_forced"] = forced
    for name, module in (("unfused", mods[torch.bfloat16][0]), ("sdpa", mods[torch.bfloat16][1])):
        ms, mib = _timed(lambda m=module: run(m, torch.bfloat16))
        out[f"attention_fwd_bwd_{name}"] = {"ms": ms, "peak_mib": mib}


def check_packed(s: dict, out: dict) -> None:
    """THD-packed sequences (batch x seq tokens in 8 sequences of uneven length): the module's packed path
    (FlashAttention varlen on CUDA) against one causal SDPA call per sequence, bf16; time of each."""
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_fp4.parallel import SDPADotProductAttention
    from megatron_fp4.parallel.attention import varlen_attn

    dev = _device()
    _, cfg = _config(s, torch.bfloat16)
    module = SDPADotProductAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self").to(dev)
    t = s["batch"] * s["seq"]
    weights = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], dtype=torch.float64)
    lengths = (weights / weights.sum() * t).long()
    lengths[-1] += t - int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).to(dev)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(lengths.max()),
                             max_seqlen_kv=int(lengths.max()))
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(t, s["heads"], s["head_dim"], device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(t, s["groups"], s["head_dim"], device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(t, s["groups"], s["head_dim"], device=dev, generator=g).to(torch.bfloat16)

    def packed():
        return module(q, k, v, None, packed_seq_params=params)

    def one_by_one():
        outs, bounds = [], cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1), is_causal=True, scale=module._sdpa_scale(),
                                               enable_gqa=True)
            outs.append(o.transpose(0, 1).reshape(b - a, -1))
        return torch.cat(outs)

    with torch.no_grad():
        res = {"lengths": lengths.tolist(), "varlen_available": varlen_attn is not None,
               "vs_per_sequence_sdpa": _diff(packed(), one_by_one())}
        for name, fn in (("packed_module", packed), ("per_sequence_sdpa", one_by_one)):
            ms, mib = _timed(fn)
            res[f"{name}_fwd"] = {"ms": ms, "peak_mib": mib}
    out["packed_thd"] = res


def check_model(s: dict, out: dict) -> None:
    from megatron_fp4.models import build_gpt_model

    args, _ = _config(s, torch.bfloat16)
    models = {}
    for backend in ("local", "sdpa"):
        args.attention_backend = backend
        torch.manual_seed(0)
        models[backend] = build_gpt_model(args)
    models["sdpa"].load_state_dict(models["local"].state_dict())
    dev = next(models["local"].parameters()).device
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=dev, generator=g)
    pos = torch.arange(s["seq"], device=dev)[None].expand_as(ids)
    res = {}
    for name, m in models.items():
        logits = m(ids, pos, None)
        logits.float().logsumexp(-1).mean().backward()
        res[name] = logits.detach(), {n: p.grad for n, p in m.named_parameters()}
        del logits
    out["gpt_2_layers_bf16"] = {
        "logits": _diff(res["sdpa"][0], res["local"][0]),
        "logits_rel": _rel(res["sdpa"][0], res["local"][0]),
        "grad_rel_max": max(_rel(res["sdpa"][1][n], g) for n, g in res["local"][1].items()),
    }
    del res
    # the same model on a THD pack of the batch's rows cut to uneven lengths (the varlen path inside megatron-core's
    # attention, forward and backward) against one forward per sequence
    from megatron.core.packed_seq_params import PackedSeqParams

    m = models["sdpa"]
    m.zero_grad(set_to_none=True)
    lengths = [s["seq"] - i * (s["seq"] // (2 * s["batch"])) for i in range(s["batch"])]
    seqs = [ids[i, :n] for i, n in enumerate(lengths)]
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    packed = m(torch.cat(seqs)[None], torch.cat([torch.arange(n, device=dev) for n in lengths])[None], None,
               packed_seq_params=params)
    packed.float().logsumexp(-1).sum().backward()
    with torch.no_grad():
        alone = torch.cat([m(x[None], torch.arange(len(x), device=dev)[None], None)[0] for x in seqs])
    out["gpt_2_layers_bf16_packed"] = {"lengths": lengths, "vs_one_forward_per_sequence": _diff(packed[0], alone),
                                       "rel": _rel(packed[0].detach(), alone),
                                       "grads_finite": all(bool(torch.isfinite(p.grad).all())
                                                           for p in m.parameters() if p.grad is not None)}


def check_logprobs(s: dict, out: dict, tp_group, tp: int, rank: int) -> None:
    from megatron_fp4.rl.grpo import entropy_from_logits, token_logprobs
    from megatron_fp4.rl.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    dev = _device()
    n, vocab = s["batch"] * s["seq"], s["vocab"]
    g = torch.Generator(device=dev).manual_seed(2)
    full = (torch.randn(n, vocab, device=dev, generator=g) * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device=dev, generator=g)
    up = torch.randn(n, device=dev, generator=g)
    part = vocab // tp
    shard = full[:, rank * part:(rank + 1) * part].contiguous()
    res = {"tokens": n, "vocab": vocab, "tp": tp}

    def ref_fwd_bwd():
        x = full.clone().requires_grad_()
        lp = token_logprobs(x, target)
        (lp * up).sum().backward()
        return lp.detach(), x.grad[:, rank * part:(rank + 1) * part]

    def new_fwd_bwd():
        x = shard.clone().requires_grad_()
        lp = vocab_parallel_logprobs(x, target, tp_group)
        (lp * up).sum().backward()
        return lp.detach(), x.grad

    ref_lp, ref_grad = ref_fwd_bwd()
    new_lp, new_grad = new_fwd_bwd()
    res["logp"] = _diff(new_lp, ref_lp)
    res["logp_bit_identical"] = bool(torch.equal(new_lp, ref_lp))
    res["grad"] = _diff(new_grad, ref_grad)
    res["grad_bit_identical"] = bool(torch.equal(new_grad, ref_grad))
    del ref_grad, new_grad
    ent_new, ent_ref = vocab_parallel_entropy(shard, tp_group), entropy_from_logits(full)
    res["entropy"] = _diff(ent_new, ent_ref)
    res["entropy_bit_identical"] = bool(torch.equal(ent_new, ent_ref))
    del ent_new, ent_ref
    for name, fn in (("reference", ref_fwd_bwd), ("chunked", new_fwd_bwd)):
        ms, mib = _timed(lambda f=fn: f(), repeats=3)
        res[f"{name}_fwd_bwd"] = {"ms": ms, "peak_mib_above_logits": mib}
    for name, fn in (("reference", lambda: entropy_from_logits(full)),
                     ("chunked", lambda: vocab_parallel_entropy(shard, tp_group))):
        ms, mib = _timed(fn, repeats=3)
        res[f"{name}_entropy"] = {"ms": ms, "peak_mib_above_logits": mib}
    out["logprobs"] = res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the results here (JSON)")
    ap.add_argument("--skip-model", action="store_true", help="skip the 2-layer GPTModel comparison")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the script only")
    a = ap.parse_args()
    if not torch.cuda.is_available() and not a.cpu_smoke:
        sys.exit("check_attention_gpu.py needs a CUDA GPU (--cpu-smoke runs a tiny shape on the CPU)")
    shape = SMOKE if a.cpu_smoke else SHAPE
    from megatron_fp4.parallel import initialize_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_parallel(tensor_model_parallel_size=world, seed=0)
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = {"info": {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "shape": shape,
                    "date": time.strftime("%Y-%m-%d"), "tp": world}}
    if world == 1:  # the attention checks need the whole model on one GPU
        check_attention(shape, out)
        check_packed(shape, out)
        if not a.skip_model:
            check_model(shape, out)
    check_logprobs(shape, out, ps.get_tensor_model_parallel_group(), world, rank)
    if rank == 0:
        print(json.dumps(out, indent=1))
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
