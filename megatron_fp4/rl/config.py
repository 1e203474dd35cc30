"""Every knob of the GRPO driver, defined once: typed, documented dataclasses, one per role.

Each field is one command-line flag (``--tensor-model-parallel-size`` for ``tensor_model_parallel_size``) and one
YAML key; :mod:`megatron_fp4.rl.arguments` generates both from these classes (as megatron-core's
argument_utils does from its config dataclasses), so a default is written once, here, and adding a flag or an
alias is one line. The roles take their section (:class:`RolloutConfig` for the rollout manager,
:class:`ActorConfig` for the actor, ...) instead of reading the flat namespace.

    knob(default, help, check=..., choices=..., aliases=(...))

``check`` names the range a value must lie in (floats must also be finite); ``choices`` the allowed values;
``aliases`` extra flag spellings (e.g. slime's) that set the same field. A field typed ``tuple[str, ...]`` takes one
or more values (``--eval-prompt-data NAME PATH ...``; a YAML list). ``None`` defaults that depend on other knobs
are resolved by :func:`megatron_fp4.rl.arguments.validate_args` and say so in their help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, get_type_hints

from megatron_fp4.ops import GEMM_MODES
from megatron_fp4.parallel.attention import ATTENTION_BACKENDS
from megatron_fp4.recipe import RECIPES
from megatron_fp4.resq import RESQ_COMBINES, ROLLOUT_MODES, SPARSITIES
from megatron_fp4.rollout.native import DECODE_MODES
from megatron_fp4.rl.grpo import GRPOConfig
from megatron_fp4.rl.rewards import VALID_KINDS

__all__ = ["knob", "positive", "non_negative", "at_least", "in_range", "ParallelConfig", "ModelConfig",
           "PrecisionConfig", "DataConfig", "RolloutConfig", "ActorConfig", "WarmupConfig", "CheckpointConfig",
           "RunConfig", "RLConfig", "SECTIONS", "section_fields", "FP4_FORMATS", "ROLLOUT_BACKENDS", "ADVANTAGES",
           "INITS", "REWARD_KINDS", "WANDB_MODES", "ATTENTION_BACKENDS", "SGLANG_ATTENTION_BACKENDS",
           "SGLANG_PORTS_PER_RANK", "SGLANG_MAX_GRAPH_BS", "SGLANG_DRIVER_FIELDS", "sglang_server_args"]

FP4_FORMATS = (*RECIPES, "none")
ROLLOUT_BACKENDS = ("native", "sglang")
SGLANG_ATTENTION_BACKENDS = ("triton", "flashinfer", "fa3", "torch_native")
#: Ports of each local rank's SGLang Engine from --sglang-base-port on: its port, and its NCCL port at + 8.
SGLANG_PORTS_PER_RANK = 16
#: The largest decode batch the driver has SGLang capture as a CUDA graph by default (--sglang-cuda-graph-max-bs 0).
SGLANG_MAX_GRAPH_BS = 512
ADVANTAGES = ("grpo", "drgrpo", "gspo", "reinforce_plus_plus")
INITS = ("random",)
REWARD_KINDS = VALID_KINDS
WANDB_MODES = ("online", "offline", "disabled")
_GRPO = GRPOConfig()  # the GRPO math's own defaults are the driver's


# -- range checks: a function of the value returning what it must be, or None when it is fine ----------------------
def positive(v: Any) -> Optional[str]:
    return None if v > 0 else "> 0"


def non_negative(v: Any) -> Optional[str]:
    return None if v >= 0 else ">= 0"


def at_least(lo: float) -> Callable[[Any], Optional[str]]:
    """A check for v >= lo."""
    return lambda v: None if v >= lo else f">= {lo}"


def greater_than(lo: float) -> Callable[[Any], Optional[str]]:
    """A check for v > lo."""
    return lambda v: None if v > lo else f"> {lo}"


def in_range(lo: float, hi: float, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[Any], Optional[str]]:
    """A check for lo <= v <= hi (either end open on request)."""
    def check(v: Any) -> Optional[str]:
        ok = (v > lo if low_open else v >= lo) and (v < hi if high_open else v <= hi)
        return None if ok else f"in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
    return check


def knob(default: Any, help: str, *, check: Optional[Callable[[Any], Optional[str]]] = None,
         choices: Optional[tuple] = None, aliases: tuple[str, ...] = ()) -> Any:
    """A config field that is also a command-line flag and a YAML key."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices, "aliases": aliases})


