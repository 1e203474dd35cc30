"""Tests for megatron_fp4.rl.checkpoint: round trip, crash safety, keep-last-K, weights_only refusal, RNG resume."""

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_fp4.rl import checkpoint as ckpt
from megatron_fp4.rl.checkpoint import (TRACKER_FILE, WRITER_FILE, CheckpointError, CheckpointNotFoundError,
                                        capture_rng_state, latest_iteration, list_checkpoints, load_checkpoint,
                                        restore_rng_state, save_checkpoint)
from megatron_fp4.rl.data import PromptSampler

REPO = Path(__file__).resolve().parents[1]


def _train_state(seed: int = 0):
    """A small model + AdamW after one step, plus the other pieces a resume needs."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sampler = PromptSampler(10, seed=1)
    sampler.next_indices(7)
    return model, opt, sampler


def _state(model, opt, sampler, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng_state(),
            "data": sampler.state_dict(), "step": step, "args": {"lr": 1e-3, "fp4_format": "hif4", "tags": None}}


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_restores_model_optimizer_rng_data_and_step(tmp_path):
    model, opt, sampler = _train_state()
    state = _state(model, opt, sampler, step=5)
    out = save_checkpoint(tmp_path, 5, state)
    assert out == tmp_path / "iter_0000005" and (tmp_path / TRACKER_FILE).read_text().strip() == "5"
    it, loaded = load_checkpoint(tmp_path)
    assert it == 5
    _assert_same(state, loaded)

    # Restoring into fresh objects continues exactly like the original.
    model2, opt2, sampler2 = _train_state(seed=99)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sampler2.load_state_dict(loaded["data"])
    restore_rng_state(loaded["rng"])
    x2 = torch.randn(3, 4)
    restore_rng_state(state["rng"])
    x1 = torch.randn(3, 4)
    for m, o, x in ((model, opt, x1), (model2, opt2, x2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)
    assert sampler.next_indices(5) == sampler2.next_indices(5)


def test_rng_capture_restore_all_generators():
    s = capture_rng_state()
    a = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    restore_rng_state(s)
    b = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    assert a[:3] == b[:3] and torch.equal(a[3], b[3])


def test_missing_checkpoint_has_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint found in"):
        load_checkpoint(tmp_path / "does_not_exist")
    (tmp_path / "iter_0000003").mkdir()  # an incomplete directory is not a checkpoint
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="iteration 7"):
        load_checkpoint(tmp_path, 7)
    assert latest_iteration(tmp_path) is None


def test_crash_inside_writer_keeps_previous_checkpoint_and_tracker(tmp_path, monkeypatch):
    model, opt, sampler = _train_state()
    good = _state(model, opt, sampler, step=1)
    save_checkpoint(tmp_path, 1, good)
    tracker_before = (tmp_path / TRACKER_FILE).read_bytes()

    def crashing_writer(path, state):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 partial garbage")  # a half-written file, then the process "dies"
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "_write_state", crashing_writer)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, 2, _state(model, opt, sampler, step=2))
    monkeypatch.undo()

    assert (tmp_path / TRACKER_FILE).read_bytes() == tracker_before
    assert not (tmp_path / "iter_0000002").exists()
    it, loaded = load_checkpoint(tmp_path)
    assert it == 1
    _assert_same(good, loaded)
    # The next save cleans the stale temp directory and succeeds.
    save_checkpoint(tmp_path, 2, _state(model, opt, sampler, step=2))
    assert load_checkpoint(tmp_path)[1]["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["iter_0000001", "iter_0000002", TRACKER_FILE,
                                                                 WRITER_FILE])


_HARD_CRASH = r"""
import os, sys, torch
from megatron_fp4.rl import checkpoint as ckpt
def die(path, state):
    with open(path, "wb") as f:
        f.write(b"partial")
        f.flush()
    os._exit(17)  # no cleanup, no exception handlers: like SIGKILL mid-write
