# Tests for agents/graders.py: extraction, normalisation and equivalence on tables of positive and negative cases.
import time

import pytest

from agents import graders


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{7}.", "7"),
    ("first \\boxed{3}, then corrected: \\boxed{ 5 }", "5"),                 # the last one wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                               # nested braces kept
    ("\\fbox{42}", "42"),
    ("\\boxed{8} and a cut-off \\boxed{\\frac{1}{", "8"),                    # last *balanced* one
    ("\\boxed {x^{2}}", "x^{2}"),
    ("The answer is \\boxed{}.", ""),                                       # empty, but present
    ("no box here, just 7", None),
    ("\\boxed{unclosed", None),
])
def test_extract_boxed_takes_the_last_balanced_box(text, expected):
    assert graders.extract_boxed(text) == expected


def test_extract_answer_tag_takes_the_last_tag():
    assert graders.extract_answer_tag("<answer>3</answer> wait <answer>\n 4 \n</answer>") == "4"
    assert graders.extract_answer_tag("<answer>3") is None


@pytest.mark.parametrize("text, expected", [
    ("<answer>9</answer> \\boxed{7}", "7"),                                  # 1. boxed beats the tag
    ("The answer is \\boxed{}. <answer>6</answer>", "6"),                    # empty box counts as absent
    ("Sam has 3 + 4 = 7 apples.\nThe final answer is 7.", "7"),              # 3. "answer is"
    ("The final answer is 14 + 4 = 18.", "18"),                              # after the last '='
    ("The answer is: 1,000 apples", "1,000 apples"),                         # unit words go in normalize
    ("The answer is 7, because 3 + 4 = 7", "7"),
    ("Answer: x^2", "x^2"),                                                 # no number: the sentence
    ("Sam has 7 - 2 = 5 apples left.", "5"),                                 # 4. last number
    ("I am not sure.", None),
    ("", None),
])
def test_extract_final_answer_tries_box_tag_phrase_then_last_number(text, expected):
    assert graders.extract_final_answer(text) == expected


@pytest.mark.parametrize("raw, normalized", [
    (" $7$. ", "7"), ("1,000", "1000"), ("x = 7", "7"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("90^\\circ", "90"), ("50\\%", "50"), ("\\text{7 apples}", "7"), ("2\\pi", "2\\pi"), ("1,2", "1,2"),
])
def test_normalize_answer(raw, normalized):
    assert graders.normalize_answer(raw) == normalized


@pytest.mark.parametrize("prediction, label", [
    ("7", "7"), ("7.0", "7"), ("7.00", "7"), ("\\frac{14}{2}", "7"), ("14/2", "7"), ("1,000", "1000"),
    ("-\\frac{1}{3}", "-1/3"), ("0.5", "\\frac{1}{2}"), (".5", "1/2"), ("x=7", "7"), ("$7$", "7"),
    ("7 apples", "7"), ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"), ("2x+2", "2(x+1)"), ("x^2 - 1", "(x-1)(x+1)"),
    ("2\\pi", "\\pi \\cdot 2"), ("(1, 2)", "(1,2)"), ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
    # geo3k: exact radicals and multiples of pi, and their correct roundings (a tool computed them)
    ("\\sqrt{52}", "2 \\sqrt{13}"), ("7.21", "2 \\sqrt{13}"), ("7.2111", "2\\sqrt{13}"), ("31.42", "10 \\pi"),
    ("2\\sqrt{13}", "7.21"), ("70^{\\circ}", "70"), ("4\\sqrt{3}", "\\sqrt{48}"),
])
def test_equivalent_answers_are_accepted(prediction, label):
    assert graders.is_equivalent(prediction, label)
    assert graders.grade(f"So the result is \\boxed{{{prediction}}}.", label) == 1.0


@pytest.mark.parametrize("prediction, label", [
    ("8", "7"), ("7.01", "7"), ("0.333", "1/3"), ("-7", "7"), ("70", "7"), ("1,2", "12"), ("(2, 1)", "(1, 2)"),
    ("x+1", "x+2"), ("", "7"), (None, "7"), ("seven", "7"), ("\\frac{1}{0}", "7"), ("1/0", "1/0x"),
    ("7.2", "2\\sqrt{13}"), ("7.22", "2\\sqrt{13}"), ("7.21", "7.2111"), ("31.41", "10\\pi"), ("0.33", "1/3"),
])
def test_different_answers_are_rejected(prediction, label):
    assert not graders.is_equivalent(prediction, label)


@pytest.mark.parametrize("garbage", [
    "\\frac{", "}{", "((((((((", "9^9^9^9^9^9", "((9^64)^64)^64^64", "__import__('os').system('echo')",
    "x" * 10_000, "\\sqrt[3]{8}", "1/(x-x)", "i^i^i", "😀", "\\boxed{\\boxed{", "\x00",
])
def test_garbage_never_raises_and_is_fast(garbage):
    start = time.perf_counter()
    assert graders.grade(garbage, "7") == 0.0
    assert graders.is_equivalent(garbage, garbage + "+1") is False
    assert time.perf_counter() - start < 2.0


def test_grade_on_realistic_smollm2_responses():
    # responses seen from SmolLM2-135M-Instruct on data.arithmetic_tasks prompts
    assert graders.grade("Sam has 9 + 8 = 17 apples.\nThe final answer is 17.", "17") == 1.0
    assert graders.grade("Sam has 14 apples, and 4 apples are left.\n\nThe final answer is 14 + 4 = 18.", "10") == 0.0
    assert graders.grade("Sam has 7 - 2 = 5 apples left. The answer is \\boxed{5}", "5") == 1.0
    assert graders.grade("so 7 + 7 = 14 apples.\n\nThe answer is \\boxed{}.", "14") == 0.0  # the phrase holds no number
