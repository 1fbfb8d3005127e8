# recipes/code_exec.py — code execution: write a Python function; hidden tests run in the sandbox grade it. A
# failing attempt is shown how many tests passed and may try again (up to the turn budget); GRPO on the best
# fraction of tests passed.
#
# The whole recipe: the problems with their hidden tests, the defaults, and the environment, written as a plain
# gymnasium.Env with text observations and actions (agents.GymEnv drives it; no adapter of the recipe's own).
# Defaults: SmolLM2-135M-Instruct on a CPU (it writes a correct one-liner now and then); Qwen2.5-Coder-1.5B-Instruct
# with CUDA and the hub.
import json
import random
import re
import secrets
import string

import gymnasium
from gymnasium import spaces

import data
import models
from agents import EnvRunner
from agents.sandbox import SandboxLimits, run_python

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

ON_GPU = models.gpu_defaults()
DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-Coder-1.5B-Instruct" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 10,
    "rollout.prompts_per_step": 16 if ON_GPU else 4,
    "rollout.samples_per_prompt": 4,
    "rollout.temperature": 1.0,
    "rollout.max_turns": 2,                  # one attempt and one retry after seeing the test results
    "rollout.max_tokens": 384 if ON_GPU else 96,
    "rollout.max_length": 2048 if ON_GPU else 768,
    "actor.lr": 1e-6 if ON_GPU else 2e-5,
    "algo.estimator": "grpo",
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


def run_hidden_tests(code: str, name: str, tests: list) -> tuple[int, str]:
    """(tests passed, a note for the model) after running `code` and then the tests in one sandbox call. The tally
    line carries a fresh random tag, and the program file that holds it is deleted before the code runs, so what
    the code prints cannot pass for the tally."""
    tag = secrets.token_hex(8)
    program = (f"import os as _os, sys as _sys\n_os.remove(__file__)\n_namespace = {{'__name__': 'solution'}}\n"
               f"exec(compile({code!r}, 'solution.py', 'exec'), _namespace)\n_passed = 0\n"
               f"for _args, _expected in {tests!r}:\n    try:\n"
               f"        _passed += bool(_namespace[{name!r}](*_args) == _expected)\n"
               f"    except Exception:\n        pass\n"
               f"_sys.__stdout__.write('\\n{tag} %d\\n' % _passed)\n")
    done = run_python(program, TEST_LIMITS)
    found = re.search(rf"^{tag} (\d+)$", done.stdout, re.MULTILINE)
    if found is None:
        return 0, f"The code did not run to the tests: {done.error or 'no result'}."
    return int(found.group(1)), ""


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
