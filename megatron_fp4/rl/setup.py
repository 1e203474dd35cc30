"""Wiring a GRPO run from its configuration: data, tokenizer, models (policy + optimizer, reference, rollout copy),
the rollout engine, and the roles the trainer loops over. Call after ``initialize_parallel``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_fp4.rl.checkpointer import StartPlan
from megatron_fp4.rl.config import RLConfig

__all__ = ["load_examples", "tokenizer_source", "build_tokenizer", "Models", "build_models", "describe",
           "build_trainer"]


def load_examples(cfg: RLConfig, tokenizer=None) -> tuple[list, list, dict]:
    """(train, held-out, evaluation sets) of the data flags: --prompt-data or --dataset; held out: --eval-dataset,
    or --eval-samples split off; --eval-prompt-data's named sets. ``tokenizer`` formats the prompts with its chat
    template under --apply-chat-template; --rm-type replaces every example's reward kind."""
    import dataclasses

    from megatron_fp4.rl.data import load_dataset, load_prompt_data, split_heldout

    d, seed = cfg.data, cfg.run.seed
    chat = tokenizer if d.apply_chat_template else None
    kind = cfg.rollout.rm_type or "math"
    need_label = cfg.rollout.custom_rm_path is None
    if d.prompt_data is not None:
        examples = load_prompt_data(d.prompt_data, d.input_key, d.label_key, d.metadata_key, kind, chat, need_label)
    else:
        task_kwargs = {}
        if d.dataset == "synthetic:add":
            task_kwargs = {"digits": d.synthetic_digits, "num_operands": d.synthetic_operands}
        examples = load_dataset(d.dataset, seed=seed, num_examples=d.num_synthetic_examples, chat_template=chat,
                                **task_kwargs)
    if d.eval_dataset:
        train, held_out = examples, load_dataset(d.eval_dataset, seed=seed + 1, chat_template=chat)
    elif d.eval_samples == 0:
        train, held_out = examples, []
    elif d.eval_samples >= len(examples):
        raise ValueError(f"--eval-samples={d.eval_samples} leaves no training data ({len(examples)} examples)")
    else:
        train, held_out = split_heldout(examples, d.eval_samples, seed=seed)
    pairs = d.eval_prompt_data or ()
    sets = {name: load_prompt_data(path, d.eval_input_key or d.input_key, d.eval_label_key or d.label_key,
                                   d.metadata_key, kind, chat, need_label)
            for name, path in zip(pairs[0::2], pairs[1::2])}
    if cfg.rollout.rm_type is not None:
        def retag(exs):
            return [dataclasses.replace(e, kind=cfg.rollout.rm_type) for e in exs]

        train, held_out, sets = retag(train), retag(held_out), {k: retag(v) for k, v in sets.items()}
    return train, held_out, sets


def tokenizer_source(cfg: RLConfig, plan: StartPlan) -> Optional[str]:
    """Where the tokenizer comes from: --tokenizer-model, else --hf-checkpoint, else the converted checkpoint's
    hf_assets/ (--ref-load), else None (a sentencepiece model built on the examples)."""
    from megatron_fp4.models.checkpoint_io import checkpoint_tokenizer_dir

    if cfg.model.tokenizer_model is not None:
        return cfg.model.tokenizer_model
    if cfg.checkpoint.hf_checkpoint is not None:
        return cfg.checkpoint.hf_checkpoint
    if plan.ref_load:
        tok_dir = checkpoint_tokenizer_dir(plan.ref_load)
        if tok_dir is None:
            raise ValueError(f"--ref-load {plan.ref_load} has no tokenizer files (hf_assets/): pass --tokenizer-model "
                             f"or --hf-checkpoint")
        return str(tok_dir)
    return None


def build_tokenizer(cfg: RLConfig, tokenizer_model: Optional[str], examples: list):
    """The tokenizer of ``tokenizer_model`` (sentencepiece file or HF folder), or one built on the examples."""
    from megatron_fp4.rl.tokenizer import HFTokenizer, SentencePieceTokenizer, build_sentencepiece

    if tokenizer_model is None:
        return build_sentencepiece([e.prompt + e.target for e in examples], vocab_size=cfg.model.vocab_size)
    if os.path.isdir(tokenizer_model):
        return HFTokenizer(tokenizer_model)
    return SentencePieceTokenizer(model_file=tokenizer_model)


