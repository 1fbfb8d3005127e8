# recipes/swe_fix.py — repository fixing by mini-swe-agent, an agent that is its own process.
#
# Each task is a tiny repository with one planted bug: a module `<name>.py` holding one function of the code_exec
# recipe's problems, written wrong, and `test_<name>.py`, which checks two of its examples. Each rollout gets its own
# copy and runs mini-swe-agent there (PyPI, unchanged: its `mini` command line, litellm inside, talking to the
# rollout's session through OPENAI_BASE_URL), in the python sandbox's jail, so the bash commands the model writes
# run jailed too. When the agent has exited, the hidden tests (all three examples) run on what it left of the module,
# in the sandbox; the reward is the fraction they pass, the score whether all do. mini's step limit is the turn
# budget (--rollout.max_turns). What the agent left (the module, mini's trajectory) is hostile, read only through
# agents.graders.read_agent_file: a module it deleted or left undecodable passes nothing (reward 0); one it replaced
# by a symlink, a FIFO, a device, a directory, a hard link or more than MODULE_BYTES, or a trajectory refused or not
# of mini's shape (or of more values than agents.graders.parse_agent_json parses), fails the grade: ProcessFailure("process_grade"), which the runner counts (the metric
# rollout/failed_process_grade_total) and logs with the reason, and the rollout is dropped.
# The whole recipe: the bugs (and their fixes), the tasks, the repository and its grade (which the codex and
# claude_code recipes share), mini's configuration, the defaults and the agent (agents/process.py).
# Defaults: on a CPU, a tiny Qwen3 taught mini-swe-agent's tool-call format (read the module, run the tests, submit):
# the episodes are multi-turn and every stage of the pipeline runs, but it fixes nothing (the reward is what the bug
# leaves passing); Qwen2.5-Coder-1.5B-Instruct, which writes Hermes tool calls natively, with CUDA.
import ast
import importlib.util
import json
import os
import random
import sys

import yaml
from jinja2 import Template

import data
import models
from agents import ChatAgentRunner, Result
from agents.graders import AgentFileError, AgentFileMissing, parse_agent_json, read_agent_file
from agents.process import ProcessAgent, ProcessFailure
from recipes.code_exec import PROBLEMS, run_hidden_tests

# function name -> its body with the bug (the code_exec problems give the signature, the spec and the tests)
BUGS = {
    "add": "return a - b",
    "square": "return n + n",
    "is_even": "return n % 2 == 1",
    "reverse": "return s[1:][::-1]",
    "maximum": "return min(xs)",
    "count_vowels": "return sum(c in 'eiou' for c in s)",
    "factorial": "out = 1\n    for i in range(1, n):\n        out *= i\n    return out",
    "fib": "a, b = 0, 1\n    for _ in range(n + 1):\n        a, b = b, a + b\n    return a",
    "is_palindrome": "return s[:1] == s[-1:]",
    "total": "return sum(xs[1:])",
    "first_word": "return s.split()[-1]",
    "clamp": "return max(lo, min(x, lo))",
}
# function name -> (the line of its bug, that line fixed): the edit a demonstration makes (the codex and claude_code
# recipes teach their CPU models these, each in its harness's own edit tool)
FIXES = {
    "add": ("return a - b", "return a + b"),
    "square": ("return n + n", "return n * n"),
    "is_even": ("return n % 2 == 1", "return n % 2 == 0"),
    "reverse": ("return s[1:][::-1]", "return s[::-1]"),
    "maximum": ("return min(xs)", "return max(xs)"),
    "count_vowels": ("return sum(c in 'eiou' for c in s)", "return sum(c in 'aeiou' for c in s)"),
    "factorial": ("for i in range(1, n):", "for i in range(1, n + 1):"),
    "fib": ("for _ in range(n + 1):", "for _ in range(n):"),
    "is_palindrome": ("return s[:1] == s[-1:]", "return s == s[::-1]"),
    "total": ("return sum(xs[1:])", "return sum(xs)"),
    "first_word": ("return s.split()[-1]", "return s.split()[0]"),
    "clamp": ("return max(lo, min(x, lo))", "return max(lo, min(x, hi))"),
}
VENV = "/opt/venv"               # where the jail sees this environment, mini-swe-agent's (no host path inside)
# mini-swe-agent's command line, run as a module (its `mini` script's first line names the host path of this venv)
MINI = [f"{VENV}/bin/python", "-m", "minisweagent.run.mini"]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"          # how mini-swe-agent's agent says it is done
SYSTEM = "You are a helpful assistant that can interact with a computer."
INSTANCE = ("Please solve this issue: {{task}}\n\nThe repository is in the current directory. Reply with one bash "
            f"tool call at a time. When the tests pass, submit with `{SUBMIT}` alone.\n")
