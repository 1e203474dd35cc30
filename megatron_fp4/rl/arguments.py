"""Command-line flags and YAML configs of pretrain_rl.py, generated from the config dataclasses; validation.

Precedence: the defaults in :mod:`megatron_fp4.rl.config` < ``--config FILE.yaml`` < flags on the command line.
YAML keys are the flag names with dashes or underscores (``group-size: 8`` or ``group_size: 8``) or an alias;
YAML values go through the same conversion as flag values (a quoted "false" is false, "8" is 8, ``.nan`` for a
float is refused), so a YAML file can say nothing a command line could not. ``--print-config`` writes every knob
with its default and help as a YAML file that ``--config`` reads back.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from typing import Any, Optional, Sequence

import yaml

from megatron_fp4.rl.config import SGLANG_PORTS_PER_RANK, RLConfig, section_fields, sglang_server_args

__all__ = ["build_parser", "load_args", "validate_args", "parse_args", "config_yaml", "convert_value", "flag_name",
           "rl_config"]

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def flag_name(field_name: str) -> str:
    """'--group-size' for 'group_size'."""
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field annotation such as Optional[int]; ``tuple`` for a
    field of several strings (``tuple[str, ...]``)."""
    optional = False
    if typing.get_origin(tp) is typing.Union:
        tp, optional = [a for a in typing.get_args(tp) if a is not type(None)][0], True
    if typing.get_origin(tp) is tuple:
        return tuple, optional
    return tp, optional


def convert_value(name: str, value: Any, tp: Any) -> Any:
    """``value`` (a flag's string, or a YAML scalar) as the field's type; ValueError naming the flag otherwise."""
    base, optional = _base_type(tp)
    flag = flag_name(name)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{flag} needs a value (got null)")
    if base is tuple:  # one or more strings: a YAML list (or one whitespace-separated string), or a flag's values
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(
                isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            raise ValueError(f"{flag}={value!r} is not valid; expected one or more values")
        return tuple(str(v) for v in items)
    text = value.strip() if isinstance(value, str) else None
    if base is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{flag}={value!r} is not valid; expected true or false")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            if text is not None:
                return int(text)
        except ValueError:
            pass
        raise ValueError(f"{flag}={value!r} is not valid; expected an integer")
    if base is float:
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if text is not None:
                return float(text)
        except ValueError:
            pass
        raise ValueError(f"{flag}={value!r} is not valid; expected a number")
    if isinstance(value, str):
        return value
    hint = f" (quote it in YAML: {flag[2:]}: '...')" if isinstance(value, (int, float)) else ""
    raise ValueError(f"{flag}={value!r} is not valid; expected a string{hint}")


def _cli_type(name: str, tp: Any):
    def convert(text: str) -> Any:
        try:
            return convert_value(name, text, tp)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = name
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one flag per config field (defaults = the embedded tiny CPU run)."""
    p = argparse.ArgumentParser(
        prog="pretrain_rl.py",
        description="GRPO post-training with FP4 (HiF4 / MXFP4) training and rollout on megatron-core. "
                    "With no arguments: a tiny CPU run on synthetic addition in HiF4 with ResQ 2:4 rollout.")
    p.add_argument("--config", default=None, help="YAML file of arguments (command-line flags override it)")
    p.add_argument("--print-config", action="store_true",
                   help="print every argument with its value and help as YAML (a --config file) and exit")
    group, current = None, None
    for section, f, tp in section_fields():
        if section is not current:
            group, current = p.add_argument_group(section.__doc__.strip()), section
        meta, (base, _) = f.metadata, _base_type(tp)
        names = [flag_name(f.name), *meta["aliases"]]
        if base is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=meta["help"])
        elif base is tuple:
            group.add_argument(*names, dest=f.name, nargs="+", default=f.default, help=meta["help"])
        else:
            metavar = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else None
            group.add_argument(*names, dest=f.name, type=_cli_type(f.name, tp), default=f.default, metavar=metavar,
                               help=meta["help"] + (f" (default: {f.default})" if f.default is not None else ""))
    return p


def _yaml_values(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML file's values by field name, converted exactly as flags are."""
    if not os.path.isfile(path):
        raise ValueError(f"--config: no such file {path!r}")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of argument names to values")
    by_key = {}
    for _, f, tp in section_fields():
        for name in (flag_name(f.name), *f.metadata["aliases"]):
            by_key[name[2:].replace("-", "_")] = (f, tp)
    unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in by_key)
    if unknown:
        raise ValueError(f"--config {path!r}: unknown argument(s) {unknown}")
    out = {}
    for key, value in data.items():
        f, tp = by_key[str(key).replace("-", "_")]
        try:
            out[f.name] = convert_value(f.name, value, tp)
            _check_field(f, out[f.name])
        except ValueError as e:
            raise ValueError(f"--config {path!r}: {e}") from None
    return out


