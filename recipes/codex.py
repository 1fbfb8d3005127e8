# recipes/codex.py — repository fixing by Codex, the harness unchanged (`codex exec`), as a jailed process.
#
# Each rollout runs Codex's CLI (npm's @openai/codex, pinned in harnesses/package.json: its Node shim over its native
# binary, agents/harness.py) on one of swe_fix's repositories with a planted bug, in the jail, pointed at the
# rollout's session only through its documented configuration: a config.toml in a CODEX_HOME of the rollout's own
# whose model provider speaks the Responses API (`wire_api = "responses"`) at the session's base_url, with the key in
# OPENAI_API_KEY (`env_key`; ProcessAgent sets it to the session's); the update check, analytics and feedback off;
# its own sandbox and approvals off (--dangerously-bypass-approvals-and-sandbox, meant for an environment that is
# sandboxed outside: the jail); nothing persisted (--ephemeral); a configuration key it does not know refused
# (--strict-config). `codex exec --json` prints its events, one JSON object a line: the commands it ran and the
# files it patched are the rollout's info. Codex has no turn limit: an episode ends when the model answers without a
# tool call, when the context is full (the server's context_length_exceeded), or at the deadline. The reward is
# swe_fix's: the hidden tests on what it left of the module.
# Defaults: on a CPU, the documented settings that shorten its prompt (model_instructions_file: a line of
# instructions for its own; the permissions, apps, environment and skills sections left out; web search, the
# multi-agent and goal tools off): a first request of 5.9 KB instead of 40 KB, for a tiny Qwen3 taught its tool
# format on its own requests, harvested through the loopback server (cat the module, apply_patch it, run the tests,
# answer); the full prompt would cost the teaching ~40 times as much (docs/agents.md). With CUDA, Codex on its
# defaults for Qwen2.5-Coder-1.5B-Instruct, with a 32K context.
import json
import os
import random
import re

import data
import models
from agents import ChatAgentRunner
from agents.harness import (CODEX, HarnessAgent, call, demonstration_edit, json_lines, recipe_defaults,
                            taught_harness_model)
from recipes import swe_fix

INSTRUCTIONS = "You fix bugs in the repository in the current directory: read the module, patch it, run its tests."
CPU_MODEL = "tiny-qwen3-codex"

DEFAULTS = recipe_defaults(CPU_MODEL)


tasks = swe_fix.tasks       # swe_fix's repositories, one planted bug each (held-out splits: functions never trained on)


def notice(cfg) -> str:
    if cfg["run"].model == CPU_MODEL:
        return (f"codex: a PIPELINE run, not a learning run: {CPU_MODEL} is a tiny random Qwen3 taught Codex's tool "
                f"format (exec_command, apply_patch) on its own requests, with the demonstrated fix of every bug; "
                f"Codex {CODEX.version} runs with the settings that shorten its prompt")
    return f"codex: Codex {CODEX.version} on its defaults, model {cfg['run'].model}"


# ---- Codex, as a process per rollout ------------------------------------------------------------------------------

toml_string = json.dumps        # a TOML basic string: JSON's escapes are TOML's


