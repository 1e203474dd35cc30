"""GRPO post-training with FP4 training and FP4 (+ Rollout-ResQ) rollout on megatron-core.

    python pretrain_rl.py                                    # the tiny CPU default (synthetic addition, HiF4 + ResQ 2:4)
    python pretrain_rl.py --config examples/tiny_cpu.yaml    # the same, from a YAML file
    torchrun --nproc-per-node 2 pretrain_rl.py --tensor-model-parallel-size 2 ...
    torchrun --nproc-per-node 2 pretrain_rl.py --pipeline-model-parallel-size 2 ...   # rollout on a full copy

See ``python pretrain_rl.py --help`` for every argument and README.md for recipes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings


def _quiet_imports() -> None:
    """megatron-core and torchao warn at import on CPU-only machines; keep the console readable."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)


def build_tokenizer(args, examples):
    from megatron_fp4.rl.tokenizer import HFTokenizer, SentencePieceTokenizer, build_sentencepiece

    if args.tokenizer_model is None:
        return build_sentencepiece([e.prompt + e.target for e in examples], vocab_size=args.vocab_size)
    if os.path.isdir(args.tokenizer_model):
        return HFTokenizer(args.tokenizer_model)
    return SentencePieceTokenizer(model_file=args.tokenizer_model)


def load_examples(args):
    from megatron_fp4.rl.data import load_dataset, split_heldout

    task_kwargs = {}
    if args.dataset == "synthetic:add":
        task_kwargs = {"digits": args.synthetic_digits, "num_operands": args.synthetic_operands}
    examples = load_dataset(args.dataset, seed=args.seed, num_examples=args.num_synthetic_examples, **task_kwargs)
    if args.eval_dataset:
        return examples, load_dataset(args.eval_dataset, seed=args.seed + 1)
    if args.eval_samples >= len(examples):
        raise ValueError(f"--eval-samples={args.eval_samples} leaves no training data ({len(examples)} examples)")
    return split_heldout(examples, args.eval_samples, seed=args.seed)


def build_models(args, vocab_size, init_checkpoint=None):
    """Policy (DDP + optimizer), frozen reference, and the rollout engine with its own copy of the weights.

    With pipeline parallelism the policy and the reference hold this rank's stage, the rollout model the whole
    model (every layer on every pipeline rank; GRPOTrainer.sync_rollout_weights gathers the stages into it).

    ``init_checkpoint``: a converted megatron checkpoint (tools/convert_hf_to_megatron.py) whose architecture and
    weights initialize all three models (any TP that divides the model; resharded on the fly).
    """
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config
    from megatron_fp4.recipe import recipe_for_format
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rollout import NativeRolloutEngine

    recipe = None
    if args.fp4_train and args.fp4_format != "none":
        recipe = recipe_for_format(args.fp4_format,
                                   high_precision_first_layers=args.fp4_high_precision_first_layers,
                                   high_precision_last_layers=args.fp4_high_precision_last_layers)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if init_checkpoint is not None:
        from megatron_fp4.models.checkpoint_io import gpt_model_args_from_checkpoint, load_checkpoint_into_model

        margs = gpt_model_args_from_checkpoint(init_checkpoint, fp4_recipe=recipe, params_dtype=dtype)
        margs.max_seq_len = max(margs.max_seq_len, args.seq_length)
    else:
        margs = GPTModelArgs(num_layers=args.num_layers, hidden_size=args.hidden_size,
                             ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                             num_query_groups=args.num_query_groups, vocab_size=vocab_size,
                             max_seq_len=args.seq_length, fp4_recipe=recipe, params_dtype=dtype)

    def load_init(model):
        if init_checkpoint is not None:
            load_checkpoint_into_model(model, init_checkpoint)
        return model

    from megatron.core import parallel_state as ps

    if args.use_cpu_initialization:  # the full weights from one CPU RNG stream, then split: TP-invariant on GPUs
        margs.config_overrides = {**margs.config_overrides, "use_cpu_initialization": True}
    rollout_margs = GPTModelArgs(**{**margs.__dict__, "fp4_recipe": None})
    full_model = None
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        # The rollout engine needs the whole model: every pipeline rank holds a full-depth copy, tensor-parallel
        # sharded like the policy. Its config says PP = 1, so megatron builds all layers at offset 0 and sets up
        # no embedding group for tied weights. It is built first, from the RNG state a PP = 1 run builds its
        # policy from, and the policy stage takes its slice: PP > 1 starts from the same weights as PP = 1.
        full_model = load_init(build_gpt_model(
            rollout_margs, config=gpt_transformer_config(rollout_margs, pipeline_model_parallel_size=1),
            pre_process=True, post_process=True, parallel_output=False))

    def schedule_config():
        """The config of a model run through megatron's schedule (the policy, the reference)."""
        cfg = gpt_transformer_config(margs, calculate_per_token_loss=True)
        if pp > 1:
            # a short last micro-batch is fine when the stages exchange activation shapes before the tensors (set
            # after construction: TransformerConfig rejects it with its default MoE token dispatcher, unused here)
            cfg.variable_seq_lengths = True
        return cfg

    config = schedule_config()
    if full_model is None:
        policy = load_init(build_gpt_model(margs, config=config, parallel_output=False))
    else:
        from megatron_fp4.models.pp_gather import copy_stage_from_full_model

        policy = build_gpt_model(margs, config=config, parallel_output=False)
        copy_stage_from_full_model(policy, full_model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        overlap_grad_reduce=False), policy)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                        bf16=args.bf16, params_dtype=dtype, adam_beta1=0.9, adam_beta2=0.98), [ddp])

    reference = None
    if args.kl_beta > 0:
        reference = load_init(build_gpt_model(margs, config=schedule_config(), parallel_output=False))
        reference.requires_grad_(False)
    rollout_model = full_model if full_model is not None else load_init(build_gpt_model(rollout_margs,
                                                                                      parallel_output=False))
    rollout_model.requires_grad_(False)
    fmt = args.fp4_format if args.fp4_format != "none" else "hif4"
    precision = RolloutPrecision(args.rollout_precision, fmt, args.resq, resq_combine=args.resq_combine)
    engine = NativeRolloutEngine(rollout_model, precision)
    return ddp, optimizer, config, reference, engine, precision, recipe


