"""Verifiable rewards: extract a final answer from a model response and compare it with the reference; or a
user's reward function (``--custom-rm-path``, called as slime calls it).

`score(response, reference, kind)` returns 1.0 when the response's final answer equals the reference's, else 0.0.
Kinds:
  gsm8k:     the project's exact grader, "####" answers first (below).
  math:      math-verify (PyPI ``math-verify``, as verl, NeMo-RL and Megatron-LM RL use it): symbolic and LaTeX
             equivalence (\\frac{\\pi}{2} == \\pi/2, 10^{3} == 1000, intervals, sets). A reference holding "####" is
             a GSM8K answer and is graded exactly as kind "gsm8k" is. Needs ``pip install math-verify``.
  math_rule: the project's exact grader, \\boxed{} answers first (what kind "math" meant before math-verify; the
             synthetic tasks use it: no dependency, exact).

The exact grader's answer extraction from the response, first hit wins (order depends on `kind`):
  gsm8k:     "#### X" (last one), \\boxed{X} (last one, nested braces), "The answer is X", the last number.
  math_rule: \\boxed{X}, "#### X", "The answer is X", the last number.
The reference is the dataset's answer field: for "gsm8k" the text after the last "####" (the whole string if it
has none); for "math_rule" the content of its last \\boxed{} if any, else the text after "####" if any, else the
string.

Comparison: both sides are parsed to exact rationals (fractions.Fraction) when possible and compared exactly;
otherwise the normalized strings are compared. Normalization handles thousands separators (1,200 and 1{,}200),
currency ($, \\$), percent (50% == 50: the sign is dropped, not divided by 100), degrees, trailing periods,
units written after the number and separated by a space (18 dollars, 5\\text{ cm}), LaTeX spacing, \\text{},
\\left/\\right, leading "x =", fractions (3/4, \\frac{3}{4}, \\dfrac34, -\\frac{3}{4}, mixed 2\\frac{1}{2}),
decimals (5.00 == 5, .5 == 1/2), leading zeros, negative numbers (including the unicode minus) and markdown
bold (**18**). After a marker ("####", "answer is") a trailing equation keeps its right-hand side ("5 + 3 = 8").
When a response holds several markers of one kind, the LAST counts (as verl does): rollouts should stop at EOS
or a stop string so that a hallucinated follow-up question cannot override the answer.
Not handled by the exact grader (kind "math" handles them): symbolic equivalence (\\frac{1}{\\sqrt3} vs
\\frac{\\sqrt3}{3}), scientific notation, tuples/sets
compared element-wise (they fall back to string equality), and inexact decimals (0.333 != 1/3).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

__all__ = ["VALID_KINDS", "score", "extract_answer", "extract_reference", "parse_number", "normalize_answer",
           "answers_match", "math_verify_score", "require_math_verify", "load_function", "RewardSample",
           "RewardFunction"]

VALID_KINDS = ("gsm8k", "math", "math_rule")

# An unsigned number: 1,234,567.89 | 1234.5 | 12. | .5
_UNUM = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)"
_NUM_RE = re.compile(rf"[+-]?{_UNUM}")
_FULL_NUM_RE = re.compile(rf"^([+-]?)\s*({_UNUM})$")
_FULL_SLASH_FRAC_RE = re.compile(rf"^([+-]?)\s*\(?\s*([+-]?{_UNUM})\s*/\s*([+-]?{_UNUM})\s*\)?$")
# A number followed by whitespace and a unit made of words (no digits, no operators): "18 dollars per day".
_NUM_UNIT_RE = re.compile(rf"^([+-]?\s*{_UNUM})\s+[A-Za-z][A-Za-z\s.'/-]*$")
# Tokens for the last-number fallback: a minus sign counts only when not glued to a preceding word/number.
_LAST_NUM_RE = re.compile(rf"(?<![\w)\]}}.])(-?)({_UNUM}(?:/\d+(?!\.\d))?)")
_HASHES_RE = re.compile(r"####")
_ANSWER_IS_RE = re.compile(r"(?i)\banswer\s*(?:is|:|=)\s*:?\s*")
_LEADING_VAR_RE = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=\S)")
_CURRENCY_PREFIX_RE = re.compile(r"^(?:(?:usd|inr|eur|rs)\b\.?|€|£|¥)\s*", re.IGNORECASE)
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{")


def _match_brace(s: str, open_idx: int) -> int:
    """Index of the '}' matching the '{' at open_idx, or -1 when unbalanced."""
    depth = 0
    for i in range(open_idx, len(s)):
        c = s[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _last_boxed(s: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces) or \\boxed X; None when absent."""
    idx = max(s.rfind("\\boxed"), s.rfind("\\fbox"))
    while idx >= 0:
        j = idx + (6 if s.startswith("\\boxed", idx) else 5)
        while j < len(s) and s[j] == " ":
            j += 1
        if j < len(s) and s[j] == "{":
            end = _match_brace(s, j)
            if end > 0:
                return s[j + 1:end].strip()
        elif j < len(s) and j > idx + 5 and s[j - 1] == " ":  # "\boxed 5"
            m = re.match(r"[^\s$]+", s[j:])
            if m:
                return m.group(0)
        # malformed: try an earlier one
        idx = max(s.rfind("\\boxed", 0, idx), s.rfind("\\fbox", 0, idx))
    return None


