"""Tests for megatron_fp4.rl.rewards: GSM8K gold solutions, shuffled pairings and each formatting case."""

import json
import random
from fractions import Fraction

import pytest

from megatron_fp4.rl.rewards import (VALID_KINDS, answers_match, extract_answer, extract_reference, parse_number,
                                     score)

from data_helpers import gsm8k_file


def _gsm8k_rows():
    return [json.loads(line) for line in gsm8k_file("test").read_text().splitlines() if line.strip()]


def test_all_gsm8k_gold_solutions_score_one():
    rows = _gsm8k_rows()
    assert len(rows) == 1319
    failures = [i for i, r in enumerate(rows) if score(r["answer"], r["answer"], "gsm8k") != 1.0]
    assert failures == []


def test_gsm8k_shuffled_pairing_scores_near_zero():
    rows = _gsm8k_rows()
    rng = random.Random(1234)
    perm = list(range(len(rows)))
    while True:  # a derangement: nobody keeps its own reference
        rng.shuffle(perm)
        if all(i != p for i, p in enumerate(perm)):
            break
    mean = sum(score(rows[i]["answer"], rows[p]["answer"], "gsm8k") for i, p in enumerate(perm)) / len(rows)
    assert mean < 0.05
    # The only matches left are genuine collisions of equal final answers.
    for i, p in enumerate(perm):
        if score(rows[i]["answer"], rows[p]["answer"], "gsm8k") == 1.0:
            a = parse_number(extract_reference(rows[i]["answer"], "gsm8k"))
            b = parse_number(extract_reference(rows[p]["answer"], "gsm8k"))
            assert a == b


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="gsm8k, math"):
        score("1", "1", "aime")
    assert VALID_KINDS == ("gsm8k", "math", "math_rule")