def warm_up(trainer, args, bf16_precision) -> list[float]:
    """Supervised warm-up: ``--sft-iters`` iterations, or fewer with ``--sft-target-accuracy`` (the first check,
    every ``--sft-eval-interval`` iterations, whose greedy held-out BF16 accuracy reaches the target stops it).
    Returns the per-iteration NLL."""
    if args.sft_target_accuracy is None:
        return trainer.supervised_warmup(args.sft_iters, args.sft_lr, args.sft_batch_size)
    done, losses = 0, []
    while done < args.sft_iters:
        chunk = min(args.sft_eval_interval, args.sft_iters - done)
        losses += trainer.supervised_warmup(chunk, args.sft_lr, args.sft_batch_size, progress=False)
        done += chunk
        trainer.sync_rollout_weights()
        acc = trainer.evaluate({"accuracy": bf16_precision})["accuracy"]
        if trainer.rank == 0:
            print(f"[warmup] iter {done}/{args.sft_iters} | held-out accuracy {acc:.3f} "
                  f"(target {args.sft_target_accuracy:.3f})", flush=True)
        if acc >= args.sft_target_accuracy:
            break
    return losses


def describe(args, recipe, precision) -> str:
    train = "high precision" if recipe is None else f"FP4 {type(recipe).__name__}"
    roll = precision.mode if precision.mode == "bf16" else f"{precision.mode} {precision.format}"
    if precision.quantize_activations and precision.sparsity != "none":
        roll += f" + ResQ {precision.sparsity}" + (" (bf16 sum)" if precision.resq_combine == "bf16" else "")
    return f"training: {train} | rollout: {roll} ({args.rollout_backend})"


