"""Shared helpers of the tools/ command-line scripts: import path, error reporting, size parsing."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1048576")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B")
    mult = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(float(m.group(1)) * mult)


#: --dtype choices of the tools (torch attribute names).
DTYPES = ("float32", "bfloat16", "float16")


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; configuration/data errors (and unreadable RL checkpoints) print one clear line and exit with
    status 2."""
    try:
        main()
    except Exception as e:
        from megatron_fp4.rl.checkpoint import CheckpointError

        if not isinstance(e, (ValueError, KeyError, FileNotFoundError, FileExistsError, NotImplementedError,
                              ImportError, CheckpointError)):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
