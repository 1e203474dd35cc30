"""The driver's configuration: one typed, documented field per knob (flags and YAML generated from it, values
converted the same way from both)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_fp4.rl.arguments import build_parser, config_yaml, load_args, parse_args
from megatron_fp4.rl.config import SECTIONS, RLConfig, section_fields


def test_every_field_is_one_documented_flag_with_its_default():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for section, f, _ in section_fields():
        assert f.metadata["help"], f.name
        assert actions[f.name].default == f.default, f.name
        assert f"--{f.name.replace('_', '-')}" in actions[f.name].option_strings
    args = parse_args([])
    cfg = RLConfig.from_args(args)
    assert cfg.rollout.group_size == 16 and cfg.actor.lr == 6e-4 and cfg.checkpoint.load is None
    names = [f.name for s in SECTIONS.values() for f in dataclasses.fields(s)]
    assert len(names) == len(set(names))  # a flat namespace: no two sections share a name


def test_defaults_of_the_grpo_math_are_the_drivers():
    from megatron_fp4.rl.grpo import GRPOConfig

    args, g = parse_args([]), GRPOConfig()
    assert (args.group_size, args.clip_low, args.clip_high, args.tis_cap, args.kl_beta, args.dynamic_sampling,
            args.overlong_filter) == (g.group_size, g.clip_low, g.clip_high, g.tis_cap, g.kl_beta,
                                      g.dynamic_sampling, g.overlong_filter)


@pytest.mark.parametrize("text,field,value", [
    ("fp4-train: 'false'\n", "fp4_train", False),      # quoted booleans mean what they say
    ("fp4-train: 'no'\n", "fp4_train", False),
    ("dynamic_sampling: 'true'\n", "dynamic_sampling", True),
    ("group-size: '8'\n", "group_size", 8),             # a quoted number, as a flag's text would be
    ("lr: 1e-3\n", "lr", 1e-3),                         # YAML 1.1 reads 1e-3 as a string: converted like a flag
    ("min-lr: null\n", "min_lr", None),
    ("resq: '2:4'\n", "resq", "2:4"),
])
def test_yaml_values_convert_like_flags(tmp_path, text, field, value):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert getattr(parse_args(["--config", str(cfg)]), field) == value


@pytest.mark.parametrize("text,match", [
    ("fp4-train: maybe\n", "--fp4-train='maybe' is not valid; expected true or false"),
    ("group-size: 8.5\n", "--group-size=8.5 is not valid; expected an integer"),
    ("group-size: true\n", "--group-size=True is not valid; expected an integer"),
    ("lr: .nan\n", "--lr=nan is not valid; it must be a finite number"),
    ("clip-high: .inf\n", "--clip-high=inf is not valid; it must be a finite number"),
    ("resq: 2:4\n", "quote it in YAML"),                # YAML 1.1 reads an unquoted 2:4 as the number 124
    ("seed: null\n", "--seed needs a value"),
    ("no_such_flag: 1\n", "unknown argument(s) ['no_such_flag']"),
    ("- a list\n", "must hold a mapping"),
    ("a: [\n", "is not valid YAML"),
])
def test_bad_yaml_values_name_the_key(tmp_path, text, match):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError) as e:
        parse_args(["--config", str(cfg)])
    assert match in str(e.value) and str(cfg) in str(e.value)


@pytest.mark.parametrize("argv,match", [
    (["--lr", "nan"], "--lr=nan is not valid; it must be a finite number"),
    (["--kl-beta", "inf"], "--kl-beta=inf is not valid; it must be a finite number"),
    (["--temperature", "-1"], "--temperature=-1.0 is not valid; it must be > 0"),
    (["--init", "zeros"], "--init='zeros' is not valid; allowed: random"),
])
def test_float_and_choice_flags_are_checked(argv, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)


def test_help_lists_every_section():
    text = build_parser().format_help()
    for section in SECTIONS.values():
        assert section.__doc__.strip() in text
    assert "--no-fp4-train" in text and "--ref-load" in text


def test_print_config_holds_every_field():
    text = config_yaml(load_args([]))
    for _, f, _ in section_fields():
        assert f"\n{f.name.replace('_', '-')}:" in text, f.name


def test_save_hf_is_not_the_run_folder(tmp_path):
    with pytest.raises(ValueError, match="--save-hf=.* is the --save folder"):
        parse_args(["--save", str(tmp_path / "run"), "--save-hf", str(tmp_path / "run")])
    assert parse_args(["--save", str(tmp_path / "run"), "--save-hf", str(tmp_path / "run" / "hf")]).save_hf


def test_fp4_gemm_mode_flag():
    """--fp4-gemm-mode reaches the training recipe; the FP8 modes need MXFP4 training GEMMs (clear error)."""
    from megatron_fp4.rl.arguments import rl_config

    args = parse_args(["--fp4-block-format", "mxfp4", "--fp4-gemm-mode", "fp8"])
    assert rl_config(args).precision.fp4_gemm_mode == "fp8"
    with pytest.raises(ValueError, match="--fp4-gemm-mode='fp8' needs MXFP4 training GEMMs.*'hif4'"):
        parse_args(["--fp4-gemm-mode", "fp8"])
    with pytest.raises(ValueError, match="needs MXFP4.*--no-fp4-train"):
        parse_args(["--fp4-block-format", "mxfp4", "--fp4-gemm-mode", "fp8_fast", "--no-fp4-train"])
    with pytest.raises(ValueError, match="--fp4-gemm-mode='fp16' is not valid; allowed: exact, fp8, fp8_fast"):
        parse_args(["--fp4-gemm-mode", "fp16"])
