"""What --load / --save / --ref-load / --init-from / --init decide before any model is built (plan_start): the
meaning Megatron-LM and slime give them, and an error naming the file for a damaged checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from megatron_fp4.rl.arguments import parse_args
from megatron_fp4.rl.checkpoint import TRACKER_FILE, CheckpointError, save_checkpoint
from megatron_fp4.rl.checkpointer import plan_start
from megatron_fp4.rl.config import CheckpointConfig


def _rl_checkpoint(path, iteration=2):
    save_checkpoint(path, iteration, {"step": iteration})
    return str(path)


def _converted(path):
    d = path / "release"
    d.mkdir(parents=True)
    (d / "args.json").write_text(json.dumps({"format": "megatron_fp4.gpt"}))
    (path / TRACKER_FILE).write_text("release")
    return str(path)


def _plan(**kw):
    return plan_start(CheckpointConfig(**kw))


def test_no_load_starts_random_or_resumes_save(tmp_path):
    plan = _plan()
    assert (plan.resume, plan.ref_load, plan.notes) == (None, None, ())
    plan = _plan(save=str(tmp_path / "new"))  # --save holds nothing yet: a new run
    assert plan.resume is None and plan.notes == ()
    run = _rl_checkpoint(tmp_path / "run")
    assert _plan(save=run).resume == run  # re-running the same command resumes it


def test_load_equal_to_save_is_the_default_spelled_out(tmp_path):
    run = str(tmp_path / "run")
    plan = _plan(load=run, save=run)  # a new run: random (the default) like no --load at all, and said so
    assert plan.resume is None and plan.notes == (f"--load {run} (= --save) holds no checkpoint yet: a new run",)
    _rl_checkpoint(tmp_path / "run")
    assert _plan(load=run, save=run).resume == run


def test_load_with_a_checkpoint_resumes_it_not_save(tmp_path):
    first, other = _rl_checkpoint(tmp_path / "first"), _rl_checkpoint(tmp_path / "other", 5)
    plan = _plan(load=first, save=other)
    assert plan.resume == first and plan.notes == ()


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_load_without_checkpoint_starts_from_named_weights_and_says_so_first(tmp_path, state):
    load = tmp_path / "load"
    if state == "empty":
        load.mkdir()
        (load / "notes.txt").write_text("not a checkpoint")
    why = "does not exist" if state == "missing" else "holds no checkpoint"
    ref = _converted(tmp_path / "converted")
    plan = _plan(load=str(load), ref_load=ref)
    assert plan.resume is None and plan.ref_load == ref
    assert plan.notes[0] == f"--load {load} {why}: starting from --ref-load {ref}"
    warm = _rl_checkpoint(tmp_path / "warm")
    assert _plan(load=str(load), init_from=warm).notes[0] == f"--load {load} {why}: starting from --init-from {warm}"
    plan = _plan(load=str(load), init="random")
    assert plan.notes[0] == f"--load {load} {why}: starting from a random model (--init random)"
    with pytest.raises(ValueError, match=f"--load {load} {why} and no starting weights are named: pass --ref-load"):
        _plan(load=str(load))


def test_load_of_a_converted_checkpoint_means_ref_load_with_a_note(tmp_path):
    ref = _converted(tmp_path / "converted")
    plan = _plan(load=ref, save=str(tmp_path / "run"))
    assert plan.resume is None and plan.ref_load == ref
    assert plan.notes == (f"--load {ref} is a converted model checkpoint: taken as --ref-load {ref} (the starting "
                          f"weights). --load now names the RL checkpoint a run resumes from, as in Megatron-LM and "
                          f"slime: pass --ref-load {ref}",)
    run = _rl_checkpoint(tmp_path / "run")
    assert _plan(load=ref, save=run).resume == run  # the old spelling resumed from --save: it still does
    with pytest.raises(ValueError, match="names others"):
        _plan(load=ref, ref_load=_converted(tmp_path / "other"))


def test_ref_load_must_be_a_converted_checkpoint(tmp_path):
    run = _rl_checkpoint(tmp_path / "run")
    with pytest.raises(ValueError, match=f"resume it with --load {run}, or start from its weights with --init-from"):
        _plan(ref_load=run)


@pytest.mark.parametrize("damage,names", [
    ("no_metadata", "metadata.json is missing"),
    ("empty_rank_file", "rank_00000.pt is missing or empty"),
    ("tracker_to_nowhere", "names iteration 9, but"),
    ("tracker_garbage", "expected an iteration number"),
    ("bad_metadata", "metadata.json is damaged"),
])
def test_load_of_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, damage, names):
    run = tmp_path / "run"
    _rl_checkpoint(run)
    d = run / "iter_0000002"
    if damage == "no_metadata":
        (d / "metadata.json").unlink()
    elif damage == "empty_rank_file":
        (d / "rank_00000.pt").write_bytes(b"")
    elif damage == "tracker_to_nowhere":
        (run / TRACKER_FILE).write_text("9\n")
    elif damage == "tracker_garbage":
        (run / TRACKER_FILE).write_text("\x00\x01junk")
    else:
        (d / "metadata.json").write_text("{not json")
    for kw in ({"load": str(run)}, {"save": str(run)}):
        with pytest.raises(CheckpointError, match=names) as e:
            _plan(**kw)
        assert str(run) in str(e.value)


def test_validation_checks_start_paths(tmp_path):
    with pytest.raises(ValueError, match="--ref-load="):
        parse_args(["--ref-load", str(tmp_path / "missing")])
    warm = _rl_checkpoint(tmp_path / "warm")
    with pytest.raises(ValueError, match="--init random contradicts --init-from"):
        parse_args(["--init", "random", "--init-from", warm])
    assert os.path.isdir(warm)