def parse(argv=None):
    """Parsed and validated arguments; a bad argument exits with a one-line message naming it."""
    from megatron_fp4.rl.arguments import parse_args

    try:
        return parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"pretrain_rl.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> dict:
    _quiet_imports()
    import torch

    args = parse(argv)
    if args.rollout_backend == "sglang":
        raise SystemExit("pretrain_rl.py: --rollout-backend sglang is not available yet; use --rollout-backend native")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    from megatron_fp4.formats import get_format
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rl.trainer import GRPOTrainer

    from megatron_fp4.models.checkpoint_io import checkpoint_tokenizer_dir, is_megatron_checkpoint
    from megatron_fp4.rl.checkpoint import latest_iteration

    initialize_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, seed=args.seed)
    rank = torch.distributed.get_rank()
    t_start = time.monotonic()
    # --load is either a converted model checkpoint (initial weights) or an RL checkpoint to resume; an RL
    # checkpoint in --save is resumed too, so re-running the same command after a crash continues the run.
    init_checkpoint = args.load if args.load and is_megatron_checkpoint(args.load) else None
    resume_dir = next((d for d in (args.save, None if init_checkpoint else args.load)
                       if d and latest_iteration(d) is not None), None)
    if init_checkpoint and args.tokenizer_model is None:
        tok_dir = checkpoint_tokenizer_dir(init_checkpoint)
        if tok_dir is None:
            raise SystemExit(f"pretrain_rl.py: --load {init_checkpoint} has no tokenizer files (hf_assets/); "
                             f"pass --tokenizer-model")
        args.tokenizer_model = str(tok_dir)
    train_examples, eval_examples = load_examples(args)
    tok = build_tokenizer(args, train_examples + eval_examples)
    tp = args.tensor_model_parallel_size
    # pad to a multiple of 16 that TP divides, the same at every TP <= 16: the same random model at any TP
    multiple = math.lcm(16, tp)
    vocab = -(-tok.vocab_size // multiple) * multiple
    policy, optimizer, config, reference, engine, precision, recipe = build_models(args, vocab, init_checkpoint)
    model_vocab = policy.module.vocab_size
    if tok.vocab_size > model_vocab:
        raise SystemExit(f"pretrain_rl.py: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"only {model_vocab} (--load {args.load}): use the checkpoint's own tokenizer")
    trainer = GRPOTrainer(args, tok, train_examples, eval_examples, policy, optimizer, config, reference, engine,
                          args.rollout_precision)
    if rank == 0:
        n_params = sum(p.numel() for p in policy.module.parameters())
        pp = args.pipeline_model_parallel_size
        print(f"[setup] {args.dataset}: {len(train_examples)} train / {len(eval_examples)} held-out | tokenizer "
              f"{tok.vocab_size} tokens, model vocab {model_vocab} | {n_params / 1e6:.2f}M params/rank | "
              f"{describe(args, recipe, precision)} | world {torch.distributed.get_world_size()} "
              f"(TP {tp}{f', PP {pp}' if pp > 1 else ''})", flush=True)

    if rank == 0 and recipe is not None and tp > 1:
        block = get_format(args.fp4_format).block_size
        cfg = policy.module.config
        split = {"hidden size": cfg.hidden_size, "ffn hidden size": cfg.ffn_hidden_size}
        uneven = [f"{k} {v} / TP {tp}" for k, v in split.items() if (v // tp) % block]
        if uneven:
            print(f"[setup] note: {', '.join(uneven)} is not a multiple of the {args.fp4_format} block ({block}): "
                  f"FP4 blocks along the sharded K differ from TP=1's, so results depend on TP", flush=True)

    eval_precisions = {"accuracy": None}
    if precision.mode != "bf16":
        eval_precisions["accuracy_bf16"] = RolloutPrecision("bf16", precision.format, "none")

    resumed = resume_dir is not None and trainer.try_resume(resume_dir)
    if not resumed:
        if args.init_from:  # a shared warm start: its weights replace the warm-up
            trainer.load_model_weights(args.init_from)
        else:
            trainer.state_extra["warmup_losses"] = warm_up(trainer, args,
                                                           RolloutPrecision("bf16", precision.format, "none"))
        if reference is not None:
            reference.load_state_dict(policy.module.state_dict())
    trainer.sync_rollout_weights()
    if not resumed:
        warm = trainer.evaluate(eval_precisions)
        trainer.state_extra["warm_start"] = warm
        trainer.logger.log(0, warm, prefix="eval")
        if args.save:
            trainer.save()

    def log_jsonl(step, prefix, metrics):
        if args.log_jsonl and rank == 0:
            with open(args.log_jsonl, "a") as f:
                f.write(json.dumps({"step": step, "kind": prefix, **metrics}) + "\n")

    underflow_sparsity = args.resq if args.resq != "none" else "2:4"

    def log_underflow(step):
        if args.log_underflow_interval and (step % args.log_underflow_interval == 0 or step == args.train_iters):
            rates = trainer.measure_rollout_underflow(underflow_sparsity)
            log_jsonl(step, "underflow", {"format": precision.format, "sparsity": underflow_sparsity, **rates})
            if trainer.logger.writer is not None:
                for k, v in rates.items():
                    trainer.logger.writer.add_scalar(f"underflow/{k}", v, step)

    if not resumed:
        log_underflow(0)
    last_eval = None
    for _ in range(trainer.step, args.train_iters):
        metrics = trainer.train_step()
        step = trainer.step
        log_jsonl(step, "train", metrics)
        if step % args.log_interval == 0:
            trainer.logger.log(step, metrics, prefix="train")
        if step % args.eval_interval == 0 or step == args.train_iters:
            last_eval = trainer.evaluate(eval_precisions)
            log_jsonl(step, "eval", last_eval)
            trainer.logger.log(step, last_eval, prefix="eval")
        log_underflow(step)
        if args.save and (step % args.save_interval == 0 or step == args.train_iters):
            trainer.save()
    warm = trainer.state_extra.get("warm_start", {})
    if last_eval is None:
        last_eval = dict(warm) if args.train_iters == 0 and warm else trainer.evaluate(eval_precisions)
    result = {"warm_start": warm, "final": last_eval, "steps": trainer.step,
              "warmup_losses": trainer.state_extra.get("warmup_losses", []),
              "seconds": time.monotonic() - t_start, "setup": describe(args, recipe, precision)}
    if rank == 0:
        for key, value in last_eval.items():
            before = warm.get(key, float("nan"))
            print(f"[result] held-out {key}: {before:.3f} (warm start) -> {value:.3f} after {trainer.step} GRPO steps "
                  f"({(value - before) * 100:+.1f} points)", flush=True)
        print(f"[result] wall time {result['seconds']:.0f}s", flush=True)
        if args.results_json:
            with open(args.results_json, "w") as f:
                json.dump(result, f, indent=2)
    trainer.logger.close()
    return result


if __name__ == "__main__":
    from megatron_fp4.rl.checkpoint import CheckpointError
    from megatron_fp4.rl.monitor import TrainingDivergedError

    try:
        main()
    except (TrainingDivergedError, CheckpointError) as e:  # the messages name the step / checkpoint and what to do
        print(f"pretrain_rl.py: error: {e}", file=sys.stderr)
        sys.exit(1)