def load_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Defaults < YAML config < command line, converted but not yet validated."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_values(pre.config, parser))
    args = parser.parse_args(argv)
    for _, f, tp in section_fields():  # several values from the command line: a tuple, as from YAML
        if _base_type(tp)[0] is tuple and isinstance(getattr(args, f.name), list):
            setattr(args, f.name, tuple(getattr(args, f.name)))
    return args


def _check_field(f, v: Any) -> None:
    """A field's own allowed values and range (floats finite); ValueError naming the flag."""
    if v is None:
        return
    flag, choices, check = flag_name(f.name), f.metadata["choices"], f.metadata["check"]
    if choices and v not in choices:
        raise ValueError(f"{flag}={v!r} is not valid; allowed: {', '.join(map(str, choices))}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{flag}={v!r} is not valid; it must be a finite number")
    need = check(v) if check is not None else None
    if need:
        raise ValueError(f"{flag}={v!r} is not valid; it must be {need}")


def validate_args(args: argparse.Namespace, world_size: int = 1) -> argparse.Namespace:
    """Check ranges and cross-argument constraints; raise ValueError naming the argument and allowed values.
    Fills the derived defaults (``seq_length``, ``global_batch_size``, ``clip_high``, ``dataset``, ``sft_iters``, ...;
    each field's help says how) and, with ``--fp4-block-format none``, a BF16 rollout."""
    for _, f, _ in section_fields():
        _check_field(f, getattr(args, f.name))
    if args.min_lr is not None and not args.min_lr <= args.lr:
        raise ValueError(f"--min-lr={args.min_lr} is not valid; it must be in [0, --lr={args.lr}]")
    if args.clip_high is None:  # slime: --eps-clip-high defaults to --eps-clip
        args.clip_high = args.clip_low
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
                         f"--pipeline-model-parallel-size={pp}")
    source, heads, groups, layers = _architecture(args)
    if source is None:
        if args.num_attention_heads % tp or args.num_query_groups % tp:
            raise ValueError(f"--tensor-model-parallel-size={tp} must divide --num-attention-heads="
                             f"{args.num_attention_heads} and --num-query-groups={args.num_query_groups}")
        if args.num_attention_heads % args.num_query_groups:
            raise ValueError(f"--num-query-groups={args.num_query_groups} must divide --num-attention-heads="
                             f"{args.num_attention_heads}")
        if args.hidden_size % args.num_attention_heads:
            raise ValueError(f"--num-attention-heads={args.num_attention_heads} must divide --hidden-size="
                             f"{args.hidden_size}")
        if args.num_layers % pp:
            raise ValueError(f"--pipeline-model-parallel-size={pp} must divide --num-layers={args.num_layers}")
    else:  # the model flags are ignored: the named checkpoint carries the architecture
        if (heads and heads % tp) or (groups and groups % tp):
            raise ValueError(f"--tensor-model-parallel-size={tp} must divide the attention heads ({heads}) and "
                             f"key/value heads ({groups}) of {source}")
        if layers and layers % pp:
            raise ValueError(f"--pipeline-model-parallel-size={pp} must divide the {layers} layers of {source}")
    _check_batches(args, world_size // (tp * pp))
    _check_dataset(args)
    _check_start(args)
    _check_rewards(args)
    for flag, path in (("--results-json", args.results_json), ("--log-jsonl", args.log_jsonl)):
        _check_writable(flag, path)
    from megatron_fp4.rl.debug_data import check_template

    check_template(args.save_debug_rollout_data)
    _check_writable("--save-debug-rollout-data", args.save_debug_rollout_data)
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir), ("--save-hf", args.save_hf)):
        _check_writable(flag, path, is_dir=True)
    if args.save_hf is not None and args.save is not None and os.path.abspath(args.save_hf) == os.path.abspath(
            args.save):
        raise ValueError(f"--save-hf={args.save_hf!r} is the --save folder (the run's checkpoints): export to another "
                         f"folder, e.g. {os.path.join(args.save, 'hf')}")
    if args.exit_signal_handler and args.save is None:
        raise ValueError("--exit-signal-handler saves a checkpoint before the run stops: it needs --save DIR")
    if args.save_hf is not None and os.path.isdir(args.save_hf) and os.listdir(args.save_hf):
        raise ValueError(f"--save-hf={args.save_hf!r} already holds files: the export needs a new or empty directory")
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise ValueError(f"--tokenizer-model={args.tokenizer_model!r}: no such file or directory")
    if args.fp4_block_format == "none" and args.rollout_precision != "bf16":
        # FP4 rollout needs a format; "none" means everything in high precision
        args.rollout_precision = "bf16"
        args.resq = "none"
    if args.rollout_precision not in ("w4a4", "w16a4") and args.resq != "none":
        raise ValueError(f"--resq={args.resq!r} needs FP4 rollout activations (--rollout-precision w4a4 or w16a4); "
                         f"got --rollout-precision {args.rollout_precision!r}")
    if args.fp4_gemm_mode != "exact" and not (args.fp4_block_format == "mxfp4" and args.fp4_train):
        raise ValueError(f"--fp4-gemm-mode={args.fp4_gemm_mode!r} needs MXFP4 training GEMMs (--fp4-block-format "
                         f"mxfp4 with --fp4-train); got --fp4-block-format {args.fp4_block_format!r}"
                         f"{'' if args.fp4_train else ' with --no-fp4-train'}")
    if args.resq_combine != "exact" and args.resq == "none":
        raise ValueError(f"--resq-combine={args.resq_combine!r} needs a ResQ residual (--resq other than 'none')")
    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (packed tokens per micro-batch)")
        args.pack_sequences = True  # its micro-batches are packs
    elif args.max_tokens_per_gpu is not None:
        raise ValueError(f"--max-tokens-per-gpu={args.max_tokens_per_gpu} takes effect only with "
                         f"--use-dynamic-batch-size (micro-batches by tokens); add it, or drop --max-tokens-per-gpu")
    flag = "--use-dynamic-batch-size (it packs sequences)" if args.use_dynamic_batch_size else "--pack-sequences"
    if args.pack_sequences:
        from megatron_fp4.parallel.attention import resolve_attention_backend

        if resolve_attention_backend(args.attention_backend) != "sdpa":
            raise ValueError(f"{flag} needs --attention-backend sdpa (megatron-core's unfused attention "
                             f"takes no packed sequences); got --attention-backend {args.attention_backend}"
                             + (" (local without CUDA)" if args.attention_backend == "auto" else ""))
        if pp > 1:
            raise ValueError(f"{flag} is not supported with --pipeline-model-parallel-size={pp} (allowed: 1)")
    if args.cuda_graph_impl == "local":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--cuda-graph-impl local needs a CUDA GPU (CUDA graphs); use --cuda-graph-impl none")
        if args.pack_sequences:
            raise ValueError(f"--cuda-graph-impl local needs one micro-batch shape; {flag} makes one per "
                             "micro-batch (drop one of the two)")
        if pp > 1:
            raise ValueError(f"--cuda-graph-impl local is not supported with --pipeline-model-parallel-size={pp} "
                             f"(allowed: 1)")
    if args.rollout_backend == "sglang":
        from megatron_fp4.rollout.sglang_engine import sglang_start_problem

        problem = sglang_start_problem(needs_plugin=args.rollout_precision != "bf16")
        if problem is not None:
            raise ValueError(f"--rollout-backend sglang cannot run here: {problem}; use --rollout-backend native")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local % tp:
            raise ValueError(f"--rollout-backend sglang: each tensor-parallel group's Engine runs on the group's GPUs "
                             f"of one node, so --tensor-model-parallel-size {tp} must divide the processes per node "
                             f"({local})")
        from megatron_fp4.rollout.sglang_engine import sglang_server_args_fields

        sglang_server_args(args.sglang_server_args, sglang_server_args_fields())
        master = int(os.environ.get("MASTER_PORT", "0") or 0)
        end = args.sglang_base_port + SGLANG_PORTS_PER_RANK * local
        if args.sglang_base_port <= master < end:
            raise ValueError(f"--sglang-base-port={args.sglang_base_port}: the SGLang Engines' ports "
                             f"{args.sglang_base_port}-{end - 1} include torchrun's MASTER_PORT {master}; pick another "
                             f"--sglang-base-port")
    if args.overlong_buffer_len >= args.max_response_length:
        raise ValueError(f"--overlong-buffer-len={args.overlong_buffer_len} must be smaller than "
                         f"--max-response-length={args.max_response_length}")
    if args.eval_temperature is None:
        args.eval_temperature = args.temperature
    if args.eval_max_response_len is None:
        args.eval_max_response_len = args.max_response_length
    longest = args.max_prompt_length + max(args.max_response_length, args.eval_max_response_len)
    if args.seq_length is None:
        args.seq_length = longest
    if args.seq_length < longest:
        raise ValueError(f"--seq-length={args.seq_length} must be >= --max-prompt-length + the longest response "
                         f"(--max-response-length, --eval-max-response-len): {longest}")
    if args.use_wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--use-wandb needs the wandb package, which is not installed: pip install wandb "
                             "(or pip install -e .[wandb])")
    return args


