# recipes/geo3k_chat.py — the geo3k recipe, with the agent written against the stock OpenAI SDK.
#
# Same model, data, defaults and grader as recipes/geo3k.py. The agent owns its loop: it sends the diagram and the
# question with `tools=[python]`, runs each structured tool call the loopback server parsed from the model's
# <tool_call> blocks in the sandbox, answers with `tool` messages, and stops at a reply without calls (graded) or
# at the turn budget. Every turn is a real HTTP request to the rollout's loopback session.
import asyncio
import json

from openai import AsyncOpenAI, BadRequestError

from agents import ChatAgent, ChatAgentRunner, Result
from agents.graders import extract_final_answer, grade
from agents.tools import call_tool, python_tool
from recipes.geo3k import DEFAULTS, notice, tasks  # noqa: F401  (read from this module: config.py, train.py)

TOOLS = [python_tool()]


class Geo3kChatAgent(ChatAgent):
    async def run(self, ctx) -> Result:
        messages = list(ctx.messages)
        counts = {"tool_calls": 0.0, "tool_errors": 0.0}
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            for _ in range(ctx.max_turns):
                try:
                    reply = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                                 tools=[tool.schema for tool in TOOLS])
                except BadRequestError as error:
                    if "context" not in str(error):
                        raise
                    break            # the conversation outgrew the context: truncated, as the Env version ends
                message = reply.choices[0].message
                if not message.tool_calls:
                    text = message.content or ""
                    reward = grade(text, ctx.label)
                    return Result(reward=reward, score=reward,
                                  info={**counts, "answered": float(extract_final_answer(text) is not None)})
                messages.append(message.model_dump(exclude_none=True))    # the reply, echoed as it came
                for call in message.tool_calls:
                    try:
                        arguments = json.loads(call.function.arguments)
                    except json.JSONDecodeError:     # the server only passes valid JSON objects; be safe anyway
                        arguments = None
                    if isinstance(arguments, dict):   # the sandbox blocks: run it off the event loop
                        output, ok = await asyncio.to_thread(call_tool, TOOLS, call.function.name, arguments)
                    else:
                        output, ok = "[error] the arguments must be a JSON object", False
                    counts["tool_calls"] += 1
                    counts["tool_errors"] += not ok
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        return Result(reward=0.0, score=0.0, truncated=True, info={**counts, "answered": 0.0})


class AgentRunner(ChatAgentRunner):
    agent_cls = Geo3kChatAgent
