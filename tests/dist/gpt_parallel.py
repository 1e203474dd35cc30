"""Train a tiny FP4 GPTModel (real megatron-core) under several parallel layouts and dump loss/grads.

Run single-process (``python tests/dist/gpt_parallel.py --layouts ref --out DIR``) or under torchrun
(``torchrun --nproc-per-node 2 tests/dist/gpt_parallel.py --layouts tp2,pp2,dp2 --out DIR``). For every layout it

1. re-initializes megatron parallel_state (TP/PP from the layout; DP = world / (TP*PP));
2. builds the GPTModel with the FP4 spec, wraps it in megatron DDP and loads the same canonical weights in every
   layout (generated per parameter name, then sliced to this rank's TP shard / PP stage);
3. runs one forward/backward over the same global batch (2 micro-batches: DP=1 accumulates both, DP=2 gives one
   to each replica) with megatron's pipeline schedule, and dumps the loss and full (TP-gathered) gradients;
4. trains ``--steps`` steps with megatron-core's optimizer (Adam) on that batch and dumps the loss curve.

Layout names: ref (TP=PP=1 on one process), tp2, pp2, dp2; "<layout>@<format>" picks the FP4 format (default
--format); "hp:<layout>" also checks, at that layout, that the FP4 spec with no recipe is bit-identical to
megatron-core's local spec; "linears" checks the TP=2 FP4 column/row linears with and without sequence parallel
(the local GPT spec's torch norms do not support sequence parallel, so it is tested at the linear level).
Rank 0 writes ``<out>/<layout>.pt``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config  # noqa: E402
from megatron_fp4.parallel import FP4ParallelLinearMixin, initialize_parallel  # noqa: E402
from megatron_fp4.recipe import recipe_for_format  # noqa: E402

SEQ, MICRO_BATCH, GLOBAL_MICROBATCHES, VOCAB = 32, 2, 2, 128
# name -> (TP, PP, tied embeddings, bf16 params + megatron's bf16 optimizer); DP is what the world size leaves
LAYOUTS = {"ref": (1, 1, False, False), "tp2": (2, 1, False, False), "pp2": (1, 2, False, False),
           "dp2": (1, 1, False, False), "ref_tied": (1, 1, True, False), "pp2_tied": (1, 2, True, False),
           "ref_bf16": (1, 1, False, True)}
TIED_NAME = "embedding.word_embeddings.weight"


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def model_args(recipe, tie: bool = False, bf16: bool = False) -> GPTModelArgs:
    # Per-rank GEMM dims stay multiples of 64 at TP=2 so the quantization blocks coincide with TP=1's.
    return GPTModelArgs(num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                        num_query_groups=2, vocab_size=VOCAB, max_seq_len=SEQ, add_qkv_bias=True,
                        tie_embeddings=tie, fp4_recipe=recipe,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32)


def global_batch():
    g = torch.Generator().manual_seed(0)
    # a learnable task: the next token is a fixed function of the current one
    out = []
    for _ in range(GLOBAL_MICROBATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        labels = (ids * 7 + 3) % VOCAB
        pos = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        out.append({"tokens": ids.to(device()), "labels": labels.to(device()), "position_ids": pos.to(device())})
    return out


def canonical_tensor(name: str, shape, layer_offset: int) -> torch.Tensor:
    """Deterministic full (unsharded) tensor for a global parameter name."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if "layernorm" in name or name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.05 * torch.randn(shape, generator=g)


