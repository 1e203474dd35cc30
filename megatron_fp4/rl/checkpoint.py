"""Atomic, code-free checkpoints for the RL driver: save/resume a state dict, RNG capture/restore, keep-last-K.

Layout (Megatron style):
    SAVE_DIR/latest_checkpointed_iteration.txt      the iteration of the newest COMPLETE checkpoint
    SAVE_DIR/iter_0000100/rank_00000.pt              one torch.save'd state dict per rank
    SAVE_DIR/iter_0000100/metadata.json              iteration, world size, file list (written last)
    SAVE_DIR/checkpoint_writer.json                  what wrote the folder (the saver touches only its own folders)
A save writes everything into SAVE_DIR/.tmp_iter_XXXXXXX, fsyncs the files and the directory, os.replace()s it to
iter_XXXXXXX, then replaces the tracker the same way (write temp, fsync, os.replace). A crash at any moment leaves
the tracker pointing at the previous complete checkpoint; stale temp directories are removed by the next save.

Ownership: a folder is the saver's once it holds checkpoint_writer.json (or, written before that file existed,
only RL checkpoints of this format). The saver refuses any other non-empty folder, naming what it found (another
tool's checkpoints, a converted model), and it moves or deletes only iter_* directories whose metadata says this
format wrote them.

Integrity: every rank file carries an xxh3-128 checksum of each of its tensors' bytes and one of everything else
(keys, numbers, strings, tensor dtypes and shapes), written in the same file, so atomically with the data;
loading verifies them and names the file and the tensor that does not match, and the previous checkpoint to
resume from instead.
Loading uses torch.load(weights_only=True): only tensors and plain containers/primitives are accepted and no code
stored in the file is executed. The state must therefore hold only tensors, numbers, strings, bools, None, and
lists/tuples/dicts of them (model and optimizer state_dicts qualify; use capture_rng_state for RNG states).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from megatron_fp4.models.safetensors_io import fsync_dir, write_text_atomic as _write_text_atomic

__all__ = ["TRACKER_FILE", "WRITER_FILE", "CHECKSUM_ALGORITHM", "CheckpointError", "CheckpointNotFoundError",
           "iter_dir_name", "check_save_dir", "claim_save_dir", "inspect_checkpoint_dir", "save_checkpoint",
           "load_checkpoint", "latest_iteration", "list_checkpoints", "tensor_checksums", "verify_checksums",
           "capture_rng_state", "restore_rng_state"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
WRITER_FILE = "checkpoint_writer.json"
CHECKSUM_ALGORITHM = "xxh3_128"
_FORMAT = "torch.save/weights_only"  # metadata.json "format" of this module's checkpoints
_WRITER = {"writer": "megatron_fp4.rl.checkpoint", "format": _FORMAT, "version": 1}
_METADATA = "metadata.json"
_TMP_PREFIX = ".tmp_"
_DEL_PREFIX = ".del_"


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be read safely (corrupt, incompatible, or containing non-tensor objects)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint in the directory."""


def iter_dir_name(iteration: int) -> str:
    """'iter_0000100' for iteration 100."""
    return f"iter_{iteration:07d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _write_state(path: Path, state: Any) -> None:
    """torch.save state (with the checksums of its tensors) to path and fsync it."""
    state = {**state, "checksums": _checksum_table(state)}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _remove_dir(path: Path) -> None:
    """Delete a directory by first renaming it out of the iter_* namespace, so a half-deleted one never loads."""
    if not path.exists():
        return
    doomed = path.with_name(_DEL_PREFIX + path.name)
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _is_complete(d: Path) -> bool:
    return d.is_dir() and (d / _METADATA).is_file()


