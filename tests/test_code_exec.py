# The code_exec judge, attacked the way a policy searching for reward would attack it: every way a wrong add()
# could claim the hidden tests (reading the grader's frame, rewriting sys.__stdout__, an object equal to
# everything, printed result lines, a patched json) scores what the function earns and no more, and every way to
# break the judge (an early exit, a test that never returns, a signal, closed stdout, raising or recursing
# __eq__/__repr__, results too big or too deep) costs the tests not yet done, never the grader. Each call runs the
# judge for real, in the sandbox.
import secrets
import sys

from agents.sandbox import SandboxLimits
from recipes import code_exec
from recipes.code_exec import Outcome, run_hidden_tests

ADD = [((2, 3), 5), ((-1, 1), 0), ((10, 32), 42)]     # the add problem's hidden tests
WRONG = "def add(a, b):\n    return a - b\n"            # scores 0 of 3 honestly (a - b is none of 5, 0, 42)
CORRECT = "def add(a, b):\n    return a + b\n"
# a wrong add() that looks through the grader's frames for what would pass: the tally line's format (its tag
# included) to print as 3 of 3, and the test's expected result to return
FORGE_FROM_FRAMES = """
import os, re, sys

def forge(a, b):
    frame = sys._getframe(1)
    while frame is not None:
        for const in frame.f_code.co_consts:
            if isinstance(const, str) and re.fullmatch(r"\\n[0-9a-f]{16} %d\\n", const):
                os.write(1, (const % 3).encode())
        for key, value in {**frame.f_globals, **frame.f_locals}.items():
            if "expected" in key:
                return value
        frame = frame.f_back
    return a - b
"""
# looks everywhere in its own process for a string the grader expects as an answer: the program file, every
# object the collector knows of and what they hold, every frame's variables; returns the first it finds
SEARCH_FOR_THE_ANSWER = """
import gc, re, sys
PATTERN = re.compile("judge-secret-" + "[0-9a-f]{32}")

def everything():
    try:
        yield open(sys.argv[0]).read()
    except OSError:
        pass
    for obj in gc.get_objects():
        yield repr(obj) if isinstance(obj, (tuple, list, dict)) else ""
        yield from (ref for ref in gc.get_referents(obj) if isinstance(ref, str))
    frame = sys._getframe()
    while frame is not None:
        yield repr(frame.f_locals) + repr(frame.f_globals)
        frame = frame.f_back

def find():
    return next((found.group() for text in everything() if (found := PATTERN.search(text))), "")
"""


def test_a_correct_function_scores_every_test_and_a_wrong_one_none():
    assert run_hidden_tests(CORRECT, "add", ADD) == (3, "")
    assert run_hidden_tests(WRONG, "add", ADD) == (0, "")
    assert run_hidden_tests("def add(a, b):\n    return 5\n", "add", ADD) == (1, "")   # the public example only


def test_reading_the_graders_frames_forges_nothing():
    assert run_hidden_tests(FORGE_FROM_FRAMES + "def add(a, b):\n    return forge(a, b)\n", "add", ADD)[0] == 0
    # the tally alone: printed, then out before the grader's own
    code = FORGE_FROM_FRAMES + "def add(a, b):\n    forge(a, b)\n    os._exit(0)\n"
    assert run_hidden_tests(code, "add", ADD)[0] == 0


def test_the_expected_results_never_enter_the_process_that_runs_the_code():
    tests = [((), f"judge-secret-{secrets.token_hex(16)}")]
    assert run_hidden_tests(SEARCH_FOR_THE_ANSWER, "find", tests) == (0, "")


def test_rewriting_sys_stdout_forges_nothing():
    code = ("import re, sys\nclass Rewrite:\n    def __init__(self, real):\n        self.real = real\n"
            "    def write(self, text):\n"
            "        return self.real.write(re.sub(r'([0-9a-f]{16}) \\d+', r'\\1 3', text))\n"
            "    def flush(self):\n        self.real.flush()\n"
            "sys.__stdout__ = sys.stdout = Rewrite(sys.stdout)\n" + WRONG)
    assert run_hidden_tests(code, "add", ADD)[0] == 0