def _architecture(args: argparse.Namespace) -> tuple[Optional[str], int, int, int]:
    """(the flag naming the architecture, heads, key/value heads, layers) of --ref-load's converted checkpoint or
    --hf-checkpoint's config.json (0 where unreadable here; the model build checks again); (None, 0, 0, 0) when the
    model flags give the architecture."""
    import json

    if args.ref_load is not None:
        try:
            tracker = os.path.join(args.ref_load, "latest_checkpointed_iteration.txt")
            it = open(tracker).read().strip()
            name = it if it == "release" else f"iter_{int(it):07d}"
            with open(os.path.join(args.ref_load, name, "args.json")) as f:
                m = json.load(f).get("model_args", {})
            return f"--ref-load {args.ref_load}", m.get("num_attention_heads", 0), m.get("num_query_groups", 0), \
                m.get("num_layers", 0)
        except (OSError, ValueError):
            return f"--ref-load {args.ref_load}", 0, 0, 0
    if args.hf_checkpoint is not None:
        try:
            with open(os.path.join(args.hf_checkpoint, "config.json")) as f:
                c = json.load(f)
        except (OSError, ValueError):
            return f"--hf-checkpoint {args.hf_checkpoint}", 0, 0, 0
        heads = int(c.get("num_attention_heads", 0) or 0)
        return (f"--hf-checkpoint {args.hf_checkpoint}", heads, int(c.get("num_key_value_heads") or heads),
                int(c.get("num_hidden_layers", 0) or 0))
    return None, 0, 0, 0