def _is_ours(d: Path) -> bool:
    """Whether iteration directory ``d`` was written by this module (its metadata says so)."""
    try:
        return json.loads((d / _METADATA).read_text()).get("format") == _FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _foreign_entries(root: Path) -> list[str]:
    """What in ``root`` this module did not write: anything but its marker, tracker, own checkpoints and the temp
    directories of its saves."""
    out = []
    for e in sorted(root.iterdir()):
        n = e.name
        if n in (WRITER_FILE, TRACKER_FILE, TRACKER_FILE + ".tmp", WRITER_FILE + ".tmp"):
            continue
        if n.startswith(("iter_", _TMP_PREFIX + "iter_", _DEL_PREFIX + "iter_")) and e.is_dir() and (
                not n.startswith("iter_") or _is_ours(e)):
            continue
        out.append(n)
    return out


def check_save_dir(save_dir: str | Path) -> None:
    """Refuse a ``save_dir`` that is not this saver's: CheckpointError naming what it holds. Fine: a missing or
    empty folder, one with checkpoint_writer.json (the saver's own; files beside its checkpoints are left alone),
    or one holding only RL checkpoints of this format (written before the marker existed)."""
    root = Path(save_dir)
    if not root.exists():
        return
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory: cannot save checkpoints into it")
    marker = root / WRITER_FILE
    if marker.is_file():
        try:
            ok = json.loads(marker.read_text()).get("format") == _FORMAT
        except (OSError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise CheckpointError(f"{marker} does not name this checkpoint format: refusing to save into {root}")
        foreign = [n for n in _foreign_entries(root) if n.startswith("iter_") or n == "release"]
    else:
        foreign = _foreign_entries(root)
    if not foreign:
        return
    if "release" in foreign and (root / "release" / "args.json").is_file():
        raise CheckpointError(f"{root} holds a converted model checkpoint (release/, tools/convert_hf_to_megatron.py):"
                              f" a run never writes into it. Pass it as --ref-load {root} and --save a new directory")
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise CheckpointError(f"{root} holds files this trainer did not write ({shown}): refusing to save checkpoints "
                          f"there (they could be overwritten or pruned); choose an empty or new directory")


def claim_save_dir(save_dir: str | Path) -> None:
    """Check ``save_dir`` (:func:`check_save_dir`), create it and record this saver as its writer."""
    check_save_dir(save_dir)
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / WRITER_FILE).is_file():
        _write_text_atomic(root / WRITER_FILE, json.dumps(_WRITER) + "\n")