@pytest.mark.parametrize("response,reference,kind,expected", [
    # GSM8K "####" answers, commas, currency, trailing period, units
    ("So she makes 18 dollars.\n#### 18", "blah\n#### 18", "gsm8k", 1.0),
    ("#### $1,200.", "x\n#### 1200", "gsm8k", 1.0),
    ("#### 1,200", "x\n#### 1,200", "gsm8k", 1.0),
    ("#### 18 dollars", "#### 18", "gsm8k", 1.0),
    ("#### 17", "#### 18", "gsm8k", 0.0),
    # "#### " wins over an earlier different number and over "The answer is" in gsm8k
    ("The answer is 3.\n#### 4", "#### 4", "gsm8k", 1.0),
    # boxed with nested braces; latest box wins
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "0.75", "math_rule", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{\\dfrac{\\sqrt3}{2}}", "math_rule", 1.0),
    ("\\boxed{{7}}", "7", "math_rule", 1.0),
    ("\\boxed 7", "7", "math_rule", 1.0),
    ("\\fbox{12}", "12", "math_rule", 1.0),
    # math kind prefers boxed over ####; gsm8k kind prefers ####
    ("#### 5 and \\boxed{6}", "6", "math_rule", 1.0),
    ("#### 5 and \\boxed{6}", "#### 5", "gsm8k", 1.0),
    # "The answer is X"
    ("The answer is $1,200.", "#### 1200", "gsm8k", 1.0),
    ("Thus the final answer is 18 dollars per day.", "#### 18", "gsm8k", 1.0),
    ("The answer is 18 because 9*2=18", "#### 18", "gsm8k", 1.0),
    ("Answer: 42", "42", "math_rule", 1.0),
    ("answer = -3", "-3", "math_rule", 1.0),
    # last-number fallback (signs glued to a previous number are subtraction, not negation)
    ("16-3-4=9", "#### 9", "gsm8k", 1.0),
    ("she has 3 apples and buys 5 more, total 8", "#### 8", "gsm8k", 1.0),
    ("the temperature is -5 degrees", "-5", "math_rule", 1.0),
    ("no digits here", "#### 5", "gsm8k", 0.0),
    ("", "#### 5", "gsm8k", 0.0),
    # fractions
    ("\\boxed{3/4}", "0.75", "math_rule", 1.0),
    ("\\boxed{\\dfrac34}", "3/4", "math_rule", 1.0),
    ("\\boxed{\\tfrac{3}{4}}", "\\frac{6}{8}", "math_rule", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", "math_rule", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-1/2", "math_rule", 1.0),
    ("\\boxed{2\\frac{1}{2}}", "5/2", "math_rule", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.333", "math_rule", 0.0),
    # decimals, leading zeros, negatives, unicode minus, percent, degrees, LaTeX spacing
    ("\\boxed{5.00}", "5", "math_rule", 1.0),
    ("\\boxed{.5}", "1/2", "math_rule", 1.0),
    ("\\boxed{007}", "7", "math_rule", 1.0),
    ("answer: \u22123", "-3", "math_rule", 1.0),
    ("\\boxed{50\\%}", "50", "math_rule", 1.0),
    ("#### 50%", "#### 50", "gsm8k", 1.0),
    ("\\boxed{90^\\circ}", "90", "math_rule", 1.0),
    ("\\boxed{1{,}000}", "1000", "math_rule", 1.0),
    ("\\boxed{1\\,000}", "1000", "math_rule", 1.0),
    ("\\boxed{\\$18.00}", "18", "math_rule", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", "math_rule", 1.0),
    ("\\boxed{\u20ac12}", "12", "math_rule", 1.0),
    ("The answer is Rs. 250.", "#### 250", "gsm8k", 1.0),
    ("\\boxed{rst}", "t", "math_rule", 0.0),
    ("\\boxed{x = 5}", "5", "math_rule", 1.0),
    # markdown bold, equations after the marker, $-delimited boxes
    ("The answer is: **18**", "#### 18", "gsm8k", 1.0),
    ("#### **1,200**", "#### 1200", "gsm8k", 1.0),
    ("The answer is 5 + 3 = 8.", "#### 8", "gsm8k", 1.0),
    ("#### 9 * 2 = 18", "#### 18", "gsm8k", 1.0),
    ("The final answer is $\\boxed{18}$.", "#### 18", "gsm8k", 1.0),
    # non-numeric answers: normalized string comparison
    ("\\boxed{\\text{(B)}}", "(B)", "math_rule", 1.0),
    ("\\boxed{x^2+1}", "x^2 + 1", "math_rule", 1.0),
    ("\\boxed{\\left(1,2\\right)}", "(1, 2)", "math_rule", 1.0),
    ("\\boxed{2x}", "2", "math_rule", 0.0),
    ("\\boxed{\\pi}", "\\boxed{2\\pi}", "math_rule", 0.0),
])
def test_formatting_cases(response, reference, kind, expected):
    """The exact graders (gsm8k, math_rule): every formatting case."""
    assert score(response, reference, kind) == expected


def test_extraction_and_parsing_details():
    assert extract_answer("text \\boxed{\\frac{a}{\\sqrt{b}}} tail", "math") == "\\frac{a}{\\sqrt{b}}"
    assert extract_answer("nothing", "gsm8k") is None
    assert extract_reference("work\n#### 1,234", "gsm8k") == "1,234"
    assert extract_reference("\\boxed{12}", "math") == "12"
    assert extract_reference("12", "math") == "12"
    assert parse_number("1,234.50") == Fraction(246_9, 2)
    assert parse_number("1,2345") is None  # not a thousands grouping
    assert parse_number("\\frac{3}{0}") is None
    assert parse_number("3 apples") == 3
    assert parse_number("3apples") is None  # units must be separated (so "2x" is not 2)
    assert not answers_match(None, "1")
    assert not answers_match("", "")


_FORMATS = ["#### {v}", "#### {c}", "#### ${c}", "#### {v}.00", "The answer is {c}.", "The answer is ${v} dollars.",
            "so \\boxed{{{v}}}", "\\boxed{{{c}}}", "\\boxed{{\\${v}}}", "work 1 2 3 ... total {v}", "answer: **{v}**"]


@pytest.mark.parametrize("fmt", _FORMATS)
def test_property_same_value_any_format(fmt):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.integers(min_value=-10**9, max_value=10**9))
    def check(v):
        resp = fmt.format(v=v, c=f"{v:,}")
        assert score(resp, f"solution\n#### {v}", "gsm8k") == 1.0, resp
        assert score(resp, f"solution\n#### {v + 1}", "gsm8k") == 0.0, resp
        assert score(resp, str(v), "math_rule") == 1.0, resp

    check()


# ---------------------------------------------------------------- math-verify (kind "math") and --custom-rm-path


@pytest.mark.parametrize("response,reference,expected", [
    ("so \\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),          # LaTeX-equivalent answers score as math-verify does
    ("\\boxed{1000}", "10^{3}", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt3}}", "\\boxed{\\frac{\\sqrt3}{3}}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("The answer is 18", "18", 1.0),
    ("\\boxed{\\frac{\\pi}{3}}", "\\pi/2", 0.0),
    ("\\boxed{999}", "10^{3}", 0.0),
    ("no answer here", "7", 0.0),
    ("Natalia sold 72 clips.\n#### 72", "She sold 48 + 24 = 72.\n#### 72", 1.0),  # "####": the exact GSM8K grader
])
def test_math_kind_is_math_verify(response, reference, expected):
    pytest.importorskip("math_verify")
    assert score(response, reference, "math") == expected


def test_math_rule_kind_keeps_the_exact_grader():
    # what kind "math" meant before math-verify: no symbolic equivalence
    assert score("so \\boxed{\\frac{\\pi}{2}}", "\\pi/2", "math_rule") == 0.0
    assert score("\\boxed{1000}", "10^{3}", "math_rule") == 0.0
    assert score("\\boxed{1000}", "1,000", "math_rule") == 1.0


@pytest.mark.parametrize("kind", ["gsm8k", "math"])
def test_gsm8k_gold_and_shuffled_under_both_kinds(kind):
    """The GSM8K test split scores 1.0 on gold answers and ~0 on a shuffled pairing, whichever kind grades it."""
    if kind == "math":
        pytest.importorskip("math_verify")
    rows = _gsm8k_rows()
    assert sum(score(r["answer"], r["answer"], kind) for r in rows) == len(rows)
    shuffled = [r["answer"] for r in rows]
    random.Random(7).shuffle(shuffled)
    assert sum(score(a, r["answer"], kind) for a, r in zip(shuffled, rows)) / len(rows) < 0.05


def test_custom_reward_functions_sync_async_and_group():
    from megatron_fp4.rl.rewards import RewardFunction, RewardSample, load_function

    samples = [RewardSample(prompt="p", response=f"the answer is {i}", label="2", response_length=i, index=i)
               for i in range(4)]
    refs, kinds = ["2"] * 4, ["math_rule"] * 4
    assert RewardFunction()(samples, refs, kinds) == [0.0, 0.0, 1.0, 0.0]  # built in: score() per kind
    assert RewardFunction("custom_rewards.response_length")(samples, refs, kinds) == [0.0, 1.0, 2.0, 3.0]
    assert RewardFunction("custom_rewards.label_in_response")(samples, refs, kinds) == [0.0, 0.0, 1.0, 0.0]
    group = RewardFunction("custom_rewards.rank_in_group", group_rm=True)
    assert group(samples, refs, kinds, group_size=2) == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="custom_rewards.not_a_number returned 'high' for sample 0; expected a "
                                         "finite number"):
        RewardFunction("custom_rewards.not_a_number")(samples, refs, kinds)
    with pytest.raises(ValueError, match="returned .* for a group of 4; expected a list of 4 numbers"):
        RewardFunction("custom_rewards.one_number_per_group", group_rm=True)(samples, refs, kinds, group_size=4)
    with pytest.raises(AttributeError, match="has no function 'nope'"):
        load_function("custom_rewards.nope")
    with pytest.raises(ValueError, match="expected module.path.function"):
        load_function("justaname")