def _check_batches(args: argparse.Namespace, dp: int) -> None:
    """Prompts per rollout, samples per optimizer step (slime's meaning) and over-sampling, against DP."""
    rollout_samples = args.rollout_batch_size * args.group_size
    if args.num_steps_per_rollout is not None:
        if rollout_samples % args.num_steps_per_rollout:
            raise ValueError(f"--num-steps-per-rollout={args.num_steps_per_rollout} must divide --rollout-batch-size "
                             f"x --n-samples-per-prompt = {rollout_samples}")
        gbs = rollout_samples // args.num_steps_per_rollout
        if args.global_batch_size is not None and args.global_batch_size != gbs:
            raise ValueError(f"--global-batch-size={args.global_batch_size} contradicts --num-steps-per-rollout="
                             f"{args.num_steps_per_rollout} (rollout-batch-size {args.rollout_batch_size} x "
                             f"n-samples-per-prompt {args.group_size} / {args.num_steps_per_rollout} = {gbs}): "
                             f"pass one")
        args.global_batch_size = gbs
    if args.global_batch_size is None:
        args.global_batch_size = rollout_samples  # one optimizer step per rollout
    if rollout_samples % args.global_batch_size:
        raise ValueError(f"--global-batch-size={args.global_batch_size} (samples per optimizer step) must divide "
                         f"--rollout-batch-size x --n-samples-per-prompt = {args.rollout_batch_size} x "
                         f"{args.group_size} = {rollout_samples}")
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        raise ValueError(f"--over-sampling-batch-size={args.over_sampling_batch_size} must be >= "
                         f"--rollout-batch-size={args.rollout_batch_size}")
    for flag, value in (("--rollout-batch-size", args.rollout_batch_size),
                        ("--over-sampling-batch-size", args.over_sampling_batch_size),
                        ("--global-batch-size", args.global_batch_size)):
        if value % dp:
            raise ValueError(f"{flag}={value} must be a multiple of the data-parallel size {dp} (world / (TP "
                             f"{args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}))")