@dataclass
class Models:
    """The models of a run: the policy (megatron DDP) with its optimizer and schedule config, the frozen reference
    (None without KL), the rollout copy (the whole model, also under pipeline parallelism) and the FP4 recipe."""

    policy: Any
    optimizer: Any
    config: Any
    reference: Optional[torch.nn.Module]
    rollout_model: torch.nn.Module
    recipe: Any


def build_models(cfg: RLConfig, vocab_size: int, init_checkpoint: Any = None) -> Models:
    """Policy (DDP + optimizer), frozen reference, and the rollout model with its own copy of the weights.

    With pipeline parallelism the policy and the reference hold this rank's stage, the rollout model the whole
    model (every layer on every pipeline rank; the rollout manager's weight sync gathers the stages into it).

    ``init_checkpoint``: a converted megatron checkpoint (tools/convert_hf_to_megatron.py), or an HF folder's
    :class:`~megatron_fp4.models.hf_weights.HFCheckpointWeights`, whose architecture and weights initialize all
    three models (any TP/PP that divides the model; resharded on the fly).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config
    from megatron_fp4.recipe import recipe_for_format

    m, prec, act = cfg.model, cfg.precision, cfg.actor
    recipe = None
    if prec.fp4_train and prec.fp4_block_format != "none":
        recipe = recipe_for_format(prec.fp4_block_format,
                                   high_precision_first_layers=prec.fp4_high_precision_first_layers,
                                   high_precision_last_layers=prec.fp4_high_precision_last_layers,
                                   gemm_mode=prec.fp4_gemm_mode)
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model
    from megatron_fp4.models.hf_weights import HFCheckpointWeights, hf_gpt_model_args

    if isinstance(init_checkpoint, HFCheckpointWeights):
        margs = hf_gpt_model_args(init_checkpoint, fp4_recipe=recipe, params_dtype=dtype)
        margs.max_seq_len = max(margs.max_seq_len, m.seq_length)
    elif init_checkpoint is not None:
        from megatron_fp4.models.checkpoint_io import gpt_model_args_from_checkpoint

        margs = gpt_model_args_from_checkpoint(init_checkpoint, fp4_recipe=recipe, params_dtype=dtype)
        margs.max_seq_len = max(margs.max_seq_len, m.seq_length)
    else:
        margs = GPTModelArgs(num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
                             num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                             vocab_size=vocab_size, max_seq_len=m.seq_length, fp4_recipe=recipe, params_dtype=dtype)

    def load_init(model):
        if init_checkpoint is not None:
            load_checkpoint_into_model(model, init_checkpoint)
        return model

    margs.attention_backend = m.attention_backend
    if cfg.parallel.use_cpu_initialization:  # the full weights from one CPU RNG stream, then split: TP-invariant
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

    def schedule_config(**overrides):
        """The config of a model run through megatron's schedule (the policy, the reference)."""
        c = gpt_transformer_config(margs, calculate_per_token_loss=True, **overrides)
        if pp > 1:
            # a short last micro-batch is fine when the stages exchange activation shapes before the tensors (set
            # after construction: TransformerConfig rejects it with its default MoE token dispatcher, unused here)
            c.variable_seq_lengths = True
        return c

    # the policy and the reference keep vocab-parallel logits: the actor's log-probs reduce over the TP group
    config = schedule_config(cuda_graph_impl=act.cuda_graph_impl)  # the reference's forward-only passes: eager
    if full_model is None:
        policy = load_init(build_gpt_model(margs, config=config, parallel_output=True))
    else:
        from megatron_fp4.models.pp_gather import copy_stage_from_full_model

        policy = build_gpt_model(margs, config=config, parallel_output=True)
        copy_stage_from_full_model(policy, full_model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=act.use_distributed_optimizer),
        policy)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=act.lr, weight_decay=act.weight_decay, clip_grad=act.clip_grad,
                        bf16=m.bf16, params_dtype=dtype, adam_beta1=0.9, adam_beta2=0.98,
                        use_distributed_optimizer=act.use_distributed_optimizer), [ddp])

    reference = None
    if act.use_kl_loss and act.kl_beta > 0:
        reference = load_init(build_gpt_model(margs, config=schedule_config(), parallel_output=True))
        reference.requires_grad_(False)
    rollout_model = full_model if full_model is not None else load_init(build_gpt_model(rollout_margs,
                                                                                      parallel_output=False))
    rollout_model.requires_grad_(False)
    return Models(ddp, optimizer, config, reference, rollout_model, recipe)


