# agents/harness.py — the coding harnesses people use, run unchanged as jailed processes against a rollout's session:
# Codex (`codex exec`) and Claude Code (`claude -p`), installed from the npm registry into harnesses/node_modules.
#
# Owns: `Harness` (one installed harness: its pinned version, the command that runs it, the paths the jail binds) with
# CODEX and CLAUDE_CODE, `check_installed` (launch.sh runs it after installing), `HarnessAgent` (a ProcessAgent that
# runs a harness in the jail on one of swe_fix's repositories and grades what it left with swe_fix's grader), and
# `taught_harness_model`, a tiny model taught a harness's tool format on the harness's own requests, harvested once.
# The install (launch.sh, harnesses/package.json and its lockfile): Codex's package is a Node shim (bin/codex.js,
# node >= 16) over a native binary in a platform package, so the jail gets Node and the packages; Claude Code's CLI
# is a native executable (Bun-compiled) in its platform package, which needs no Node (its package's node >= 22 covers
# only its JavaScript shims), so it is run as it is. Inside the jail the packages are at /opt/harnesses, Node at
# /opt/node/bin/node and this environment's Python at /opt/venv (the tests a model runs say `python`); no host path of
# the checkout is visible.
# The harvest (engines/harvest.py): each demonstration is the harness itself, jailed as in a rollout, against a real
# LoopbackServer over a ScriptEngine that answers with the demonstration's replies; the server records each request
# exactly as it renders it for the policy (the harness's system prompt, its tools, its tool results). The recorded
# texts are kept in a cache folder named by everything that shapes them (the harness's version, the recipe's and this
# module's source, the server's rendering, the replies, the tokenizer), so the taught model is made once per machine
# and reused.
# Never: passes a host secret to a harness (ProcessAgent builds its environment from nothing), runs one unjailed.
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import data
import models
from agents import ChatAgentRunner, Result
from agents.graders import JSON_EVENTS, AgentFileError, json_events
from agents.process import ProcessAgent, ProcessFailure
from engines import SamplingParams
from engines.harvest import ScriptEngine, teaching_texts
from recipes import swe_fix
from recipes.code_exec import PROBLEMS

HARNESSES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harnesses")
MODULES = os.path.join(HARNESSES_DIR, "node_modules")
JAIL_HARNESSES, JAIL_NODE, JAIL_VENV = "/opt/harnesses", "/opt/node/bin/node", "/opt/venv"


# ---- the installed harnesses ---------------------------------------------------------------------------------------

def node_binary() -> str:
    """The machine's Node (launch.sh installs Debian's where none is), as a real path: bound into a jail as one file."""
    found = shutil.which("node")
    if found is None:
        raise FileNotFoundError("no `node` on PATH: ./launch.sh installs Debian's nodejs (or install Node >= 16)")
    return os.path.realpath(found)


@dataclass(frozen=True)
class Harness:
    name: str                    # how the recipes and the docs call it
    package: str                 # its npm package (harnesses/package.json pins the version)
    entry: str                   # glob under node_modules of the file that runs it (a platform package's binary)
    needs_node: bool             # the entry is JavaScript run by Node (Codex's shim), not a native executable

    @property
    def version(self) -> str:
        """The version harnesses/package.json pins (the one place the pins live)."""
        with open(os.path.join(HARNESSES_DIR, "package.json")) as f:
            return json.load(f)["dependencies"][self.package]

    def host_entry(self) -> str:
        """The installed entry on this machine; FileNotFoundError saying how to install it when it is not there."""
        found = sorted(glob.glob(os.path.join(MODULES, self.entry)))
        installed = os.path.join(MODULES, self.package, "package.json")
        if len(found) != 1 or not os.path.exists(installed):
            raise FileNotFoundError(f"{self.name} ({self.package}@{self.version}) is not installed in {MODULES}: run "
                                    f"./launch.sh train --recipe {self.name} (or ./launch.sh test), which installs "
                                    f"it, or `npm ci --prefix harnesses --ignore-scripts`")
        with open(installed) as f:
            version = json.load(f)["version"]
        if version != self.version:
            raise FileNotFoundError(f"{MODULES} holds {self.package}@{version}, not the pinned {self.version}: "
                                    f"./launch.sh installs the pins again (or `npm ci --prefix harnesses "
                                    f"--ignore-scripts`)")
        return found[0]

    def argv(self) -> list[str]:
        """The command that starts it inside the jail (before its own arguments)."""
        entry = os.path.join(JAIL_HARNESSES, "node_modules", os.path.relpath(self.host_entry(), MODULES))
        return [JAIL_NODE, entry] if self.needs_node else [entry]

    def jail_binds(self) -> dict[str, str]:
        node = {JAIL_NODE: node_binary()} if self.needs_node else {}
        return {JAIL_HARNESSES: HARNESSES_DIR, JAIL_VENV: sys.prefix, **node}


CODEX = Harness("codex", "@openai/codex", "@openai/codex/bin/codex.js", needs_node=True)
CLAUDE_CODE = Harness("claude_code", "@anthropic-ai/claude-code", "@anthropic-ai/claude-code-*/claude",
                      needs_node=False)


