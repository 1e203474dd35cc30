"""Every knob of the GRPO driver, defined once: typed, documented dataclasses, one per role.

Each field is one command-line flag (``--tensor-model-parallel-size`` for ``tensor_model_parallel_size``) and one
YAML key; :mod:`megatron_fp4.rl.arguments` generates both from these classes (as megatron-core's
argument_utils does from its config dataclasses), so a default is written once, here, and adding a flag or an
alias is one line. The roles take their section (:class:`RolloutConfig` for the rollout manager,
:class:`ActorConfig` for the actor, ...) instead of reading the flat namespace.

    knob(default, help, check=..., choices=..., aliases=(...))

``check`` names the range a value must lie in (floats must also be finite); ``choices`` the allowed values;
``aliases`` extra flag spellings (e.g. slime's) that set the same field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, get_type_hints

from megatron_fp4.recipe import RECIPES
from megatron_fp4.resq import RESQ_COMBINES, ROLLOUT_MODES, SPARSITIES
from megatron_fp4.rollout.native import DECODE_MODES
from megatron_fp4.rl.grpo import GRPOConfig

__all__ = ["knob", "positive", "non_negative", "at_least", "in_range", "ParallelConfig", "ModelConfig",
           "PrecisionConfig", "DataConfig", "RolloutConfig", "ActorConfig", "WarmupConfig", "CheckpointConfig",
           "RunConfig", "RLConfig", "SECTIONS", "section_fields", "FP4_FORMATS", "ROLLOUT_BACKENDS",
           "ADVANTAGES", "INITS"]

FP4_FORMATS = (*RECIPES, "none")
ROLLOUT_BACKENDS = ("native", "sglang")
ADVANTAGES = ("grpo", "drgrpo")
INITS = ("random",)
_GRPO = GRPOConfig()  # the GRPO math's own defaults are the driver's


# -- range checks: a function of the value returning what it must be, or None when it is fine ----------------------
def positive(v: Any) -> Optional[str]:
    return None if v > 0 else "> 0"


def non_negative(v: Any) -> Optional[str]:
    return None if v >= 0 else ">= 0"


def at_least(lo: float) -> Callable[[Any], Optional[str]]:
    """A check for v >= lo."""
    return lambda v: None if v >= lo else f">= {lo}"


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


@dataclass(frozen=True)
class PrecisionConfig:
    """FP4 (training GEMMs and rollout)"""

    fp4_format: str = knob("hif4", "FP4 format of the training GEMMs and the rollout ('none': everything in high "
                                   "precision)", choices=FP4_FORMATS)
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


@dataclass(frozen=True)
class DataConfig:
    """data"""

    dataset: str = knob("synthetic:add", "gsm8k:PATH | math:PATH | synthetic:add | synthetic:arith")
    eval_dataset: Optional[str] = knob(None, "held-out data, same forms as --dataset (default: split off "
                                             "--eval-samples)")
    num_synthetic_examples: int = knob(4000, "examples of a synthetic task", check=positive)
    synthetic_digits: int = knob(1, "max digits per operand of synthetic:add", check=positive)
    synthetic_operands: int = knob(4, "operands per synthetic:add problem", check=positive)
    eval_samples: int = knob(256, "held-out examples split off --dataset when no --eval-dataset is given",
                             check=non_negative)


@dataclass(frozen=True)
class RolloutConfig:
    """rollout (sampling and filtering)"""

    rollout_backend: str = knob("native", "rollout engine", choices=ROLLOUT_BACKENDS)
    rollout_decode: str = knob("auto", "the native engine's decode path: megatron (megatron-core's forward, the "
                                       "reference), static (static KV cache), graph (static KV cache, CUDA-graph "
                                       "decode steps; ~9x faster on an H200, see docs/PERFORMANCE.md), auto (graph "
                                       "on CUDA, megatron elsewhere; models the static path does not serve, e.g. "
                                       "TP > 1, take megatron)", choices=DECODE_MODES)
    group_size: int = knob(_GRPO.group_size, "responses sampled per prompt (G)", check=at_least(2))
    global_batch_size: int = knob(32, "prompts per step (all data-parallel ranks together)", check=positive)
    max_prompt_length: int = knob(16, "prompt tokens kept (longer prompts keep their end)", check=positive)
    max_response_length: int = knob(8, "new tokens per response", check=positive)
    temperature: float = knob(1.0, "sampling temperature", check=positive)
    top_p: float = knob(1.0, "nucleus sampling (1 = off)", check=in_range(0, 1, low_open=True))
    top_k: int = knob(0, "top-k sampling (0 = off)", check=non_negative)
    dynamic_sampling: bool = knob(_GRPO.dynamic_sampling, "drop groups whose rewards are all equal")
    overlong_filter: bool = knob(_GRPO.overlong_filter, "mask responses truncated at --max-response-length out of "
                                                        "the loss")


@dataclass(frozen=True)
class ActorConfig:
    """GRPO loss and optimizer"""

    micro_batch_size: int = knob(256, "sequences per training micro-batch", check=positive)
    lr: float = knob(6e-4, "learning rate", check=positive)
    min_lr: Optional[float] = knob(1e-4, "cosine decay floor (= --lr for a constant lr)", check=non_negative)
    weight_decay: float = knob(0.0, "AdamW weight decay", check=non_negative)
    clip_grad: float = knob(1.0, "global gradient-norm clip (0 = off)", check=non_negative)
    kl_beta: float = knob(_GRPO.kl_beta, "beta of the k3 KL penalty to the frozen reference (0 = off: no reference "
                                         "model)", check=non_negative)
    clip_low: float = knob(_GRPO.clip_low, "PPO ratio clipped below at 1 - clip_low",
                           check=in_range(0, 1, high_open=True))
    clip_high: float = knob(_GRPO.clip_high, "PPO ratio clipped above at 1 + clip_high (clip-higher when larger "
                                             "than --clip-low)", check=non_negative)
    tis_cap: float = knob(_GRPO.tis_cap, "truncated importance sampling cap against the rollout engine's logprobs "
                                         "(0 = off)", check=non_negative)
    advantage: str = knob("grpo", "grpo: (r - mean) / std per group; drgrpo: r - mean", choices=ADVANTAGES)
    ppo_epochs: int = knob(1, "optimizer passes over each rollout batch", check=positive)


@dataclass(frozen=True)
class WarmupConfig:
    """warm-up (supervised on the examples' targets, before GRPO)"""

    sft_iters: int = knob(100, "supervised warm-up iterations for a randomly initialized model (use 0 with "
                               "--ref-load)", check=non_negative)
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
    init_from: Optional[str] = knob(None, "an RL checkpoint directory whose latest model weights start the policy and "
                                          "the reference (no optimizer, step or data state; skips the warm-up; any "
                                          "TP/PP, resharded on load); ignored when --load resumes")
    init: Optional[str] = knob(None, "'random': start from a random model although --load names no checkpoint "
                                     "(the default only when no --load is given)", choices=INITS)
    save_hf: Optional[str] = knob(None, "also write the trained policy as a Hugging Face folder here at the end "
                                        "(config.json, tokenizer, safetensors; transformers loads it)")
    save_interval: int = knob(50, "GRPO steps between checkpoints", check=positive)
    keep_last: int = knob(2, "checkpoints kept in --save", check=positive)


@dataclass(frozen=True)
class RunConfig:
    """run, evaluation and logging"""

    seed: int = knob(1234, "seed of the data order, sampling and initialization")
    train_iters: int = knob(250, "GRPO steps (0: warm-up, evaluate and save only)", check=non_negative)
    eval_interval: int = knob(50, "GRPO steps between held-out evaluations", check=positive)
    log_interval: int = knob(1, "GRPO steps between console/tensorboard lines", check=positive)
    max_nonfinite_steps: int = knob(3, "stop after this many consecutive steps with a non-finite loss or gradient",
                                    check=positive)
    tensorboard_dir: Optional[str] = knob(None, "tensorboard log directory")
    results_json: Optional[str] = knob(None, "write the final metrics and accuracy here")
    log_jsonl: Optional[str] = knob(None, "append every step's metrics as one JSON line (rank 0)")
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


def section_fields() -> list[tuple[type, dataclasses.Field, Any]]:
    """(section, field, resolved type) of every knob, in definition order."""
    out = []
    for section in SECTIONS.values():
        hints = get_type_hints(section)
        out += [(section, f, hints[f.name]) for f in dataclasses.fields(section)]
    return out