def sglang_model_dir(rollout_model: torch.nn.Module) -> str:
    """The folder an SGLang Engine starts from: the policy's config.json (as its HF export writes it) in a temporary
    folder of this rank, removed at exit. The Engine loads no weights from it (``load_format="dummy"``): the
    policy's arrive at the first sync. Its vocabulary is the policy's (a model converted from HF: that model's;
    else padding rows included), so that the Engine samples from the distribution the policy trains on."""
    import atexit
    import json
    import shutil
    import tempfile

    from megatron_fp4.models.hf_export import hf_config_of_model

    path = tempfile.mkdtemp(prefix="megatron-fp4-sglang-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_of_model(rollout_model), f, indent=2)
    return path


def describe(cfg: RLConfig, recipe, precision) -> str:
    """'training: FP4 HiF4BlockScaling | rollout: w4a4 hif4 + ResQ 2:4 (native)'."""
    train = "high precision" if recipe is None else f"FP4 {type(recipe).__name__}"
    roll = precision.mode if precision.mode == "bf16" else f"{precision.mode} {precision.format}"
    if precision.quantize_activations and precision.sparsity != "none":
        roll += f" + ResQ {precision.sparsity}" + (" (bf16 sum)" if precision.resq_combine == "bf16" else "")
    return f"training: {train} | rollout: {roll} ({cfg.rollout.rollout_backend})"


def build_trainer(cfg: RLConfig, plan: StartPlan):
    """The trainer and its roles for ``cfg``, with the models built from ``plan``'s starting weights (a converted
    checkpoint's or an HF folder's architecture and weights when it names one). Returns (trainer, description)."""
    from megatron_fp4.formats import get_format
    from megatron_fp4.models.hf_weights import HFCheckpointWeights
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rl.actor import Actor
    from megatron_fp4.rl.checkpointer import Checkpointer
    from megatron_fp4.rl.evaluator import Evaluator
    from megatron_fp4.rl.monitor import MetricsLogger, init_wandb
    from megatron_fp4.rl.rewards import RewardFunction
    from megatron_fp4.rl.rollout_manager import RolloutManager, make_engines
    from megatron_fp4.rl.trainer import GRPOTrainer
    from megatron_fp4.rl.warmup import SupervisedWarmup

    rank = torch.distributed.get_rank()
    tokenizer_model = tokenizer_source(cfg, plan)
    tok = build_tokenizer(cfg, tokenizer_model, []) if tokenizer_model is not None else None
    train_examples, eval_examples, eval_sets = load_examples(cfg, tok)
    if tok is None:
        tok = build_tokenizer(cfg, None, train_examples + eval_examples)
    warmup_iters = cfg.warmup.sft_iters or 0
    if warmup_iters and plan.resume is None and not plan.init_from and not all(e.target for e in train_examples):
        raise ValueError(f"--sft-iters={warmup_iters}: the supervised warm-up needs training examples with target "
                         f"completions (synthetic tasks, --dataset gsm8k); these have none: pass --sft-iters 0")
    tp = cfg.parallel.tensor_model_parallel_size
    # pad to a multiple of 16 that TP divides, the same at every TP <= 16: the same random model at any TP
    multiple = math.lcm(16, tp)
    init = plan.ref_load or (HFCheckpointWeights(plan.hf_checkpoint) if plan.hf_checkpoint else None)
    models = build_models(cfg, -(-tok.vocab_size // multiple) * multiple, init)
    model_vocab = models.policy.module.vocab_size
    if tok.vocab_size > model_vocab:
        source = f"--ref-load {plan.ref_load}" if plan.ref_load else f"--hf-checkpoint {plan.hf_checkpoint}"
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has only "
                         f"{model_vocab} ({source}): use the checkpoint's own tokenizer")
    prec = cfg.precision
    fmt = prec.fp4_block_format if prec.fp4_block_format != "none" else "hif4"
    precision = RolloutPrecision(prec.rollout_precision, fmt, prec.resq, resq_combine=prec.resq_combine)
    bf16 = RolloutPrecision("bf16", fmt, "none")
    eval_precisions = {"accuracy": None}
    if precision.mode != "bf16":
        eval_precisions["accuracy_bf16"] = bf16
    hf_dir = None
    if cfg.rollout.rollout_backend == "sglang":
        hf_dir = sglang_model_dir(models.rollout_model)
    engine, diagnostics_engine = make_engines(cfg.rollout, models.rollout_model, precision, hf_dir=hf_dir,
                                              dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
                                              seed=cfg.run.seed)

    run, ro = cfg.run, cfg.rollout
    steps_per_rollout = ro.rollout_batch_size * ro.group_size // cfg.actor.global_batch_size
    actor = Actor(cfg.actor, models.policy, models.optimizer, models.reference, group_size=ro.group_size,
                  train_iters=run.train_iters, max_nonfinite_steps=run.max_nonfinite_steps,
                  steps_per_rollout=steps_per_rollout,
                  fixed_shape=((cfg.actor.micro_batch_size, cfg.model.seq_length)
                               if cfg.actor.cuda_graph_impl == "local" else None))
    reward_fn = RewardFunction(ro.custom_rm_path, ro.group_rm, cfg.namespace())
    rollout = RolloutManager(ro, engine, tok, train_examples, seed=run.seed, reward_fn=reward_fn,
                             debug_data_path=run.save_debug_rollout_data, diagnostics_engine=diagnostics_engine)
    evaluator = Evaluator(rollout, eval_examples, eval_precisions, sets=eval_sets,
                          n_samples=run.n_samples_per_eval_prompt, temperature=run.eval_temperature,
                          max_new_tokens=run.eval_max_response_len, seed=run.seed,
                          debug_data_path=run.save_debug_rollout_data)
    wandb_run = init_wandb(run, vars(cfg.namespace())) if run.use_wandb and rank == 0 else None
    tokenizer_dir = tokenizer_model if tokenizer_model and os.path.isdir(tokenizer_model) else None
    trainer = GRPOTrainer(cfg, rollout, actor, evaluator, Checkpointer(cfg.checkpoint, tok.vocab_size, tokenizer_dir),
                          SupervisedWarmup(cfg.warmup, actor, tok, train_examples, seed=run.seed,
                                           max_prompt_length=ro.max_prompt_length,
                                           max_response_length=ro.max_response_length),
                          MetricsLogger(run.tensorboard_dir, total_steps=run.train_iters, rank=rank,
                                        jsonl_path=run.log_jsonl, wandb_run=wandb_run), bf16_precision=bf16)
    setup = describe(cfg, models.recipe, precision)
    if rank == 0:
        n_params = sum(p.numel() for p in models.policy.module.parameters())
        pp = cfg.parallel.pipeline_model_parallel_size
        data = cfg.data.prompt_data or cfg.data.dataset
        sets = "".join(f" + {name} {len(exs)}" for name, exs in eval_sets.items())
        print(f"[setup] {data}: {len(train_examples)} train / {len(eval_examples)} held-out{sets} | tokenizer "
              f"{tok.vocab_size} tokens, model vocab {model_vocab} | {n_params / 1e6:.2f}M params/rank | {setup} | "
              f"attention {models.policy.module.attention_backend} | "
              f"world {torch.distributed.get_world_size()} (TP {tp}{f', PP {pp}' if pp > 1 else ''})"
              f"{' | distributed optimizer' if cfg.actor.use_distributed_optimizer else ''}", flush=True)
        if steps_per_rollout > 1:
            print(f"[setup] each rollout ({ro.rollout_batch_size} prompts x {ro.group_size} samples) feeds "
                  f"{steps_per_rollout} optimizer steps of --global-batch-size {cfg.actor.global_batch_size} samples",
                  flush=True)
        if models.recipe is not None and tp > 1:
            block = get_format(prec.fp4_block_format).block_size
            mcfg = models.policy.module.config
            split = {"hidden size": mcfg.hidden_size, "ffn hidden size": mcfg.ffn_hidden_size}
            uneven = [f"{k} {v} / TP {tp}" for k, v in split.items() if (v // tp) % block]
            if uneven:
                print(f"[setup] note: {', '.join(uneven)} is not a multiple of the {prec.fp4_block_format} block "
                      f"({block}): FP4 blocks along the sharded K differ from TP=1's, so results depend on TP",
                      flush=True)
    return trainer, setup