# -- the sections, in the order --help and --print-config show them --------------------------------------------------
@dataclass(frozen=True)
class ParallelConfig:
    """parallelism"""

    tensor_model_parallel_size: int = knob(1, "tensor-parallel size", check=positive)
    pipeline_model_parallel_size: int = knob(1, "pipeline-parallel size (every rank also holds a full-depth rollout "
                                                "copy)", check=positive)
    use_cpu_initialization: bool = knob(False, "initialize full weights on the CPU, then shard them: the same random "
                                               "model at any TP/PP (always the case on CPU; on GPUs megatron otherwise "
                                               "seeds each TP rank's shard itself)")


@dataclass(frozen=True)
class ModelConfig:
    """model (ignored with --ref-load of a converted checkpoint, which carries its own)"""

    num_layers: int = knob(2, "transformer layers", check=positive)
    hidden_size: int = knob(128, "hidden size", check=positive)
    ffn_hidden_size: int = knob(512, "MLP hidden size", check=positive)
    num_attention_heads: int = knob(4, "attention heads", check=positive)
    num_query_groups: int = knob(2, "key/value heads (GQA)", check=positive)
    seq_length: Optional[int] = knob(None, "max positions (default: max prompt + max response length)",
                                     check=positive)
    tokenizer_model: Optional[str] = knob(None, "sentencepiece .model file or HF tokenizer folder (default: build "
                                                "one for synthetic data)")
    vocab_size: int = knob(24, "vocabulary of a tokenizer built on the fly", check=positive)
    bf16: bool = knob(False, "bf16 parameters (GPU); default fp32")
    attention_backend: str = knob("auto", "core attention of the policy, reference and rollout models: sdpa (PyTorch's "
                                          "fused scaled_dot_product_attention, FlashAttention on Hopper), local "
                                          "(megatron-core's unfused DotProductAttention, the reference; Megatron-LM's "
                                          "--attention-backend local), auto (sdpa on CUDA, local on the CPU). "
                                          "Megatron-LM's flash/fused/unfused are Transformer Engine's (not used here)",
                                  choices=ATTENTION_BACKENDS)


@dataclass(frozen=True)
class PrecisionConfig:
    """FP4 (training GEMMs and rollout)"""

    fp4_block_format: str = knob("hif4", "FP4 block format of the training GEMMs and the rollout ('none': everything "
                                         "in high precision). Not megatron-core's --fp4-format e2m1 / --fp4-recipe, "
                                         "which select Transformer Engine's NVFP4 (unused here)",
                                 choices=FP4_FORMATS, aliases=("--fp4-format",))
    fp4_train: bool = knob(True, "quantize the training GEMMs (fprop, dgrad, wgrad); --no-fp4-train trains in high "
                                 "precision")
    rollout_precision: str = knob("w4a4", "which rollout GEMM operands are FP4", choices=ROLLOUT_MODES)
    resq: str = knob("2:4", "Rollout-ResQ residual sparsity (quote '2:4' in YAML)", choices=SPARSITIES)
    resq_combine: str = knob("exact", "exact: add the residual's product exactly; bf16: round Q(X) + S(Q(R)) once to "
                                      "one BF16 operand (one GEMM: the fast path on Hopper, see docs/PERFORMANCE.md)",
                             choices=RESQ_COMBINES)
    fp4_high_precision_first_layers: int = knob(0, "first N transformer layers trained in high precision",
                                                check=non_negative)
    fp4_high_precision_last_layers: int = knob(0, "last N transformer layers trained in high precision",
                                               check=non_negative)
    fp4_gemm_mode: str = knob("exact", "how the training GEMMs multiply on the GPU: exact (fp32 accumulation of the "
                                       "exact FP4 products), or for MXFP4 fp8 / fp8_fast (the three GEMMs on the FP8 "
                                       "tensor cores, promoted / fast accumulation, values far below their "
                                       "row's largest flushed: approximate, see docs/PERFORMANCE.md)",
                              choices=GEMM_MODES)


