"""Shared helpers of the tools/ command-line scripts: import path, argument parser, error reporting, size parsing.

Every tool reports bad input the same way as ``pretrain_rl.py``: one line ``<tool>.py: error: <what is wrong>``
naming the argument or the file, on stderr, exit status 2, no traceback. That covers argument errors (the parser's
:meth:`ToolArgumentParser.error`) and what the library raises for bad or damaged input (:func:`run_cli`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes (at least 1)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1048576")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B")
    mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    size = int(float(m.group(1)) * mult)
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r} is not valid; expected a size of at least 1 byte")
    return size


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The options of a tool that writes safetensors shards into --save: --max-shard-size (parse it with
    :func:`parse_size`), --no-progress, --overwrite."""
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output in --save")


#: --dtype choices of the tools (torch attribute names).
DTYPES = ("float32", "bfloat16", "float16")


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse with the tools' error style: one ``prog: error: ...`` line (no usage block), status 2."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def tool_parser(prog: str, doc: Optional[str]) -> ToolArgumentParser:
    """The parser of tool ``prog`` (e.g. "convert_hf_to_megatron.py"), described by the first paragraph of
    ``doc``."""
    return ToolArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is not valid; expected an integer >= {low}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def iteration_arg(text: str) -> str:
    """argparse type of --iteration: "release" or a number >= 0 (kept as text)."""
    if text != "release" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; allowed values: \"release\" or a number >= 0")
    return text


def _input_error_types() -> tuple[type, ...]:
    """What the library raises for bad or damaged input (and what the OS raises for unusable paths)."""
    types: list[type] = [ValueError, KeyError, OSError, NotImplementedError, ImportError]
    try:
        from megatron_fp4.rl.checkpoint import CheckpointError

        types.append(CheckpointError)
    except ImportError:  # (a broken install: the ImportError of the tool's own import is reported instead)
        pass
    return tuple(types)


def run_cli(main: Callable[[], object], prog: Optional[str] = None) -> None:
    """Run ``main``; bad input (ValueError, KeyError, OSError, ... from the library, including damaged or foreign
    checkpoints) prints one ``prog: error: ...`` line and exits with status 2. Anything else is a bug and keeps
    its traceback."""
    prog = prog or os.path.basename(sys.argv[0])
    try:
        main()
    except Exception as e:
        if not isinstance(e, _input_error_types()):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        msg = " ".join(str(msg).split()) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        sys.exit(2)
