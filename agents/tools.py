# agents/tools.py — tools a model calls by writing Hermes/Qwen <tool_call> blocks, and ToolEnv, the multi-turn Env
# that runs them between turns.
#
# Owns: `Tool` (an OpenAI function schema plus the Python that serves it), the `python` tool (agents/sandbox.py),
# `call_tool` (one call -> its output text, failures as text), and `ToolEnv`: each turn either calls tools (their
# outputs come back as the next observation, in the chat template's own <tool_response> blocks) or answers (graded
# against the task's label). Tool calls and tool errors are counted in Result.info, so they reach the metrics.
# Never: parses a reply any other way than the loopback server does (one parser, `wires.parse_hermes_tool_calls`),
# or lets a misbehaving tool end a rollout: an unknown tool, bad arguments, a crash or a sandbox limit is a counted
# tool error whose message the model reads.
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import data
from agents import Env, Result
from agents.graders import extract_final_answer, grade
from agents.sandbox import SandboxLimits, run_python
from wires import parse_hermes_tool_calls


class ToolError(Exception):
    """A failure the model should read (bad arguments, nothing found). Its message is the tool's reply, verbatim;
    start it with "[error]" so the model can tell it from an output."""


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict                       # JSON schema of the arguments object
    run: Callable[[dict], str]             # arguments -> output text; raise ToolError for a failure to show

    @property
    def schema(self) -> dict:
        """The OpenAI function schema, as `tools=` takes it (the chat template renders it into the prompt)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """`python(code)`: runs the code in the sandbox and returns what it printed (an error is a ToolError)."""
    def run(arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('[error] python needs {"code": "<a Python program>"}; print what you want to see')
        done = run_python(code, limits)
        if not done.ok:
            raise ToolError(done.tool_output())
        return done.tool_output()
    return Tool("python", "Run a Python 3 program (math, sympy and numpy are available; no network, no files) "
                "and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                 "required": ["code"]}, run)


def call_tool(tools: list[Tool], name: str, arguments: dict) -> tuple[str, bool]:
    """Run one call -> (output text, ok). Never raises: every failure is returned as text for the model."""
    by_name = {tool.name: tool for tool in tools}
    if name not in by_name:
        return f"[error] unknown tool {name!r}; the tools are: {', '.join(by_name)}", False
    try:
        return by_name[name].run(arguments), True
    except ToolError as error:
        return str(error), False
    except Exception as error:  # a tool's own bug is the model's tool error, never the rollout's end
        return f"[error] the {name} tool failed: {type(error).__name__}: {error}", False


# The chat glue after an assistant turn: each tool output is its own user block wrapping <tool_response> (as
# data.CHATML_TEMPLATE and Qwen's templates render a `tool` message), then the next assistant turn opens.
TOOL_RESPONSE = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>"
NEXT_TURN = "\n<|im_start|>assistant\n"


class ToolEnv(Env):
    """A multi-turn episode with tools. Subclass with `tools = [...]` and, if the answer is not graded by
    agents.graders.grade against the task's label, override `score(answer_text)`. The turn budget is the runner's
    max_turns: an episode still calling tools when it runs out ends truncated with reward 0."""

    tools: list[Tool] = []

    def reset(self, task) -> list[dict]:
        self.task = task
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0}
        return task.messages

    def tool_schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools]

    def score(self, answer_text: str) -> float:
        return grade(answer_text, self.task.label)

    def step(self, action_text: str) -> Result:
        message = parse_hermes_tool_calls(action_text, "call")
        calls = message.get("tool_calls") or []
        # a <tool_call> block the parser could not read (bad JSON, no name) is a tool error the model is shown
        broken = max(action_text.count("<tool_call>") - len(calls), 0)
        if not calls and not broken:
            reward = self.score(action_text)
            return Result(reward=reward, score=reward,
                          info={**self.counts, "answered": float(extract_final_answer(action_text) is not None)})
        replies = [call_tool(self.tools, call["function"]["name"], call["function"]["arguments"]) for call in calls]
        replies += [('[error] a <tool_call> block must hold one JSON object {"name": ..., "arguments": {...}}',
                     False)] * broken
        self.counts["tool_calls"] += len(replies)
        self.counts["tool_errors"] += sum(not ok for _, ok in replies)
        # a tool's output is text, never template: a "<|im_end|>" it prints stays characters (data.plain)
        observation = "".join(TOOL_RESPONSE.format(data.plain(output)) for output, _ in replies) + NEXT_TURN
        return Result(reward=0.0, observation=observation, terminated=False, info={**self.counts, "answered": 0.0})