@dataclass(frozen=True)
class DataConfig:
    """data"""

    dataset: Optional[str] = knob(None, "gsm8k:PATH | math:PATH | synthetic:add | synthetic:arith (default: "
                                        "synthetic:add, unless --prompt-data names the training prompts)")
    prompt_data: Optional[str] = knob(None, "training prompts as slime reads them: a .jsonl, .json or .parquet file "
                                            "(local, through the datasets library) whose --input-key holds the prompt "
                                            "(text, or chat messages with --apply-chat-template) and --label-key the "
                                            "reference answer")
    input_key: str = knob("input", "--prompt-data / --eval-prompt-data key of the prompt")
    label_key: str = knob("label", "--prompt-data / --eval-prompt-data key of the reference answer (the reward's "
                                   "label)")
    metadata_key: str = knob("metadata", "--prompt-data key of an optional per-prompt dict passed to "
                                         "--custom-rm-path as sample.metadata")
    apply_chat_template: bool = knob(False, "format every prompt (--prompt-data, --dataset and eval sets) with the HF "
                                            "tokenizer's chat template: the text as one user message (or the "
                                            "record's message list) plus the generation prompt")
    eval_dataset: Optional[str] = knob(None, "held-out data, same forms as --dataset (default: split off "
                                             "--eval-samples)")
    eval_prompt_data: Optional[tuple[str, ...]] = knob(
        None, "extra evaluation sets as slime names them: NAME PATH [NAME PATH ...] (jsonl/json/parquet, read like "
              "--prompt-data); metrics NAME/accuracy (and NAME/pass@k with --n-samples-per-eval-prompt)")
    eval_input_key: Optional[str] = knob(None, "--eval-prompt-data key of the prompt (default: --input-key)")
    eval_label_key: Optional[str] = knob(None, "--eval-prompt-data key of the answer (default: --label-key)")
    num_synthetic_examples: int = knob(4000, "examples of a synthetic task", check=positive)
    synthetic_digits: int = knob(1, "max digits per operand of synthetic:add", check=positive)
    synthetic_operands: int = knob(4, "operands per synthetic:add problem", check=positive)
    eval_samples: Optional[int] = knob(None, "held-out examples split off the training data when no --eval-dataset "
                                             "is given (default: 256 with --dataset, 0 with --prompt-data, whose "
                                             "evaluation sets are --eval-prompt-data's as in slime)",
                                       check=non_negative)


