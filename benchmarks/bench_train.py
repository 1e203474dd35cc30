"""Training-step benchmark: forward + backward of the GRPO loss through megatron's schedule (the actor's own loss and
schedule functions), per FP4 recipe, with the optimizer step timed apart; one table, JSON under benchmarks/results/.

    PYTHONPATH=. python benchmarks/bench_train.py --shape qwen2.5-1.5b --recipes bf16,hif4,mxfp4,mxfp4-fp8 \\
        --batches 4x2048,8x4096/2 --out benchmarks/results/train_h200.json

Models are randomly initialized Qwen2.5-shaped megatron-core GPTModels (the FP4 layer spec; bf16 parameters, fp32
gradients and Adam state in megatron's DDP and optimizer, the driver's settings) on one GPU; the batch is random
token ids with every position in the loss. A row "BxT" runs B sequences of T tokens per optimizer step in
micro-batches of --micro-batch-size sequences. Per row: --warmup untimed steps (kernel autotuning), then --iters
timed ones (median). Columns:

- tokens_per_s: B x T / (forward + backward time); opt_s: the optimizer step alone;
- mfu: (6 x (transformer params + output head) x tokens + 6 x layers x seq x hidden x tokens (causal attention))
  / (forward + backward time) / --peak-tflops (790: the H200's measured dense BF16 GEMM rate);
- peak_mem_gib: torch's peak allocation during forward + backward; peak_mem_no_opt_gib: the same less the
  optimizer's fp32 main weights and Adam moments (what the step needs beside them);
- loss, grad_norm: the first timed step's values (same seed per row: comparable across code versions).

``--profile`` adds, per row, the CUDA time of one step by kernel family (GEMM, FP4 quantize, attention, ...), the
top kernels, and the host's top Python functions (cProfile: where a CPU-bound step spends its time).
``--host-overhead`` measures only each recipe's host time per linear forward + backward (tiny operands, no model).
``--mode-error`` measures only how far MXFP4's FP8 GEMM modes are from its exact mode on the shape's linears.
``--cuda-graph`` runs the step under megatron-core's CUDA graphs (``cuda_graph_impl="local"``, the driver's
``--cuda-graph-impl local``): each row in a process of its own (megatron-core keeps a graphed model's memory pool
until its process ends), started by this one, which prints and writes the whole table.
Recipes: bf16 (no recipe), hif4, mxfp4, and mxfp4-fp8 / mxfp4-fp8_fast (MXFP4 with --fp4-gemm-mode).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rollout import SHAPES  # noqa: E402  (one table of model shapes for the benchmarks)
from kernel_profile import profile_step  # noqa: E402

RECIPES = ("bf16", "hif4", "mxfp4", "mxfp4-fp8", "mxfp4-fp8_fast")


def parse_batches(text: str) -> list[tuple[int, int, int | None]]:
    """"4x2048,8x4096/2" -> [(4, 2048, None), (8, 4096, 2)]: B sequences of T tokens, optionally /micro-batch."""
    out = []
    for part in text.split(","):
        try:
            bt, _, mb = part.lower().partition("/")
            b, t = bt.split("x")
            out.append((int(b), int(t), int(mb) if mb else None))
        except ValueError:
            raise SystemExit(f"bench_train.py: error: --batches: {part!r} is not BxT[/micro-batch] (e.g. 4x2048 or "
                             f"8x4096/2)") from None
    return out


def row_argv(argv: list[str], recipe: str, batch: tuple[int, int, int | None], out: str) -> list[str]:
    """This script's command line ``argv`` (without the program) for one row: ``--recipes``, ``--batches`` and
    ``--out`` replaced (either spelling, ``--flag value`` or ``--flag=value``), every other argument kept."""
    replaced, keep, skip = ("--recipes", "--batches", "--out"), [], False
    for a in argv:
        if skip:
            skip = False
        elif a in replaced:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in replaced)):
            keep.append(a)
    b, t, mb = batch
    return keep + ["--recipes", recipe, "--batches", f"{b}x{t}" + (f"/{mb}" if mb else ""), "--out", out]


def rows_in_processes(argv: list[str], recipes: list[str], batches: list) -> list[dict]:
    """Each (batch, recipe) row run by this script in a process of its own (its output shown as it comes), its JSON
    row collected; a process that fails or writes no row gives an error row (the others still run)."""
    import subprocess
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b, t, mb in batches:
            for r in recipes:
                out = os.path.join(tmp, f"{r}_{b}x{t}.json")
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), *row_argv(argv, r, (b, t, mb), out)])
                got = json.load(open(out))["rows"] if os.path.exists(out) else []
                rows.extend(got or [dict(recipe=r, batch=b, seq=t, error=f"the row's process exited with "
                                                                        f"{proc.returncode} and wrote no row")])
    return rows


def print_row(row: dict) -> None:
    r, b, t = row["recipe"], row.get("batch"), row.get("seq")
    if "error" in row:
        print(f"{r:<15} {f'{b}x{t}':>8} {row['error'][:80]}", flush=True)
        return
    print(f"{r:<15} {f'{b}x{t}':>8} {row['tokens_per_s']:>9.0f} {row['mfu']:>6.3f} {row['step_s']:>7.3f} "
          f"{row['opt_s']:>6.3f} {row['peak_mem_gib']:>8.1f} {row['peak_mem_no_opt_gib']:>7.1f} "
          f"{row['loss']:>12.5e}", flush=True)
    if "profile" in row:
        print("   ", json.dumps(row["profile"]["families_ms"]), flush=True)
        for op, shapes, calls, ms in row["profile"]["top_ops_ms"][:8]:
            print(f"    {ms:8.2f} ms {calls:>5} x {op} {shapes[:90]}", flush=True)


TABLE_HEADER = (f"{'recipe':<15} {'BxT':>8} {'tok/s':>9} {'MFU':>6} {'step s':>7} {'opt s':>6} {'peak GiB':>8} "
                f"{'no-opt':>7} {'loss':>12}")


def recipe_and_mode(name: str):
    from megatron_fp4.recipe import recipe_for_format

    if name == "bf16":
        return None, "exact"
    fmt, _, mode = name.partition("-")
    return recipe_for_format(fmt, gemm_mode=mode or "exact"), mode or "exact"


def flops_per_token(shape: dict, seq: int, params: int, head: int) -> float:
    return 6.0 * (params + head) + 6.0 * shape["num_layers"] * seq * shape["hidden_size"]


def build(shape_name: str, seq: int, recipe, distributed_optimizer: bool, attention: str | None,
          cuda_graph: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config

    shape = SHAPES[shape_name]
    extra = {"attention_backend": attention} if attention else {}
    margs = GPTModelArgs(**shape, max_seq_len=seq, add_qkv_bias=True, tie_embeddings=shape_name == "qwen2.5-1.5b",
                         fp4_recipe=recipe, params_dtype=torch.bfloat16, **extra)
    graphs = {"cuda_graph_impl": "local"} if cuda_graph else {}
    config = gpt_transformer_config(margs, calculate_per_token_loss=True, **graphs)
    model = build_gpt_model(margs, config=config, parallel_output=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, clip_grad=1.0, bf16=True,
                                                 params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=distributed_optimizer), [ddp])
    return model, ddp, opt


def make_batches(vocab: int, batch: int, seq: int, micro: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    out = []
    for s in range(0, batch, micro):
        sl = slice(s, s + micro)
        n = tokens[sl].shape[0]
        out.append({"inputs": tokens[sl, :-1], "labels": tokens[sl, 1:], "mask": torch.ones(n, seq),
                    "logp_rollout": -torch.rand(n, seq, generator=g) * 5,
                    "advantages": torch.randn(n, generator=g)})
    return out


def optimizer_state_bytes(opt) -> int:
    seen, total = set(), 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(o, "optimizer", o)
        for group in inner.param_groups:
            for p in group["params"]:
                tensors = [p] + [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v)]
                for t in tensors:
                    if t.data_ptr() not in seen and t.dtype == torch.float32:
                        seen.add(t.data_ptr())
                        total += t.numel() * t.element_size()
    return total


def cpu_profile_step(step) -> list:
    """The host side of one step: the Python functions taking the most time (own time, cProfile)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
    return [[f"{os.path.basename(f)}:{line}({fn})", calls, round(tt * 1e3, 2), round(ct * 1e3, 2)]
            for (f, line, fn), (_, calls, tt, ct, _) in rows]


