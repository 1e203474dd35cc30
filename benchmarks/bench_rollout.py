"""Rollout engine benchmark: generation tokens/s at a fixed batch, prompt and response length, per model shape and
rollout precision, with the rollout-vs-eager logprob check; one table, JSON under benchmarks/results/.

    PYTHONPATH=. python benchmarks/bench_rollout.py --backend native --shapes qwen2.5-1.5b,qwen2.5-7b \\
        --batch 64 --prompt-len 128 --new-tokens 128 --out benchmarks/results/rollout_h200.json

Models are randomly initialized Qwen2.5-shaped megatron-core GPTModels in bf16 (weights std 0.02); prompts are
random token ids of exactly --prompt-len tokens; no stop tokens, so every sample has --new-tokens tokens.
Each row: one warm-up generate (graph capture, kernel autotuning), then --repeats (5) timed generates (median; each in
the row's ``seconds_all``). The logprob checks, max and mean over --check-samples samples: the graph path's logprobs
against the same decode steps run eagerly (the engine's "static" path) teacher-forced on the same tokens, and against
one teacher-forced full forward in the same precision (megatron-core,
:func:`megatron_fp4.rollout.teacher_forced_logprobs`); ``--eager-baseline`` also times the engine's megatron path (the
reference) on the first shape in BF16 and scores its tokens through the graph path (teacher-forced), and ``--hf-anchor``
times HF transformers' ``generate`` with a static cache on the same shape. ``--profile`` adds per row the CUDA time of
one more generate by kernel family (FP4 decode GEMM, other GEMMs, attention, quantizers, ...; graph replays included)
and its top kernels: where a decode step's time goes (SGLang rows: from the Engine's own profiler trace).

Backends: "native" (:class:`megatron_fp4.rollout.NativeRolloutEngine`; ``--decode`` picks its path) and "sglang"
(:class:`megatron_fp4.rollout.sglang_engine.SGLangRolloutEngine`: the same random model written as an HF folder
under --work-dir, one ``sglang.Engine`` per precision (the quantization is fixed at start; triton attention,
PyTorch sampling, no grammar, decode CUDA graphs up to the batch, no prefill graph), rows of the same schema with
the logprob check against the megatron-core teacher-forced forward; needs a CUDA GPU with SGLang, sgl-kernel and
the plug-in's entry point: on the H200, ``source tools/sglang_bundle_env.sh BUNDLE_DIR`` first). Rows:
``{"backend", "shape", "precision", "batch", "tokens_per_s", ...}``. ``--append`` adds this run's rows to --out's
(replacing rows of the same backend, shape, precision, batch and path), so one results file collects a grid run
over several GPU calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=512),
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936),
    "qwen2.5-7b": dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                       num_query_groups=4, vocab_size=152064),
}

#: --precisions names -> RolloutPrecision arguments.
PRECISIONS = {
    "bf16": ("bf16",),
    "w4a16/hif4": ("w4a16", "hif4"), "w4a16/mxfp4": ("w4a16", "mxfp4"),
    "w4a4/hif4": ("w4a4", "hif4"), "w4a4/mxfp4": ("w4a4", "mxfp4"),
    "w4a4+resq2:4+bf16sum/hif4": ("w4a4", "hif4", "2:4", "resq", 1 / 64, "bf16"),
    "w4a4+resq2:4+bf16sum/mxfp4": ("w4a4", "mxfp4", "2:4", "resq", 1 / 64, "bf16"),
    "w4a4+resq2:4/hif4": ("w4a4", "hif4", "2:4"), "w4a4+resq2:4/mxfp4": ("w4a4", "mxfp4", "2:4"),
}
DEFAULT_PRECISIONS = "bf16,w4a16/hif4,w4a16/mxfp4,w4a4+resq2:4+bf16sum/hif4,w4a4+resq2:4+bf16sum/mxfp4"


def _diffs(a, b):
    d = torch.tensor([abs(x - y) for s, r in zip(a, b) for x, y in zip(s, r)], dtype=torch.float64)
    return float(d.max()), float(d.mean())


def hf_anchor(shape: dict, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """tokens/s of HF transformers' Qwen2 ``generate`` with a static KV cache (random weights, sampling)."""
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                                   intermediate_size=shape["ffn_hidden_size"],
                                   num_hidden_layers=shape["num_layers"],
                                   num_attention_heads=shape["num_attention_heads"],
                                   num_key_value_heads=shape["num_query_groups"],
                                   max_position_embeddings=prompt_len + new_tokens + 64)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(10, shape["vocab_size"], (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, cache_implementation="static",
              attention_mask=torch.ones_like(ids), pad_token_id=0)
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
    n = (out.shape[1] - prompt_len) * batch
    del model
    torch.cuda.empty_cache()
    return dict(tokens_per_s=n / statistics.median(times), seconds=statistics.median(times),
                transformers=transformers.__version__)


def export_hf(model, args, folder: str) -> str:
    """``model`` (megatron-core, TP=PP=1) written as an HF Qwen2 folder for SGLang; returns its path."""
    import shutil

    from megatron_fp4.models.checkpoint_io import save_model_checkpoint
    from megatron_fp4.models.hf_conversion import convert_megatron_to_hf

    shutil.rmtree(folder, ignore_errors=True)
    save_model_checkpoint(model, os.path.join(folder, "megatron"), 0, args)
    convert_megatron_to_hf(os.path.join(folder, "megatron"), os.path.join(folder, "hf"), progress=False)
    shutil.rmtree(os.path.join(folder, "megatron"))
    return os.path.join(folder, "hf")


def sglang_rows(a, shape: str, model, args, prompts, params, rows: list, save) -> None:
    """--backend sglang: one Engine per precision on ``model``'s HF export; timed like the native rows, each appended to
    ``rows`` and saved (``save()``) as it is measured; a row that fails (e.g. out of memory) is recorded with its
    error and the next one runs. SGLang's prefix (radix) cache is flushed before every generate: the timed generates
    repeat the same prompts, and without the flush every one after the first skips their prefill (the native engine
    prefills every time)."""
    from megatron_fp4.resq import RolloutPrecision

    hf = export_hf(model, args, os.path.join(a.work_dir, shape))
    sub = list(range(min(a.check_samples, a.batch)))
    for name in a.precisions.split(","):
        p = RolloutPrecision(*PRECISIONS[name])
        try:
            row = _sglang_row(a, shape, model, hf, p, prompts, params, sub)
        except torch.OutOfMemoryError as e:
            row = dict(backend="sglang", shape=shape, precision=p.label, batch=a.batch, path=_sglang_path(a),
                       error=f"{type(e).__name__}: {str(e)[:300]}")
            print(f"sglang {shape} {p.label:28s} failed: {row['error']}", flush=True)
        gc.collect()  # this row's Engine handle and check tensors, before the next Engine starts
        torch.cuda.empty_cache()
        rows.append(row)
        save()


def _sglang_path(a) -> str:
    """An SGLang row's path: "sglang" on the triton attention backend (every row before session 52), else
    "sglang+BACKEND", so that --append keeps the rows of both."""
    return "sglang" if a.sglang_attention_backend == "triton" else f"sglang+{a.sglang_attention_backend}"


def _sglang_row(a, shape, model, hf, p, prompts, params, sub) -> dict:
    """One precision's SGLang row (see :func:`sglang_rows`)."""
    from megatron_fp4.rollout import teacher_forced_logprobs
    from megatron_fp4.rollout.precision import get_weight_cache
    from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine

    t0 = time.perf_counter()
    with SGLangRolloutEngine(hf, p, device="cuda", attention_backend=a.sglang_attention_backend,
                             sampling_backend="pytorch",
                             grammar_backend="none", enable_memory_saver=False,
                             cuda_graph_max_bs_decode=max(a.batch, 8),  # no graphs above the batch
                             disable_prefill_cuda_graph=True) as engine:
        start = time.perf_counter() - t0
        samples = engine.generate(prompts, params)  # warm-up (kernel autotuning happens outside capture)
        times = []
        for _ in range(a.repeats):
            engine.flush_cache()
            samples = engine.generate(prompts, params)
            times.append(engine.last_generate_stats["seconds"])
        profile = None
        if a.profile:
            folder = os.path.join(a.work_dir, "profile", shape, p.label.replace("/", "_"))
            profile = _sglang_profile(engine, prompts, params, folder)
        sync = engine.update_weights(model.named_parameters())  # (flushes the cache itself)
        engine.generate(prompts, params)
        after_sync = dict(engine.last_generate_stats)
    ref = teacher_forced_logprobs(model, [prompts[i] for i in sub], [samples[i].token_ids for i in sub], p)
    # the check's FP4 weights stay on the model per format (tens of GiB on the 7B shape: session 29's third row ran
    # out of memory); drop them before the next row's Engine, and say how much that freed
    held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    get_weight_cache(model).clear()
    gc.collect()
    check_gib = (held - torch.cuda.memory_allocated()) / 2 ** 30 if torch.cuda.is_available() else None
    dmax, dmean = _diffs([samples[i].logprobs for i in sub], ref)
    n_tok = sum(len(s.token_ids) for s in samples)
    row = dict(backend="sglang", shape=shape, precision=p.label, batch=a.batch, prompt_len=a.prompt_len,
               new_tokens=a.new_tokens, tokens_per_s=n_tok / statistics.median(times),
               seconds=statistics.median(times), seconds_all=times, generated_tokens=n_tok, path=_sglang_path(a),
               attention_backend=a.sglang_attention_backend,
               engine_start_s=start,
               prefix_cache="flushed before each generate",
               weight_sync_s=sync.total_seconds, tokens_per_s_after_sync=after_sync["tokens_per_s"],
               logp_vs_teacher_forced_max=dmax, logp_vs_teacher_forced_mean=dmean, check_samples=len(sub),
               check_weights_freed_gib=check_gib)
    if profile is not None:
        row["profile"] = profile
        print(f"  CUDA ms per generate by family: {json.dumps(profile.get('families_ms', profile))}", flush=True)
    print(f"sglang {shape} {p.label:28s} {row['tokens_per_s']:9.0f} tok/s (start {start:.1f} s; after sync "
          f"{row['tokens_per_s_after_sync']:.0f} tok/s) |dlogp| vs teacher-forced full forward max {dmax:.2e} "
          f"mean {dmean:.2e}", flush=True)
    return row


def _sglang_profile(engine, prompts, params, folder: str, wait_s: float = 300.0) -> dict:
    """--profile for an SGLang row: one more generate (prefix cache flushed) under the Engine's own torch.profiler
    (``start_profile`` / ``stop_profile``: its scheduler runs in another process and exports a Chrome trace into
    ``folder``), summed by kernel family as the native rows' (:func:`kernel_profile.trace_kernels`). The trace may
    still be being written when ``stop_profile`` returns: read once it parses, for up to ``wait_s``."""
    import glob
    import shutil

    from kernel_profile import trace_kernels

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    engine.flush_cache()
    engine.engine.start_profile(output_dir=folder, with_stack=False, record_shapes=False)  # (SGLang: stacks on)
    engine.generate(prompts, params)
    engine.engine.stop_profile()
    deadline, error = time.monotonic() + wait_s, "no trace file"
    while time.monotonic() < deadline:
        files = sorted(glob.glob(os.path.join(folder, "*.json*")))
        if files:
            try:
                return trace_kernels(files)
            except (EOFError, OSError, ValueError) as e:  # half-written (gzip, json)
                error = f"{type(e).__name__}: {e}"
        time.sleep(2)
    return {"error": f"{error} in {folder} after {wait_s:.0f} s"}


def _row_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("backend", "shape", "precision", "batch", "path"))