ckpt._write_state = die
ckpt.save_checkpoint(sys.argv[1], 2, {"w": torch.ones(3), "step": 2})
"""


def test_hard_kill_mid_save_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(3), "step": 1})
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _HARD_CRASH, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert r.returncode == 17, r.stderr.decode()
    assert (tmp_path / ".tmp_iter_0000002").exists()  # the dead save's leftovers
    it, state = load_checkpoint(tmp_path)
    assert it == 1 and state["step"] == 1 and torch.equal(state["w"], torch.zeros(3))


class _Evil:
    """Pickles to a call that would create a file if unpickling executed code."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_weights_only_refuses_pickled_objects_and_runs_no_code(tmp_path):
    sentinel = tmp_path / "code_was_executed"
    save_checkpoint(tmp_path / "ck", 4, {"step": 4, "payload": _Evil(sentinel)})  # torch.save pickles anything
    assert not sentinel.exists()
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(tmp_path / "ck")
    assert not sentinel.exists()
    # A corrupt file is an error, not a crash or a silent empty state.
    save_checkpoint(tmp_path / "ck2", 1, {"step": 1})
    (tmp_path / "ck2" / "iter_0000001" / "rank_00000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="rank_00000.pt"):
        load_checkpoint(tmp_path / "ck2")


def test_keep_last_k_and_tracker(tmp_path):
    for it in (10, 20, 30, 40):
        save_checkpoint(tmp_path, it, {"step": it}, keep_last=2)
    assert list_checkpoints(tmp_path) == [30, 40]
    assert latest_iteration(tmp_path) == 40
    assert load_checkpoint(tmp_path, 30)[1]["step"] == 30
    # Re-saving an existing iteration (after a resume) replaces it.
    save_checkpoint(tmp_path, 30, {"step": 31}, keep_last=2)
    assert load_checkpoint(tmp_path)[1]["step"] == 31 and list_checkpoints(tmp_path) == [30, 40]
    # A corrupt tracker falls back to the newest complete checkpoint.
    (tmp_path / TRACKER_FILE).write_text("garbage")
    assert latest_iteration(tmp_path) == 40
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 50, {}, keep_last=0)


def _save_by_threads(root, iteration, states):
    """Save ``states[r]`` as rank r's file of one checkpoint, one thread per rank (a threading barrier)."""
    world = len(states)
    bar = threading.Barrier(world)
    errors = []

    def worker(rank):
        try:
            save_checkpoint(root, iteration, states[rank], rank=rank, world_size=world, barrier=bar.wait)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_multi_rank_save_with_barrier(tmp_path, monkeypatch):
    world = 3
    _save_by_threads(tmp_path, 7, [{"rank": r, "w": torch.full((2,), float(r))} for r in range(world)])
    meta = json.loads((tmp_path / "iter_0000007" / "metadata.json").read_text())
    assert meta["world_size"] == 3
    for r in range(world):
        it, st = load_checkpoint(tmp_path, rank=r)
        assert it == 7 and st["rank"] == r and torch.equal(st["w"], torch.full((2,), float(r)))
    with pytest.raises(CheckpointError, match="world_size=3"):
        load_checkpoint(tmp_path, rank=5)
    # without torch.distributed (an earlier test in this process may have initialized it) there is no barrier
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="barrier"):
        save_checkpoint(tmp_path, 8, {}, rank=0, world_size=2)


def _save_layout_checkpoint(root, rank_order):
    """A trainer-style checkpoint of TP=2, PP=2, DP=2 (8 rank files): rank_order[r] is the (tp_rank, pp_rank,
    dp_rank) of rank r; each file holds one tensor naming its (TP, PP, DP) position."""
    states = []
    for t, p, d in rank_order:
        layout = {"tp": 2, "tp_rank": t, "pp": 2, "pp_rank": p, "dp": 2, "dp_rank": d, "real_vocab_size": 10,
                  "model_args": {"num_layers": 2, "vocab_size": 16, "tie_embeddings": False}}
        states.append({"layout": layout, "model": {"decoder.layers.0.w": torch.tensor([float(t), float(p), float(d)])}})
    _save_by_threads(root, 3, states)