def test_an_object_equal_to_everything_passes_nothing():
    code = ("class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
            "def add(a, b):\n    return Anything()\n")
    assert run_hidden_tests(code, "add", ADD)[0] == 0
    code = "class Five(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Five(0)\n"
    assert run_hidden_tests(code, "add", ADD)[0] == 0


def test_an_early_exit_costs_only_the_tests_not_yet_done():
    code = ("import os\ncalls = []\ndef add(a, b):\n    calls.append(1)\n    if len(calls) == 3:\n        os._exit(0)\n"
            "    return a + b\n")
    passed, note = run_hidden_tests(code, "add", ADD)
    assert passed == 2 and "2 of 3" in note, note


def test_a_test_that_never_returns_costs_only_the_tests_not_yet_done():
    code = "import time\ndef add(a, b):\n    if a == -1:\n        time.sleep(60)\n    return a + b\n"
    passed, note = run_hidden_tests(code, "add", ADD, SandboxLimits(wall_s=4.0, cpu_s=2))
    assert passed == 1 and "1 of 3" in note and "timed out" in note, note


def test_killing_itself_with_a_signal_raises_nothing_and_keeps_the_tests_done():
    code = "import os\ndef add(a, b):\n    if a == 10:\n        os.kill(os.getpid(), 40)\n    return a + b\n"
    passed, note = run_hidden_tests(code, "add", ADD)
    assert passed == 2 and "signal" in note, note


def test_closing_stdout_does_not_hide_the_results():
    code = "import os, sys\nsys.stdout.close()\nos.close(1)\n" + CORRECT
    assert run_hidden_tests(code, "add", ADD) == (3, "")


def test_eq_and_repr_that_raise_or_recurse_fail_their_test_only():
    for body in ["raise RuntimeError('no')", "return self == other", "import os; os._exit(0)"]:
        code = (f"class Odd(int):\n    def __eq__(self, other):\n        {body}\n    def __repr__(self):\n"
                f"        {body.replace('self == other', 'repr(self)')}\n    __str__ = __repr__\n    __hash__ = None\n"
                f"def add(a, b):\n    return Odd(a + b) if a == 2 else a + b\n")
        assert run_hidden_tests(code, "add", ADD) == (2, ""), body


def test_printed_result_lines_can_only_give_answers():
    # with the judge's own tag, read from its globals: a tally, a claim that is no answer, an index out of range,
    # a line after garbage, a line with two keys; printed before the tests run
    forged = """
import os, sys
tag = sys._getframe(1).f_globals["TAG"]
os.write(1, f'\\n{tag} 3\\n{tag} 0 {{"passed": true}}\\n{tag} 9 {{"answer": 1}}\\n\\xff{tag} 1 {{"answer": 0}}\\n'
            f'{tag} 2 {{"answer": 42, "error": ""}}\\n'.encode())
"""
    outcomes, _ = code_exec.judge(forged + WRONG, "add", [[2, 3], [-1, 1], [10, 32]], code_exec.TEST_LIMITS)
    assert outcomes == [Outcome(None, "reported twice"), Outcome("-2"), Outcome(None, "reported twice")]
    outcomes, _ = code_exec.judge(forged + "os._exit(0)\n", "add", [[2, 3], [-1, 1], [10, 32]], code_exec.TEST_LIMITS)
    assert outcomes == [Outcome(None, "malformed result line"), None, Outcome(None, "malformed result line")]
    assert run_hidden_tests(forged + WRONG, "add", ADD)[0] == 0


def test_a_patched_json_can_only_give_answers():
    code = "import json\njson.dumps = lambda *args, **kwargs: '{\"answer\": true}'\n" + WRONG
    assert run_hidden_tests(code, "add", ADD)[0] == 0