def check_installed() -> None:
    """Run each installed harness's --version on the host, as the jail will run it (launch.sh's last install step)."""
    for harness in (CODEX, CLAUDE_CODE):
        host = harness.host_entry()
        argv = [node_binary(), host] if harness.needs_node else [host]
        with tempfile.TemporaryDirectory() as home:          # what a harness writes into its home goes with it
            done = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60,
                                  env={"PATH": "/usr/bin:/bin", "HOME": home})
        if done.returncode != 0 or harness.version not in done.stdout:
            raise RuntimeError(f"{harness.name}: `{' '.join(argv)} --version` gave {done.returncode}: "
                               f"{(done.stdout + done.stderr).strip()[:500]}")
        print(f"{harness.name} {harness.version}: {done.stdout.strip()}")


def recipe_defaults(cpu_model: str) -> dict:
    """A harness recipe's defaults: swe_fix's with a longer context; with CUDA the harness on its defaults for
    Qwen2.5-Coder-1.5B-Instruct with a 32K context, else `cpu_model` (taught_harness_model)."""
    on_gpu = models.gpu_defaults()
    return {**swe_fix.DEFAULTS,
            "run.model": "Qwen/Qwen2.5-Coder-1.5B-Instruct" if on_gpu else cpu_model,
            "rollout.max_turns": 16 if on_gpu else 6,         # the runner's budget: step_timeout_s x max_turns
            "rollout.max_tokens": 1024 if on_gpu else 256,   # the longest demonstrated reply: 167 ids (Codex's)
            "rollout.max_length": 32768 if on_gpu else 8192}


# ---- one rollout: a harness in the jail, on one of swe_fix's repositories -----------------------------------------

class HarnessAgent(ProcessAgent):
    """A harness run unchanged on one repository with a planted bug (swe_fix's tasks), graded by swe_fix's hidden
    tests on what it left. A recipe names the harness and fills `arguments` (its own flags), `settings` (files of
    its configuration, written into home/), `harness_environment`, and `accepts_exit` (the harness's own report of a
    reply cut at max_tokens or a full context: the episode ended there, truncated). `short_prompt`: the documented
    settings that shorten the harness's prompt (a CPU's tiny model, whose teaching cost grows with the prompt: the
    default without CUDA); False runs it on its defaults, as a real model gets it."""

    harness: Harness
    short_prompt: bool = not models.gpu_defaults()
    compaction_room = 1024               # ids a turn may add above the compaction threshold before the harness counts
                                         # again (the tool results it appends), beside a reply
    jail = True
    timeout_s = 300.0                    # keep below the runner's budget (--rollout.step_timeout_s x max_turns)

    @property
    def jail_binds(self) -> dict[str, str]:
        return self.harness.jail_binds()

    def arguments(self, ctx, ws) -> list[str]:
        raise NotImplementedError

    def settings(self, ctx, ws) -> dict[str, str]:
        """{path under home/: text}: the harness's configuration files."""
        return {}

    def harness_environment(self, ctx, ws) -> dict[str, str]:
        return {}

    def compaction_threshold(self, ctx) -> int | None:
        """The tokens past which a recipe sets its harness to compact and go on (docs/agents.md#compaction): the
        session's context less a reply and compaction_room; None where the context leaves no such room."""
        return max(ctx.max_length - ctx.sampling_params["max_tokens"] - self.compaction_room, 0) or None

    def harness_info(self, stdout: str) -> dict[str, float]:
        """What the harness reported (its own JSON output), as numbers for Result.info."""
        return {}

    def prepare(self, ctx, ws) -> None:
        swe_fix.write_repository(ctx, ws)
        for path, text in self.settings(ctx, ws).items():
            os.makedirs(os.path.dirname(os.path.join(ws.home, path)), exist_ok=True)
            with open(os.path.join(ws.home, path), "w") as f:
                f.write(text)

    def command(self, ctx, ws) -> list[str]:
        return [*self.harness.argv(), *self.arguments(ctx, ws)]

    def environment(self, ctx, ws) -> dict[str, str]:
        # `python` is this environment's, for the tests the model runs; the harness's own variables after
        return {"PATH": f"{JAIL_VENV}/bin:/usr/local/bin:/usr/bin:/bin", "SHELL": "/bin/bash",
                **self.harness_environment(ctx, ws)}

    def grade(self, ctx, ws, run) -> Result:
        info = self.harness_info(run.stdout)           # the harness's report, read before the hidden tests run
        result = swe_fix.grade_repository(ctx, ws)
        result.info.update(info)
        # an exit the recipe's accepts_exit took (the harness's own report of a reply cut at max_tokens or a full
        # context): an episode that ended truncated, not a failed process
        result.truncated = result.truncated or run.exit_code != 0
        return result


