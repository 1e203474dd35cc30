"""Who wrote a checkpoint folder, and whether a tool may write into it: the rule the RL saver, the converters and the
exporters share.

Standard library only and importing nothing of the package, so that ``models/`` (which must not import ``rl/``) and
``rl/`` both reach it. The RL saver (:mod:`megatron_fp4.rl.checkpoint`) marks its folders with
``checkpoint_writer.json`` and writes ``iter_*/metadata.json``; converted checkpoints
(:mod:`megatron_fp4.models.checkpoint_io`) have a tracker naming an iteration whose ``args.json`` has format
``megatron_fp4.gpt`` and record their writer there. The constants below are those modules' own (a test pins them).

Rules (:func:`check_output_dir`): a converter writes only into a missing or empty folder or a converted checkpoint of
its own format; an HF exporter writes only into a folder that is not a checkpoint folder of any kind (no tracker,
no writer marker, no RL checkpoint) and is not one of the folders it reads. Neither ever writes into a training
run's folder, and the path must be writable, both checked before any work starts.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

__all__ = ["WRITER_FILE", "TRACKER_FILE", "RL_CHECKPOINT_FORMAT", "CONVERTED_FORMAT", "OutputDirError",
           "training_run_evidence", "check_writable_dir", "check_output_dir"]

WRITER_FILE = "checkpoint_writer.json"            # megatron_fp4.rl.checkpoint.WRITER_FILE
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # both checkpoint kinds (Megatron-LM's name)
RL_CHECKPOINT_FORMAT = "torch.save/weights_only"  # metadata.json / checkpoint_writer.json "format" of RL checkpoints
CONVERTED_FORMAT = "megatron_fp4.gpt"             # args.json "format" of converted checkpoints

PathLike = Union[str, os.PathLike]


class OutputDirError(ValueError):
    """An output path a tool must not (or cannot) write into; the message names the argument, the path and why."""


def _json(path: Path) -> Optional[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def training_run_evidence(path: PathLike) -> Optional[str]:
    """What marks ``path`` as a training run's checkpoint folder (its writer marker, or an RL ``iter_*`` checkpoint
    written before markers existed), or None when nothing does."""
    root = Path(path)
    if not root.is_dir():
        return None
    marker = root / WRITER_FILE
    if marker.exists():
        doc = _json(marker) or {}
        return f"{WRITER_FILE} (writer {doc.get('writer', 'unknown')!r}, format {doc.get('format', 'unknown')!r})"
    for d in sorted(root.glob("iter_*")):
        meta = d / "metadata.json"
        if d.is_dir() and meta.is_file():
            fmt = (_json(meta) or {}).get("format")
            return f"an RL checkpoint {d.name}/metadata.json (format {fmt!r})"
        if d.is_dir() and any(p.name.startswith("rank_") and p.suffix == ".pt" for p in d.iterdir()):
            return f"an RL checkpoint {d.name} (rank files)"
    return None


def _converted_tracker(root: Path) -> Optional[bool]:
    """None without a tracker; True when the tracker names an iteration whose args.json is a converted
    checkpoint's; False when it belongs to something else (another tool, or damaged)."""
    tracker = root / TRACKER_FILE
    if not tracker.exists():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        return False
    doc = _json(root / name / "args.json")
    return doc is not None and doc.get("format") == CONVERTED_FORMAT


def _is_converted_iteration(d: Path) -> bool:
    """An iteration directory a converter wrote: its args.json has the converted format, or (a conversion that was
    interrupted before args.json) it holds only shard directories."""
    if not d.is_dir():
        return False
    doc = _json(d / "args.json")
    if doc is not None:
        return doc.get("format") == CONVERTED_FORMAT
    return all(p.is_dir() and p.name.startswith("mp_rank_") for p in d.iterdir())


