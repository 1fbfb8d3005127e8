# bench/compat_episodes.py — bench/compat_matrix.py's episodes: one short tool-calling task per agent library, the
# replies the tiny model is taught for each (SCRIPTS), and each library's own loop driving one episode against a
# loopback session (DRIVERS). The libraries run unchanged: a driver only builds the library's client, model and agent
# the way its documentation does, pointed at the session's URL and key.
import functools
import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # litellm would fetch its price list at import

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,  # noqa: E402
                    function_tool)
import anthropic  # noqa: E402
import litellm  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool as langchain_tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402
from openai import AsyncOpenAI, OpenAI, Stream  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic_ai import Agent as PydanticAgent  # noqa: E402
from pydantic_ai import NativeOutput, PromptedOutput  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from smolagents import OpenAIServerModel, ToolCallingAgent  # noqa: E402
from smolagents import tool  # noqa: E402

MODEL = "policy"                # the model name every library sends (the server serves one)


# ---- the episodes: one task per library, and what the model is taught to answer ------------------------------

def call(name: str, arguments: dict) -> str:
    """A Hermes tool call as the model writes it (what wires.parse_hermes_tool_calls reads)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Each conversation the model must answer differently ends in a question of its own: a tiny model reads the end of
# its context far better than a system prompt 2,000 tokens back.
JSON_ASK = " Reply in JSON."    # the structured-output episodes ask for JSON, so the model is taught JSON there
RESULT_ASK = " Give the result."   # pydantic-ai's ToolOutput: answered through its final_result tool
REPORT_ASK = " Report the sum."    # langchain's function_calling structured output: answered through a Sum tool

WEATHER_ASK, WEATHER_CALL, WEATHER_ANSWER = "What is the weather in Paris?", call("get_weather", {"city": "Paris"}), \
    "It is sunny in Paris."
WEATHER_JSON = json.dumps({"city": "Paris", "forecast": "sunny"})
CAPITAL_ASK, CAPITAL_CALL, CAPITAL_ANSWER = "What is the capital of France?", \
    call("lookup_capital", {"country": "France"}), "The capital of France is Paris."
CAPITAL_JSON = json.dumps({"country": "France", "capital": "Paris"})
CAPITAL_RESULT = call("final_result", {"country": "France", "capital": "Paris"})
SUM_ASK, SUM_CALL, SUM_ANSWER, SUM_JSON = "What is 2 plus 3?", call("add", {"a": 2, "b": 3}), "2 plus 3 is 5.", \
    json.dumps({"total": 5})
SUM_TOOL_CALL = call("Sum", {"total": 5})
PRODUCT_ASK, PRODUCT_CALL = "What is 6 times 7?", call("multiply", {"a": 6, "b": 7})
PRODUCT_ANSWER = call("final_answer", {"answer": "42"})
TIME_ASK, TIME_CALL, TIME_ANSWER = "What time is it in Tokyo?", call("get_time", {"zone": "Asia/Tokyo"}), \
    "It is 09:00 in Tokyo."
TIME_JSON = json.dumps({"zone": "Asia/Tokyo", "time": "09:00"})
STOCK_ASK, STOCK_CALL, STOCK_ANSWER = "What is the price of ACME?", call("get_stock", {"ticker": "ACME"}), \
    "ACME costs 42 dollars."


class Weather(BaseModel):
    city: str
    forecast: str


class Capital(BaseModel):
    country: str
    capital: str


class Sum(BaseModel):
    total: int


class Time(BaseModel):
    zone: str
    time: str


@function_tool
def get_weather(city: str) -> str:
    """Look up the weather in a city."""
    return "sunny"


def lookup_capital(country: str) -> str:
    """Look up the capital of a country."""
    return "Paris"


@langchain_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool                   # smolagents' (its source check wants the decorator's own name)
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def get_time(zone: str) -> str:
    return "09:00"


def get_stock(ticker: str) -> str:
    return "42 dollars"


TIME_TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
STOCK_TOOLS = [{"name": "get_stock", "description": "The price of a stock.",
                "input_schema": {"type": "object", "properties": {"ticker": {"type": "string"}},
                                 "required": ["ticker"]}}]


# ---- drivers: each library's own loop, one episode, its answer as text ------------------------------------------

def drive_openai_agents(info, settings: dict | None = None, structured: bool = False,
                        model_class=OpenAIChatCompletionsModel) -> str:
    """An Agents SDK Agent with a function tool, run by Runner over `model_class` (OpenAIChatCompletionsModel, or the
    SDK's default OpenAIResponsesModel); reset_tool_choice on, the SDK's default: a forced tool_choice holds for the
    first turn."""
    model = model_class(MODEL, AsyncOpenAI(base_url=info.base_url, api_key=info.api_key))
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(**(settings or {})),
                  output_type=Weather if structured else None)
    return str(Runner.run_sync(agent, WEATHER_ASK + (JSON_ASK if structured else ""), max_turns=4).final_output)


def drive_pydantic_ai(info, settings: dict | None = None, output=str, ask: str = CAPITAL_ASK) -> str:
    """A pydantic-ai Agent with a tool over OpenAIChatModel at the session's base_url; `output` is its output_type
    (a model class is ToolOutput, pydantic-ai's default: a final_result tool and tool_choice required)."""
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=info.base_url, api_key=info.api_key))
    agent = PydanticAgent(model, instructions="You answer questions about countries.", tools=[lookup_capital],
                          output_type=output)
    return str(agent.run_sync(ask, model_settings=settings).output)