def json_lines(stdout: str) -> list[dict]:
    """The JSON objects a harness printed, one a line (its --json / --output-format json output); other lines (a
    harness's warnings) are skipped. Its stdout is the jailed tree's to write, so each line's values are counted
    (agents.graders.json_events) before it is parsed, within one budget for the whole output: past it,
    ProcessFailure("process_grade")."""
    found, budget = [], JSON_EVENTS
    for number, line in enumerate(stdout.splitlines(), 1):
        try:
            budget -= json_events(line, f"stdout line {number}", budget)
            value = json.loads(line)
        except ValueError:
            continue
        except AgentFileError as exc:
            raise ProcessFailure("process_grade", f"the harness's output is refused: {exc}") from None
        if isinstance(value, dict):
            found.append(value)
    return found


# ---- the CPU model: a tiny Qwen3 taught a harness's tool format on its own requests --------------------------------

def call(name: str, arguments: dict) -> str:
    """A Hermes tool call as the model writes it (what wires.parse_hermes_tool_calls reads)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def harvest(agent_cls: type[HarnessAgent], tasks: list, scripts: list[list[str]]) -> list[str]:
    """Each task's demonstration as the server rendered it for the policy: `agent_cls` runs the harness, jailed, on
    the task's repository against a LoopbackServer whose engine answers with the task's script. Raises RuntimeError
    when a harness asked for more or fewer replies than its script holds, or failed."""
    tokenizer = models.bpe_tokenizer()
    engine = ScriptEngine(tokenizer)
    runner = type("HarvestRunner", (ChatAgentRunner,), {"agent_cls": agent_cls})(
        engine, tokenizer, max_turns=max(len(script) for script in scripts), max_length=1 << 16)
    generations = []
    try:
        for task, script in zip(tasks, scripts):
            engine.replies = list(script)
            rollouts = runner.run([task], ["harvest"], SamplingParams(max_tokens=1024))
            if not rollouts or engine.replies or rollouts[0].num_turns != len(script):
                raise RuntimeError(f"harvesting {agent_cls.harness.name} on {task.task_id}: {len(script)} replies "
                                   f"scripted, {rollouts[0].num_turns if rollouts else 0} asked for (failures: "
                                   f"{runner.failures}); the harness and the script disagree")
            generations += rollouts[0].generations
            models.progress(f"harvested {task.task_id}: {len(script)} turns")
    finally:
        runner.server.stop()
    return teaching_texts(tokenizer, generations)


def taught_harness_model(agent_cls: type[HarnessAgent], script: Callable[[data.Task], list[str]], steps: int,
                         another_run: Callable[[str, random.Random], str] | None = None, variants: int = 0) -> str:
    """A tiny Qwen3 taught the demonstration of every bug of swe_fix (`script(task)`: the replies of its episode),
    harvested once into the cache (named by what shapes it: header) and taught its replies by
    models.taught_replies_model_dir. Every bug, train and held-out alike: the model learns the harness's format (and
    repeats the demonstrated fixes). A harness whose tool results differ from run to run (Codex's chunk ids and wall
    times) gives `another_run(text, rng)`, the text as another run renders it: each demonstration is also taught in
    `variants` such renderings (seeded), so that the replies follow the task, not one run's ids."""
    tokenizer = models.bpe_tokenizer()
    agent_cls = type(agent_cls.__name__, (agent_cls,), {"short_prompt": True})   # the CPU's prompt, on any machine
    tasks = [swe_fix.task(*problem) for problem in PROBLEMS]
    scripts = [script(task) for task in tasks]
    # what shapes the texts: the harness, the recipe's file (train.py loads it under a module name of its own), this
    # file, the server's rendering (loopback.py, session.py, data.py, the wires), the replies, the tokenizer
    root = os.path.dirname(HARNESSES_DIR)
    sources = [script.__code__.co_filename, __file__, *sorted(glob.glob(os.path.join(root, "wires", "*.py"))),
               *(os.path.join(root, f"{name}.py") for name in ("loopback", "session", "data"))]
    fingerprint = hashlib.sha256(json.dumps([agent_cls.harness.version, scripts,
                                             tokenizer.backend_tokenizer.to_str()]).encode())
    for source in sources:
        with open(source, "rb") as f:
            fingerprint.update(f.read())

    def write(folder: str) -> None:
        with open(os.path.join(folder, "demonstrations.json"), "w") as f:
            json.dump(harvest(agent_cls, tasks, scripts), f)

    what = f"harvesting {agent_cls.harness.name}'s requests over {len(tasks)} demonstrations"
    folder = models._cached_folder(f"harvest-{agent_cls.harness.name}-{fingerprint.hexdigest()[:10]}", write, what)
    with open(os.path.join(folder, "demonstrations.json")) as f:
        texts = json.load(f)
    if another_run:
        rng = random.Random(0)
        texts += [another_run(text, rng) for _ in range(variants) for text in texts]
    return models.taught_replies_model_dir(texts, steps=steps)


def demonstration_edit(task) -> tuple[str, str, str, str]:
    """(module file, its buggy line, that line fixed, test file) of a swe_fix task: what a demonstration edits."""
    label = json.loads(task.label)
    name = label["name"]
    old, new = swe_fix.FIXES[name]
    line = next(line for line in label["files"][f"{name}.py"].splitlines() if old in line)
    return f"{name}.py", line, line.replace(old, new), f"test_{name}.py"

