# recipes/code_exec.py — code execution: write a Python function; hidden tests run in the sandbox grade it. A
# failing attempt is shown how many tests passed and may try again (up to the turn budget); GRPO on the best
# fraction of tests passed.
#
# The whole recipe: the problems with their hidden tests, the defaults, the judge (also swe_fix's grader), and the
# environment, written as a plain gymnasium.Env with text observations and actions (agents.GymEnv drives it; no
# adapter of the recipe's own). The judge never lets an expected result into the process that runs model code.
# Defaults: SmolLM2-135M-Instruct on a CPU (it writes a correct one-liner now and then); Qwen2.5-Coder-1.5B-Instruct
# with CUDA.
import json
import random
import re
import secrets
import string
from dataclasses import dataclass

import gymnasium
from gymnasium import spaces

import data
import models
from agents import EnvRunner
from agents.sandbox import SandboxLimits, SandboxResult, run_python

# (function name, what it must do, hidden tests as (arguments, expected result)); the model sees one example only
PROBLEMS = [
    ("add", "add(a, b) returns the sum of two numbers", [((2, 3), 5), ((-1, 1), 0), ((10, 32), 42)]),
    ("square", "square(n) returns n times n", [((3,), 9), ((-4,), 16), ((0,), 0)]),
    ("is_even", "is_even(n) returns True when n is even", [((4,), True), ((7,), False), ((0,), True)]),
    ("reverse", "reverse(s) returns the string s backwards", [(("abc",), "cba"), (("",), ""), (("ab a",), "a ba")]),
    ("maximum", "maximum(xs) returns the largest number of a non-empty list", [(([3, 9, 2],), 9), (([-5, -2],), -2),
                                                                              (([7],), 7)]),
    ("count_vowels", "count_vowels(s) returns how many of the letters a, e, i, o, u are in s (lower case)",
     [(("banana",), 3), (("xyz",), 0), (("aeiou",), 5)]),
    ("factorial", "factorial(n) returns n! for n >= 0", [((0,), 1), ((5,), 120), ((7,), 5040)]),
    ("fib", "fib(n) returns the n-th Fibonacci number, fib(0) = 0, fib(1) = 1", [((0,), 0), ((1,), 1), ((10,), 55)]),
    ("is_palindrome", "is_palindrome(s) returns True when s reads the same backwards",
     [(("racecar",), True), (("abca",), False), (("",), True)]),
    ("total", "total(xs) returns the sum of a list of numbers", [(([1, 2, 3],), 6), (([],), 0), (([-2, 2, 5],), 5)]),
    ("first_word", "first_word(s) returns the first space-separated word of s",
     [(("hello world",), "hello"), (("one",), "one"), (("a b c",), "a")]),
    ("clamp", "clamp(x, lo, hi) returns x limited to the range [lo, hi]", [((5, 0, 3), 3), ((-1, 0, 3), 0),
                                                                           ((2, 0, 3), 2)]),
]
TEST_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5)
RESULT_BYTES = 1024        # the longest result line a test may send ({"answer": ...} as JSON); the answers are short

ON_GPU = models.gpu_defaults()
DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-Coder-1.5B-Instruct" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 10,
    "rollout.prompts_per_step": 16 if ON_GPU else 4,
    "rollout.max_turns": 2,                  # one attempt and one retry after seeing the test results
    "rollout.max_tokens": 384 if ON_GPU else 96,
    "rollout.max_length": 2048 if ON_GPU else 768,
    "actor.lr": 1e-6 if ON_GPU else 2e-5,
}


def tasks(split: str, seed: int) -> list[data.Task]:
    """The problems, shuffled; held-out splits take the last third (functions never trained on)."""
    problems = list(PROBLEMS)
    random.Random(seed).shuffle(problems)
    cut = len(problems) * 2 // 3
    out = []
    for name, spec, tests in problems[:cut] if split == "train" else problems[cut:]:
        (args, expected), = tests[:1]
        call = f"{name}({', '.join(map(repr, args))})"
        prompt = (f"Write a Python function: {spec}. For example, {call} == {expected!r}. Answer with the code in "
                  f"one ```python block.")
        out.append(data.Task(f"code-{name}", [{"role": "user", "content": prompt}], json.dumps([name, tests])))
    return out