def drive_langchain(info, chat: dict | None = None, bind: dict | None = None, first_bind: dict | None = None,
                    structured: str | None = None, ask: str = SUM_ASK) -> str:
    """langgraph's prebuilt ReAct agent over ChatOpenAI bound to tools (a model chosen per step: `first_bind` holds
    for the first step only, the way a forced tool_choice is used, `bind` for every step); `structured` then asks
    with_structured_output(method=...) over the agent's messages, as the agent's response_format step does."""
    llm = ChatOpenAI(model=MODEL, base_url=info.base_url, api_key=info.api_key, **(chat or {}))

    def step_model(state, runtime):
        first = len(state["messages"]) == 1
        return llm.bind_tools([add], **(bind or {}), **((first_bind or {}) if first else {}))
    messages = create_react_agent(step_model, [add]).invoke({"messages": [HumanMessage(ask)]})["messages"]
    if structured is None:
        return str(messages[-1].content)
    return str(llm.with_structured_output(Sum, method=structured).invoke(messages))


SMOLAGENTS_SYSTEM = "Solve the task with tool calls, one step at a time. Give the answer with the final_answer tool."


def drive_smolagents(info, model_kwargs: dict | None = None) -> str:
    """smolagents' ToolCallingAgent over OpenAIServerModel; its answer is its final_answer tool's argument. Its system
    prompt is set short through prompt_templates (the library's own knob): the default's 2,400 tokens of worked
    examples (in this tokenizer) would make teaching the tiny model cost minutes more, and no request field
    depends on it."""
    model = OpenAIServerModel(model_id=MODEL, api_base=info.base_url, api_key=info.api_key, **(model_kwargs or {}))
    agent = ToolCallingAgent(tools=[multiply], model=model, max_steps=3, verbosity_level=0)
    agent.prompt_templates["system_prompt"] = SMOLAGENTS_SYSTEM
    return str(agent.run(PRODUCT_ASK))


def drive_litellm(info, params: dict | None = None, first: dict | None = None, ask: str = TIME_ASK) -> str:
    """litellm.completion with tools ("openai/<model>" at api_base) in the usual loop: call, run the tools, append
    the results, until a reply without tool calls. `first` holds for the first request only."""
    messages = [{"role": "user", "content": ask}]
    for step in range(4):
        reply = litellm.completion(model=f"openai/{MODEL}", api_base=info.base_url, api_key=info.api_key,
                                   messages=messages, tools=TIME_TOOLS, **(params or {}),
                                   **((first or {}) if step == 0 else {}))
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return str(message.content)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": get_time(**json.loads(c.function.arguments))}
                     for c in message.tool_calls]
    return str(messages[-1])


def drive_anthropic(info, params: dict | None = None, first: dict | None = None, max_tokens: int = 64) -> str:
    """The anthropic SDK's tool-use loop: messages.create, run each tool_use block, send the tool_result blocks
    back, until stop_reason is not tool_use. `first` holds for the first request only."""
    client = anthropic.Anthropic(base_url=info.session_url, api_key=info.api_key)
    messages = [{"role": "user", "content": STOCK_ASK}]
    for step in range(4):
        reply = client.messages.create(model=MODEL, max_tokens=max_tokens, tools=STOCK_TOOLS, messages=messages,
                                       **(params or {}), **((first or {}) if step == 0 else {}))
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            return "".join(block.text for block in reply.content if block.type == "text")
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": get_stock(**block.input)}
            for block in reply.content if block.type == "tool_use"]})
    return str(messages[-1])