CPU_MODEL = "tiny-qwen3-swe"
MODULE_BYTES = 1 << 20                  # the module the agent leaves: one small function (a larger one is refused)
TRAJECTORY_BYTES = 16 << 20             # mini's trajectory: the messages of at most max_turns steps

ON_GPU = models.gpu_defaults()
DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-Coder-1.5B-Instruct" if ON_GPU else CPU_MODEL,
    "run.steps": 50 if ON_GPU else 4,
    "rollout.prompts_per_step": 8 if ON_GPU else 2,
    "rollout.samples_per_prompt": 4 if ON_GPU else 2,
    "rollout.max_turns": 8 if ON_GPU else 4,   # mini-swe-agent's step limit
    "rollout.max_tokens": 512 if ON_GPU else 64,
    "rollout.max_length": 8192 if ON_GPU else 2048,
    "actor.lr": 1e-6 if ON_GPU else 1e-4,
}


# ---- the tasks: one repository each -------------------------------------------------------------------------------

def task(name: str, spec: str, tests: list) -> data.Task:
    """The task of one bug: the issue as the prompt; the label carries the repository and the hidden tests. The
    repository is the buggy module and a test script that checks the first two examples."""
    checks = "".join(f"    assert {name}({', '.join(map(repr, a))}) == {e!r}\n" for a, e in tests[:2])
    files = {f"{name}.py": f"def {spec[:spec.index(')') + 1]}:\n    {BUGS[name]}\n",   # spec: "add(a, b) returns .."
             f"test_{name}.py": (f"from {name} import {name}\n\n\ndef test_{name}():\n{checks}\n\nif __name__ == "
                                 f"\"__main__\":\n    test_{name}()\n    print(\"all tests passed\")\n")}
    (args, expected), = tests[:1]
    issue = (f"{name}.py has a bug: {spec}, so {name}({', '.join(map(repr, args))}) should be {expected!r}, and "
             f"test_{name}.py fails. Fix {name}.py.")
    return data.Task(f"swe-{name}", [{"role": "user", "content": issue}],
                     json.dumps({"name": name, "tests": tests, "files": files}))


def tasks(split: str, seed: int) -> list[data.Task]:
    """One task per bug, shuffled; held-out splits take the last third (functions never trained on)."""
    problems = list(PROBLEMS)
    random.Random(seed).shuffle(problems)
    cut = len(problems) * 2 // 3
    return [task(*problem) for problem in (problems[:cut] if split == "train" else problems[cut:])]


# ---- the repository an agent works in, and its grade (any agent that is a process: mini here, the harnesses) ------

def write_repository(ctx, ws) -> None:
    """The task's repository (the buggy module and its test script) into the agent's working directory."""
    for path, text in json.loads(ctx.label)["files"].items():
        with open(os.path.join(ws.work, path), "w") as f:
            f.write(text)


def grade_repository(ctx, ws) -> Result:
    """The hidden tests (all three examples) on what the agent left of the module, run in the sandbox on the bytes
    read here: reward the fraction passed, score whether all did. The module is the agent's to tamper with, so it is
    read through read_agent_file before anything runs: deleted or undecodable passes nothing; refused (a symlink, a
    FIFO, a device, a directory, a hard link, over MODULE_BYTES) is ProcessFailure("process_grade")."""
    label = json.loads(ctx.label)
    name, tests = label["name"], [(tuple(a), e) for a, e in label["tests"]]
    try:
        source = read_agent_file(ws.work, f"{name}.py", MODULE_BYTES).decode()
    except (AgentFileMissing, UnicodeDecodeError):   # deleted, or made binary: nothing passes
        source = ""
    except AgentFileError as exc:
        raise ProcessFailure("process_grade", f"the agent's module is refused: {exc}") from None
    passed, _ = run_hidden_tests(source, name, tests)
    fraction = passed / len(tests)
    return Result(reward=fraction, score=float(passed == len(tests)), info={"tests_passed": fraction})


# ---- mini-swe-agent, as a process per rollout ---------------------------------------------------------------------

