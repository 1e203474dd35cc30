"""Verifiable rewards: extract a final answer from a model response and compare it with the reference.

`score(response, reference, kind)` returns 1.0 when the response's final answer equals the reference's, else 0.0.

Answer extraction from the response, first hit wins (order depends on `kind`):
  gsm8k: "#### X" (last one), \\boxed{X} (last one, nested braces), "The answer is X", the last number.
  math:  \\boxed{X}, "#### X", "The answer is X", the last number.
The reference is the dataset's answer field: for "gsm8k" the text after the last "####" (the whole string if it
has none); for "math" the content of its last \\boxed{} if any, else the text after "####" if any, else the string.

Comparison: both sides are parsed to exact rationals (fractions.Fraction) when possible and compared exactly;
otherwise the normalized strings are compared. Normalization handles thousands separators (1,200 and 1{,}200),
currency ($, \\$), percent (50% == 50: the sign is dropped, not divided by 100), degrees, trailing periods,
units written after the number and separated by a space (18 dollars, 5\\text{ cm}), LaTeX spacing, \\text{},
\\left/\\right, leading "x =", fractions (3/4, \\frac{3}{4}, \\dfrac34, -\\frac{3}{4}, mixed 2\\frac{1}{2}),
decimals (5.00 == 5, .5 == 1/2), leading zeros, negative numbers (including the unicode minus) and markdown
bold (**18**). After a marker ("####", "answer is") a trailing equation keeps its right-hand side ("5 + 3 = 8").
When a response holds several markers of one kind, the LAST counts (as verl does): rollouts should stop at EOS
or a stop string so that a hallucinated follow-up question cannot override the answer.
Not handled: symbolic equivalence (\\frac{1}{\\sqrt3} vs \\frac{\\sqrt3}{3}), scientific notation, tuples/sets
compared element-wise (they fall back to string equality), and inexact decimals (0.333 != 1/3).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["VALID_KINDS", "score", "extract_answer", "extract_reference", "parse_number", "normalize_answer",
           "answers_match"]

VALID_KINDS = ("gsm8k", "math")

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
    """The model's final answer string from a response, or None when nothing answer-like is found."""
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
    """1.0 when the response's final answer equals the reference answer, else 0.0."""
    _check_kind(kind)
    return 1.0 if answers_match(extract_answer(response, kind), extract_reference(reference, kind)) else 0.0