@dataclass(frozen=True)
class RolloutConfig:
    """rollout (sampling and filtering)"""

    rollout_backend: str = knob("native", "rollout engine: native (in-process, the reference; CPU or GPU) or sglang "
                                          "(an SGLang Engine per tensor-parallel group on its GPUs, serving the "
                                          "rollout precision through the megatron_fp4 plug-in; CUDA only)",
                                choices=ROLLOUT_BACKENDS)
    rollout_decode: str = knob("auto", "the native engine's decode path: megatron (megatron-core's forward, the "
                                       "reference), static (static KV cache), graph (static KV cache, CUDA-graph "
                                       "decode steps; ~9x faster on an H200, see docs/PERFORMANCE.md), auto (graph "
                                       "on CUDA, megatron elsewhere; models the static path does not serve, e.g. "
                                       "TP > 1, take megatron)", choices=DECODE_MODES)
    offload_rollout: bool = knob(False, "release the rollout engine's accelerator memory (KV cache, FP4 weights, "
                                        "CUDA graphs; the native engine's weights go to the CPU, SGLang's through "
                                        "its memory saver) while the policy trains, and restore it at the weight "
                                        "sync (slime's --offload-rollout)")
    sglang_mem_fraction_static: float = knob(
        0.4, "--rollout-backend sglang: the fraction of the GPU's memory SGLang's Engine takes for its weights and KV "
             "cache, beside training on the same GPU", check=in_range(0, 1, low_open=True, high_open=True))
    sglang_attention_backend: str = knob("triton", "--rollout-backend sglang: SGLang's attention kernels",
                                         choices=SGLANG_ATTENTION_BACKENDS)
    sglang_cuda_graph_max_bs: int = knob(0, "--rollout-backend sglang: the largest decode batch SGLang captures as a "
                                            "CUDA graph (0: one step's samples, --rollout-batch-size x --group-size, "
                                            f"at most {SGLANG_MAX_GRAPH_BS})", check=non_negative)
    sglang_disable_cuda_graph: bool = knob(False, "--rollout-backend sglang: run SGLang's decode eagerly")
    sglang_server_args: str = knob("", "--rollout-backend sglang: further SGLang ServerArgs fields for the Engine, as a "
                                       "JSON object (e.g. '{\"chunked_prefill_size\": 4096, "
                                       "\"max_running_requests\": 256}'; slime forwards each --sglang-* flag); "
                                       "fields this driver sets are refused, naming their flag")
    update_weight_buffer_size: int = knob(512 * 2**20, "--rollout-backend sglang: bytes of weights per push into the "
                                                       "Engine at each sync (whole decoder layers, so each FP4 "
                                                       "linear is re-quantized once; slime's name)",
                                          check=positive)
    sglang_base_port: int = knob(30000, "--rollout-backend sglang: the Engine of local rank r uses ports base + 16 r "
                                        "(its port) and base + 16 r + 8 (its NCCL port); keep them apart from "
                                        "torchrun's MASTER_PORT", check=in_range(1024, 65000))
    group_size: int = knob(_GRPO.group_size, "responses sampled per prompt (G)", check=at_least(2),
                           aliases=("--n-samples-per-prompt",))
    rollout_batch_size: int = knob(32, "prompts per GRPO step (one rollout; all data-parallel ranks together)",
                                   check=positive)
    max_prompt_length: int = knob(16, "prompt tokens kept (longer prompts keep their end)", check=positive)
    max_response_length: int = knob(8, "new tokens per response", check=positive,
                                    aliases=("--rollout-max-response-len",))
    temperature: float = knob(1.0, "sampling temperature", check=positive, aliases=("--rollout-temperature",))
    top_p: float = knob(1.0, "nucleus sampling (1 = off)", check=in_range(0, 1, low_open=True),
                        aliases=("--rollout-top-p",))
    top_k: int = knob(0, "top-k sampling (0 or -1 = off)", check=at_least(-1), aliases=("--rollout-top-k",))
    dynamic_sampling: bool = knob(_GRPO.dynamic_sampling, "DAPO dynamic sampling: keep only groups whose rewards are "
                                                          "not all equal and refill the batch from further rounds "
                                                          "of --over-sampling-batch-size prompts")
    over_sampling_batch_size: Optional[int] = knob(
        None, "prompts drawn per sampling round (default: --rollout-batch-size); with --dynamic-sampling, rounds "
              "repeat until --rollout-batch-size groups pass (surplus groups are dropped); without it only the "
              "round's first --rollout-batch-size prompts are sampled", check=positive)
    dynamic_sampling_max_rounds: int = knob(
        8, "most sampling rounds per step; when they leave fewer than --rollout-batch-size groups that pass, the step "
           "trains on those (the filtered groups fill the batch, masked out of the loss). 1: drop without refill",
        check=positive)
    overlong_filter: bool = knob(_GRPO.overlong_filter, "mask responses truncated at --max-response-length out of "
                                                        "the loss")
    overlong_buffer_len: int = knob(0, "DAPO overlong reward shaping: responses longer than --max-response-length "
                                       "minus this many tokens lose up to --overlong-penalty-factor of reward, "
                                       "linearly (0 = off)", check=non_negative)
    overlong_penalty_factor: float = knob(1.0, "the largest overlong penalty (at --max-response-length)",
                                          check=non_negative)
    rm_type: Optional[str] = knob(None, "the reward of every example: gsm8k ('####' answers, exact), math "
                                        "(math-verify), math_rule (the exact-number rule grader). Default: each "
                                        "dataset's own (--prompt-data and --eval-prompt-data: math)",
                                  choices=REWARD_KINDS)
    custom_rm_path: Optional[str] = knob(None, "module.path.function computing the reward instead, as slime calls it: "
                                               "fn(args, sample) -> float (sync or async), or fn(args, samples) -> "
                                               "list[float] with --group-rm; sample has prompt, response, label, "
                                               "metadata, index, group_index, response_length, status")
    group_rm: bool = knob(False, "call --custom-rm-path once per group of --n-samples-per-prompt samples")


