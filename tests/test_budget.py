# A rollout's budget (session.Budget): --rollout.max_turns model calls and max_turns x max_tokens sampled tokens,
# over the whole rollout, whatever the agent asks. A chat agent that keeps asking, through the real server and the real
# SDKs on every wire (OpenAI chat completions and Responses, Anthropic messages; streamed and not), past its turns and
# past its tokens: the rollout's rows hold at most the budget (each sampled token trainable once), a request's
# max_tokens is clipped to what is left and the reply's usage says so, and every request after the budget is spent is
# answered in its wire's own words as a reply cut at its token limit with no token in it (nothing sampled, nothing
# recorded); the rollout is truncated. The same holds for a program over HTTP (ProcessAgent), and for an Env whose
# later turns ask for more tokens than the budget has left.
import sys

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

import data
import models
from agents import ChatAgent, ChatAgentRunner, Env, EnvRunner, Result
from agents.process import ProcessAgent
from engines import SamplingParams
from invariants import check_sampled_once
from rollout import EmbeddedEngine

MAX_TURNS, MAX_TOKENS = 2, 8                    # the budget: 2 turns, 16 sampled tokens
ASKS = 6                                        # the requests a greedy agent makes, well past either budget
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, seed=0)
CUT = {"chat": "length", "responses": "incomplete", "messages": "max_tokens"}   # each wire's "cut at its limit"
SEEN: dict[str, list[dict]] = {}                # task id -> per request: what the agent was answered


@pytest.fixture(scope="module")
def tokenizer():
    return models.bpe_tokenizer()


@pytest.fixture
def engine():
    return EmbeddedEngine(models.tiny_model("qwen3", seed=0))     # fresh per test: its seeded sampler repeats


async def ask(ctx, wire: str, stream: bool, max_tokens: int, messages: list[dict]) -> dict:
    """One request on `wire` with a stock SDK; what the agent reads of the reply: its text, how it ended, the tokens
    it holds and the budget's report in its usage."""
    if wire == "messages":
        async with AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0) as client:
            if not stream:
                reply = await client.messages.create(model=ctx.model_name, max_tokens=max_tokens, messages=messages)
                return {"text": "".join(b.text for b in reply.content if b.type == "text"), "end": reply.stop_reason,
                        "tokens": reply.usage.output_tokens, "budget": reply.usage.model_extra.get("rollout_budget")}
            got = {"text": ""}
            async for event in await client.messages.create(model=ctx.model_name, max_tokens=max_tokens,
                                                            messages=messages, stream=True):
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    got["text"] += event.delta.text
                elif event.type == "message_delta":
                    got.update(end=event.delta.stop_reason, tokens=event.usage.output_tokens,
                               budget=event.usage.model_extra.get("rollout_budget"))
            return got
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        if wire == "responses":
            if stream:
                async for event in await client.responses.create(model=ctx.model_name, input=messages,
                                                                 max_output_tokens=max_tokens, stream=True):
                    if event.type in ("response.completed", "response.incomplete"):
                        reply = event.response
            else:
                reply = await client.responses.create(model=ctx.model_name, input=messages,
                                                      max_output_tokens=max_tokens)
            return {"text": reply.output_text, "end": reply.status, "tokens": reply.usage.output_tokens,
                    "budget": reply.usage.model_extra.get("rollout_budget")}
        if not stream:
            reply = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=max_tokens)
            return {"text": reply.choices[0].message.content, "end": reply.choices[0].finish_reason,
                    "tokens": reply.usage.completion_tokens, "budget": reply.usage.model_extra.get("rollout_budget")}
        got = {"text": ""}
        async for chunk in await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                                max_tokens=max_tokens, stream=True,
                                                                stream_options={"include_usage": True}):
            for choice in chunk.choices:
                got["text"] += choice.delta.content or ""
                got["end"] = choice.finish_reason or got.get("end")
            if chunk.usage is not None:
                got.update(tokens=chunk.usage.completion_tokens,
                           budget=chunk.usage.model_extra.get("rollout_budget"))
        return got


class GreedyAgent(ChatAgent):
    """Asks ASKS times, each time echoing the reply it got and asking on. Its task id says the wire, whether it
    streams, and the max_tokens each request asks for ("chat stream 100")."""

    async def run(self, ctx):
        wire, stream, max_tokens = ctx.task.task_id.split()
        messages, answers = list(ctx.messages), SEEN.setdefault(ctx.task.task_id, [])
        for _ in range(ASKS):
            answers.append(await ask(ctx, wire, stream == "stream", int(max_tokens), messages))
            echo = [{"role": "assistant", "content": answers[-1]["text"]}] if answers[-1]["text"] else []
            messages += [*echo, {"role": "user", "content": "Go on."}]
        return Result(reward=1.0)


# Which budget binds: asking the run's max_tokens, the turns run out; asking 100, the tokens do (the first request is
# clipped to the 16 the budget holds). Each wire is driven both streamed and not, once for each budget.
@pytest.mark.parametrize("task_id", ["chat plain 8", "responses stream 8", "messages stream 8",
                                     "chat stream 100", "responses plain 100", "messages plain 100"])