def _after_hashes(s: str) -> str | None:
    """Text after the last '####' up to the end of its line; None when absent or empty."""
    idx = s.rfind("####")
    if idx < 0:
        return None
    rest = s[idx + 4:].split("\n", 1)[0].strip()
    return _segment_answer(rest) if rest else None


def _segment_answer(seg: str) -> str:
    """The answer in a segment after a marker: the whole segment if it parses, else a leading number."""
    if parse_number(seg) is not None:
        return seg
    if "=" in seg:  # "The answer is 5 + 3 = 8" -> "8"
        tail = seg.rsplit("=", 1)[1].strip()
        if tail and parse_number(tail) is not None:
            return tail
    # "The answer is $18 because ..." -> the number right at the start of the segment.
    lead = re.match(rf"^(?:\\?\$|usd\s*)?\s*([+-]?{_UNUM})(?![\w^/])", seg, re.IGNORECASE)
    return lead.group(1) if lead else seg


def _answer_is(s: str) -> str | None:
    """Text after the last 'answer is' / 'answer:' up to the end of the line or sentence."""
    matches = list(_ANSWER_IS_RE.finditer(s))
    for m in reversed(matches):
        seg = s[m.end():].split("\n", 1)[0]
        seg = re.split(r"\.(?=\s+[A-Z(]|\s*$)", seg, maxsplit=1)[0].strip()  # sentence end, not "Rs. 5"
        if seg:
            return _segment_answer(seg)
    return None


def _last_number(s: str) -> str | None:
    """The last number in the text (with sign, thousands separators, decimals or a/b), or None."""
    s = s.replace("\u2212", "-")
    found = None
    for m in _LAST_NUM_RE.finditer(s):
        found = m.group(1) + m.group(2)
    return found


def _strip_text_cmds(s: str) -> str:
    """Replace \\text{...} and friends by ' ...' (keeping their contents)."""
    while True:
        m = _TEXT_CMD_RE.search(s)
        if not m:
            return s
        end = _match_brace(s, m.end() - 1)
        if end < 0:
            return s[:m.start()] + " " + s[m.end():]
        s = s[:m.start()] + " " + s[m.end():end] + " " + s[end + 1:]


