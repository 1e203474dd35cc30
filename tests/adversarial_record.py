"""The record of every adversarial case the tools' tests try (issue 24's closing table), and the helpers that judge
them: "clear error or correct result", and nothing lost.

Each case is recorded with its suite, its kind and its outcome: ``clear_error`` (one of the library's input-error
types naming the file or argument, or a CLI's single ``error:`` line with status 2), ``correct`` (the result equals
the reference), ``silent_wrong`` or ``data_loss`` (both fail the test that saw them). With
``MEGATRON_FP4_ADVERSARIAL_SUMMARY=PATH`` set, the counts are written to PATH (JSON) when the test process exits:

    MEGATRON_FP4_ADVERSARIAL_SUMMARY=/tmp/adv.json python -m pytest -q tests/test_tools_integrity.py \\
        tests/test_fuzz_tools.py && python tests/adversarial_record.py /tmp/adv.json
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Optional

OUTCOMES = ("clear_error", "correct", "silent_wrong", "data_loss")
_CASES: Counter = Counter()


def record(suite: str, kind: str, outcome: str) -> None:
    """Count one adversarial case."""
    assert outcome in OUTCOMES, outcome
    _CASES[(suite, kind, outcome)] += 1


def input_error_types() -> tuple[type, ...]:
    """What the library raises for bad or damaged input (the types tools/_common.run_cli reports as one line)."""
    from megatron_fp4.rl.checkpoint import CheckpointError

    return (ValueError, KeyError, OSError, NotImplementedError, CheckpointError)


def is_clear(exc: BaseException, names: Iterable[object]) -> bool:
    """An input-error type whose message names one of ``names`` (files, folders or flags)."""
    if not isinstance(exc, input_error_types()):
        return False
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return any(str(n) in str(msg) for n in names)


def tree_digest(root: os.PathLike, skip: Callable[[Path], bool] = lambda p: False) -> dict[str, str]:
    """{relative path: sha256 of the bytes (or "<dir>")} of everything under ``root`` (what "nothing lost" compares)."""
    root = Path(root)
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        if skip(p):
            continue
        rel = str(p.relative_to(root))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli_inprocess(module, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of a tools/ script's ``main(argv)`` run through its ``run_cli``, in this process."""
    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(buf):
        try:
            module.run_cli(lambda: module.main(argv), module.PROG)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, buf.getvalue()


def one_error_line(prog: str, stderr: str) -> Optional[str]:
    """The single ``prog: error: ...`` line of a failed tool's stderr (its last line; a progress bar may come
    before it), or None when stderr is anything else (several error lines, a traceback, another format)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    if (not lines or len(errors) != 1 or "Traceback" in stderr or errors[0] is not lines[-1]
            or not lines[-1].startswith(f"{prog}: error: ")):
        return None
    return lines[-1]


def summary(cases: Optional[Counter] = None) -> dict:
    """{"total": {...}, "by_suite": {suite: {...}}, "kinds": {suite: [kinds]}} of the recorded cases."""
    cases = _CASES if cases is None else cases
    total = {o: 0 for o in OUTCOMES}
    by_suite: dict[str, dict[str, int]] = {}
    kinds: dict[str, set] = {}
    for (suite, kind, outcome), n in cases.items():
        total[outcome] += n
        by_suite.setdefault(suite, {o: 0 for o in OUTCOMES})[outcome] += n
        kinds.setdefault(suite, set()).add(kind)
    total["cases"] = sum(total[o] for o in OUTCOMES)
    for s in by_suite.values():
        s["cases"] = sum(s[o] for o in OUTCOMES)
    return {"total": total, "by_suite": by_suite, "kinds": {s: sorted(k) for s, k in sorted(kinds.items())},
            "by_kind": {f"{s} / {k}": {o: cases.get((s, k, o), 0) for o in OUTCOMES}
                        for s, k in sorted({(s, k) for s, k, _ in cases})}}


def _dump() -> None:
    path = os.environ.get("MEGATRON_FP4_ADVERSARIAL_SUMMARY")
    if not path or not _CASES:
        return
    old: Counter = Counter()
    if os.path.isfile(path):  # several pytest processes (or files run separately) add up
        for row in json.loads(Path(path).read_text()).get("rows", []):
            old[(row["suite"], row["kind"], row["outcome"])] += row["n"]
    old.update(_CASES)
    rows = [{"suite": s, "kind": k, "outcome": o, "n": n} for (s, k, o), n in sorted(old.items())]
    Path(path).write_text(json.dumps({"summary": summary(old), "rows": rows}, indent=1) + "\n")


atexit.register(_dump)


def table(path: str) -> str:
    """The closing table of a summary file (markdown), with the kinds of case of each suite."""
    doc = json.loads(Path(path).read_text())
    s = doc["summary"]
    lines = ["| suite | cases | clear errors | correct results | silent wrong results | data losses |",
             "|---|---|---|---|---|---|"]
    for suite, c in sorted(s["by_suite"].items()) + [("**total**", s["total"])]:
        lines.append(f"| {suite} | {c['cases']} | {c['clear_error']} | {c['correct']} | {c['silent_wrong']} | "
                     f"{c['data_loss']} |")
    lines += ["", "Kinds of case (suite: kinds; `a -> b` = input kind -> output folder kind):", ""]
    for suite, kinds in s["kinds"].items():
        lines.append(f"- {suite} ({len(kinds)}): " + "; ".join(kinds))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
