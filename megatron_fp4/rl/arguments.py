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

from megatron_fp4.rl.config import RLConfig, section_fields

__all__ = ["build_parser", "load_args", "validate_args", "parse_args", "config_yaml", "convert_value", "flag_name",
           "rl_config"]

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def flag_name(field_name: str) -> str:
    """'--group-size' for 'group_size'."""
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field annotation such as Optional[int]."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def convert_value(name: str, value: Any, tp: Any) -> Any:
    """``value`` (a flag's string, or a YAML scalar) as the field's type; ValueError naming the flag otherwise."""
    base, optional = _base_type(tp)
    flag = flag_name(name)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{flag} needs a value (got null)")
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
    return parser.parse_args(argv)


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
    Fills the derived defaults (``seq_length``) and, with ``--fp4-format none``, a BF16 rollout."""
    for _, f, _ in section_fields():
        _check_field(f, getattr(args, f.name))
    if args.min_lr is not None and not args.min_lr <= args.lr:
        raise ValueError(f"--min-lr={args.min_lr} is not valid; it must be in [0, --lr={args.lr}]")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
                         f"--pipeline-model-parallel-size={pp}")
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
    dp = world_size // (tp * pp)
    if args.global_batch_size % dp:
        raise ValueError(f"--global-batch-size={args.global_batch_size} must be a multiple of the data-parallel "
                         f"size {dp} (world {world_size} / (TP {tp} x PP {pp}))")
    _check_dataset(args)
    _check_start(args)
    for flag, path in (("--results-json", args.results_json), ("--log-jsonl", args.log_jsonl)):
        _check_writable(flag, path)
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir), ("--save-hf", args.save_hf)):
        _check_writable(flag, path, is_dir=True)
    if args.save_hf is not None and os.path.isdir(args.save_hf) and os.listdir(args.save_hf):
        raise ValueError(f"--save-hf={args.save_hf!r} already holds files: the export needs a new or empty directory")
    if args.tokenizer_model is not None and not os.path.exists(args.tokenizer_model):
        raise ValueError(f"--tokenizer-model={args.tokenizer_model!r}: no such file or directory")
    if args.fp4_format == "none" and args.rollout_precision != "bf16":
        # FP4 rollout needs a format; "none" means everything in high precision
        args.rollout_precision = "bf16"
        args.resq = "none"
    if args.rollout_precision not in ("w4a4", "w16a4") and args.resq != "none":
        raise ValueError(f"--resq={args.resq!r} needs FP4 rollout activations (--rollout-precision w4a4 or w16a4); "
                         f"got --rollout-precision {args.rollout_precision!r}")
    if args.resq_combine != "exact" and args.resq == "none":
        raise ValueError(f"--resq-combine={args.resq_combine!r} needs a ResQ residual (--resq other than 'none')")
    if args.rollout_backend == "sglang" and (tp * pp) > 1:
        raise ValueError("--rollout-backend sglang currently runs with TP=PP=1 trainers only")
    if args.seq_length is None:
        args.seq_length = args.max_prompt_length + args.max_response_length
    if args.seq_length < args.max_prompt_length + args.max_response_length:
        raise ValueError(f"--seq-length={args.seq_length} must be >= --max-prompt-length + --max-response-length "
                         f"({args.max_prompt_length + args.max_response_length})")
    return args


def _check_dataset(args: argparse.Namespace) -> None:
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
    kind = args.dataset.partition(":")[0]
    if kind != "synthetic" and args.tokenizer_model is None and args.ref_load is None and args.load is None:
        raise ValueError(f"--dataset={args.dataset!r} needs --tokenizer-model (or --ref-load of a converted "
                         "checkpoint that holds one)")


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
    """Paths of the starting weights exist; a random start is not combined with named weights."""
    if args.init_from is not None and not os.path.isdir(args.init_from):
        raise ValueError(f"--init-from={args.init_from!r}: no such directory")
    if args.ref_load is not None and not os.path.isdir(args.ref_load):
        raise ValueError(f"--ref-load={args.ref_load!r}: no such directory")
    if args.ref_load is not None and args.init_from is not None:
        raise ValueError(f"--ref-load={args.ref_load!r} and --init-from={args.init_from!r} both name starting "
                         f"weights: pass one")
    named = [f"--{k.replace('_', '-')}" for k in ("ref_load", "init_from") if getattr(args, k) is not None]
    if args.init == "random" and named:
        raise ValueError(f"--init random contradicts {named[0]}: pass one")


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
        lines.append(yaml.safe_dump({flag_name(f.name)[2:]: getattr(args, f.name)}, sort_keys=False,
                                    width=1000).strip())
    return "\n".join(lines) + "\n"


def rl_config(args: argparse.Namespace) -> RLConfig:
    """The typed per-role sections of a validated namespace."""
    return RLConfig.from_args(args)