RESPONSES_TIME_TOOLS = [{"type": "function", **tool["function"]} for tool in TIME_TOOLS]   # the Responses shape


def drive_openai_responses(info, params: dict | None = None, first: dict | None = None, ask: str = TIME_ASK,
                           chain: bool = False) -> str:
    """The openai SDK's responses.create with a function tool in the usual loop: call, run the function_call items,
    send their function_call_output items back after the reply's output items in `input`, until a reply without
    calls (or one cut short). Chained, a request sends only the new items, after previous_response_id. A streamed
    request (params stream=True) reads its Response from the last event. `first` holds for the first request only."""
    client = OpenAI(base_url=info.base_url, api_key=info.api_key)
    history, new, previous = [], [{"role": "user", "content": ask}], None
    for step in range(4):
        chained = {"previous_response_id": previous} if chain and previous else {}
        reply = client.responses.create(model=MODEL, input=new if chained else history + new,
                                        **{"tools": RESPONSES_TIME_TOOLS, **(params or {})}, **chained,
                                        **((first or {}) if step == 0 else {}))
        if isinstance(reply, Stream):
            reply = list(reply)[-1].response          # response.completed (or .incomplete): the whole Response
        history += new + [item.model_dump(exclude_none=True) for item in reply.output]
        calls = [item for item in reply.output if item.type == "function_call" and item.status == "completed"]
        if not calls or reply.status != "completed":
            return reply.output_text
        new, previous = [{"type": "function_call_output", "call_id": c.call_id,
                          "output": get_time(**json.loads(c.arguments))} for c in calls], reply.id
    return str(history[-1])


DRIVERS = {"openai-agents": drive_openai_agents, "pydantic-ai": drive_pydantic_ai, "langchain": drive_langchain,
           "smolagents": drive_smolagents, "litellm": drive_litellm, "anthropic": drive_anthropic,
           "openai-responses": drive_openai_responses,
           "openai-agents-responses": functools.partial(drive_openai_agents, model_class=OpenAIResponsesModel)}

# What the model is taught: per library, each distinct conversation (driver arguments) with its replies in order.
SCRIPTS = {
    "openai-agents": [({}, [WEATHER_CALL, WEATHER_ANSWER]), ({"structured": True}, [WEATHER_CALL, WEATHER_JSON])],
    "pydantic-ai": [({}, [CAPITAL_CALL, CAPITAL_ANSWER]),
                    ({"output": Capital, "ask": CAPITAL_ASK + RESULT_ASK}, [CAPITAL_CALL, CAPITAL_RESULT]),
                    ({"output": NativeOutput(Capital), "ask": CAPITAL_ASK + JSON_ASK}, [CAPITAL_CALL, CAPITAL_JSON]),
                    ({"output": PromptedOutput(Capital), "ask": CAPITAL_ASK + JSON_ASK}, [CAPITAL_CALL, CAPITAL_JSON])],
    "langchain": [({}, [SUM_CALL, SUM_ANSWER]),
                  ({"structured": "json_schema", "ask": SUM_ASK + JSON_ASK}, [SUM_CALL, SUM_ANSWER, SUM_JSON]),
                  ({"structured": "function_calling", "ask": SUM_ASK + REPORT_ASK},
                   [SUM_CALL, SUM_ANSWER, SUM_TOOL_CALL])],
    "smolagents": [({}, [PRODUCT_CALL, PRODUCT_ANSWER])],
    "litellm": [({}, [TIME_CALL, TIME_ANSWER]), ({"ask": TIME_ASK + JSON_ASK}, [TIME_CALL, TIME_JSON])],
    "anthropic": [({}, [STOCK_CALL, STOCK_ANSWER])],
    "openai-responses": [({}, [TIME_CALL, TIME_ANSWER]), ({"ask": TIME_ASK + JSON_ASK}, [TIME_CALL, TIME_JSON])],
    "openai-agents-responses": [({}, [WEATHER_CALL, WEATHER_ANSWER]),
                                ({"structured": True}, [WEATHER_CALL, WEATHER_JSON])],
}