@dataclass(frozen=True)
class ActorConfig:
    """GRPO loss and optimizer"""

    global_batch_size: Optional[int] = knob(
        None, "samples per optimizer step, all data-parallel ranks together (Megatron-LM's and slime's meaning; "
              "before, it counted prompts: that is --rollout-batch-size now). Default: --rollout-batch-size x "
              "--n-samples-per-prompt, one optimizer step per rollout; smaller: each rollout feeds several",
        check=positive)
    num_steps_per_rollout: Optional[int] = knob(None, "optimizer steps per rollout: sets --global-batch-size to "
                                                      "rollout-batch-size x n-samples-per-prompt / this",
                                                check=positive)
    micro_batch_size: int = knob(256, "sequences per training micro-batch", check=positive)
    use_dynamic_batch_size: bool = knob(False, "cut the training and log-prob passes into micro-batches by tokens, "
                                               "not sequences (slime's flag): consecutive sequences packed as "
                                               "--pack-sequences packs them (implied) up to --max-tokens-per-gpu "
                                               "tokens each; --micro-batch-size is then unused. The same losses "
                                               "(per-token accounting) in fewer passes when responses are short")
    max_tokens_per_gpu: Optional[int] = knob(None, "with --use-dynamic-batch-size: packed tokens per micro-batch "
                                                   "(each sequence counted up to its last loss token; at least the "
                                                   "longest prompt + response)", check=positive)
    pack_sequences: bool = knob(False, "run each training micro-batch as one THD pack of its sequences (each up to its "
                                       "last loss token, attention within each sequence): no compute on padding. "
                                       "Needs the sdpa attention (--attention-backend sdpa, or auto on CUDA) and "
                                       "pipeline-parallel size 1. Losses equal the padded batch's up to rounding; "
                                       "FP4 wgrad blocks along the tokens then group other tokens")
    cuda_graph_impl: str = knob("none", "CUDA graphs of the policy's training passes (Megatron-LM's flag): local "
                                        "(megatron-core's own: each transformer layer's forward and backward "
                                        "captured in the first training step and replayed after, so the FP4 "
                                        "linears' host work and kernel launches are gone) or none. Needs a GPU, "
                                        "pipeline-parallel size 1 and no --pack-sequences; training micro-batches "
                                        "are padded to --micro-batch-size x --seq-length (the graphs' one shape); "
                                        "log-prob and evaluation passes run eagerly",
                                choices=("none", "local"))
    lr: float = knob(6e-4, "learning rate", check=positive)
    min_lr: Optional[float] = knob(1e-4, "cosine decay floor (= --lr for a constant lr)", check=non_negative)
    lr_warmup_iters: int = knob(0, "optimizer steps of linear LR warm-up from 0 (Megatron-LM's); the cosine decay "
                                   "follows over the remaining steps", check=non_negative)
    weight_decay: float = knob(0.0, "AdamW weight decay", check=non_negative)
    clip_grad: float = knob(1.0, "global gradient-norm clip (0 = off)", check=non_negative)
    use_distributed_optimizer: bool = knob(False, "shard the fp32 main weights and Adam moments across the "
                                                  "data-parallel ranks (megatron-core's distributed optimizer, ZeRO-1: "
                                                  "gradients reduce-scattered, weights all-gathered). Checkpoints "
                                                  "still store the optimizer state whole, by parameter name")
    use_kl_loss: bool = knob(True, "add the k3 KL penalty to the frozen reference to the loss (--no-use-kl-loss: "
                                   "no reference model)")
    kl_beta: float = knob(_GRPO.kl_beta, "beta of the k3 KL penalty to the frozen reference (0 = off: no reference "
                                         "model)", check=non_negative, aliases=("--kl-loss-coef",))
    clip_low: float = knob(_GRPO.clip_low, "PPO ratio clipped below at 1 - clip_low",
                           check=in_range(0, 1, high_open=True), aliases=("--eps-clip",))
    clip_high: Optional[float] = knob(None, "PPO ratio clipped above at 1 + clip_high (default: --clip-low; "
                                            "clip-higher when larger)", check=non_negative,
                                      aliases=("--eps-clip-high",))
    clip_c: Optional[float] = knob(None, "dual-clip PPO: for a negative advantage A a token's policy loss is at most "
                                         "-clip_c * A (> 1; default off; verl's clip_ratio_c)",
                                   check=greater_than(1.0), aliases=("--eps-clip-c",))
    tis_cap: float = knob(_GRPO.tis_cap, "truncated importance sampling cap against the rollout engine's logprobs "
                                         "(0 = off)", check=non_negative)
    advantage: str = knob("grpo", "grpo: (r - mean) / std per group; drgrpo: r - mean (Dr.GRPO); gspo: grpo's "
                                  "advantages with GSPO's sequence-level ratio; reinforce_plus_plus: discounted "
                                  "returns (--gamma) whitened over the global batch (REINFORCE++)",
                          choices=ADVANTAGES, aliases=("--advantage-estimator",))
    gamma: float = knob(1.0, "REINFORCE++ discount of the reward along the response", check=in_range(0, 1))
    ppo_epochs: int = knob(1, "optimizer passes over each rollout batch", check=positive)