def merge_results(old: dict, new: dict) -> dict:
    """``new`` added to ``old`` (--append): ``new``'s rows replace ``old``'s of the same (backend, shape, precision,
    batch, path); ``info`` becomes the list of both runs' infos; checks are concatenated."""
    keys = {_row_key(r) for r in new["rows"]}
    infos = old["info"] if isinstance(old["info"], list) else [old["info"]]
    return dict(info=[*infos, new["info"]], rows=[r for r in old["rows"] if _row_key(r) not in keys] + new["rows"],
                checks=old.get("checks", []) + new["checks"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="native", choices=("native", "sglang"),
                    help="native: the in-process engine; sglang: sglang.Engine with the megatron_fp4 plug-in (CUDA "
                         "GPU, SGLang, sgl-kernel)")
    ap.add_argument("--sglang-attention-backend", default="triton", choices=("triton", "fa3", "flashinfer"),
                    help="--backend sglang: the Engine's attention backend (triton: the issue's setting and every row "
                         "before session 52; flashinfer: JIT-compiled on first use; fa3: SGLang's default on Hopper, "
                         "not in the offline bundle, which leaves out its 342 MB library). The GEMMs are the same; on "
                         "an H100 (session 53, 7B, batch 64) flashinfer ran SGLang's BF16 4%% slower than triton and "
                         "our FP4 rows as fast")
    ap.add_argument("--work-dir", default="/tmp/bench_rollout",
                    help="--backend sglang: where the random models are written as HF folders")
    ap.add_argument("--shapes", default="qwen2.5-1.5b")
    ap.add_argument("--precisions", default=DEFAULT_PRECISIONS,
                    help=f"comma-separated, of: {', '.join(PRECISIONS)}")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode", default="auto", help="native engine path: auto, graph, static, megatron")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed generates per row (median; each one is in the row's seconds_all): an Engine's "
                         "runs differ by a few percent, a generate costs about a second")
    ap.add_argument("--check-samples", type=int, default=16)
    ap.add_argument("--eager-baseline", action="store_true",
                    help="also time the megatron path (BF16, first shape) and score its tokens via the graph path")
    ap.add_argument("--hf-anchor", action="store_true", help="also time HF transformers generate (static cache)")
    ap.add_argument("--profile", action="store_true",
                    help="add the CUDA time of one more generate per row by kernel family (torch.profiler; SGLang: "
                         "its Engine's own profiler, trace under --work-dir/profile)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rollout.json"))
    ap.add_argument("--append", action="store_true",
                    help="keep --out's rows of other (backend, shape, precision, batch, path) and its infos")
    a = ap.parse_args()
    unknown = [p for p in a.precisions.split(",") if p not in PRECISIONS]
    if unknown:
        ap.error(f"--precisions: unknown {unknown}; allowed: {', '.join(PRECISIONS)}")
    if a.backend == "sglang":
        from megatron_fp4.rollout.sglang_engine import sglang_start_problem

        problem = sglang_start_problem(needs_plugin=a.precisions.split(",") != ["bf16"])
        if problem is not None:
            ap.error(f"--backend sglang cannot run here: {problem}")

    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rollout import NativeRolloutEngine, SamplingParams, teacher_forced_logprobs

    initialize_parallel(1, 1, seed=0)
    rows, anchors, checks = [], [], []
    t_start = time.time()
    old = json.load(open(a.out)) if a.append and os.path.exists(a.out) else None

    def save() -> None:
        """--out as measured so far (after every row: a crash or a time limit keeps the rows before it)."""
        info = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                    batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, decode=a.decode,
                    sampling="temperature 1, no stop tokens", wall_s=time.time() - t_start,
                    env={k: v for k, v in os.environ.items() if k.startswith("MEGATRON_FP4_")})  # (A/B switches)
        record = dict(info=info, rows=rows + anchors, checks=checks)
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(merge_results(old, record) if old is not None else record, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    for si, shape in enumerate(a.shapes.split(",")):
        torch.manual_seed(0)
        args = GPTModelArgs(**SHAPES[shape], max_seq_len=a.prompt_len + a.new_tokens + 64, add_qkv_bias=True,
                            params_dtype=torch.bfloat16, init_method_std=0.02)
        model = build_gpt_model(args).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, args.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
        params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
        if a.backend == "sglang":
            sglang_rows(a, shape, model, args, prompts, params, rows, save)
            del model
            torch.cuda.empty_cache()
            continue
        engine = NativeRolloutEngine(model, RolloutPrecision("bf16"), decode=a.decode, max_batch_size=a.batch)
        sub = list(range(min(a.check_samples, a.batch)))
        for name in a.precisions.split(","):
            p = RolloutPrecision(*PRECISIONS[name])
            engine.set_precision(p)
            t0 = time.perf_counter()
            samples = engine.generate(prompts, params)
            first = time.perf_counter() - t0
            warm = dict(engine.last_generate_stats)
            times = []
            for _ in range(a.repeats):
                samples = engine.generate(prompts, params)
                times.append(engine.last_generate_stats["seconds"])
            st = dict(engine.last_generate_stats)
            sync = engine.update_weights(model.named_parameters())
            samples2 = engine.generate(prompts, params)
            after_sync = dict(engine.last_generate_stats)
            ref = teacher_forced_logprobs(model, [prompts[i] for i in sub], [samples[i].token_ids for i in sub], p)
            dmax, dmean = _diffs([samples[i].logprobs for i in sub], ref)
            gmax = gmean = None
            if st.get("path", "").startswith("graph"):  # the same decode steps run eagerly, teacher-forced on the
                # graph's tokens (with the same fused kernels under MEGATRON_FP4_DECODE_FUSED=1: path "graph+fused")
                engine.decode = "static"
                eager_lp = engine.forced_logprobs([prompts[i] for i in sub], [samples[i].token_ids for i in sub])
                engine.decode = "graph"
                gmax, gmean = _diffs([samples[i].logprobs for i in sub], eager_lp)
            n_tok = sum(len(s.token_ids) for s in samples)
            row = dict(backend=a.backend, shape=shape, precision=p.label, batch=a.batch, prompt_len=a.prompt_len,
                       new_tokens=a.new_tokens, tokens_per_s=n_tok / statistics.median(times),
                       seconds=statistics.median(times), seconds_all=times, generated_tokens=n_tok,
                       path=st.get("path"),
                       first_call_s=first, capture_s=warm.get("capture_seconds", 0.0), graphs=st.get("graphs"),
                       weight_sync_s=sync.total_seconds, weight_quantize_s=sync.quantize_seconds,
                       tokens_per_s_after_sync=after_sync["tokens_per_s"],
                       capture_s_after_sync=after_sync.get("capture_seconds", 0.0),
                       logp_graph_vs_eager_max=gmax, logp_graph_vs_eager_mean=gmean,
                       logp_vs_teacher_forced_max=dmax, logp_vs_teacher_forced_mean=dmean, check_samples=len(sub))
            if a.profile:
                from benchmarks.kernel_profile import profile_step

                row["profile"] = profile_step(partial(engine.generate, prompts, params))
                print(f"  CUDA ms per generate by family: {json.dumps(row['profile']['families_ms'])}", flush=True)
            rows.append(row)
            save()
            print(f"{a.backend} {shape} {p.label:28s} {row['tokens_per_s']:9.0f} tok/s ({row['seconds']:.2f} s; "
                  f"first {first:.1f} s, capture {row['capture_s']:.1f} s; after sync "
                  f"{row['tokens_per_s_after_sync']:.0f} tok/s, recapture {row['capture_s_after_sync']:.2f} s) "
                  f"|dlogp| graph vs eager steps max {gmax or 0:.2e} mean {gmean or 0:.2e}; vs teacher-forced full "
                  f"forward max {dmax:.2e} mean {dmean:.2e}", flush=True)
            del samples2
        if a.eager_baseline and si == 0:
            engine.set_precision(RolloutPrecision("bf16"))
            eager = NativeRolloutEngine(model, RolloutPrecision("bf16"), decode="megatron")
            eager.generate(prompts[:4], SamplingParams(max_new_tokens=4, seed=0))
            es = eager.generate(prompts, params)
            st = eager.last_generate_stats
            rows.append(dict(backend=a.backend, shape=shape, precision="bf16", batch=a.batch,
                             prompt_len=a.prompt_len, new_tokens=a.new_tokens, tokens_per_s=st["tokens_per_s"],
                             seconds=st["seconds"], generated_tokens=st["generated_tokens"], path="megatron"))
            forced = engine.forced_logprobs(prompts, [s.token_ids for s in es])
            dmax, dmean = _diffs([s.logprobs for s in es], forced)
            tf = teacher_forced_logprobs(model, [prompts[i] for i in sub], [es[i].token_ids for i in sub],
                                         RolloutPrecision("bf16"))
            tmax, tmean = _diffs([es[i].logprobs for i in sub], tf)
            checks.append(dict(shape=shape, precision="bf16", what="megatron-path samples against the teacher-forced "
                               "full forward (the reference's own bf16 noise)", max=tmax, mean=tmean,
                               samples=len(sub)))
            checks.append(dict(shape=shape, precision="bf16", what="megatron-path samples, logprobs of the same "
                               "tokens through the graph path (teacher-forced decode steps)",
                               max=dmax, mean=dmean, samples=len(es)))
            print(f"{a.backend} {shape} bf16 megatron path {st['tokens_per_s']:9.0f} tok/s; graph path forced on its "
                  f"tokens: |dlogp| max {dmax:.2e} mean {dmean:.2e}; megatron path vs teacher-forced forward: "
                  f"max {tmax:.2e} mean {tmean:.2e}", flush=True)
        del engine, model
        torch.cuda.empty_cache()
        if a.hf_anchor and si == 0:
            try:
                r = hf_anchor(SHAPES[shape], a.batch, a.prompt_len, a.new_tokens, a.repeats)
                anchors.append(dict(backend="hf-transformers-static", shape=shape, precision="bf16", batch=a.batch,
                                    prompt_len=a.prompt_len, new_tokens=a.new_tokens, **r))
                print(f"hf transformers static cache {shape} bf16 {r['tokens_per_s']:9.0f} tok/s", flush=True)
            except Exception as e:  # noqa: BLE001
                anchors.append(dict(backend="hf-transformers-static", shape=shape, error=f"{type(e).__name__}: {e}"))
                print(f"hf anchor failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    save()
    print("\n| backend | shape | precision | path | batch | tok/s | vs engine BF16 | |dlogp| graph vs eager max / mean "
          "| |dlogp| vs teacher-forced max / mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows + anchors:
        base = next((b.get("tokens_per_s") for b in rows if b["shape"] == r.get("shape") and b["precision"] == "bf16"
                     and b.get("path") != "megatron"), None)
        tps = r.get("tokens_per_s")
        rel = f"{tps / base:.2f}x" if tps and base else ""
        ge = (f"{r['logp_graph_vs_eager_max']:.1e} / {r['logp_graph_vs_eager_mean']:.1e}"
              if r.get("logp_graph_vs_eager_max") is not None else "")
        lp = (f"{r['logp_vs_teacher_forced_max']:.1e} / {r['logp_vs_teacher_forced_mean']:.1e}"
              if "logp_vs_teacher_forced_max" in r else "")
        print(f"| {r['backend']} | {r.get('shape')} | {r.get('precision')} | {r.get('path', '')} | {r.get('batch')} | "
              f"{tps or float('nan'):.0f} | {rel} | {ge} | {lp} |")
    for c in checks:
        print(f"check {c['shape']} {c['precision']}: {c['what']}: max {c['max']:.2e} mean {c['mean']:.2e}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
