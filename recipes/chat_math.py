# recipes/chat_math.py — the math recipe, with the agent written against the stock OpenAI SDK.
#
# Same tasks, defaults and grader as recipes/math.py; the difference is the agent's form: it owns its
# loop and talks to a per-rollout loopback session, exactly as it would talk to any OpenAI endpoint.
from openai import AsyncOpenAI

from agents import ChatAgent, ChatAgentRunner, Result
from agents.graders import grade
from recipes.math import DEFAULTS, tasks  # noqa: F401  (read from this module: config.py, train.py)


class MathChatAgent(ChatAgent):
    async def run(self, ctx) -> Result:
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        reward = grade(reply.choices[0].message.content or "", ctx.label)
        return Result(reward=reward, score=reward)


class AgentRunner(ChatAgentRunner):
    agent_cls = MathChatAgent
