# recipes/agents_sdk.py — the agent is an OpenAI Agents SDK `Agent` with a function tool (a calculator), run by
# the SDK's own `Runner.run` against the rollout's loopback session; GRPO on the graded final answer.
#
# The whole recipe: the tool, the problems, the defaults, the CPU model and the agent. The SDK's names come from
# `agents` beside tracerl's (agents/__init__.py says how one package serves both). The SDK reaches the session
# through its OpenAIChatCompletionsModel over an AsyncOpenAI client, as it would reach any chat-completions
# endpoint; its traces stay local (tracing_disabled: nothing is uploaded). A model that calls a tool the agent
# does not have, or runs out of turns, scores 0 (a real sample of the policy, kept for training).
# Defaults: on a CPU, a tiny Qwen3 taught the calculator's call format (a PIPELINE run: it learned the shape of a
# call and an answer, not arithmetic); with CUDA, Qwen2.5-1.5B-Instruct, which calls tools natively.
import random

from openai import AsyncOpenAI

import data
import models
from agents import (Agent, ChatAgent, ChatAgentRunner, MaxTurnsExceeded, ModelBehaviorError,
                    OpenAIChatCompletionsModel, Result, RunConfig, Runner, ToolCallItem, function_tool)
from agents.graders import grade
from agents.models.chatcmpl_converter import Converter
from agents.tools import ToolError
from recipes.tool_use import calculate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / ^, parentheses, sqrt)."""
    try:
        return calculate({"expression": expression})
    except ToolError as error:            # the refusal is the model's to read, as in recipes/tool_use.py
        return str(error)


INSTRUCTIONS = "Use the calculator for the arithmetic, then give the final answer in \\boxed{}."

ON_GPU = models.gpu_defaults()
CPU_MODEL = "tiny-qwen3-calculator"
DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-1.5B-Instruct" if ON_GPU else CPU_MODEL,
    "run.steps": 100 if ON_GPU else 10,
    "rollout.prompts_per_step": 16 if ON_GPU else 4,
    "rollout.max_turns": 3,               # a calculator call, the answer, one turn to spare
    "rollout.max_tokens": 256 if ON_GPU else 48,
    "rollout.max_length": 2048 if ON_GPU else 1024,
    "actor.lr": 1e-6 if ON_GPU else 2e-5,
}


def tasks(split: str, seed: int) -> list[data.Task]:
    """a * b + c with two-digit factors: easy with the calculator, hard for a small model in its head. Train and
    held-out problems come from disjoint seeds."""
    rng = random.Random(seed if split == "train" else seed + 10_000)
    out = []
    for i in range(512):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 999)
        out.append(data.Task(f"agents-sdk-{split}-{i}", [{"role": "user", "content": f"What is {a} * {b} + {c}?"}],
                             str(a * b + c)))
    return out


def notice(cfg) -> str:
    if cfg["run"].model == CPU_MODEL:
        return (f"agents_sdk: a PIPELINE run, not a learning run: {CPU_MODEL} is a tiny random Qwen3 taught the "
                f"calculator's call format (it calls the tool and boxes a number, not the right one)")
    return f"agents_sdk: model {cfg['run'].model}"


# ---- the CPU model: a tiny Qwen3 that calls the calculator, then answers ----

def _demonstration(tokenizer, task: data.Task) -> tuple[str, list]:
    """One rendered episode as the SDK's requests show it: the instructions and the tool, the question, a
    calculator call, its output, the boxed answer."""
    expression = task.messages[0]["content"].removeprefix("What is ").removesuffix("?")
    schema = Converter.tool_to_openai(calculator)        # the tool as the SDK sends it
    messages = [{"role": "system", "content": INSTRUCTIONS}, *task.messages,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": calculator.name, "arguments": {"expression": expression}}}]},
                {"role": "tool", "content": task.label},
                {"role": "assistant", "content": f"The answer is \\boxed{{{task.label}}}."}]
    return data.render_prompt_text(tokenizer, messages, tools=[schema], add_generation_prompt=False), []


def taught_calculator_model() -> str:
    tokenizer = models.bpe_tokenizer()
    return models.taught_tiny_model_dir("qwen3", [_demonstration(tokenizer, t) for t in tasks("train", 777)[:128]])


models.MODEL_NAMES[CPU_MODEL] = taught_calculator_model


# ---- the agent ----

class CalculatorAgent(ChatAgent):
    async def run(self, ctx) -> Result:
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator],
                          model=OpenAIChatCompletionsModel(model=ctx.model_name, openai_client=client))
            try:
                result = await Runner.run(agent, ctx.prompt, max_turns=ctx.max_turns,
                                          run_config=RunConfig(tracing_disabled=True))
            except (MaxTurnsExceeded, ModelBehaviorError) as error:   # out of turns; an unknown tool, bad arguments
                items = error.run_data.new_items if error.run_data else []
                calls = sum(isinstance(item, ToolCallItem) for item in items)
                return Result(reward=0.0, score=0.0, truncated=isinstance(error, MaxTurnsExceeded),
                              info={"tool_calls": calls, "model_errors": 1.0})
        calls = sum(isinstance(item, ToolCallItem) for item in result.new_items)
        reward = grade(str(result.final_output), ctx.label)
        return Result(reward=reward, score=reward, info={"tool_calls": calls, "model_errors": 0.0})


class AgentRunner(ChatAgentRunner):
    agent_cls = CalculatorAgent