def global_name(name: str, offset: int) -> str:
    name = name.removeprefix("module.")  # Float16Module wrapper (bf16 layouts)
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def shard_of(full: torch.Tensor, param, tp_rank: int, tp: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = full.chunk(tp * stride, dim=dim)
    return torch.cat([chunks[s * tp + tp_rank] for s in range(stride)], dim=dim)


def gather_full(t: torch.Tensor, param, tp: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)


def layer_offset(args: GPTModelArgs) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank() * (args.num_layers // ps.get_pipeline_model_parallel_world_size())


def build(args: GPTModelArgs, sequence_parallel: bool = False, local_spec: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps

    config = gpt_transformer_config(args, sequence_parallel=sequence_parallel)
    if local_spec:  # megatron-core's own local spec, for the bit-identity check
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=args.vocab_size,
                         max_sequence_length=args.max_seq_len, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=args.tie_embeddings, position_embedding_type="rope")
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
    else:
        model = build_gpt_model(args, config=config)
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    tp, tp_rank, off = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), layer_offset(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full_shape = list(p.shape)
            if getattr(p, "tensor_model_parallel", False):
                full_shape[p.partition_dim] *= tp
            cname = global_name(name, off)
            cname = TIED_NAME if (args.tie_embeddings and cname == "output_layer.weight") else cname
            p.copy_(shard_of(canonical_tensor(cname, full_shape, off), p, tp_rank, tp))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        overlap_grad_reduce=False), model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, config


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def run_batch(ddp, config, microbatches, forward_only=False) -> float:
    """One forward/backward over this rank's micro-batches; returns the global-batch mean loss (all ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    store = fb(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[ddp],
               num_microbatches=len(microbatches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
               forward_only=forward_only)
    loss = torch.zeros(1, device=device())
    if ps.is_pipeline_last_stage():
        loss += torch.stack([d["loss"] for d in store]).mean()
    # sum over PP (only last stage non-zero), average over DP
    torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss / ps.get_data_parallel_world_size())


def my_microbatches():
    from megatron.core import parallel_state as ps

    batch = global_batch()
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = GLOBAL_MICROBATCHES // dp
    return batch[r * per:(r + 1) * per]


def collect_grads(ddp, args) -> dict:
    from megatron.core import parallel_state as ps

    tp, off = ps.get_tensor_model_parallel_world_size(), layer_offset(args)
    out = {}
    for name, p in ddp.module.named_parameters():
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        out[global_name(name, off)] = gather_full(g.detach().float(), p, tp).cpu()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, out)
    merged = {}
    for d in gathered:
        merged.update(d)
    return merged


def run_layout(layout: str, default_format: str, steps: int, seed: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if layout == "linears":
        return run_linears(seed)
    layout_name, _, fmt = layout.partition("@")
    recipe = recipe_for_format(fmt or default_format)
    check_hp = layout_name.startswith("hp:")
    base = layout_name[3:] if check_hp else layout_name
    tp, pp, tie, bf16 = LAYOUTS[base]
    sp = False  # the local spec's torch norms do not support sequence parallel (see run_linears)
    initialize_parallel(tp, pp, seed=seed)
    args = model_args(recipe, tie=tie, bf16=bf16)
    result = {"layout": layout, "world": torch.distributed.get_world_size()}
    ddp, config = build(args, sp)
    mbs = my_microbatches()
    result["layer_numbers"] = layer_numbers(
        ddp, recipe.replace(high_precision_first_layers=1, high_precision_last_layers=1))
    from megatron_fp4.diagnostics import UnderflowMonitor

    with UnderflowMonitor(ddp.module) as monitor:
        result["loss0"] = run_batch(ddp, config, mbs)
    from megatron.core import parallel_state as ps

    result["underflow"] = monitor.collect(group=ps.get_data_parallel_group())  # summed over DP replicas
    result["grads0"] = collect_grads(ddp, args)
    if check_hp:
        # the FP4 spec with no recipe vs megatron-core's local spec: identical loss and gradients, bit for bit
        # (megatron-core's unfused attention in both: on a GPU "auto" would take SDPA in the FP4 spec)
        args_hp = model_args(None, tie=tie, bf16=bf16)
        args_hp.attention_backend = "local"
        fp4_hp, cfg1 = build(args_hp, sp)
        local, cfg2 = build(args_hp, sp, local_spec=True)
        result["hp_fp4_spec_loss"] = run_batch(fp4_hp, cfg1, mbs)
        result["hp_local_spec_loss"] = run_batch(local, cfg2, mbs)
        result["hp_fp4_spec_grads"] = collect_grads(fp4_hp, args_hp)
        result["hp_local_spec_grads"] = collect_grads(local, args_hp)
        result["hp_fp4_linears"] = sum(isinstance(m, FP4ParallelLinearMixin) for m in fp4_hp.modules())
        # fp4_autocast(enabled=False) turns the config's recipe off: the FP4 model then equals the local spec
        from megatron_fp4.recipe import fp4_autocast

        with fp4_autocast(enabled=False):
            result["autocast_off_loss"] = run_batch(ddp, config, mbs, forward_only=True)
        # and fp4_autocast(recipe=...) overrides it (MXFP4 instead of the config's format)
        with fp4_autocast(recipe=recipe_for_format("mxfp4")):
            result["autocast_mxfp4_loss"] = run_batch(ddp, config, mbs, forward_only=True)
    if steps:
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.0, clip_grad=1.0,
                                                     bf16=bf16, fp16=False), [ddp])
        losses = []
        for _ in range(steps):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            losses.append(run_batch(ddp, config, mbs))
            ok, grad_norm, _ = opt.step()
            assert ok, "optimizer step skipped"
        losses.append(run_batch(ddp, config, mbs, forward_only=True))
        result["train_losses"] = losses
    return result


def layer_numbers(ddp, recipe_hp) -> dict:
    """Global linear name -> (layer number, whether FP4 under a recipe keeping the first/last layer in HP)."""
    from megatron_fp4.recipe import fp4_autocast

    out = {}
    with fp4_autocast(recipe=recipe_hp):
        for name, m in ddp.module.named_modules():
            if isinstance(m, FP4ParallelLinearMixin):
                out[name] = (m.fp4_layer_number, m.fp4_recipe_for_forward() is not None)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, out)
    merged = {}
    for rank, d in enumerate(gathered):
        for k, v in d.items():
            merged[f"rank{rank}:{k}"] = v
    return merged


def run_linears(seed: int) -> dict:
    """TP=2 FP4 column->row linears (with and without sequence parallel) against fp4_linear on full tensors,
    and, with no recipe, against megatron-core's own linears bit for bit."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_fp4.linear import fp4_linear
    from megatron_fp4.parallel import FP4ColumnParallelLinear, FP4RowParallelLinear, FP4TransformerConfig
    from megatron_fp4.parallel.cpu_compat import cpu_config_overrides

    initialize_parallel(2, 1, seed=seed)
    tp, rank = 2, ps.get_tensor_model_parallel_rank()
    s_len, b, h, f = 16, 2, 128, 256
    g = torch.Generator().manual_seed(5)
    x_full = torch.randn(s_len, b, h, generator=g).to(device())
    dy_full = torch.randn(s_len, b, h, generator=g).to(device())
    w1 = (0.05 * torch.randn(f, h, generator=g)).to(device())
    w2 = (0.05 * torch.randn(h, f, generator=g)).to(device())
    recipe = recipe_for_format("hif4")
    res = {"layout": "linears"}
    for sp in (False, True):
        fields = dict(num_layers=1, hidden_size=h, num_attention_heads=4, tensor_model_parallel_size=tp,
                      sequence_parallel=sp, **cpu_config_overrides())
        init = torch.nn.init.zeros_
        outs = {}
        for kind, col_cls, row_cls, rec in (("fp4", FP4ColumnParallelLinear, FP4RowParallelLinear, recipe),
                                            ("fp4_off", FP4ColumnParallelLinear, FP4RowParallelLinear, None),
                                            ("megatron", ColumnParallelLinear, RowParallelLinear, None)):
            cfg = FP4TransformerConfig(fp4_recipe=rec, **fields)
            col = col_cls(h, f, config=cfg, init_method=init, bias=False, gather_output=False)
            row = row_cls(f, h, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                          skip_bias_add=False)
            with torch.no_grad():
                col.weight.copy_(w1.chunk(tp, 0)[rank])
                row.weight.copy_(w2.chunk(tp, 1)[rank])
            x = (x_full.chunk(tp, 0)[rank] if sp else x_full).clone().requires_grad_(True)
            y, _ = row(col(x)[0])
            y.backward(dy_full.chunk(tp, 0)[rank] if sp else dy_full)
            outs[kind] = (y.detach(), x.grad, gather_full(col.weight.grad, col.weight, tp),
                          gather_full(row.weight.grad, row.weight, tp))
        # the same math on full tensors in one process
        xr = x_full.clone().requires_grad_(True)
        w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        yr = fp4_linear(fp4_linear(xr, w1r, None, recipe), w2r, None, recipe)
        yr.backward(dy_full)
        full = (yr.detach(), xr.grad, w1r.grad, w2r.grad)
        if sp:
            full = (full[0].chunk(tp, 0)[rank], full[1].chunk(tp, 0)[rank], full[2], full[3])
        tag = "sp" if sp else "nosp"
        res[f"fp4_vs_full_{tag}"] = [float((a - r).norm() / r.norm()) for a, r in zip(outs["fp4"], full)]
        res[f"off_equal_{tag}"] = [torch.equal(a, r) for a, r in zip(outs["fp4_off"], outs["megatron"])]
        res[f"fp4_vs_megatron_{tag}"] = [float((a - r).norm() / r.norm()) for a, r in zip(outs["fp4"], outs["megatron"])]
    flags = torch.tensor([float(all(res["off_equal_sp"]) and all(res["off_equal_nosp"]))], device=device())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    res["off_equal_all_ranks"] = bool(flags.item() == 1.0)
    worst = torch.tensor([max(res["fp4_vs_full_sp"] + res["fp4_vs_full_nosp"])], device=device())
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    res["fp4_vs_full_worst_all_ranks"] = float(worst)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help="comma list: ref, tp2, pp2, dp2, hp:<layout>, <layout>@<format>, linears")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", default="hif4")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--kernels", action="store_true", help="route CUDA FP4 GEMMs through the kernels")
    a = ap.parse_args()
    kernel_calls = [0]
    if a.kernels:  # route FP4 GEMMs through the kernels (CUDA, or the Triton interpreter on CPU)
        from megatron_fp4 import ops
        from megatron_fp4.ops.kernels_backend import ops_backend

        def counted(*args):
            out = ops_backend(*args)
            kernel_calls[0] += out is not NotImplemented
            return out

        ops.register_fp4_gemm_backend(device().type, counted)
    os.makedirs(a.out, exist_ok=True)
    for layout in a.layouts.split(","):
        res = run_layout(layout, a.format, a.steps, a.seed)
        res["kernel_gemm_calls"] = kernel_calls[0]
        if torch.distributed.get_rank() == 0:
            torch.save(res, os.path.join(a.out, f"{layout.replace(':', '_').replace('@', '_')}.pt"))
    torch.distributed.barrier()
    from megatron_fp4.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    main()