def _tensors(obj: Any, prefix: str = ""):
    """(path, tensor) of every tensor in nested dicts / lists / tuples, paths like ``model/decoder.x.weight``."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}" if prefix else str(i))


def _digest(t: torch.Tensor) -> str:
    import xxhash

    b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(memoryview(b))


def tensor_checksums(state: Any) -> dict[str, str]:
    """{path: xxh3-128 hex digest of the tensor's bytes} of every tensor in ``state``."""
    return {k: _digest(t) for k, t in _tensors(state)}


def _skeleton(obj: Any) -> Any:
    """``obj`` with each tensor replaced by its dtype and shape: what the checksum of the non-tensor values covers
    (the step, the data position, the keys, and how the tensors' bytes are to be read)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def _structure_digest(state: dict) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(repr(_skeleton({k: v for k, v in state.items() if k != "checksums"})).encode())


def _checksum_table(state: dict) -> dict:
    return {"algorithm": CHECKSUM_ALGORITHM, "tensors": tensor_checksums(state), "structure": _structure_digest(state)}


def verify_checksums(state: dict, path: str | Path, prefixes: tuple[str, ...] = ()) -> None:
    """Recompute the checksums a rank file carries (only of the tensors under ``prefixes``, e.g. ``("model/",)``,
    when given) and raise CheckpointError naming the file and the first tensor that does not match, and the
    previous checkpoint."""
    def damaged(what: str) -> CheckpointError:  # the previous checkpoint is looked up only for an error
        return CheckpointError(f"{path}: {what} {_previous_hint(Path(path).parent)}")

    if "checksums" not in state:
        if _metadata_names_checksums(Path(path).parent):  # a damaged key, not a file from before checksums
            raise damaged(f"its checksum table is missing though {_METADATA} says it was written: the file is "
                          f"damaged.")
        return  # written before checksums existed
    table = state["checksums"]
    if not isinstance(table, dict) or table.get("algorithm") != CHECKSUM_ALGORITHM:
        raise damaged("its checksum table is damaged.")
    if table.get("structure") != _structure_digest(state):
        raise damaged("its keys, values or tensor shapes and dtypes do not match their checksum: the file is damaged.")
    want = table.get("tensors") or {}
    for key, t in _tensors({k: v for k, v in state.items() if k != "checksums"}):
        if prefixes and not key.startswith(prefixes):
            continue
        if key not in want or _digest(t) != want[key]:
            raise damaged(f"tensor {key} does not match its checksum: the file is damaged.")


def _metadata_names_checksums(iter_dir: Path) -> bool:
    """Whether the iteration's metadata says its rank files carry checksum tables (every save since they exist)."""
    try:
        return bool(json.loads((iter_dir / _METADATA).read_text()).get("checksums"))
    except (OSError, ValueError, AttributeError):
        return False


def _previous_hint(iter_dir: Path) -> str:
    root, name = iter_dir.parent, iter_dir.name
    older = [it for it in list_checkpoints(root) if iter_dir_name(it) < name]
    if not older:
        return f"No earlier checkpoint is in {root}."
    prev = root / iter_dir_name(older[-1])
    return f"The previous checkpoint is {prev}: move {iter_dir} out of {root} to resume from it."


def list_checkpoints(save_dir: str | Path) -> list[int]:
    """Iterations of the complete checkpoints in save_dir, ascending."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    its = []
    for d in root.iterdir():
        if d.name.startswith("iter_") and d.name[5:].isdigit() and _is_complete(d):
            its.append(int(d.name[5:]))
    return sorted(its)


def latest_iteration(save_dir: str | Path) -> int | None:
    """The iteration named by the tracker file when that checkpoint is complete, else the newest complete
    checkpoint found by scanning (a tracker lost or corrupted by the filesystem), else None."""
    root = Path(save_dir)
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text.isdigit() and _is_complete(root / iter_dir_name(int(text))):
            return int(text)
    its = list_checkpoints(root)
    return its[-1] if its else None


def inspect_checkpoint_dir(path: str | Path) -> int | None:
    """The iteration a resume from ``path`` loads, checked before any model is built: None when ``path`` does not
    exist or holds no checkpoint (no tracker file, no iter_* directory); CheckpointError naming the file when the
    checkpoint it holds is incomplete or damaged (a tracker that names no complete iteration, metadata that does
    not parse, rank files missing or empty)."""
    root = Path(path)
    if not root.exists():
        return None
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    tracker = root / TRACKER_FILE
    iters = sorted(int(d.name[5:]) for d in root.iterdir() if d.name.startswith("iter_") and d.name[5:].isdigit())
    if not tracker.exists() and not iters:
        return None
    if tracker.exists():
        text = tracker.read_text(errors="replace").strip()
        if not text.isdigit():
            raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
        it = int(text)
    else:
        it = iters[-1]
    d = root / iter_dir_name(it)
    meta_path = d / _METADATA
    if not d.is_dir():
        raise CheckpointError(f"{tracker} names iteration {it}, but {d} does not exist")
    if not meta_path.is_file():
        raise CheckpointError(f"{d} is incomplete: {_METADATA} is missing (not written by a finished save)")
    try:
        meta = json.loads(meta_path.read_text())
        files = [str(f) for f in meta["files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path} is damaged: {e}") from None
    for f in files:
        if not (d / f).is_file() or (d / f).stat().st_size == 0:
            raise CheckpointError(f"{d / f} is missing or empty: the checkpoint in {d} is incomplete")
    return it


def save_checkpoint(save_dir: str | Path, iteration: int, state: dict, *, keep_last: int | None = None,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None) -> Path:
    """Atomically write `state` as checkpoint `iteration` (every rank calls this with its own state).

    keep_last: after a successful save keep only the newest K complete checkpoints (the one just written always
    survives). With world_size > 1, `barrier` synchronizes the ranks (default torch.distributed.barrier); rank 0
    owns the directory rename, the tracker and pruning. Returns the final iter_XXXXXXX directory.
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if world_size > 1 and barrier is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError("world_size > 1 needs a barrier callable or an initialized torch.distributed")
        barrier = torch.distributed.barrier
    sync = barrier if barrier is not None else (lambda: None)

    root = Path(save_dir)
    name = iter_dir_name(iteration)
    final, tmp = root / name, root / (_TMP_PREFIX + name)
    if rank == 0:
        claim_save_dir(root)
        if final.exists() and not _is_ours(final):
            raise CheckpointError(f"{final} was not written by this trainer: refusing to replace it")
        if tmp.exists():  # left over from a crashed save
            shutil.rmtree(tmp)
        tmp.mkdir()
    sync()
    _write_state(tmp / _rank_file(rank), state)
    sync()
    if rank == 0:
        meta = {"iteration": iteration, "world_size": world_size,
                "files": [_rank_file(r) for r in range(world_size)], "format": _FORMAT,
                "checksums": CHECKSUM_ALGORITHM}
        missing = [f for f in meta["files"] if not (tmp / f).is_file()]
        if missing:
            raise CheckpointError(f"{tmp}: rank files missing after the barrier: {missing}")
        with open(tmp / _METADATA, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        aside = root / (_DEL_PREFIX + name)
        if final.exists():  # re-saving an iteration (e.g. after a resume): move the old copy aside first
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(root)
        if aside.exists():
            shutil.rmtree(aside)
        _write_text_atomic(root / TRACKER_FILE, f"{iteration}\n")
        if keep_last is not None:
            others = [it for it in list_checkpoints(root) if it != iteration]
            for it in others[:max(0, len(others) - (keep_last - 1))]:
                if _is_ours(root / iter_dir_name(it)):
                    _remove_dir(root / iter_dir_name(it))
    sync()
    return final


def load_checkpoint(load_dir: str | Path, iteration: int | None = None, *, rank: int = 0,
                    map_location: str | torch.device = "cpu", mmap: bool = False) -> tuple[int, dict]:
    """(iteration, state) of this rank from the latest (or the given) complete checkpoint.

    Raises CheckpointNotFoundError when there is none, CheckpointError when the file is unreadable or holds
    anything torch.load(weights_only=True) refuses (pickled classes, functions): no code from it is executed.
    ``mmap``: map the file instead of reading it (tensors are paged in when used; for reading a few of them): the
    checksums are then left to the caller (:func:`verify_checksums` with the prefix of what it reads); otherwise
    every tensor is verified (CheckpointError naming the file and tensor on a mismatch).
    """
    root = Path(load_dir)
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            raise CheckpointNotFoundError(
                f"no checkpoint found in {root} (no {TRACKER_FILE} naming a complete iter_* directory)")
    d = root / iter_dir_name(iteration)
    if not _is_complete(d):
        raise CheckpointNotFoundError(f"no complete checkpoint for iteration {iteration} in {root}")
    meta = json.loads((d / _METADATA).read_text())
    path = d / _rank_file(rank)
    if not path.is_file():
        raise CheckpointError(f"{path} missing: the checkpoint was saved with world_size={meta.get('world_size')}, "
                              f"this process is rank {rank}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused to load (only tensors and plain containers are allowed, "
                              f"weights_only=True): {str(e).splitlines()[0]}") from e
    except Exception as e:  # a damaged zip or pickle fails in many ways inside torch.load: all mean unreadable
        raise CheckpointError(f"{path}: unreadable checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'}). "
                              f"{_previous_hint(path.parent)}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of state, got {type(state).__name__}")
    if not mmap:
        verify_checksums(state, path)
        state.pop("checksums", None)
    return iteration, state


def capture_rng_state() -> dict:
    """RNG states of python, numpy (legacy global) and torch (CPU and all CUDA devices) as weights_only-safe data."""
    np_state = np.random.get_state(legacy=False)
    out = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng_state(state: dict) -> None:
    """Restore what capture_rng_state returned (CUDA states only when present in both)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
                         "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