@dataclass(frozen=True)
class WarmupConfig:
    """warm-up (supervised on the examples' targets, before GRPO)"""

    sft_iters: Optional[int] = knob(None, "supervised warm-up iterations (default: 100 for a random model, 0 when "
                                          "--ref-load, --hf-checkpoint or --init-from name starting weights)",
                                    check=non_negative)
    sft_lr: float = knob(3e-3, "warm-up learning rate", check=positive)
    sft_batch_size: int = knob(64, "warm-up examples per iteration", check=positive)
    sft_target_accuracy: Optional[float] = knob(
        None, "stop the warm-up early once greedy held-out accuracy (BF16) reaches this fraction, checked every "
              "--sft-eval-interval iterations: sets the warm start to a level where GRPO matters",
        check=in_range(0, 1))
    sft_eval_interval: int = knob(25, "warm-up iterations between accuracy checks", check=positive)


@dataclass(frozen=True)
class CheckpointConfig:
    """checkpoints and starting weights"""

    load: Optional[str] = knob(None, "the RL checkpoint directory a run resumes from (default: --save). One that "
                                     "does not exist or holds no checkpoint starts from the starting weights")
    save: Optional[str] = knob(None, "checkpoint directory (default: no checkpoints)")
    ref_load: Optional[str] = knob(None, "the starting weights: a converted checkpoint (tools/convert_hf_to_megatron.py"
                                         "; architecture, weights and tokenizer); also the KL reference")
    hf_checkpoint: Optional[str] = knob(None, "a Hugging Face model folder (Qwen2/Llama): the tokenizer, and the "
                                              "architecture and starting weights (also the KL reference) when no "
                                              "--ref-load names a converted checkpoint")
    init_from: Optional[str] = knob(None, "an RL checkpoint directory whose latest model weights start the policy and "
                                          "the reference (no optimizer, step or data state; skips the warm-up; any "
                                          "TP/PP, resharded on load); ignored when --load resumes")
    init: Optional[str] = knob(None, "'random': start from a random model although --load names no checkpoint "
                                     "(the default only when no --load is given)", choices=INITS)
    save_hf: Optional[str] = knob(None, "also write the trained policy as a Hugging Face folder here at the end "
                                        "(config.json, tokenizer, safetensors; transformers loads it)")
    save_interval: int = knob(50, "GRPO steps between checkpoints", check=positive)
    keep_last: int = knob(2, "checkpoints kept in --save", check=positive)
    exit_signal_handler: bool = knob(False, "on SIGTERM (a scheduler's or a job runner's stop; SIGINT too): finish "
                                            "the GRPO step in progress, save a checkpoint to --save and exit with "
                                            "status 0 without --results-json (Megatron-LM's flag); the same command "
                                            "resumes the run")