class CodexAgent(HarnessAgent):
    harness = CODEX

    def settings(self, ctx, ws) -> dict[str, str]:
        home = os.path.join(ws.home, "codex")
        # compaction: the session's context is the model's window, and Codex compacts past compaction_threshold
        threshold = self.compaction_threshold(ctx)
        lines = [f"model = {toml_string(ctx.model_name)}", 'model_provider = "tracerl"',
                 "check_for_update_on_startup = false", f"model_context_window = {ctx.max_length}",
                 *([f"model_auto_compact_token_limit = {threshold}"] if threshold else [])]
        files = {}
        if self.short_prompt:
            files["codex/instructions.md"] = INSTRUCTIONS + "\n"
            lines += [f"model_instructions_file = {toml_string(os.path.join(home, 'instructions.md'))}",
                      "include_permissions_instructions = false", "include_apps_instructions = false",
                      "include_environment_context = false", 'web_search = "disabled"']
        lines += ["", "[model_providers.tracerl]", 'name = "tracerl loopback session"',
                  f"base_url = {toml_string(ctx.base_url)}", 'env_key = "OPENAI_API_KEY"', 'wire_api = "responses"',
                  "", "[analytics]", "enabled = false", "", "[feedback]", "enabled = false"]
        if self.short_prompt:
            lines += ["", "[agents]", "enabled = false", "", "[features]", "goals = false", "", "[skills]",
                      "include_instructions = false"]
        files["codex/config.toml"] = "\n".join(lines) + "\n"
        return files

    def prepare(self, ctx, ws) -> None:
        super().prepare(ctx, ws)
        os.mkdir(os.path.join(ws.home, "tmp"))

    def arguments(self, ctx, ws) -> list[str]:
        return ["exec", "--json", "--color", "never", "--skip-git-repo-check", "--ephemeral", "--strict-config",
                "--dangerously-bypass-approvals-and-sandbox", ctx.prompt]

    def harness_environment(self, ctx, ws) -> dict[str, str]:
        # a temporary directory beside CODEX_HOME, not around it: Codex makes its command aliases (apply_patch) only
        # in a home outside the temporary directory
        return {"CODEX_HOME": os.path.join(ws.home, "codex"), "TMPDIR": os.path.join(ws.home, "tmp")}

    def harness_info(self, stdout: str) -> dict[str, float]:
        items = [event.get("item") for event in json_lines(stdout) if event.get("type") == "item.completed"]
        kinds = [item.get("type") for item in items if isinstance(item, dict)]
        return {"codex_commands": float(kinds.count("command_execution")),
                "codex_patches": float(kinds.count("file_change")),
                "codex_answered": float("agent_message" in kinds)}

    def accepts_exit(self, run) -> bool:
        # `codex exec` ends its turn failed, and exits 1, on a reply cut at max_output_tokens and on a full context
        failed = [event.get("error") for event in json_lines(run.stdout) if event.get("type") == "turn.failed"]
        message = str(failed[-1].get("message", "")) if failed and isinstance(failed[-1], dict) else ""
        return "reason: max_output_tokens" in message or "out of room in the model's context window" in message


class AgentRunner(ChatAgentRunner):
    agent_cls = CodexAgent


# ---- the CPU model: a tiny Qwen3 taught Codex's tool format ------------------------------------------------------

def script(task: data.Task) -> list[str]:
    """The replies of one demonstration: cat the module, apply_patch its bug away (Codex runs an apply_patch
    command itself), run its tests, answer."""
    module, line, fixed, test = demonstration_edit(task)
    patch = f"*** Begin Patch\n*** Update File: {module}\n@@\n-{line}\n+{fixed}\n*** End Patch"
    return [call("exec_command", {"cmd": f"cat {module}"}),
            call("exec_command", {"cmd": f"apply_patch <<'EOF'\n{patch}\nEOF"}),
            call("exec_command", {"cmd": f"python {test}"}),
            f"Fixed {module}: the tests pass."]


def another_run(text: str, rng: random.Random) -> str:
    """A harvested demonstration as another run renders it: each command's result carries a random chunk id and the
    command's wall time (0.0000 s on a fast machine, milliseconds on a slow one), and nothing else differs."""
    text = re.sub(r"Chunk ID: [0-9a-f]{6}", lambda _: f"Chunk ID: {rng.getrandbits(24):06x}", text)
    return re.sub(r"Wall time: \d+\.\d{4} seconds",
                  lambda _: f"Wall time: {rng.choice([0.0, rng.uniform(0.0, 0.05)]):.4f} seconds", text)


def taught_model() -> str:
    return taught_harness_model(CodexAgent, script, steps=200, another_run=another_run, variants=3)


models.MODEL_NAMES[CPU_MODEL] = taught_model