def _clean(s: str) -> str:
    """Formatting-only normalization shared by numeric parsing and string comparison."""
    s = s.replace("\u2212", "-").replace("\u2013", "-").replace("\u00a0", " ")
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\;", " ").replace("\\:", " ")
    s = s.replace("\\ ", " ").replace("~", " ").replace("**", "")  # LaTeX spaces, markdown bold
    s = _strip_text_cmds(s)
    for tok in ("\\left", "\\right", "\\displaystyle", "\\$", "$", "\\%", "%", "^{\\circ}", "^\\circ", "\u00b0",
                "\\(", "\\)", "\\[", "\\]"):
        s = s.replace(tok, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.strip()
    while True:
        prev = s
        s = s.rstrip(" .;,").strip()
        if len(s) >= 2 and s[0] == "{" and _match_brace(s, 0) == len(s) - 1:
            s = s[1:-1].strip()
        if s == prev:
            break
    s = _CURRENCY_PREFIX_RE.sub("", s)
    s = _LEADING_VAR_RE.sub("", s)
    return s.strip()


def _unum(s: str) -> Fraction | None:
    """Exact value of a plain signed decimal string (commas as thousands separators), or None."""
    m = _FULL_NUM_RE.match(s.strip())
    if not m:
        return None
    body = m.group(2).replace(",", "")
    if body.endswith("."):
        body = body[:-1]
    value = Fraction(body)
    return -value if m.group(1) == "-" else value


def _parse_latex_frac(s: str) -> Fraction | None:
    """Value of [sign][whole]\\frac{a}{b} where a and b are numbers, or None."""
    m = re.match(r"^([+-]?)\s*(\d+)?\s*\\frac\s*\{", s)
    if not m:
        return None
    a_open = m.end() - 1
    a_end = _match_brace(s, a_open)
    if a_end < 0 or a_end + 1 >= len(s) or s[a_end + 1] != "{":
        return None
    b_end = _match_brace(s, a_end + 1)
    if b_end != len(s) - 1:
        return None
    num = parse_number(s[a_open + 1:a_end])
    den = parse_number(s[a_end + 2:b_end])
    if num is None or den is None or den == 0:
        return None
    value = num / den
    if m.group(2) is not None:  # mixed number 2\frac{1}{2}
        if value < 0:
            return None
        value = int(m.group(2)) + value
    return -value if m.group(1) == "-" else value


def parse_number(text: str) -> Fraction | None:
    """Exact rational value of an answer string, or None when it is not a single number."""
    s = _clean(text)
    if not s:
        return None
    v = _unum(s)
    if v is not None:
        return v
    m = _FULL_SLASH_FRAC_RE.match(s)
    if m:
        num, den = _unum(m.group(2)), _unum(m.group(3))
        if num is not None and den is not None and den != 0:
            return -(num / den) if m.group(1) == "-" else num / den
    v = _parse_latex_frac(s)
    if v is not None:
        return v
    m = _NUM_UNIT_RE.match(s)
    if m:
        return _unum(m.group(1).replace(" ", ""))
    return None


def normalize_answer(text: str) -> str:
    """Canonical string form used when an answer is not numeric (lowercase, no whitespace)."""
    s = _clean(text)
    s = re.sub(r"\s+", "", s).lower()
    return s


def answers_match(pred: str | None, ref: str | None) -> bool:
    """Numeric (exact rational) comparison when both parse, else normalized string equality."""
    if pred is None or ref is None:
        return False
    p, r = parse_number(pred), parse_number(ref)
    if p is not None and r is not None:
        return p == r
    np_, nr = normalize_answer(pred), normalize_answer(ref)
    return bool(np_) and np_ == nr


def _check_kind(kind: str) -> None:
    if kind not in VALID_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; valid kinds: {', '.join(VALID_KINDS)}")


def extract_answer(response: str, kind: str) -> str | None:
    """The model's final answer string from a response (the exact grader's extraction), or None when nothing
    answer-like is found."""
    _check_kind(kind)
    if not response:
        return None
    order = (_after_hashes, _last_boxed) if kind == "gsm8k" else (_last_boxed, _after_hashes)
    for fn in (*order, _answer_is, _last_number):
        ans = fn(response)
        if ans is not None and ans.strip():
            return ans
    return None


def extract_reference(reference: str, kind: str) -> str:
    """The gold final answer from a dataset answer field."""
    _check_kind(kind)
    if kind == "gsm8k":
        ans = _after_hashes(reference)
        return ans if ans is not None else reference.strip()
    ans = _last_boxed(reference)
    if ans is None:
        ans = _after_hashes(reference)
    return ans if ans is not None else reference.strip()


def score(response: str, reference: str, kind: str) -> float:
    """1.0 when the response's final answer equals the reference answer, else 0.0 (see the module docstring)."""
    _check_kind(kind)
    if kind == "math":
        return math_verify_score(response, reference)
    return 1.0 if answers_match(extract_answer(response, kind), extract_reference(reference, kind)) else 0.0


# -- math-verify ------------------------------------------------------------------------------------------------------
def require_math_verify(flag: str = "kind 'math'") -> Any:
    """The math_verify module; ValueError naming ``flag`` and the install command when it is missing."""
    try:
        import math_verify
    except ImportError:
        raise ValueError(f"{flag} scores answers with math-verify, which is not installed: pip install math-verify "
                         f"(or pip install -e .[rl]); --rm-type math_rule is the exact rule grader without "
                         f"it") from None
    return math_verify


def math_verify_score(response: str, reference: str) -> float:
    """math-verify's verdict on the response's final answer against the reference: 1.0 or 0.0.

    A reference holding "####" is a GSM8K answer: graded exactly (kind "gsm8k"). Otherwise the gold answer is the
    reference's last \\boxed{} content (else the text after "####", else the whole string) parsed as
    ``\\boxed{gold}``, as verl does; a gold answer math-verify cannot parse falls back to the exact rule grader."""
    if "####" in reference:
        return score(response, reference, "gsm8k")
    mv = require_math_verify()
    timeout = 5 if threading.current_thread() is threading.main_thread() else None  # signal.alarm: main thread only
    gold_text = extract_reference(reference, "math_rule")
    gold = mv.parse("\\boxed{" + gold_text + "}", parsing_timeout=timeout)
    if not gold:
        return score(response, reference, "math_rule")
    pred = mv.parse(response, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=timeout) else 0.0


# -- --custom-rm-path -------------------------------------------------------------------------------------------------
def load_function(path: str) -> Callable:
    """The function ``module.path.function`` (slime's spelling of --custom-rm-path); errors say what is missing."""
    module_name, dot, name = path.rpartition(".")
    if not dot or not module_name or not name:
        raise ValueError(f"{path!r} is not valid; expected module.path.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"module {module_name!r} has no function {name!r}")
    return fn


@dataclass
class RewardSample:
    """One scored response, with the attribute names of slime's ``Sample`` that a reward function reads."""

    prompt: str
    response: str
    label: Any
    metadata: dict = field(default_factory=dict)
    index: int = 0                 # position in the batch
    group_index: int = 0           # which prompt's group it belongs to
    response_length: int = 0       # tokens
    status: str = "completed"      # "completed" (stopped) or "truncated" (hit the length limit)
    tokens: Sequence[int] = ()     # prompt + response token ids
    reward: Optional[float] = None


class RewardFunction:
    """Scores batches of :class:`RewardSample`: with ``--custom-rm-path`` the user's function, called as slime calls it
    (``fn(args, sample)`` per sample, or ``fn(args, samples)`` per group with ``group_rm``; sync or async, the
    coroutines of a batch run concurrently); otherwise :func:`score` with each sample's kind."""

    def __init__(self, custom_rm_path: Optional[str] = None, group_rm: bool = False, args: Any = None) -> None:
        self.path, self.group_rm, self.args = custom_rm_path, group_rm, args
        self.fn = load_function(custom_rm_path) if custom_rm_path else None

    def __call__(self, samples: Sequence[RewardSample], references: Sequence[str], kinds: Sequence[str],
                 group_size: int = 1) -> list[float]:
        """Rewards of ``samples`` (``references``/``kinds`` feed the built-in graders; groups are contiguous)."""
        if self.fn is None:
            return [score(s.response, ref, kind) for s, ref, kind in zip(samples, references, kinds)]
        if self.group_rm:
            groups = [list(samples[i:i + group_size]) for i in range(0, len(samples), group_size)]
            out = self._resolve([self.fn(self.args, g) for g in groups])
            values = []
            for g, got in zip(groups, out):
                if not isinstance(got, (list, tuple)) or len(got) != len(g):
                    raise ValueError(f"--custom-rm-path {self.path} with --group-rm returned {got!r} for a group of "
                                     f"{len(g)}; expected a list of {len(g)} numbers")
                values += list(got)
        else:
            values = self._resolve([self.fn(self.args, s) for s in samples])
        return [self._check(v, i) for i, v in enumerate(values)]

    @staticmethod
    def _resolve(results: list) -> list:
        """Await the coroutines among ``results`` together (one event loop per batch)."""
        if not any(inspect.isawaitable(r) for r in results):
            return results

        async def gather():
            return await asyncio.gather(*[r if inspect.isawaitable(r) else _done(r) for r in results])

        return asyncio.run(gather())

    def _check(self, value: Any, index: int) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v):
            raise ValueError(f"--custom-rm-path {self.path} returned {value!r} for sample {index}; expected a "
                             f"finite number")
        return v


async def _done(value: Any) -> Any:
    return value
