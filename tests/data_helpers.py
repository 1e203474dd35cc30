"""Where the tests find GSM8K (SPEC 6: ``../shared/data/gsm8k`` beside the checkout; this workspace's
``/work/shared`` first). A test that needs it skips where neither copy exists, as on a user's fresh clone."""

from __future__ import annotations

from pathlib import Path

import pytest

_CANDIDATES = (Path("/work/shared/data/gsm8k"), Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")


def gsm8k_file(split: str) -> Path:
    """The GSM8K ``split`` ("train" / "test") jsonl file; skips the calling test where there is none."""
    for d in _CANDIDATES:
        if (d / f"{split}.jsonl").exists():
            return d / f"{split}.jsonl"
    pytest.skip(f"GSM8K {split} split not found (looked in {', '.join(map(str, _CANDIDATES))})")