@dataclass(frozen=True)
class RunConfig:
    """run, evaluation and logging"""

    seed: int = knob(1234, "seed of the data order, sampling and initialization")
    train_iters: int = knob(250, "GRPO steps, one rollout each (0: warm-up, evaluate and save only)",
                            check=non_negative, aliases=("--num-rollout",))
    eval_interval: int = knob(50, "GRPO steps between held-out evaluations", check=positive)
    n_samples_per_eval_prompt: int = knob(1, "responses per evaluation prompt: 1 = greedy accuracy; n > 1 = sampled "
                                             "at --eval-temperature, accuracy = mean@n and pass@k for k = 1, 2, 4, "
                                             "... <= n", check=positive)
    eval_temperature: Optional[float] = knob(None, "sampling temperature of evaluation with "
                                                   "--n-samples-per-eval-prompt > 1 (default: --temperature)",
                                             check=positive)
    eval_max_response_len: Optional[int] = knob(None, "new tokens per evaluation response (default: "
                                                      "--max-response-length)", check=positive)
    log_interval: int = knob(1, "GRPO steps between console/tensorboard lines", check=positive)
    max_nonfinite_steps: int = knob(3, "stop after this many consecutive steps with a non-finite loss or gradient",
                                    check=positive)
    tensorboard_dir: Optional[str] = knob(None, "tensorboard log directory")
    results_json: Optional[str] = knob(None, "write the final metrics and accuracy here")
    log_jsonl: Optional[str] = knob(None, "append every step's metrics as one JSON line (rank 0)")
    use_wandb: bool = knob(False, "log metrics to Weights & Biases too (rank 0; needs pip install wandb)")
    wandb_project: Optional[str] = knob(None, "W&B project (default: megatron-fp4)")
    wandb_group: Optional[str] = knob(None, "W&B group of the run")
    wandb_mode: Optional[str] = knob(None, "W&B mode (default: the WANDB_MODE environment variable, else online)",
                                     choices=WANDB_MODES)
    wandb_dir: Optional[str] = knob(None, "directory of the W&B run files (default: ./wandb)")
    save_debug_rollout_data: Optional[str] = knob(
        None, "slime's: write each rollout's samples (prompt, tokens, response, label, reward, status, logprobs) to "
              "this path, {rollout_id} replaced by the rollout index (0 = the first GRPO step) or eval_N for the "
              "evaluation after N steps (each set, each precision); torch.save of plain values, rank 0")
    log_underflow_interval: int = knob(0, "every N GRPO steps (and at step 0) log the per-layer rollout FP4 "
                                          "underflow rate without and with ResQ (--resq, or 2:4 when --resq none) on "
                                          "up to 64 held-out prompts (0 = off)", check=non_negative)