@pytest.mark.parametrize("order", ["megatron", "shuffled"])
def test_trainer_weights_open_only_the_files_they_need(tmp_path, monkeypatch, order):
    """Resharding reads a shard's DP-rank-0 file when the shard is first needed: under Megatron's rank order
    (TP fastest, then DP, then PP) just that file; under any other order one scan of the layouts, and the right
    shards either way."""
    from megatron_fp4.rl import checkpoint_weights as cw

    ranks = [(t, p, d) for p in range(2) for d in range(2) for t in range(2)]  # rank = t + 2 * (d + 2 * p)
    if order == "shuffled":
        rest = ranks[1:]
        random.Random(1).shuffle(rest)
        ranks = ranks[:1] + rest  # rank 0 stays (0, 0, 0): it records the layout
    _save_layout_checkpoint(tmp_path, ranks)
    opened = []
    real = cw.load_checkpoint
    monkeypatch.setattr(cw, "load_checkpoint", lambda *a, rank=0, **k: opened.append(rank) or real(*a, rank=rank, **k))
    src = cw.TrainerCheckpointWeights(tmp_path)
    assert (src.tp, src.pp, src.dp) == (2, 2, 2) and opened == [0]
    assert torch.equal(src.shard_tensor(1, 1, "decoder.layers.0.w"), torch.tensor([1.0, 1.0, 0.0]))
    if order == "megatron":
        assert opened == [0, 1 + 2 * 2 * 1]  # rank 0 for the layout, then only the file of shard (1, 1)
    else:
        assert len(opened) > 2  # a scan of the layouts
    for t in range(2):
        for p in range(2):
            assert torch.equal(src.shard_tensor(t, p, "decoder.layers.0.w"), torch.tensor([float(t), float(p), 0.0]))
    with pytest.raises(KeyError, match="no shard"):
        src.shard_keys(2, 0)


def test_named_optimizer_state_round_trip_and_main_copies():
    """Adam's state by parameter name round-trips exactly; under mixed precision (fp32 main copies beside bf16
    weights, as megatron's Float16 optimizer keeps them in ``param.main_param``) the main copies come back even
    from a checkpoint saved before the first step, when there is no per-parameter state yet."""
    from megatron_fp4.rl.optimizer_state import load_named_optimizer_state, named_optimizer_state

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
        for p in model.parameters():
            p.main_param = p.detach().float().clone()
        return model, torch.optim.Adam([p.main_param for p in model.parameters()], lr=0.1)

    def snapshot(named):
        return {kind: {n: t.clone() for n, t in d.items()} for kind, d in named.items()}

    model, opt = build()
    before = snapshot(named_optimizer_state(opt, model))  # no step yet: the main copies only
    assert set(before) == {"main"} and len(before["main"]) == 4
    for p in model.parameters():
        p.main_param.grad = torch.randn_like(p.main_param)
    opt.step()
    saved = snapshot(named_optimizer_state(opt, model))
    assert set(saved) == {"main", "step", "exp_avg", "exp_avg_sq"}
    model2, opt2 = build()
    assert load_named_optimizer_state(opt2, model2, saved) == 4
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p.main_param, p2.main_param)
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p.main_param][kind], opt2.state[p2.main_param][kind])
    model3, opt3 = build()
    for p in model3.parameters():
        p.main_param.data.zero_()  # stale main copies
    assert load_named_optimizer_state(opt3, model3, before) == 0  # no per-parameter state to restore ...
    assert all(torch.equal(p.main_param, before["main"][n]) for n, p in model3.named_parameters())  # mains back