def test_a_chat_agent_asking_past_its_budget_gets_a_cut_reply_and_its_rollout_holds_only_the_budget(
        engine, tokenizer, task_id):
    runner = type("Runner", (ChatAgentRunner,), {"agent_cls": GreedyAgent, "template": data.CHATML_TEMPLATE})(
        engine, tokenizer, max_turns=MAX_TURNS, max_length=1024)
    SEEN.pop(task_id, None)
    try:
        rollouts = runner.run([data.Task(task_id, [{"role": "user", "content": "Say hi."}], label="")], ["g"],
                              SAMPLING)
    finally:
        runner.server.stop()
    assert runner.failures == {} and len(rollouts) == 1
    rollout, answers = rollouts[0], SEEN[task_id]
    wire, asked = task_id.split()[0], int(task_id.split()[2])
    trained = sum(row.num_trainable for row in rollout.rows)
    turns = len(rollout.generations)
    print(f"{task_id}: {turns} turns, {trained} trainable tokens in {len(rollout.rows)} rows; answers "
          f"{[(a['end'], a['tokens']) for a in answers]}")
    assert turns <= MAX_TURNS and trained <= MAX_TURNS * MAX_TOKENS
    check_sampled_once(rollout.rows, rollout.generations)       # each sampled token trainable once, within budget
    assert [a["tokens"] for a in answers[:turns]] == [len(g.token_ids) for g in rollout.generations]
    # every request past the budget: its wire's "cut at the token limit", no token, the budget named in its usage
    spent = answers[turns:]
    assert len(spent) == ASKS - turns > 0
    assert all(a["end"] == CUT[wire] and a["tokens"] == 0 and a["text"] == "" for a in spent)
    assert all(a["budget"]["max_tokens"] == 0 and a["budget"]["turns_left"] * a["budget"]["tokens_left"] == 0
               and "budget" in a["budget"]["message"] for a in spent)
    if asked > MAX_TURNS * MAX_TOKENS:     # the first request was clipped to the whole budget, and said so
        assert answers[0]["budget"]["max_tokens"] == MAX_TURNS * MAX_TOKENS
    else:                                  # the run's max_tokens never met the budget: nothing to report
        assert [a["budget"] for a in answers[:turns]] == [None] * turns
    assert rollout.truncated                                   # it asked for more than it could have


# ---- a program over HTTP: the same session, the same budget ------------------------------------------------------

GREEDY_PROGRAM = """
import json, openai
client, messages, answers = openai.OpenAI(max_retries=0), [{"role": "user", "content": "Say hi."}], []
for _ in range(%d):
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=100)
    answers.append([reply.choices[0].finish_reason, reply.usage.completion_tokens])
    messages += [{"role": "user", "content": "Go on."}]
print(json.dumps({"reward": 1.0, "info": {"refused": sum(a == ["length", 0] for a in answers)}}))
""" % ASKS


class GreedyProgram(ProcessAgent):
    def command(self, ctx, ws):
        return [sys.executable, "-c", GREEDY_PROGRAM]


def test_a_program_asking_past_its_budget_over_http_samples_only_the_budget(engine, tokenizer):
    runner = type("Runner", (ChatAgentRunner,), {"agent_cls": GreedyProgram})(engine, tokenizer, max_turns=MAX_TURNS,
                                                                               max_length=1024)
    try:
        (rollout,) = runner.run([data.Task("p", [{"role": "user", "content": "Say hi."}], label="")], ["g"], SAMPLING)
    finally:
        runner.server.stop()
    trained = sum(row.num_trainable for row in rollout.rows)
    print(f"program: {len(rollout.generations)} turns, {trained} trainable tokens, info {rollout.info}")
    assert len(rollout.generations) <= MAX_TURNS and trained <= MAX_TURNS * MAX_TOKENS
    check_sampled_once(rollout.rows, rollout.generations)
    assert rollout.info["refused"] == ASKS - len(rollout.generations) and rollout.truncated


# ---- an Env whose later turns ask for more tokens than the budget has left ---------------------------------------

class AskingMoreEnv(Env):
    """Never terminates; each step asks the next turn for 100 tokens (Result.sampling_params)."""

    def step(self, action_text: str) -> Result:
        return Result(reward=0.0, observation="\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
                      terminated=False, sampling_params={"max_tokens": 100})


def test_an_env_whose_turns_ask_past_the_budget_samples_only_the_budget(engine, tokenizer):
    runner = type("Runner", (EnvRunner,), {"env_cls": AskingMoreEnv})(engine, tokenizer, max_turns=MAX_TURNS,
                                                                       max_length=1024)
    (rollout,) = runner.run([data.Task("e", [{"role": "user", "content": "Say hi."}], label="")], ["g"], SAMPLING)
    trained = sum(row.num_trainable for row in rollout.rows)
    print(f"env: {rollout.num_turns} turns, {[len(g.token_ids) for g in rollout.generations]} tokens a turn")
    assert rollout.num_turns <= MAX_TURNS and trained <= MAX_TURNS * MAX_TOKENS and rollout.truncated
    check_sampled_once(rollout.rows, rollout.generations)