SECTIONS = {"parallel": ParallelConfig, "model": ModelConfig, "precision": PrecisionConfig, "data": DataConfig,
            "rollout": RolloutConfig, "actor": ActorConfig, "warmup": WarmupConfig, "checkpoint": CheckpointConfig,
            "run": RunConfig}


@dataclass(frozen=True)
class RLConfig:
    """The whole configuration, one typed section per role (built from the flat namespace of flags)."""

    parallel: ParallelConfig
    model: ModelConfig
    precision: PrecisionConfig
    data: DataConfig
    rollout: RolloutConfig
    actor: ActorConfig
    warmup: WarmupConfig
    checkpoint: CheckpointConfig
    run: RunConfig

    @classmethod
    def from_args(cls, args: Any) -> "RLConfig":
        """The sections of a namespace holding one attribute per field (what arguments.parse_args returns)."""
        return cls(**{name: section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)})
                      for name, section in SECTIONS.items()})

    def namespace(self) -> argparse.Namespace:
        """Every knob as one flat namespace (what a --custom-rm-path function gets as ``args``, as in slime)."""
        return argparse.Namespace(**{f.name: getattr(getattr(self, name), f.name)
                                     for name, section in SECTIONS.items() for f in dataclasses.fields(section)})


def section_fields() -> list[tuple[type, dataclasses.Field, Any]]:
    """(section, field, resolved type) of every knob, in definition order."""
    out = []
    for section in SECTIONS.values():
        hints = get_type_hints(section)
        out += [(section, f, hints[f.name]) for f in dataclasses.fields(section)]
    return out


#: ServerArgs fields the driver sets itself, and what sets them (--sglang-server-args may not give them).
SGLANG_DRIVER_FIELDS = {
    "model_path": "the policy's config.json", "load_format": "the weight sync (dummy load)",
    "skip_tokenizer_init": "token ids in and out", "custom_weight_loader": "the weight sync",
    "quantization": "--rollout-precision", "json_model_override_args": "--rollout-precision, --resq",
    "tp_size": "--tensor-model-parallel-size", "device": "CUDA", "base_gpu_id": "the rank's GPU",
    "port": "--sglang-base-port", "nccl_port": "--sglang-base-port", "random_seed": "--seed", "dtype": "--bf16",
    "enable_memory_saver": "--offload-rollout", "mem_fraction_static": "--sglang-mem-fraction-static",
    "attention_backend": "--sglang-attention-backend", "disable_cuda_graph": "--sglang-disable-cuda-graph",
    "cuda_graph_max_bs_decode": "--sglang-cuda-graph-max-bs", "sampling_backend": "the driver (pytorch)",
    "grammar_backend": "the driver (none)", "log_level": "the driver (error)"}


def sglang_server_args(text: str, server_args_fields: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """--sglang-server-args parsed: a JSON object of ServerArgs fields, none of those the driver sets, and (given
    ``server_args_fields``, the installed SGLang's) each one a field; ValueError naming the flag otherwise."""
    if not text.strip():
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--sglang-server-args is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--sglang-server-args must be a JSON object of SGLang ServerArgs fields, got {text!r}")
    taken = {k: SGLANG_DRIVER_FIELDS[k] for k in extra if k in SGLANG_DRIVER_FIELDS}
    if taken:
        raise ValueError("--sglang-server-args: " + "; ".join(f"{k!r} is set by {v}" for k, v in taken.items()))
    if server_args_fields is not None:
        import difflib

        unknown = [k for k in extra if k not in server_args_fields]
        if unknown:
            hints = {k: difflib.get_close_matches(k, server_args_fields, n=3) for k in unknown}
            raise ValueError("--sglang-server-args: not SGLang ServerArgs fields: " + "; ".join(
                f"{k!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "") for k, h in hints.items()))
    return extra