def run_row(args, recipe_name: str, batch: int, seq: int) -> dict:
    from megatron_fp4.rl import grpo
    from megatron_fp4.rl.actor import _grpo_loss, run_schedule

    from megatron_fp4.parallel import set_seed

    recipe, mode = recipe_and_mode(recipe_name)
    set_seed(args.seed, cuda_graphs=args.cuda_graph)  # every row starts from the same weights
    model, ddp, opt = build(args.shape, seq, recipe, args.distributed_optimizer, args.attention_backend,
                            args.cuda_graph)
    shape = SHAPES[args.shape]
    batches = make_batches(shape["vocab_size"], batch, seq, args.micro_batch_size, args.seed)
    loss_fn = partial(_grpo_loss, grpo.GRPOConfig(group_size=2, kl_beta=0.0))
    params = sum(p.numel() for n, p in model.named_parameters() if "decoder" in n)
    head = shape["vocab_size"] * shape["hidden_size"]

    def fwd_bwd():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        return run_schedule(ddp, batches, loss_fn, forward_only=False)

    times, opt_times, first = [], [], None
    for i in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        static = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        store = fwd_bwd()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated()
        _, grad_norm, _ = opt.step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= args.warmup:
            times.append(t1 - t0)
            opt_times.append(t2 - t1)
            if first is None:
                loss = sum(float(d["loss"]) for d in store) / max(sum(float(d["num_tokens"]) for d in store), 1)
                first = dict(loss=loss, grad_norm=float(grad_norm), peak=peak, static=static)
    t = statistics.median(times)
    tokens = batch * seq
    opt_bytes = optimizer_state_bytes(opt)
    row = dict(recipe=recipe_name, gemm_mode=mode, batch=batch, seq=seq, micro_batch_size=args.micro_batch_size,
               step_s=round(t, 4), opt_s=round(statistics.median(opt_times), 4),
               tokens_per_s=round(tokens / t, 1),
               mfu=round(flops_per_token(shape, seq, params, head) * tokens / t / (args.peak_tflops * 1e12), 4),
               peak_mem_gib=round(first["peak"] / 2**30, 2),
               peak_mem_no_opt_gib=round((first["peak"] - opt_bytes) / 2**30, 2),
               optimizer_state_gib=round(opt_bytes / 2**30, 2),
               loss=first["loss"], grad_norm=first["grad_norm"], times_s=[round(x, 4) for x in times])
    if args.profile:
        row["profile"] = profile_step(fwd_bwd)
        row["host_profile"] = cpu_profile_step(fwd_bwd)  # [function, calls, own ms, cumulative ms]
    if args.cuda_graph:
        row["cuda_graph"] = "local"
    return row