def test_a_result_too_large_or_too_deep_fails_its_test_only():
    for big in ["[0] * 10 ** 6", "10 ** 5000", "'x' * 10 ** 5", "nested(10 ** 5)", "circular()"]:
        code = ("import sys\nsys.setrecursionlimit(10 ** 6)\n"
                "def nested(n):\n    out = []\n    for _ in range(n):\n        out = [out]\n    return out\n"
                "def circular():\n    out = []\n    out.append(out)\n    return out\n"
                f"def add(a, b):\n    return {big} if a == 2 else a + b\n")
        assert run_hidden_tests(code, "add", ADD) == (2, ""), big


def test_each_result_crosses_as_plain_data_or_as_the_reason_it_cannot():
    code = """
class Mine:
    pass
RESULTS = [7, 1.5, True, None, "s", [1, [2]], {"k": [None]}, (1, 2), Mine(), {1: 2}, 10 ** 5000, [0] * 10 ** 4]
def pick(i):
    if i == 12:
        raise KeyError(i)
    return RESULTS[i]
"""
    outcomes, done = code_exec.judge(code, "pick", [[i] for i in range(13)], code_exec.TEST_LIMITS)
    assert done.ok, done.tool_output()
    assert [o.answer for o in outcomes[:7]] == ['7', '1.5', 'true', 'null', '"s"', '[1, [2]]', '{"k": [null]}']
    assert [o.error for o in outcomes[7:]] == ["its result is not plain data"] * 3 + [
        "its result could not be serialized", "its result is too large", "raised KeyError"]


def test_answers_must_match_in_type_too():
    tests = [((2, 3), 5)]
    for answer in ["True", "5.0", "'5'", "[5]"]:
        assert run_hidden_tests(f"def add(a, b):\n    return {answer}\n", "add", tests)[0] == 0, answer
    assert run_hidden_tests("def is_even(n):\n    return 1\n", "is_even", [((4,), True)])[0] == 0


def test_a_deeply_nested_result_line_cannot_raise_in_the_grader():
    # a forged line under the size cap nests ~500 deep; the grader parses it near its own recursion limit
    code = ("import os, sys\ntag = sys._getframe(1).f_globals['TAG']\n"
            "os.write(1, ('\\n%s 0 {\"answer\": %s}\\n' % (tag, '[' * 500 + ']' * 500)).encode())\n"
            "os._exit(0)\n")
    depth, limit = 0, sys.getrecursionlimit()
    frame = sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(depth + 150)
    try:
        outcomes, _ = code_exec.judge(code, "add", [[2, 3]], code_exec.TEST_LIMITS)
    finally:
        sys.setrecursionlimit(limit)
    assert outcomes == [Outcome(None, "malformed result line")]


REFERENCE = {"add": "a + b", "square": "n * n", "is_even": "n % 2 == 0", "reverse": "s[::-1]", "maximum": "max(xs)",
             "count_vowels": "sum(c in 'aeiou' for c in s)", "factorial": "math.factorial(n)", "total": "sum(xs)",
             "fib": "n if n < 2 else fib(n - 1) + fib(n - 2)", "is_palindrome": "s == s[::-1]",
             "first_word": "s.split(' ')[0]", "clamp": "max(lo, min(x, hi))"}


def test_every_problems_reference_solution_solves_its_episode():
    # through the env as training drives it (the tests come from the task's JSON label), in the strict comparison
    for task in code_exec.tasks("train", 0) + code_exec.tasks("test", 0):
        env = code_exec.CodeEnv()
        env.reset(options={"task": task})
        spec = next(spec for name, spec, _ in code_exec.PROBLEMS if name == env.name)
        reply = f"```python\nimport math\ndef {spec[:spec.index(')') + 1]}:\n    return {REFERENCE[env.name]}\n```"
        observation, reward, solved, _, info = env.step(reply)
        assert (reward, solved, info["ran"]) == (1.0, True, 1.0), observation