def check_writable_dir(path: PathLike, arg: str = "--save") -> Path:
    """``path`` is a directory or can be created as one: no file in the way and the nearest existing directory
    accepts a new file (probed with a temporary file, removed at once). OutputDirError naming ``arg`` otherwise."""
    p = Path(os.path.abspath(path))
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"{arg} {path}: is a file, not a directory")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputDirError(f"{arg} {path}: cannot be created: {parent} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputDirError(f"{arg} {path}: cannot be written ({parent}: {e.strerror or e})") from None
    return p


def _iteration_dir_above(p: Path) -> Optional[Path]:
    """The checkpoint iteration directory (an RL ``iter_*`` or a converted ``release`` / ``iter_*``) that ``p`` is
    or lies inside, if any: its writer replaces or prunes it as a whole, with whatever else it holds."""
    for a in (p, *p.parents):
        if (a.name == "release" or a.name.startswith("iter_")) and a.is_dir() and (
                (a / "metadata.json").is_file() or (a / "args.json").is_file()
                or any(c.name.startswith(("rank_", "mp_rank_")) for c in a.iterdir())):
            return a
    return None


def check_output_dir(path: PathLike, kind: str, arg: str = "--save", sources: Iterable[PathLike] = ()) -> Path:
    """Refuse (OutputDirError naming ``arg``, the path and what it holds) an output folder a tool must not write:

    - any kind: a file, an unwritable path, a training run's folder (:func:`training_run_evidence`), one of
      ``sources`` (the inputs being read), a checkpoint iteration directory or a folder inside one (pruned or
      replaced as a whole by its writer; a new folder beside the iterations, e.g. ``RUN/hf``, is fine);
    - ``kind="converted"`` (a converter's megatron-fp4 checkpoint): anything but a missing or empty folder or a
      converted checkpoint (a tracker of another tool, files the converter did not write);
    - ``kind="hf"`` (a Hugging Face export): any checkpoint folder (a tracker or writer marker present).
    Returns the absolute path.
    """
    if kind not in ("converted", "hf"):
        raise ValueError(f"kind={kind!r} is not valid; allowed values: 'converted', 'hf'")
    p = check_writable_dir(path, arg)
    for src in sources:
        if src is not None and Path(src).exists() and p.resolve() == Path(src).resolve():
            raise OutputDirError(f"{arg} {path}: is {src}, the input being read; choose another output folder")
    inside = _iteration_dir_above(p)
    if inside is not None:
        raise OutputDirError(f"{arg} {path}: lies inside the checkpoint iteration {inside}, which its writer replaces "
                             f"or prunes as a whole; choose another output folder")
    if not p.is_dir():
        return p
    run = training_run_evidence(p)
    if run is not None:
        raise OutputDirError(f"{arg} {path}: is a training run's folder ({run}); tools never write into it. "
                             f"Choose another output folder")
    tracker = _converted_tracker(p)
    if kind == "hf":
        if tracker is not None:
            what = "a converted megatron-fp4 checkpoint" if tracker else "another tool's checkpoint"
            raise OutputDirError(f"{arg} {path}: holds {what} ({TRACKER_FILE}); a Hugging Face export never "
                                 f"writes into a checkpoint folder. Choose another output folder")
        return p
    if tracker is False:
        raise OutputDirError(f"{arg} {path}: its {TRACKER_FILE} belongs to another tool's checkpoint (it names no "
                             f"{CONVERTED_FORMAT} iteration); refusing to overwrite it. Choose an empty or new "
                             f"directory")
    foreign = [e.name for e in sorted(p.iterdir()) if not (
        e.name in (TRACKER_FILE, TRACKER_FILE + ".tmp", "hf_assets")
        or e.name.startswith((".tmp_", ".del_", ".write_probe_"))
        or ((e.name == "release" or e.name.startswith("iter_")) and _is_converted_iteration(e)))]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputDirError(f"{arg} {path}: holds files the converter did not write ({shown}); refusing to write "
                             f"a checkpoint beside them. Choose an empty or new directory")
    return p