class MiniSweAgent(ProcessAgent):
    timeout_s = 150.0                    # below the runner's budget (60 s x max_turns 4)
    jail = True
    jail_binds = {VENV: sys.prefix}      # the virtual environment mini-swe-agent is installed in

    def prepare(self, ctx, ws) -> None:
        write_repository(ctx, ws)
        # layered over mini-swe-agent's own mini.yaml: shorter prompts (a small model's context)
        with open(os.path.join(ws.home, "swe_fix.yaml"), "w") as f:
            yaml.safe_dump({"agent": {"system_template": SYSTEM, "instance_template": INSTANCE}}, f)

    def command(self, ctx, ws) -> list[str]:
        return [*MINI, "--yolo", "--exit-immediately", "--model", f"openai/{ctx.model_name}", "--task", ctx.prompt,
                "-c", "mini.yaml", "-c", os.path.join(ws.home, "swe_fix.yaml"),     # ours over its own
                "-c", f"agent.step_limit={ctx.max_turns}", "--output", os.path.join(ws.home, "trajectory.json")]

    def environment(self, ctx, ws) -> dict[str, str]:
        return {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin",   # `python` is this environment's
                "MSWEA_CONFIGURED": "true",            # no first-run set-up dialogue
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors",   # litellm has no price for the policy: cost 0, no error
                "LITELLM_LOCAL_MODEL_COST_MAP": "True"}   # litellm's bundled cost map, not a download at start

    def grade(self, ctx, ws, run) -> Result:
        # mini's trajectory is the agent's to tamper with too (its bash commands write home/): read like the module,
        # and before the hidden tests run
        info = trajectory_info(ws.home)
        result = grade_repository(ctx, ws)
        result.info.update(info)
        return result


def trajectory_info(home: str) -> dict[str, float]:
    """Whether mini-swe-agent submitted, and its model calls, from the trajectory it wrote into `home`. A trajectory
    refused, or not of mini's shape, is ProcessFailure("process_grade")."""
    try:
        info = parse_agent_json(read_agent_file(home, "trajectory.json", TRAJECTORY_BYTES), "trajectory.json")["info"]
        return {"submitted": float(info["exit_status"] == "Submitted"),
                "agent_steps": float(info["model_stats"]["api_calls"])}
    except AgentFileError as exc:
        raise ProcessFailure("process_grade", f"mini-swe-agent's trajectory is refused: {exc}") from None
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as exc:   # any JSON the agent wrote
        raise ProcessFailure("process_grade", f"trajectory.json is not mini-swe-agent's trajectory: "
                                              f"{type(exc).__name__}: {str(exc)[:200]}") from None


class AgentRunner(ChatAgentRunner):
    agent_cls = MiniSweAgent


# ---- the CPU model: a tiny Qwen3 taught mini-swe-agent's format ---------------------------------------------------

def _mini_file(*parts: str) -> str:
    """A file of the installed mini-swe-agent package, found without importing it (its import prints a banner and
    creates its configuration folder)."""
    return os.path.join(importlib.util.find_spec("minisweagent").submodule_search_locations[0], *parts)


def mini_bash_tool() -> dict:
    """The bash tool mini-swe-agent sends with every request (BASH_TOOL in its source)."""
    with open(_mini_file("models", "utils", "actions_toolcall.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["BASH_TOOL"]:
            return ast.literal_eval(node.value)
    raise RuntimeError("mini-swe-agent's BASH_TOOL is not where 2.4.6 keeps it; pin requirements-agents.txt's version")


def episode(one: data.Task) -> list[dict]:
    """The conversation mini-swe-agent would have with a model that reads the module, runs the tests and submits."""
    label = json.loads(one.label)
    name, files = label["name"], label["files"]
    with open(_mini_file("config", "mini.yaml")) as f:
        observation = Template(yaml.safe_load(f)["model"]["observation_template"])
    test_output = (f"Traceback (most recent call last):\n  File \"test_{name}.py\", line 9, in <module>\n"
                   f"    test_{name}()\nAssertionError\n")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": Template(INSTANCE).render(task=one.messages[-1]["content"])}]
    for i, (thought, command, output, code) in enumerate([
            ("Let me read the code.", f"cat {name}.py", files[f"{name}.py"], 0),
            ("Let me run the tests.", f"python test_{name}.py", test_output, 1),
            ("I am done.", SUBMIT, None, 0)]):
        messages.append({"role": "assistant", "content": thought, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]})
        if output is not None:
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": observation.render(output={"returncode": code, "output": output,
                                                                   "exception_info": ""})})
    return messages


def taught_model() -> str:
    """Taught on every bug's episode (train and held-out alike: it learns the format, not the fixes)."""
    tokenizer = models.bpe_tokenizer()
    examples = [(data.render_prompt_text(tokenizer, episode(task(*problem)), tools=[mini_bash_tool()],
                                         add_generation_prompt=False), []) for problem in PROBLEMS]
    return models.taught_tiny_model_dir("qwen3", examples, steps=200)


models.MODEL_NAMES[CPU_MODEL] = taught_model
