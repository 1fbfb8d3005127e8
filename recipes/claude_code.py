# recipes/claude_code.py — repository fixing by Claude Code, the harness unchanged (`claude -p`), as a jailed process.
#
# Each rollout runs Claude Code's CLI (npm's @anthropic-ai/claude-code, pinned in harnesses/package.json; its native
# binary, agents/harness.py) on one of swe_fix's repositories with a planted bug, in the jail, pointed at the
# rollout's session only through its documented settings: ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY (the session's,
# which ProcessAgent sets), --model, telemetry, error reports, the auto-updater and all nonessential traffic off
# (DISABLE_TELEMETRY, DISABLE_ERROR_REPORTING, DISABLE_AUTOUPDATER, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC), a
# reply's budget the run's (CLAUDE_CODE_MAX_OUTPUT_TOKENS), its turns the run's (--max-turns), and its permission
# prompts off (--dangerously-skip-permissions: the jail contains it; Claude Code refuses the flag to root, and the
# jail never runs it as root). Its last stdout line (--output-format json) reports the turns it took. The reward is
# swe_fix's: the hidden tests on what it left of the module.
# Defaults: on a CPU, the documented settings that shorten its prompt (--bare: no hooks, plugins, attribution, memory
# or CLAUDE.md discovery; --system-prompt: a system prompt of one line for its own; --tools Bash,Read,Edit: three of
# its built-in tools): a first request of 4.2 KB instead of 49 KB, for a tiny Qwen3 taught its tool format on its own
# requests, harvested through the loopback server (read the module, edit it, run the tests, answer); the full prompt
# would cost the teaching ~40 times as much (docs/agents.md). With CUDA, Claude Code on its defaults for
# Qwen2.5-Coder-1.5B-Instruct, with a 32K context.
import data
import models
from agents import ChatAgentRunner
from agents.harness import (CLAUDE_CODE, HarnessAgent, call, demonstration_edit, json_lines, recipe_defaults,
                            taught_harness_model)
from recipes import swe_fix

SYSTEM = "You fix bugs in the repository in the current directory: read the module, edit it, run its tests."
CPU_MODEL = "tiny-qwen3-claude-code"

DEFAULTS = recipe_defaults(CPU_MODEL)


tasks = swe_fix.tasks       # swe_fix's repositories, one planted bug each (held-out splits: functions never trained on)


def notice(cfg) -> str:
    if cfg["run"].model == CPU_MODEL:
        return (f"claude_code: a PIPELINE run, not a learning run: {CPU_MODEL} is a tiny random Qwen3 taught Claude "
                f"Code's tool format (Read, Edit, Bash) on its own requests, with the demonstrated fix of every bug; "
                f"Claude Code {CLAUDE_CODE.version} runs with the settings that shorten its prompt")
    return f"claude_code: Claude Code {CLAUDE_CODE.version} on its defaults, model {cfg['run'].model}"


# ---- Claude Code, as a process per rollout ------------------------------------------------------------------------

class ClaudeCodeAgent(HarnessAgent):
    harness = CLAUDE_CODE
    compaction_room = 4096               # and what its summary request adds to the conversation: its instruction
                                         # (4,000 ids of the tiny models' BPE, about 1,500 of Qwen's)

    def arguments(self, ctx, ws) -> list[str]:
        short = ["--bare", "--system-prompt", SYSTEM, "--tools", "Bash,Read,Edit"] if self.short_prompt else []
        return ["-p", ctx.prompt, "--model", ctx.model_name, "--max-turns", str(ctx.max_turns),
                "--dangerously-skip-permissions", "--output-format", "json", *short]

    def harness_environment(self, ctx, ws) -> dict[str, str]:
        # CLAUDE_CODE_ATTRIBUTION_HEADER=0: no billing line for Anthropic's API atop the system prompt (its hash of the
        # first user message would make every task's system prompt differ from its first tokens). Compaction: Claude
        # Code takes a model it does not know for a 200K one and would compact near that, never within a smaller
        # session; its auto-compact window (100K at least) and a percentage of it less a reply put its threshold at
        # compaction_threshold
        max_tokens, threshold = ctx.sampling_params["max_tokens"], self.compaction_threshold(ctx)
        window = max(100_000, ctx.max_length)
        compaction = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window), "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE":
                      f"{100 * threshold / (window - max_tokens):.4f}"} if threshold else {}
        return {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens), **compaction}

    @staticmethod
    def report(stdout: str) -> dict:
        """The last result line `claude -p` printed (--output-format json), {} if none."""
        return next((line for line in reversed(json_lines(stdout)) if line.get("type") == "result"), {})

    def harness_info(self, stdout: str) -> dict[str, float]:
        report = self.report(stdout)
        return {"claude_turns": float(report.get("num_turns") or 0),
                "claude_error": float(bool(report.get("is_error")))} if report else {}

    def accepts_exit(self, run) -> bool:
        # `claude -p` reports an error, and exits 1, on a reply cut at its output limit (the rollout's budget spent
        # answers so too), on a prompt too long, and at --max-turns (the run's turn budget: it stops itself where the
        # session would refuse its next call; a side request, which its --max-turns does not count, makes the session's
        # answer come first)
        report = self.report(run.stdout)
        return report.get("api_error") == "max_output_tokens" or \
            report.get("terminal_reason") in ("prompt_too_long", "max_turns")


class AgentRunner(ChatAgentRunner):
    agent_cls = ClaudeCodeAgent


# ---- the CPU model: a tiny Qwen3 taught Claude Code's tool format ------------------------------------------------

def script(task: data.Task) -> list[str]:
    """The replies of one demonstration: read the module, edit its bug away, run its tests, answer. The edit's
    arguments are in the order Claude Code sends them back (its defaults first), so its echo is what was sampled."""
    module, line, fixed, test = demonstration_edit(task)
    return [call("Read", {"file_path": module}),
            call("Edit", {"replace_all": False, "file_path": module, "old_string": line.strip(),
                          "new_string": fixed.strip()}),
            call("Bash", {"command": f"python {test}", "description": "Run the tests"}),
            f"Fixed {module}: the tests pass."]


def taught_model() -> str:
    return taught_harness_model(ClaudeCodeAgent, script, steps=200)


models.MODEL_NAMES[CPU_MODEL] = taught_model