def extract_code(text: str) -> str:
    """The last ```python (or bare ```) block of a reply; the whole reply when it has none."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else text


# ---- the judge -------------------------------------------------------------------------------------------------

# As competitive-programming judges work: the process that runs the model's code gets the tests' inputs only and
# sends back one line per test as each ends, its result as JSON or why there is none. The expected results never
# enter that process; the comparison is here, on the parsed JSON. Only plain data crosses (bool, int, float, str,
# None, lists and str-keyed dicts of them): an object of the code's own class (an __eq__ that says yes to
# everything, a __repr__ that raises) is refused there unread. That process is the code's to tamper with, so what
# it sends is at worst an answer the code chose: printed lines, a patched json or a rewritten stdout win nothing,
# and a test with two lines fails. A crash, a hang or an exit costs only the tests not yet reported.
HARNESS = '''
import json, os

RESULTS = os.dup(1)          # the results' channel, taken before the code can close or replace stdout


def plain(value, depth=0):
    kind = type(value)
    if kind is list:
        return depth < 64 and all(plain(item, depth + 1) for item in value)
    if kind is dict:
        return depth < 64 and all(type(key) is str and plain(item, depth + 1) for key, item in value.items())
    return kind in (bool, int, float, str, type(None))


def result_line(function, args):
    try:
        value = function(*args)
    except Exception as error:
        return json.dumps({"error": f"raised {type(error).__name__}"})
    try:
        line = json.dumps({"answer": value}) if plain(value) else '{"error": "its result is not plain data"}'
    except Exception:                                    # an int past the digit limit, a recursion limit set low
        line = '{"error": "its result could not be serialized"}'
    return line if len(line) <= RESULT_BYTES else '{"error": "its result is too large"}'


namespace = {"__name__": "solution"}
exec(compile(CODE, "solution.py", "exec"), namespace)
for index, args in enumerate(INPUTS):
    os.write(RESULTS, f"\\n{TAG} {index} {result_line(namespace.get(NAME), args)}\\n".encode())
'''


@dataclass
class Outcome:
    """One hidden test as the candidate process reported it."""
    answer: str | None       # its result as canonical JSON (sorted keys); None when it gave none
    error: str = ""          # why not: what the call raised, a result not plain or too large, a bad or repeated line


def canonical(value) -> str:
    """JSON with sorted keys: equal text means equal value and type (True is not 1, and 1.0 is not 1: the
    problems' answers are exact, so a float where an int is due fails)."""
    return json.dumps(value, sort_keys=True)


def judge(code: str, name: str, inputs: list, limits: SandboxLimits) -> tuple[list[Outcome | None], SandboxResult]:
    """Run `code` and call `name` on each of `inputs` in one sandbox call; each test's Outcome (None: never
    reported) and the call's result. Never raises for anything the code does."""
    tag = secrets.token_hex(8)          # so that a print of the code cannot be a result line by accident
    params = json.dumps([tag, name, inputs, code, RESULT_BYTES])
    done = run_python(f"import json\nTAG, NAME, INPUTS, CODE, RESULT_BYTES = json.loads({params!r})\n{HARNESS}",
                      limits)
    outcomes: list[Outcome | None] = [None] * len(inputs)
    for line in done.stdout.split("\n")[:-1]:            # the last piece has no newline: cut off, never sent whole
        found = re.fullmatch(rf"{tag} ([0-9]{{1,6}}) (.*)", line)
        if found is None or int(found.group(1)) >= len(inputs):
            continue                                     # the code's own output
        index = int(found.group(1))
        seen = outcomes[index] is not None
        outcomes[index] = Outcome(None, "reported twice") if seen else read_result(found.group(2))
    return outcomes, done


def read_result(text: str) -> Outcome:
    """A result line's Outcome; a malformed line (the candidate process's to write) is an error, never raised."""
    if len(text) > RESULT_BYTES:
        return Outcome(None, "result too large")
    try:
        result = json.loads(text)
        if type(result) is dict and list(result) == ["answer"]:
            return Outcome(canonical(result["answer"]))
        if type(result) is dict and list(result) == ["error"] and type(result["error"]) is str:
            return Outcome(None, result["error"])
    except (ValueError, RecursionError):                 # not JSON, or nested past this process's stack
        pass
    return Outcome(None, "malformed result line")


def run_hidden_tests(code: str, name: str, tests: list, limits: SandboxLimits = TEST_LIMITS) -> tuple[int, str]:
    """(tests passed, a note for the model): the code's answers, from the judge, compared here with the expected
    results. The note is empty when every test reported, else says where and why the code stopped; it never shows
    a hidden test."""
    outcomes, done = judge(code, name, [list(args) for args, _ in tests], limits)
    passed = sum(o is not None and o.answer == canonical(expected) for o, (_, expected) in zip(outcomes, tests))
    reported = sum(o is not None for o in outcomes)
    why = done.error or "it exited"
    if reported == len(tests):
        return passed, ""
    if reported == 0:
        return passed, f"The code did not run to the tests: {why}."
    return passed, f"The code stopped after {reported} of {len(tests)} tests: {why}."


class CodeEnv(gymnasium.Env):
    """One function to write. Observations and actions are text; the reward of a step is how much it raised the
    best fraction of hidden tests passed, so an episode's reward is that best fraction."""

    observation_space = spaces.Text(max_length=4096, charset=string.printable)
    action_space = spaces.Text(max_length=16384, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        task = options["task"]
        self.name, tests = json.loads(task.label)
        self.tests = [(tuple(args), expected) for args, expected in tests]
        self.best = 0.0
        return task.messages, {}

    def step(self, action):
        passed, problem = run_hidden_tests(extract_code(action), self.name, self.tests)
        fraction = passed / len(self.tests)
        reward, self.best = max(fraction - self.best, 0.0), max(self.best, fraction)
        solved = passed == len(self.tests)
        observation = (f"{passed} of {len(self.tests)} hidden tests passed. {problem} Fix the function and answer "
                       f"with the whole code again in one ```python block.")
        info = {"tests_passed": fraction, "score": float(solved), "ran": float(not problem)}
        return observation, reward, solved, False, info


class AgentRunner(EnvRunner):
    env_cls = CodeEnv