def host_overhead_us(recipe_name: str, iters: int = 300, device: str = "cuda", profile: bool = False):
    """(host microseconds per linear forward + backward, None or with ``profile`` the top host functions of 50 more
    iterations (:func:`cpu_profile_step`)): one [16, 1536] x [1536, 1536] layer, whose GPU work is a few
    microseconds, so the wall time per iteration is the host's (Python wrappers and kernel launches)."""
    from megatron_fp4.linear import fp4_linear
    from megatron_fp4 import ops

    recipe, _ = recipe_and_mode(recipe_name)
    x = torch.randn(16, 1536, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1536, 1536, device=device, dtype=torch.bfloat16, requires_grad=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        y = fp4_linear(x, w, None, recipe) if recipe is not None else torch.nn.functional.linear(x, w)
        y.backward(torch.ones_like(y))

    with ops.quantized_weight_cache():  # the weight quantized once, as over a schedule's micro-batches
        for _ in range(20):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        us = (time.perf_counter() - t0) / iters * 1e6
        return us, (cpu_profile_step(lambda: [step() for _ in range(50)]) if profile else None)


def mode_error(shape: str, tokens: int = 8192, seed: int = 0) -> list[dict]:
    """MXFP4's FP8 GEMM modes against its exact mode on the training linears of ``shape`` (qkv, proj, fc1, fc2;
    ``tokens`` tokens, bf16): the relative error (max |diff| / max |exact|, and the Frobenius ratio) of the output
    Y and of the gradients dX and dW of one forward + backward (the numbers the FP8 tensor cores change: their
    accumulation and the flush of values below each row's FP8 window). Inputs: Gaussians with heavy-tailed per-channel
    scales (a few outlier channels, as LLM activations have), gradients ~1e-4."""
    from megatron_fp4 import ops
    from megatron_fp4.linear import fp4_linear
    from megatron_fp4.recipe import MXFP4BlockScaling

    s = SHAPES[shape]
    h, ffn, heads, groups = s["hidden_size"], s["ffn_hidden_size"], s["num_attention_heads"], s["num_query_groups"]
    qkv = h + 2 * groups * (h // heads)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for name, n, k in (("qkv", qkv, h), ("proj", h, h), ("fc1", 2 * ffn, h), ("fc2", h, ffn)):
        chan = torch.exp(torch.randn(k, device="cuda", generator=g) * 1.5)
        x = (torch.randn(tokens, k, device="cuda", generator=g) * chan).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        dy = (torch.randn(tokens, n, device="cuda", generator=g) * 1e-4).bfloat16()
        out = {}
        for mode in ("exact", "fp8", "fp8_fast"):
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            with ops.quantized_weight_cache():
                y = fp4_linear(xr, wr, recipe=MXFP4BlockScaling(gemm_mode=mode))
                y.backward(dy)
            out[mode] = {"y": y.detach().float(), "dx": xr.grad.float(), "dw": wr.grad.float()}
        for mode in ("fp8", "fp8_fast"):
            row = {"linear": name, "n": n, "k": k, "tokens": tokens, "mode": mode}
            for t in ("y", "dx", "dw"):
                ref, got = out["exact"][t], out[mode][t]
                row[f"{t}_rel_max"] = float((got - ref).abs().max() / ref.abs().max())
                row[f"{t}_rel_fro"] = float((got - ref).norm() / ref.norm())
            rows.append(row)
            print(f"  {name:<5} {n:>6} x {k:<6} {mode:<8} " + "  ".join(
                f"{t} {row[f'{t}_rel_max']:.1e} / {row[f'{t}_rel_fro']:.1e}" for t in ("y", "dx", "dw")), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--recipes", default="bf16,hif4,mxfp4,mxfp4-fp8")
    ap.add_argument("--batches", default="4x2048", help="comma-separated BxT (sequences x tokens) per step, each "
                                                        "optionally /M: micro-batches of M sequences")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default: B)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--attention-backend", default=None, help="passed to the model args when given")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture each transformer layer's forward and backward as CUDA graphs (megatron-core's "
                         "cuda_graph_impl='local'): recorded in the first warm-up step, captured at its end, "
                         "replayed after; needs --warmup >= 2; several rows run in processes of their own")
    ap.add_argument("--host-overhead", action="store_true",
                    help="only measure each recipe's host time per linear forward + backward (tiny operands)")
    ap.add_argument("--mode-error", action="store_true",
                    help="only measure MXFP4's FP8 GEMM modes against exact on the shape's linears (relative error "
                         "of Y, dX, dW; max and Frobenius)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "train.json"))
    args = ap.parse_args()
    for r in args.recipes.split(","):
        if r not in RECIPES:
            raise SystemExit(f"bench_train.py: error: --recipes: {r!r} is not valid; allowed values: "
                             f"{', '.join(RECIPES)}")
    batches = parse_batches(args.batches)
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py: error: needs a CUDA GPU (the step times are GPU times)")
    if args.cuda_graph and args.warmup < 2:
        raise SystemExit(f"bench_train.py: error: --cuda-graph needs --warmup >= 2 (the first step records and "
                         f"captures the graphs, the second replays them), got --warmup {args.warmup}")
    own_processes = (args.cuda_graph and not args.host_overhead and not args.mode_error
                     and len(args.recipes.split(",")) * len(batches) > 1)
    if own_processes:  # one process per row; this one only collects (it never touches the GPU)
        print(TABLE_HEADER, flush=True)
        rows = rows_in_processes(sys.argv[1:], args.recipes.split(","), batches)
        print(f"\n{'all rows':-^80}\n{TABLE_HEADER}", flush=True)
        for row in rows:
            print_row(row)
        write_json(args, rows)  # CUDA initialized here only now, after the rows' processes ended
        return
    from megatron_fp4.parallel import destroy_parallel, initialize_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    initialize_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=args.seed)
    rows = []
    if args.host_overhead:
        for r in args.recipes.split(","):
            us, prof = host_overhead_us(r, profile=args.profile)
            rows.append(dict(recipe=r, host_us_per_linear=us, **({"host_profile_50": prof} if prof else {})))
            print(f"{r:<15} host time per linear forward + backward: {us:.1f} us", flush=True)
            for fn, calls, tt, ct in (prof or [])[:6]:
                print(f"    {fn[:70]:<70} {calls:>6} {tt:>8.2f} ms own {ct:>8.2f} ms cum", flush=True)
    if args.mode_error:
        print("MXFP4 FP8 modes vs exact, relative error max / Frobenius:", flush=True)
        rows.extend(mode_error(args.shape))
    batches = [] if args.host_overhead or args.mode_error else batches
    print(TABLE_HEADER, flush=True)
    for b, t, mb in batches:
        for r in args.recipes.split(","):
            saved = args.micro_batch_size
            args.micro_batch_size = mb or saved or b
            try:
                row = run_row(args, r, b, t)
            except torch.OutOfMemoryError as e:
                row = dict(recipe=r, batch=b, seq=t, error=f"out of memory: {str(e)[:160]}")
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001  (one broken row must not lose the others)
                traceback.print_exc()
                row = dict(recipe=r, batch=b, seq=t, error=f"{type(e).__name__}: {str(e)[:300]}")
            args.micro_batch_size = saved
            gc.collect()  # the row's model and optimizer
            torch.cuda.empty_cache()
            rows.append(row)
            print_row(row)
    write_json(args, rows)
    destroy_parallel()


def write_json(args, rows: list[dict]) -> None:
    """``{"info", "rows"}`` to ``--out``."""
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape,
                date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
                distributed_optimizer=args.distributed_optimizer, attention_backend=args.attention_backend,
                peak_tflops=args.peak_tflops, cuda_graph=args.cuda_graph)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
