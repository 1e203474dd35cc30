"""Fuzzing the inputs a user or a filesystem can damage: command lines, YAML configs and checkpoint files.

The property everywhere: a clear error (one exception type of ours, a message naming the flag, key or file) or a
correct result; never a traceback from deep inside, never a silently wrong value."""

from __future__ import annotations

import math
import os
import typing

import pytest
import torch
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatron_fp4.rl import checkpoint as ckpt  # noqa: E402
from megatron_fp4.rl.arguments import _base_type, flag_name, parse_args  # noqa: E402
from megatron_fp4.rl.config import section_fields  # noqa: E402

FIELDS = {f.name: (f, tp) for _, f, tp in section_fields()}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])

_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_NUMBER_TEXT = st.sampled_from(["0", "1", "-1", "2", "16", "0.5", "1e-3", "nan", "inf", "-inf", "1e309", "3:4",
                                "true", "false", "yes", "2:4", "hif4", "mxfp4", "none", "w4a4", "bf16", "exact"])


def _assert_valid(args) -> None:
    """Every field of a namespace that parsed holds a value of its type inside its allowed range."""
    for name, (f, tp) in FIELDS.items():
        v = getattr(args, name)
        base, optional = _base_type(tp)
        if v is None:
            assert optional or name == "seq_length", name
            continue
        if base is bool:
            assert isinstance(v, bool), name
        elif base is int:
            assert isinstance(v, int) and not isinstance(v, bool), name
        elif base is float:
            assert isinstance(v, float) and math.isfinite(v), name
        else:
            assert isinstance(v, str), name
        if f.metadata["choices"]:
            assert v in f.metadata["choices"], name
        if f.metadata["check"]:
            assert f.metadata["check"](v) is None, (name, v)


def _argv(data) -> list[str]:
    names = data.draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True))
    argv = []
    for name in names:
        base, _ = _base_type(FIELDS[name][1])
        if base is bool:
            argv.append(data.draw(st.sampled_from([flag_name(name), "--no-" + flag_name(name)[2:]])))
        else:
            argv += [flag_name(name), data.draw(st.one_of(_NUMBER_TEXT, _TEXT))]
    return argv


@SETTINGS
@given(st.data())
def test_command_lines_parse_to_valid_values_or_fail_naming_a_flag(tmp_path_factory, data):
    argv = _argv(data)
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))  # relative paths in random values stay in a scratch folder
    try:
        args = parse_args(argv)
    except ValueError as e:
        assert "--" in str(e) or "world size" in str(e), str(e)
        return
    except SystemExit as e:  # argparse: a usage line and "error: argument --x: ..." on stderr, status 2
        assert e.code == 2
        return
    finally:
        os.chdir(cwd)
    _assert_valid(args)


_YAML_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=True),
                        _TEXT, _NUMBER_TEXT, st.lists(st.integers(), max_size=2))


@SETTINGS
@given(st.dictionaries(st.one_of(st.sampled_from(sorted(FIELDS)).map(lambda n: n.replace("_", "-")),
                                 st.sampled_from(["group_size", "no_such_flag", "Lr", "1"])),
                       _YAML_VALUE, max_size=6))
def test_yaml_configs_parse_to_valid_values_or_fail_naming_the_file(tmp_path_factory, mapping):
    folder = tmp_path_factory.mktemp("cfg")
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(mapping))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        args = parse_args(["--config", str(path)])
    except ValueError as e:
        assert str(path) in str(e) or "--" in str(e), str(e)
        return
    finally:
        os.chdir(cwd)
    _assert_valid(args)
    for key, value in mapping.items():  # what the file said is what the run got
        name = key.replace("-", "_")
        if name in FIELDS and value is not None and isinstance(value, bool) and _base_type(FIELDS[name][1])[0] is bool:
            assert getattr(args, name) is value


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"step": 7, "model": {"w": torch.randn(64, 8, generator=g), "b": torch.arange(8).to(torch.bfloat16)},
            "sampler": {"epoch": 1, "index": 3, "seed": 5, "num_examples": 10, "shuffle": True},
            "extra": {"warm_start": {"accuracy": 0.25}}, "rng": {"torch": torch.get_rng_state()}}


def _same(a: typing.Any, b: typing.Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root, state = tmp_path_factory.mktemp("ck"), _state()
    ckpt.save_checkpoint(root, 1, state)
    path = root / "iter_0000001" / "rank_00000.pt"
    return root, path, path.read_bytes(), state


@SETTINGS
@given(kind=st.sampled_from(["truncate", "flip", "garbage"]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7), junk=st.binary(min_size=1, max_size=64), mmap=st.booleans())
def test_damaged_rank_files_load_correctly_or_fail_naming_the_file(saved, kind, where, bit, junk, mmap):
    root, path, good, original = saved
    at = int(where * len(good))
    if kind == "truncate":
        raw = good[:at]
    elif kind == "flip":
        raw = bytearray(good)
        raw[at] ^= 1 << bit
        raw = bytes(raw)
    else:
        raw = good[:at] + junk + good[at + len(junk):]
    path.write_bytes(raw)
    try:
        try:
            _, state = ckpt.load_checkpoint(root, 1, mmap=mmap)
            if mmap:  # a memory-mapped reader verifies what it reads: here, everything
                ckpt.verify_checksums(state, path)
                state.pop("checksums", None)
        except ckpt.CheckpointError as e:
            assert str(path) in str(e)
            return
        assert _same(state, original), f"{kind} at {at}: loaded a different state without an error"
    finally:
        path.write_bytes(good)