_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _check_data_file(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file {path!r}")
    if not path.endswith(_DATA_SUFFIXES):
        raise ValueError(f"{flag}={path!r} is not valid; allowed file types: {', '.join(_DATA_SUFFIXES)}")


def _check_dataset(args: argparse.Namespace) -> None:
    if args.prompt_data is not None and args.dataset is not None:
        raise ValueError(f"--dataset={args.dataset!r} and --prompt-data={args.prompt_data!r} both name the training "
                         f"data: pass one")
    if args.prompt_data is None and args.dataset is None:
        args.dataset = "synthetic:add"
    for flag, spec in (("--dataset", args.dataset), ("--eval-dataset", args.eval_dataset)):
        if spec is None:
            continue
        kind, sep, rest = spec.partition(":")
        if kind not in ("gsm8k", "math", "synthetic") or not sep or not rest:
            raise ValueError(f"{flag}={spec!r} is not valid; allowed: gsm8k:PATH, math:PATH, synthetic:add, "
                             f"synthetic:arith")
        if kind in ("gsm8k", "math") and not os.path.isfile(rest):
            raise ValueError(f"{flag}={spec!r}: no such file {rest!r}")
        if kind == "synthetic" and rest not in ("add", "arith"):
            raise ValueError(f"{flag}={spec!r} is not valid; synthetic tasks: add, arith")
    if args.prompt_data is not None:
        _check_data_file("--prompt-data", args.prompt_data)
    pairs = args.eval_prompt_data or ()
    if len(pairs) % 2:
        raise ValueError(f"--eval-prompt-data={' '.join(pairs)!r} is not valid; expected NAME PATH pairs")
    names = pairs[0::2]
    if len(set(names)) != len(names):
        raise ValueError(f"--eval-prompt-data: names must differ, got {list(names)}")
    for name, path in zip(pairs[0::2], pairs[1::2]):
        if not name or "/" in name or name in ("accuracy", "accuracy_bf16"):
            raise ValueError(f"--eval-prompt-data: {name!r} is not a valid set name (no '/', not a metric name)")
        _check_data_file(f"--eval-prompt-data {name}", path)
    if args.eval_samples is None:
        args.eval_samples = 0 if args.prompt_data is not None else 256
    if args.sft_target_accuracy is not None and args.eval_samples == 0 and args.eval_dataset is None:
        raise ValueError("--sft-target-accuracy is checked on the held-out split: it needs --eval-samples > 0 or "
                         "--eval-dataset")
    needs_tokenizer = args.prompt_data is not None or args.dataset.partition(":")[0] != "synthetic"
    has_tokenizer = (args.tokenizer_model is not None or args.hf_checkpoint is not None or args.ref_load is not None
                     or args.load is not None)
    if needs_tokenizer and not has_tokenizer:
        what = f"--prompt-data={args.prompt_data!r}" if args.prompt_data else f"--dataset={args.dataset!r}"
        raise ValueError(f"{what} needs a tokenizer: --hf-checkpoint, --tokenizer-model, or --ref-load of a converted "
                         f"checkpoint that holds one")
    if args.apply_chat_template and args.tokenizer_model is not None and not os.path.isdir(args.tokenizer_model):
        raise ValueError(f"--apply-chat-template needs a Hugging Face tokenizer with a chat template; "
                         f"--tokenizer-model={args.tokenizer_model!r} is a sentencepiece file")
    if args.apply_chat_template and not has_tokenizer:
        raise ValueError("--apply-chat-template needs a Hugging Face tokenizer with a chat template: pass "
                         "--hf-checkpoint or --tokenizer-model DIR")


def _check_writable(flag: str, path: Optional[str], is_dir: bool = False) -> None:
    """An output path that can be written: not a directory (for a file) and under a writable directory (the
    nearest existing one: missing ones are created when the run writes)."""
    if path is None:
        return
    p = os.path.abspath(path)
    if os.path.exists(p) and os.path.isdir(p) != is_dir:
        raise ValueError(f"{flag}={path!r} is {'a file' if is_dir else 'a directory'}; expected "
                         f"{'a directory' if is_dir else 'a file path'}")
    parent = p if is_dir and os.path.isdir(p) else os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={path!r} cannot be written: {parent!r} is not a writable directory")


def _check_start(args: argparse.Namespace) -> None:
    """Paths of the starting weights exist; a random start is not combined with named weights; the warm-up length."""
    if args.init_from is not None and not os.path.isdir(args.init_from):
        raise ValueError(f"--init-from={args.init_from!r}: no such directory")
    if args.ref_load is not None and not os.path.isdir(args.ref_load):
        raise ValueError(f"--ref-load={args.ref_load!r}: no such directory")
    if args.hf_checkpoint is not None and not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        raise ValueError(f"--hf-checkpoint={args.hf_checkpoint!r} is not a Hugging Face model folder (no config.json)")
    if args.ref_load is not None and args.init_from is not None:
        raise ValueError(f"--ref-load={args.ref_load!r} and --init-from={args.init_from!r} both name starting "
                         f"weights: pass one")
    named = [f"--{k.replace('_', '-')}" for k in ("ref_load", "hf_checkpoint", "init_from")
             if getattr(args, k) is not None]
    if args.init == "random" and named:
        raise ValueError(f"--init random contradicts {named[0]}: pass one")
    if args.sft_iters is None:  # a warm-up for a random model; named starting weights need none
        converted_load = False
        if args.load is not None:  # --load CONVERTED, the old spelling of --ref-load
            from megatron_fp4.models.checkpoint_io import is_megatron_checkpoint

            converted_load = is_megatron_checkpoint(args.load)
        args.sft_iters = 0 if named or converted_load else 100


def _check_rewards(args: argparse.Namespace) -> None:
    """--custom-rm-path imports, --group-rm has one, and math-verify is installed where a math reward is used."""
    from megatron_fp4.rl import rewards

    if args.group_rm and args.custom_rm_path is None:
        raise ValueError("--group-rm needs --custom-rm-path (the function that scores a group)")
    if args.custom_rm_path is not None:
        try:
            rewards.load_function(args.custom_rm_path)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"--custom-rm-path={args.custom_rm_path!r}: {e}") from None
        return
    math_sets = [f"--rm-type {args.rm_type}"] if args.rm_type == "math" else []
    if args.rm_type is None:
        math_sets += [f"{flag}" for flag, used in (
            ("--prompt-data", args.prompt_data), ("--eval-prompt-data", args.eval_prompt_data),
            ("--dataset math:", (args.dataset or "").startswith("math:")),
            ("--eval-dataset math:", (args.eval_dataset or "").startswith("math:"))) if used]
    if math_sets:
        rewards.require_math_verify(math_sets[0])


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1) -> argparse.Namespace:
    """Parse defaults < YAML config < command line, then validate."""
    return validate_args(load_args(argv), world_size)


def config_yaml(args: argparse.Namespace) -> str:
    """Every knob's value in ``args`` as a commented YAML file that ``--config`` reads back."""
    lines = ["# pretrain_rl.py configuration (python pretrain_rl.py --print-config): every argument, its value and",
             "# what it does. Pass it with --config FILE; flags given on the command line override it."]
    current = None
    for section, f, _ in section_fields():
        if section is not current:
            current = section
            lines += ["", f"# ---- {section.__doc__.strip()}"]
        lines.append(f"# {f.metadata['help']}")
        value = getattr(args, f.name)
        value = list(value) if isinstance(value, tuple) else value
        lines.append(yaml.safe_dump({flag_name(f.name)[2:]: value}, sort_keys=False, width=1000).strip())
    return "\n".join(lines) + "\n"


def rl_config(args: argparse.Namespace) -> RLConfig:
    """The typed per-role sections of a validated namespace."""
    return RLConfig.from_args(args)