# -- ownership and integrity ---------------------------------------------------------------------------------------
def _flip_byte_inside(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit inside ``tensor``'s stored bytes in a torch.save file (the zip entry is stored uncompressed)."""
    raw = bytearray(path.read_bytes())
    at = raw.find(tensor.numpy().tobytes()[:64])
    assert at >= 0
    raw[at + 13] ^= 0x10
    path.write_bytes(bytes(raw))


def test_flipped_bytes_in_a_tensor_are_found_naming_file_tensor_and_previous_checkpoint(tmp_path):
    w = torch.arange(4096, dtype=torch.float32)
    save_checkpoint(tmp_path, 1, {"model": {"w": w * 2}, "step": 1})
    save_checkpoint(tmp_path, 2, {"model": {"w": w}, "step": 2})
    damaged = tmp_path / "iter_0000002" / "rank_00000.pt"
    _flip_byte_inside(damaged, w)
    assert not torch.equal(torch.load(damaged, weights_only=True)["model"]["w"], w)  # torch.load alone: silent
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert str(e.value) == (f"{damaged}: tensor model/w does not match its checksum: the file is damaged. The "
                            f"previous checkpoint is {tmp_path / 'iter_0000001'}: move {tmp_path / 'iter_0000002'} "
                            f"out of {tmp_path} to resume from it.")
    assert torch.equal(load_checkpoint(tmp_path, 1)[1]["model"]["w"], w * 2)
    # a memory-mapped read (what resharding does) verifies the part it reads
    _, mapped = load_checkpoint(tmp_path, mmap=True)
    ckpt.verify_checksums(mapped, damaged, ("extra/",))
    with pytest.raises(CheckpointError, match="tensor model/w does not match"):
        ckpt.verify_checksums(mapped, damaged, ("model/",))


def test_a_damaged_checksum_key_is_not_taken_for_a_file_from_before_checksums(tmp_path):
    """A bit flip in the pickled key "checksums" (found by tests/test_fuzz.py) once made the file look like one
    written before checksums existed: nothing was verified and a stray key was loaded. The metadata now says the
    rank files carry checksums; without that entry (an old checkpoint) a file without a table still loads."""
    state = {"model": {"w": torch.arange(64, dtype=torch.float32)}, "step": 3}
    save_checkpoint(tmp_path, 1, state)
    d = tmp_path / "iter_0000001"
    path = d / "rank_00000.pt"
    assert json.loads((d / "metadata.json").read_text())["checksums"] == ckpt.CHECKSUM_ALGORITHM
    raw = bytearray(path.read_bytes())
    at = raw.find(b"checksums")
    raw[at + 4] ^= 1  # "checjsums"
    path.write_bytes(bytes(raw))
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match="its checksum table is missing") as e:
            _, got = load_checkpoint(tmp_path, mmap=mmap)
            ckpt.verify_checksums(got, path)  # what a memory-mapped reader calls
        assert str(path) in str(e.value)
    # a checkpoint from before checksums: no table in the file, none named in the metadata
    from rl_helpers import rewrite_as_older_version

    rewrite_as_older_version(tmp_path, lambda s: s.pop("checjsums"))
    assert "checksums" not in json.loads((d / "metadata.json").read_text())
    assert torch.equal(load_checkpoint(tmp_path)[1]["model"]["w"], state["model"]["w"])


def test_save_refuses_another_tools_folder_and_leaves_it_alone(tmp_path):
    other = tmp_path / "megatron_lm_run"
    (other / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (other / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"someone else's weights")
    (other / TRACKER_FILE).write_text("100")
    before = sorted(str(p) for p in other.rglob("*"))
    with pytest.raises(CheckpointError, match=r"holds files this trainer did not write \(iter_0000100\)"):
        save_checkpoint(other, 1, {"step": 1}, keep_last=1)
    assert sorted(str(p) for p in other.rglob("*")) == before and (other / TRACKER_FILE).read_text() == "100"
    converted = tmp_path / "converted"
    (converted / "release").mkdir(parents=True)
    (converted / "release" / "args.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"Pass it as --ref-load {converted} and --save a new directory"):
        save_checkpoint(converted, 1, {"step": 1})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"\(todo.txt\)"):
        save_checkpoint(tmp_path / "notes", 1, {"step": 1})


def test_own_folder_keeps_other_files_and_never_prunes_foreign_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})
    assert json.loads((tmp_path / WRITER_FILE).read_text())["format"] == "torch.save/weights_only"
    (tmp_path / "tensorboard").mkdir()  # files beside the checkpoints of a folder the saver owns are fine
    save_checkpoint(tmp_path, 2, {"step": 2}, keep_last=1)
    assert list_checkpoints(tmp_path) == [2] and (tmp_path / "tensorboard").is_dir()
    (tmp_path / "iter_0000000").mkdir()  # but a checkpoint it did not write is never pruned or replaced
    with pytest.raises(CheckpointError, match=r"\(iter_0000000\)"):
        save_checkpoint(tmp_path, 3, {"step": 3}, keep_last=1)
    assert (tmp_path / "iter_0000000").is_dir()


def test_folder_of_checkpoints_written_before_the_marker_is_adopted(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})
    (tmp_path / WRITER_FILE).unlink()  # as an older version left it
    save_checkpoint(tmp_path, 2, {"step": 2})
    assert list_checkpoints(tmp_path) == [1, 2] and (tmp_path / WRITER_FILE).is_file()
