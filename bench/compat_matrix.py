# bench/compat_matrix.py — eight agent libraries, each option they expose, against the loopback server: is it refused,
# accepted as a no-op, or honoured, and does the token path hold under it.
#
# Each library (openai-agents, pydantic-ai, langchain-openai + langgraph, smolagents, litellm, the anthropic SDK's
# tool-use loop; on the Responses wire, the openai SDK's responses.create loop and the Agents SDK on its default
# OpenAIResponsesModel) runs one short tool-calling episode, unchanged, against a real LoopbackServer over a real
# EmbeddedEngine: on its defaults, then with each option it exposes switched on, one at a time (CASES). A case says:
#   verdict  refused (the server's 4xx, with its reason), failed (the library raised for another reason), not sent
#            (the library dropped the option), not honoured (accepted, but a reply lacks the option's effect),
#            honoured (against the library's default episode: the recorded sampling changed, the server wrote
#            context tokens on the model's behalf or ended replies at a stop string of its own, or the option's
#            effect was seen on every request that carried it), or no-op (accepted, and none of that happened; a
#            hosted tool the wire drops is a no-op whose listing in the reply is checked);
#   tokens   every sampled token is trainable exactly once (invariants.check_sampled_once on the session's rows, every
#            line's: a side request, such as smolagents' final answer after its last step, is a line of its own);
#   seals    per turn, whether its prompt sealed its line's segment (a library that re-renders its history seals);
#   parity   max |behavior logprob - trainer recompute| (actor.Actor.recompute_logprobs over the batch train.py would
#            build from the ledger's rows), and the trap: the same recompute with what the option added to each
#            token's recorded sampling stripped back to the session's plain values, which must miss (invariant 3).
# A case the server refuses by design (Case.refused, e.g. truncation 'auto') must be refused with that reason.
# The model is a tiny Qwen3 taught each library's episodes (models.taught_tiny_model_dir). The conversations are what
# the libraries themselves send, harvested at the start of every run through the same server with an engine that
# answers from the script (ScriptEngine: it samples nothing and nothing is trained on it), rendered by tracerl's
# chat template; so the taught model writes Hermes <tool_call> blocks with each framework's own tool names and
# final-answer conventions (smolagents' final_answer tool, pydantic-ai's final_result tool). The two Responses
# libraries ask their chat counterparts' questions with the same tools (openai-responses litellm's, the Agents SDK's
# Responses model its chat model's): both wires decode to one canonical request, so the harvest renders the same
# conversations and the model is taught nothing more for them.
# tests/test_compat.py asserts every case; this script writes the table, docs/compat-matrix.md (from
# docs/compat-matrix.json, which keeps each labelled run: the tree before issue 17, and main; the Responses rows'
# before is 999b805's 404, measured apart, as the run's note in the table says).
#
#   python bench/compat_matrix.py --label after [--only litellm anthropic]
#
# The OpenAI Agents SDK's package is named `agents`, as tracerl's is. Its names are imported before the repository
# joins sys.path: in a tree whose agents/ carries the SDK (agents/__init__.py) that changes nothing, and a tree from
# before does not shadow it, so the same script measures both.
# The episodes, the taught replies and each library's driver are bench/compat_episodes.py's; this file holds the
# cases, the servers that record what each library sent, the judge and the report.
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agents import set_tracing_disabled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jsonschema  # noqa: E402
import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from openai.types.shared import Reasoning  # noqa: E402
from pydantic_ai import NativeOutput, PromptedOutput  # noqa: E402

import actor  # noqa: E402
import data  # noqa: E402
import invariants  # noqa: E402
import models  # noqa: E402
from engines import Generation
from engines import constraints  # noqa: E402
from engines.harvest import ScriptEngine, teaching_texts  # noqa: E402
from loopback import LoopbackServer  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402
from bench.compat_episodes import (CAPITAL_ASK, DRIVERS, JSON_ASK, REPORT_ASK, RESPONSES_TIME_TOOLS,  # noqa: E402
                                   RESULT_ASK, SCRIPTS, SUM_ASK, TIME_ASK, Capital, Time)

set_tracing_disabled(True)     # the Agents SDK would export traces to api.openai.com
warnings.filterwarnings("ignore", message=".*create_react_agent has been moved.*")   # still langgraph 1.x's prebuilt

SESSION = SamplingParams(temperature=0.7, max_tokens=64, seed=17)   # the runner's defaults: what a request overrides
PLAIN = invariants.Sampling(temperature=SESSION.temperature, top_p=SESSION.top_p, top_k=SESSION.top_k)
PARITY_TOL = 1e-4               # |behavior - recompute| at most this (the fp32 CPU path agrees to ~1e-5); the trap:
                                # where an option changed the sampling, the recompute without it must miss this


# ---- the cases: (library, option) as that library expresses it --------------------------------------------------

ANY = object()                  # a wire value that only has to be present


@dataclass
class Case:
    library: str
    option: str                 # the option as the library names it
    kwargs: dict                # the driver's arguments
    wire: tuple = ()            # ((path in the request body, value or ANY), ...): what shows the option was sent
    effect: str | None = None   # what every request that carries the option must show (EFFECTS, TURN_EFFECTS)
    refused: str = ""           # the server refuses the option by design, with a reason holding this ("": serves it)

    @property
    def name(self) -> str:
        return f"{self.library}:{self.option}"


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


NO_OP_FIELDS = {"store": True, "metadata": {"run": "compat"}, "service_tier": "auto"}
ZERO_PENALTIES = (("frequency_penalty", 0), ("presence_penalty", 0))
REQUIRED, NONE = (("tool_choice", "required"),), (("tool_choice", "none"),)
GREEDY, PARALLEL = (("temperature", 0),), (("parallel_tool_calls", False),)
JSON_SCHEMA, JSON_OBJECT = (("response_format.type", "json_schema"),), (("response_format.type", "json_object"),)
REASONING, NO_REASONING = (("reasoning_effort", "low"),), (("reasoning_effort", "none"),)


def _wire_of(fields: dict) -> tuple:
    return tuple((key, value) for key, value in fields.items())


def _function(name: str) -> dict:           # a named tool_choice in the Responses shape
    return {"type": "function", "name": name}


TEXT_SCHEMA = (("text.format.type", "json_schema"),)
TIME_FORMAT = {"format": {"type": "json_schema", "name": "Time", "schema": Time.model_json_schema(), "strict": True}}
WEB_SEARCH_TOOLS = RESPONSES_TIME_TOOLS + [{"type": "web_search"}]


CASES = [
    Case("openai-agents", "default", {}),
    Case("openai-agents", "tool_choice=required", {"settings": {"tool_choice": "required"}}, REQUIRED, "tool_call"),
    Case("openai-agents", "tool_choice=none", {"settings": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("openai-agents", "tool_choice=get_weather", {"settings": {"tool_choice": "get_weather"}},
         (("tool_choice", _named("get_weather")),), "named"),
    Case("openai-agents", "output_type", {"structured": True}, JSON_SCHEMA, "json"),
    Case("openai-agents", "parallel_tool_calls=False", {"settings": {"parallel_tool_calls": False}}, PARALLEL,
         "one_call"),
    Case("openai-agents", "temperature=0", {"settings": {"temperature": 0}}, GREEDY, "greedy"),
    Case("openai-agents", "zero penalties", {"settings": {"frequency_penalty": 0, "presence_penalty": 0}},
         ZERO_PENALTIES),
    Case("openai-agents", "store, metadata, service_tier",
         {"settings": {"store": True, "metadata": {"run": "compat"}, "extra_args": {"service_tier": "auto"}}},
         _wire_of(NO_OP_FIELDS)),
    Case("openai-agents", "reasoning.effort=low", {"settings": {"reasoning": Reasoning(effort="low")}}, REASONING),
    Case("openai-agents", "reasoning.effort=none", {"settings": {"reasoning": Reasoning(effort="none")}},
         NO_REASONING),

    Case("pydantic-ai", "default", {}),
    Case("pydantic-ai", "output_type (ToolOutput)", {"output": Capital, "ask": CAPITAL_ASK + RESULT_ASK}, REQUIRED,
         "tool_call"),
    Case("pydantic-ai", "NativeOutput", {"output": NativeOutput(Capital), "ask": CAPITAL_ASK + JSON_ASK},
         JSON_SCHEMA, "json"),
    Case("pydantic-ai", "PromptedOutput", {"output": PromptedOutput(Capital), "ask": CAPITAL_ASK + JSON_ASK},
         JSON_OBJECT, "json"),
    Case("pydantic-ai", "tool_choice=none", {"settings": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("pydantic-ai", "tool_choice=[final_result]",
         {"output": Capital, "ask": CAPITAL_ASK + RESULT_ASK, "settings": {"tool_choice": ["final_result"]}},
         (("tool_choice", _named("final_result")),), "named"),
    Case("pydantic-ai", "parallel_tool_calls=False", {"settings": {"parallel_tool_calls": False}}, PARALLEL,
         "one_call"),
    Case("pydantic-ai", "temperature=0", {"settings": {"temperature": 0}}, GREEDY, "greedy"),
    Case("pydantic-ai", "zero penalties", {"settings": {"frequency_penalty": 0, "presence_penalty": 0}},
         ZERO_PENALTIES),
    Case("pydantic-ai", "openai_store, service_tier", {"settings": {"openai_store": True, "service_tier": "auto"}},
         (("store", True), ("service_tier", "auto"))),
    Case("pydantic-ai", "openai_reasoning_effort=low", {"settings": {"openai_reasoning_effort": "low"}}, REASONING),
    Case("pydantic-ai", "openai_reasoning_effort=none", {"settings": {"openai_reasoning_effort": "none"}},
         NO_REASONING),

    Case("langchain", "default", {}),
    Case("langchain", "tool_choice=required", {"first_bind": {"tool_choice": "required"}}, REQUIRED, "tool_call"),
    Case("langchain", "tool_choice=none", {"first_bind": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("langchain", "tool_choice=add", {"first_bind": {"tool_choice": "add"}}, (("tool_choice", _named("add")),),
         "named"),
    Case("langchain", "with_structured_output(json_schema)", {"structured": "json_schema", "ask": SUM_ASK + JSON_ASK},
         JSON_SCHEMA, "json"),
    Case("langchain", "with_structured_output(function_calling)",
         {"structured": "function_calling", "ask": SUM_ASK + REPORT_ASK}, (("tool_choice", _named("Sum")),), "named"),
    Case("langchain", "with_structured_output(json_mode)", {"structured": "json_mode", "ask": SUM_ASK + JSON_ASK},
         JSON_OBJECT, "json"),
    Case("langchain", "parallel_tool_calls=False", {"bind": {"parallel_tool_calls": False}}, PARALLEL, "one_call"),
    Case("langchain", "temperature=0", {"chat": {"temperature": 0}}, GREEDY, "greedy"),
    Case("langchain", "zero penalties", {"chat": {"frequency_penalty": 0, "presence_penalty": 0}}, ZERO_PENALTIES),
    Case("langchain", "store, service_tier", {"chat": {"store": True, "service_tier": "auto"}},
         (("store", True), ("service_tier", "auto"))),
    Case("langchain", "reasoning_effort=low", {"chat": {"reasoning_effort": "low"}}, REASONING),
    Case("langchain", "reasoning_effort=none", {"chat": {"reasoning_effort": "none"}}, NO_REASONING),

    Case("smolagents", "default (tool_choice=required)", {}, REQUIRED, "tool_call"),
    Case("smolagents", "tool_choice=auto", {"model_kwargs": {"tool_choice": "auto"}}, (("tool_choice", "auto"),)),
    Case("smolagents", "tool_choice=final_answer", {"model_kwargs": {"tool_choice": _named("final_answer")}},
         (("tool_choice", _named("final_answer")),), "named"),
    Case("smolagents", "parallel_tool_calls=False", {"model_kwargs": {"parallel_tool_calls": False}}, PARALLEL,
         "one_call"),
    Case("smolagents", "temperature=0", {"model_kwargs": {"temperature": 0}}, GREEDY, "greedy"),
    Case("smolagents", "zero penalties", {"model_kwargs": {"frequency_penalty": 0, "presence_penalty": 0}},
         ZERO_PENALTIES),
    Case("smolagents", "store, metadata, service_tier", {"model_kwargs": dict(NO_OP_FIELDS)}, _wire_of(NO_OP_FIELDS)),
    Case("smolagents", "reasoning_effort=low", {"model_kwargs": {"reasoning_effort": "low"}}, REASONING),
    Case("smolagents", "reasoning_effort=none", {"model_kwargs": {"reasoning_effort": "none"}}, NO_REASONING),

    Case("litellm", "default", {}),
    Case("litellm", "tool_choice=required", {"first": {"tool_choice": "required"}}, REQUIRED, "tool_call"),
    Case("litellm", "tool_choice=none", {"params": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("litellm", "tool_choice=get_time", {"first": {"tool_choice": _named("get_time")}},
         (("tool_choice", _named("get_time")),), "named"),
    Case("litellm", "response_format=json_schema", {"ask": TIME_ASK + JSON_ASK, "params": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "Time", "schema": Time.model_json_schema(), "strict": True}}}},
         JSON_SCHEMA, "json"),
    Case("litellm", "response_format=json_object", {"ask": TIME_ASK + JSON_ASK,
                                                    "params": {"response_format": {"type": "json_object"}}},
         JSON_OBJECT, "json"),
    Case("litellm", "parallel_tool_calls=False", {"params": {"parallel_tool_calls": False}}, PARALLEL, "one_call"),
    Case("litellm", "temperature=0", {"params": {"temperature": 0}}, GREEDY, "greedy"),
    Case("litellm", "zero penalties", {"params": {"frequency_penalty": 0, "presence_penalty": 0}}, ZERO_PENALTIES),
    Case("litellm", "store, service_tier", {"params": {"store": True, "service_tier": "auto"}},
         (("store", True), ("service_tier", "auto"))),
    Case("litellm", "reasoning_effort=low", {"params": {"reasoning_effort": "low"}}, REASONING),
    Case("litellm", "reasoning_effort=none", {"params": {"reasoning_effort": "none"}}, NO_REASONING),

    Case("anthropic", "default", {}),
    Case("anthropic", "tool_choice=any", {"first": {"tool_choice": {"type": "any"}}},
         (("tool_choice", {"type": "any"}),), "tool_call"),
    Case("anthropic", "tool_choice=tool", {"first": {"tool_choice": {"type": "tool", "name": "get_stock"}}},
         (("tool_choice", {"type": "tool", "name": "get_stock"}),), "named"),
    Case("anthropic", "tool_choice=none", {"params": {"tool_choice": {"type": "none"}}},
         (("tool_choice", {"type": "none"}),), "no_tool_call"),
    Case("anthropic", "disable_parallel_tool_use", {"params": {"tool_choice": {"type": "auto",
                                                                               "disable_parallel_tool_use": True}}},
         (("tool_choice.disable_parallel_tool_use", True),), "one_call"),
    Case("anthropic", "temperature=0 (extra_body)", {"params": {"extra_body": {"temperature": 0}}}, GREEDY, "greedy"),
    Case("anthropic", "metadata, service_tier", {"params": {"metadata": {"user_id": "compat"}, "service_tier": "auto"}},
         (("metadata", {"user_id": "compat"}), ("service_tier", "auto"))),
    Case("anthropic", "thinking=enabled", {"params": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
                                           "max_tokens": 1100}, (("thinking.type", "enabled"),)),
    Case("anthropic", "thinking=disabled", {"params": {"thinking": {"type": "disabled"}}},
         (("thinking.type", "disabled"),)),

    Case("openai-responses", "default", {}),
    Case("openai-responses", "stream=True", {"params": {"stream": True}}, (("stream", True),), "stream"),
    Case("openai-responses", "instructions", {"params": {"instructions": "You tell the time in any time zone."}},
         (("instructions", ANY),), "instructions"),
    Case("openai-responses", "tool_choice=required", {"first": {"tool_choice": "required"}}, REQUIRED, "tool_call"),
    Case("openai-responses", "tool_choice=none", {"params": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("openai-responses", "tool_choice=get_time", {"first": {"tool_choice": _function("get_time")}},
         (("tool_choice", _function("get_time")),), "named"),
    Case("openai-responses", "parallel_tool_calls=False", {"params": {"parallel_tool_calls": False}}, PARALLEL,
         "one_call"),
    Case("openai-responses", "text.format=json_schema", {"ask": TIME_ASK + JSON_ASK, "params": {"text": TIME_FORMAT}},
         TEXT_SCHEMA, "json"),
    Case("openai-responses", "temperature=0", {"params": {"temperature": 0}}, GREEDY, "greedy"),
    Case("openai-responses", "reasoning.effort=none", {"params": {"reasoning": {"effort": "none"}}},
         (("reasoning.effort", "none"),)),
    Case("openai-responses", "store=False (history resent)", {"params": {"store": False}}, (("store", False),)),
    Case("openai-responses", "previous_response_id", {"chain": True}, (("previous_response_id", ANY),), "chained"),
    Case("openai-responses", "include=[reasoning.encrypted_content]",
         {"params": {"include": ["reasoning.encrypted_content"]}}, (("include", ["reasoning.encrypted_content"]),)),
    Case("openai-responses", "max_output_tokens=8", {"params": {"max_output_tokens": 8}}, (("max_output_tokens", 8),),
         "bounded"),
    Case("openai-responses", "web_search beside the function", {"params": {"tools": WEB_SEARCH_TOOLS}},
         (("tools", WEB_SEARCH_TOOLS),), "dropped"),
    Case("openai-responses", "truncation=auto", {"params": {"truncation": "auto"}}, (("truncation", "auto"),),
         refused="truncation must be 'disabled'"),

    Case("openai-agents-responses", "default", {}),
    Case("openai-agents-responses", "tool_choice=required", {"settings": {"tool_choice": "required"}}, REQUIRED,
         "tool_call"),
    Case("openai-agents-responses", "tool_choice=none", {"settings": {"tool_choice": "none"}}, NONE, "no_tool_call"),
    Case("openai-agents-responses", "tool_choice=get_weather", {"settings": {"tool_choice": "get_weather"}},
         (("tool_choice", _function("get_weather")),), "named"),
    Case("openai-agents-responses", "output_type", {"structured": True}, TEXT_SCHEMA, "json"),
    Case("openai-agents-responses", "parallel_tool_calls=False", {"settings": {"parallel_tool_calls": False}},
         PARALLEL, "one_call"),
    Case("openai-agents-responses", "temperature=0", {"settings": {"temperature": 0}}, GREEDY, "greedy"),
    Case("openai-agents-responses", "store, metadata, service_tier",
         {"settings": {"store": True, "metadata": {"run": "compat"}, "extra_args": {"service_tier": "auto"}}},
         _wire_of(NO_OP_FIELDS)),
    Case("openai-agents-responses", "reasoning.effort=low", {"settings": {"reasoning": Reasoning(effort="low")}},
         (("reasoning.effort", "low"),)),
    Case("openai-agents-responses", "reasoning.effort=none", {"settings": {"reasoning": Reasoning(effort="none")}},
         (("reasoning.effort", "none"),)),
]


# ---- the servers: the loopback server as it is, plus a record of what each library sent ----------------------

@dataclass
class Exchange:
    wire: str                   # "openai" | "anthropic" | "responses"
    body: dict                  # the request as the library sent it
    status: int
    reply: dict | None          # the server's JSON answer (an error body when status >= 400; None when streamed)
    streamed: bool = False      # answered with server-sent events


class WitnessServer(LoopbackServer):
    """The loopback server, unchanged, that also keeps every exchange of every session (its own middleware sees
    each request and each answer, refusals included)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exchanges: dict[str, list[Exchange]] = defaultdict(list)    # session id -> its exchanges, in order

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        response = await super()._errors(request, handler)
        if request.path.endswith(("/chat/completions", "/messages", "/responses")):
            try:
                body = json.loads(await request.read())      # the bytes the handler read, kept by aiohttp
            except ValueError:
                body = {}
            reply = json.loads(response.body) if isinstance(response, web.Response) and response.body else None
            wire = "anthropic" if request.path.endswith("/messages") else \
                "responses" if request.path.endswith("/responses") else "openai"
            session_id = request.path.split("/")[2]          # /s/<sid>/v1/...: a route the server lacks matches none
            self.exchanges[session_id].append(Exchange(wire, body, response.status, reply,
                                                       streamed=not isinstance(response, web.Response)))
        return response


HARVEST_KEYS = {"model", "messages", "system", "tools", "max_tokens", "max_completion_tokens", "stop",
                "stop_sequences", "stream", "input", "instructions", "max_output_tokens"}


class HarvestServer(LoopbackServer):
    """Serves the script: every request field but the conversation's is dropped before decoding, so a tree that
    refuses an option still shows what the library sends (the prompts do not depend on the options)."""

    async def _body(self, request: web.Request, optional: bool = False) -> dict:
        body = await super()._body(request, optional)
        return {key: value for key, value in body.items() if key in HARVEST_KEYS}


def harvest(tokenizer) -> list[tuple[str, list]]:
    """Every turn of every script as the text the model must learn: the prompt the server built (rendered by
    tracerl's chat template; later turns extend the record) followed by the scripted reply."""
    engine = ScriptEngine(tokenizer)
    server = HarvestServer(engine, tokenizer, template=data.CHATML_TEMPLATE)
    server.start()
    generations = []
    try:
        for library, scripts in SCRIPTS.items():
            for kwargs, replies in scripts:
                engine.replies = list(replies)
                info = server.create_session(rollout_id=library, sampling=SESSION)
                DRIVERS[library](info, **kwargs)
                session = server.close_session(info.session_id)
                served = session.served_in_order()
                if engine.replies or len(served) != len(replies):
                    raise RuntimeError(f"{library} {kwargs}: the script's {len(replies)} replies were not all asked "
                                       f"for ({len(served)} requests); the driver and SCRIPTS disagree")
                generations += served
    finally:
        server.stop()
    return [(text, []) for text in teaching_texts(tokenizer, generations)]


# ---- one case: run it, then check the token path --------------------------------------------------------------

@dataclass
class Bench:
    tokenizer: object
    model_dir: str
    server: WitnessServer
    policy: actor.Actor         # the trainer's recompute, fp32 on the CPU
    defaults: dict = field(default_factory=dict)   # library -> its default case's Mark: what an option adds to


def build_bench(steps: int = 400) -> Bench:
    tokenizer = models.bpe_tokenizer()
    model_dir = models.taught_tiny_model_dir("qwen3", harvest(tokenizer), steps=steps)
    engine = EmbeddedEngine(models.load_model(model_dir), tokenizer=tokenizer)
    server = WitnessServer(engine, tokenizer, template=data.CHATML_TEMPLATE)
    server.start()
    policy = actor.Actor(model_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    return Bench(tokenizer, model_dir, server, policy)


@dataclass
class CaseResult:
    library: str
    option: str
    verdict: str                # refused | failed | not sent | not honoured | honoured | no-op
    detail: str                 # the server's reason, the error, or what the option changed
    answer: str                 # the library's final answer (or "")
    turns: int                  # generations committed to the session's ledger
    seals: list[int]            # per turn: 1 when its prompt sealed the segment before it
    sampled_once: str           # "" when every sampled token is trainable exactly once, else the check's error
    effect: str                 # "" when every request that carried the option shows its effect, else what failed
    parity: float | None        # max |behavior - recompute| over trainable tokens (None: nothing was sampled)
    trap: float | None          # max |behavior - recompute with what it added stripped| (None: it added nothing)
    changed: list[str] = field(default_factory=list)   # the Sampling fields the option changed from the default's
    forced: str = ""            # text the option made the server write after the generation prompt, for the model
    seconds: float = 0.0


@dataclass
class Mark:
    """What a library's requests did to the sampling and the prompt on its defaults: a case's option is judged by
    what it adds (smolagents' default already forces every call)."""
    values: dict                # Sampling field -> the set of values its sampled tokens were drawn with
    forced: set                 # texts written after the generation prompt
    stops: set                  # stop strings that ended a reply

    @staticmethod
    def of(tokenizer, generations: list[Generation]) -> "Mark":
        # generation_start is where a grammar's or a penalty's state begins, not a setting: it follows them
        names = [f.name for f in dataclasses.fields(invariants.Sampling) if f.name != "generation_start"]
        return Mark({name: {getattr(g.sampling, name) for g in generations} for name in names},
                    {t for g in generations if (t := forced_text(tokenizer, g))},
                    {g.stop_string for g in generations if g.stop_string})


PLAIN_MARK = Mark({f.name: {getattr(PLAIN, f.name)} for f in dataclasses.fields(invariants.Sampling)}, set(), set())


def carries(case: Case, body: dict) -> bool:
    """Whether this request carries the case's option (every (path, value) of case.wire)."""
    def has(path, value):
        here = body
        for key in path.split("."):
            if not isinstance(here, dict) or key not in here:
                return False
            here = here[key]
        return value is ANY or here == value
    return bool(case.wire) and all(has(path, value) for path, value in case.wire)


def _reply_calls(exchange: Exchange) -> list[str]:
    """The names of the tool calls in a reply, on any wire (a Responses call item cut short is no call)."""
    if exchange.wire == "anthropic":
        return [b["name"] for b in exchange.reply.get("content", []) if b.get("type") == "tool_use"]
    if exchange.wire == "responses":
        return [item["name"] for item in exchange.reply.get("output", [])
                if item.get("type") == "function_call" and item.get("status") == "completed"]
    message = exchange.reply["choices"][0]["message"]
    return [c["function"]["name"] for c in message.get("tool_calls") or []]


def _reply_text(exchange: Exchange) -> str:
    if exchange.wire == "anthropic":
        return "".join(b.get("text", "") for b in exchange.reply.get("content", []) if b.get("type") == "text")
    if exchange.wire == "responses":
        messages = [item for item in exchange.reply.get("output", []) if item.get("type") == "message"]
        return "".join(part.get("text", "") for item in messages for part in item.get("content", [])
                       if part.get("type") == "output_text")
    return exchange.reply["choices"][0]["message"].get("content") or ""


def _requested_name(body: dict) -> str | None:
    choice = body.get("tool_choice")
    return (choice.get("name") or (choice.get("function") or {}).get("name")) if isinstance(choice, dict) else None


def _bounded_effect(exchange: Exchange) -> str:
    """A Responses reply holds at most max_output_tokens, and one cut there says so (status incomplete)."""
    limit, usage = exchange.body["max_output_tokens"], exchange.reply["usage"]["output_tokens"]
    cut = exchange.reply["status"] == "incomplete" and \
        (exchange.reply.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
    if usage > limit or cut != (usage == limit):
        return f"{usage} output tokens for max_output_tokens {limit}, status {exchange.reply['status']!r}"
    return ""


def _dropped_effect(exchange: Exchange) -> str:
    """The reply lists the hosted tools the request offered as dropped (the Responses wire leaves them out)."""
    hosted = [tool["type"] for tool in exchange.body.get("tools", []) if tool.get("type") != "function"]
    listed = exchange.reply.get("dropped_tools", [])
    return "" if listed == hosted else f"offered {hosted}, the reply lists {listed} as dropped"


def _json_effect(exchange: Exchange) -> str:
    """A reply without tool calls is a JSON object (valid against the request's schema, when it sent one)."""
    if _reply_calls(exchange):
        return ""
    try:
        value = json.loads(_reply_text(exchange))
    except ValueError:
        return f"the reply is not JSON: {_reply_text(exchange)[:80]!r}"
    if not isinstance(value, dict):
        return f"the reply is JSON but not an object: {value!r:.80}"
    schema = (exchange.body.get("response_format") or {}).get("json_schema", {}).get("schema") or \
        ((exchange.body.get("text") or {}).get("format") or {}).get("schema")     # (the Responses wire's text.format)
    try:
        jsonschema.validate(value, schema or {})
    except jsonschema.ValidationError as error:
        return f"the reply does not match the schema: {error.message}"
    return ""


EFFECTS = {  # what a reply to a request that carries the option must show; "" = shown, else what is wrong
    "tool_call": lambda x: "" if _reply_calls(x) else f"no tool call: {_reply_text(x)[:80]!r}",
    "no_tool_call": lambda x: f"tool calls {_reply_calls(x)}" if _reply_calls(x) else "",
    "named": lambda x: "" if _reply_calls(x) and set(_reply_calls(x)) == {_requested_name(x.body)} else
    f"asked for {_requested_name(x.body)!r}, got calls {_reply_calls(x)} and text {_reply_text(x)[:60]!r}",
    "one_call": lambda x: f"{len(_reply_calls(x))} tool calls" if len(_reply_calls(x)) > 1 else "",
    "json": _json_effect,
    "stream": lambda x: "" if x.streamed else "answered with one JSON body, not server-sent events",
    "bounded": _bounded_effect,
    "dropped": _dropped_effect,
}
NO_OP_EFFECTS = {   # effects that show an option is accepted and does nothing here: seen, the verdict is no-op
    "dropped": "accepted; left out of the prompt and listed in the reply's dropped_tools; sampling unchanged"}


def _instructions_effect(tokenizer, exchange: Exchange, generation: Generation, earlier: list[Generation]) -> str:
    """The prompt the server built opens with a system turn holding the request's instructions."""
    prompt = tokenizer.decode(generation.prompt_ids, skip_special_tokens=False)
    opening = f"<|im_start|>system\n{exchange.body['instructions']}"
    return "" if prompt.startswith(opening) else f"the prompt opens {prompt[:80]!r}"


def _chained_effect(tokenizer, exchange: Exchange, generation: Generation, earlier: list[Generation]) -> str:
    """The prompt extends the previous turn's prompt and reply: the server put the named response's conversation
    before the request's input."""
    whole = earlier[-1].prompt_ids + earlier[-1].token_ids if earlier else None
    if whole is not None and generation.prompt_ids[:len(whole)] == whole:
        return ""
    return "the prompt does not extend the previous turn's prompt and reply"


TURN_EFFECTS = {  # what the turn a request carrying the option was served (its generation) must show; "" = shown
    "instructions": _instructions_effect,
    "chained": _chained_effect,
}


def greedy_effect(policy: actor.Actor, generations: list[Generation]) -> str:
    """Every sampled token is the model's most likely one at its position (what temperature 0 asks for)."""
    for k, g in enumerate(generations):
        ids = torch.tensor([g.prompt_ids + g.token_ids])
        with torch.no_grad():
            logits = policy.model(input_ids=ids.to(policy.device)).logits[0, len(g.prompt_ids) - 1:-1].float().cpu()
        best = logits.argmax(-1).tolist()
        if best != g.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(best, g.token_ids)) if a != b)
            return f"turn {k}: sampled token {i} is id {g.token_ids[i]}, not the most likely id {best[i]}"
    return ""


def seals_per_turn(session) -> list[int]:
    """Per turn, in the order the session served them, 1 when its tokens sit in a later segment of its line than that
    line's previous turn's (its prompt sealed that one); a side request (session.py's lines) is no seal."""
    seals = {}
    for line in session.lines:
        owner = [i for i, segment in enumerate(line.ledger.segments) for _ in range(segment.num_trainable)]
        at, previous = 0, None
        for k, g in zip(line.order, line.generations):
            segment = owner[at] if at < len(owner) else -1
            seals[k] = int(previous is not None and segment != previous)
            at, previous = at + len(g.token_ids), segment
    return [seals[k] for k in sorted(seals)]


def recompute_gap(bench: Bench, rows: list[invariants.Segment]) -> float:
    """max |behavior - recompute| over the rows' trainable tokens: the batch train.py builds (train_on_rows: a row
    sampled under a grammar has its masks replayed with the policy's tokenizer) and the actor's recompute."""
    grammar = any(getattr(s, "constraint", None) for row in rows for s in row.sampling)   # (no such field before 17)
    replay = {"grammar_masks": constraints.mask_replayer(bench.tokenizer, bench.policy.model.config.vocab_size)} \
        if grammar else {}
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=bench.tokenizer.pad_token_id, **replay)
    recomputed = bench.policy.recompute_logprobs(batch)
    trainable = batch.loss_mask > 0
    return (recomputed - batch.behavior_logprobs)[trainable].abs().max().item()


def stripped(row: invariants.Segment, fields: list[str]) -> invariants.Segment:
    """The row with `fields` of every trainable token's sampling set back to the session's plain values (the trap)."""
    plain = {name: getattr(PLAIN, name) for name in fields}
    return dataclasses.replace(row, sampling=[dataclasses.replace(s, **plain) if t else s
                                              for s, t in zip(row.sampling, row.trainable)])


def forced_text(tokenizer, generation: Generation) -> str:
    """What the prompt holds after the template's generation prompt: tokens the server wrote for the model."""
    text = tokenizer.decode(generation.prompt_ids, skip_special_tokens=False)
    return text.rsplit("<|im_start|>assistant\n", 1)[-1]


@dataclass
class Episode:
    answer: str                 # the library's final answer as text ("" when it raised)
    error: str                  # what it raised ("" when it finished)
    session: object             # the closed session.ChatSession: its ledger and the engine's generations
    exchanges: list[Exchange]   # every request the library sent, with the server's answer


def play(bench: Bench, case: Case) -> Episode:
    """Run the case's episode in a session of its own (rollout id: the library, so prompts repeat the harvest's)."""
    info = bench.server.create_session(rollout_id=case.library, sampling=SESSION)
    answer, error = "", ""
    try:
        answer = DRIVERS[case.library](info, **case.kwargs)
    except Exception as exc:   # any failure is the case's finding, reported with the server's answer if it refused
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    session = bench.server.close_session(info.session_id)
    return Episode(answer, error, session, bench.server.exchanges.pop(info.session_id, []))


def judge(bench: Bench, case: Case, episode: Episode, seconds: float = 0.0) -> CaseResult:
    """The case's verdict and the checks of its token path."""
    answer, error, exchanges = episode.answer, episode.error, episode.exchanges
    session = episode.session
    # what a ChatAgentRunner trains with every side line (train_side_lines "all"), and the turns in the order served
    rows, generations = session.record("all")
    in_order = session.served_in_order()
    refusals = [x for x in exchanges if x.status >= 400]
    sent = not case.wire or any(carries(case, x.body) for x in exchanges)
    served = [x for x in exchanges if x.status < 400]
    effect = ""
    if len(served) != len(in_order):
        effect = f"{len(served)} answered requests for {len(in_order)} generations"
    elif case.effect == "greedy":
        effect = greedy_effect(bench.policy, [g for x, g in zip(served, in_order) if carries(case, x.body)])
    elif case.effect in TURN_EFFECTS:
        effect = "; ".join(f"request {i}: {e}" for i, (x, g) in enumerate(zip(served, in_order))
                           if carries(case, x.body) and (e := TURN_EFFECTS[case.effect](bench.tokenizer, x, g,
                                                                                        in_order[:i])))
    elif case.effect is not None:
        effect = "; ".join(f"request {i}: {e}" for i, x in enumerate(served)
                           if carries(case, x.body) and (e := EFFECTS[case.effect](x)))
    if case.effect == "json" and not any(_reply_calls(x) for x in served) and any(
            carries(case, x.body) and x.body.get("tools") and x.body.get("tool_choice", "auto") == "auto"
            for x in served):    # OpenAI's structured outputs shape the answer; the tools offered stay callable
        effect = "; ".join(filter(None, [effect, "the tools offered beside the response format were never called "
                                                 "(the episode's script calls one first)"]))
    try:
        invariants.check_sampled_once(rows, generations)
        sampled_once = ""
    except ValueError as exc:
        sampled_once = str(exc)
    parity = recompute_gap(bench, rows) if rows else None
    mark = Mark.of(bench.tokenizer, generations)
    if case.option.startswith("default"):
        bench.defaults[case.library], base = mark if generations else PLAIN_MARK, PLAIN_MARK   # (refused: plain)
    else:
        base = bench.defaults.get(case.library) or baseline(bench, case.library)
    changed = sorted(name for name, values in mark.values.items() if generations and values != base.values[name])
    forced = " | ".join(repr(t) for t in sorted(mark.forced - base.forced))
    asked = {stop for x in served for stop in _listed(x.body.get("stop") or x.body.get("stop_sequences"))}
    stops = sorted(mark.stops - base.stops - asked)     # stop strings the server added (parallel_tool_calls=false)
    added = [name for name in changed if mark.values[name] != {getattr(PLAIN, name)}]   # not only switched off
    trap = recompute_gap(bench, [stripped(r, added + ["generation_start"]) for r in rows]) if rows and added else None

    if refusals:
        verdict, detail = "refused", f"{refusals[0].status}: {_error_message(refusals[0])}"
    elif error:
        verdict, detail = "failed", error
    elif not sent:
        verdict, detail = "not sent", f"no request carried {[p for p, _ in case.wire]}"
    elif effect:
        verdict, detail = "not honoured", effect
    elif changed or forced or stops or case.effect not in (None, *NO_OP_EFFECTS):
        how = [f"sampling: {', '.join(changed)}"] if changed else []
        how += [f"forced {forced}"] if forced else []
        how += [f"replies end at {', '.join(map(repr, stops))}"] if stops else []
        verdict, detail = "honoured", "; ".join(how) or f"effect seen ({case.effect}); sampling unchanged"
    else:
        verdict, detail = "no-op", NO_OP_EFFECTS.get(case.effect, "accepted; sampling unchanged")
    return CaseResult(case.library, case.option, verdict, detail, answer[:120], len(generations),
                      seals_per_turn(session), sampled_once, effect, parity, trap, changed, forced,
                      round(seconds, 2))


def run_case(bench: Bench, case: Case) -> CaseResult:
    start = time.monotonic()
    episode = play(bench, case)
    return judge(bench, case, episode, time.monotonic() - start)


def baseline(bench: Bench, library: str) -> Mark:
    """The library's default case, run once (its Mark is kept in bench.defaults)."""
    run_case(bench, next(c for c in CASES if c.library == library and c.option.startswith("default")))
    return bench.defaults[library]


def _listed(value) -> list:
    return [value] if isinstance(value, str) else list(value or [])


def _error_message(exchange: Exchange) -> str:
    error = (exchange.reply or {}).get("error") or {}
    return str(error.get("message", exchange.reply))[:300]


# ---- the table ---------------------------------------------------------------------------------------------------

def _cell(result: dict | None, width: int = 150) -> str:
    if result is None:
        return "—"
    text = f"**{result['verdict']}**: {result['detail']}"
    return (text if len(text) <= width else text[:width] + "…").replace("|", "\\|").replace("\n", " ")


def _gap(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def render(runs: dict) -> str:
    """docs/compat-matrix.md from every labelled run: library x option -> before / after, then each run's checks."""
    labels = [label for label in ("before", "after") if label in runs] + \
        [label for label in runs if label not in ("before", "after")]
    lines = ["# Agent libraries against the loopback server, option by option",
             "",
             "Written by `python bench/compat_matrix.py --label LABEL` (tests/test_compat.py asserts the same cases). "
             "Each library runs one tool-calling episode, unchanged, against a LoopbackServer over a tiny Qwen3 taught "
             "what that library sends (its tool names, its final-answer convention), on its defaults and then with one "
             "option switched on. Judged against the library's default episode: *honoured*: the recorded sampling "
             "changed (the fields named), the server wrote context tokens for the model (`forced`) or ended replies "
             "at a stop string of its own, or the option's effect was seen on every request that carried it; "
             "*no-op*: accepted, and none of that; *not honoured*: accepted, but a reply lacks the option's effect; "
             "*refused*: the server's 4xx and its reason (truncation 'auto' on the Responses wire is refused by "
             "design); *failed*: the library raised for another reason; *not sent*: the library dropped the option. "
             "The two Responses libraries (openai-responses: the openai SDK's responses.create loop; "
             "openai-agents-responses: the Agents SDK on its default OpenAIResponsesModel) ask the questions of "
             "litellm and openai-agents with the same tools: both wires decode to one canonical request, so the "
             "server renders the same conversations.",
             ""]
    for label in labels:
        run = runs[label]
        counts = Counter(r["verdict"] for r in run["results"])
        lines.append(f"- **{label}**: tree `{run['tree']}`, {run['date']}, {len(run['results'])} cases ("
                     + ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common())
                     + f"), {run['seconds']:.0f} s from teaching the model (or finding it cached) to the last case"
                     + (f"; {run['note']}" if run.get("note") else ""))   # rows measured apart, and how
    lines += ["", "## " + " / ".join(labels), "", "| library | option | " + " | ".join(labels) + " |",
              "|---|---|" + "---|" * len(labels)]
    keyed = {label: {(r["library"], r["option"]): r for r in runs[label]["results"]} for label in labels}
    order = list(dict.fromkeys(key for label in labels for key in keyed[label]))
    for library, option in order:
        lines.append(f"| {library} | {option} | " +
                     " | ".join(_cell(keyed[label].get((library, option))) for label in labels) + " |")
    for label in labels:
        lines += ["", f"## The token path, {label}", "",
                  "| library | option | turns | seals per turn | tokens exactly once | effect | max \\|behavior - "
                  "recompute\\| | trap (plain sampling) | s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in runs[label]["results"]:
            once = "yes" if not r["sampled_once"] else f"NO: {r['sampled_once'][:80]}"
            effect = r["effect"].replace("|", "\\|")[:100] or "ok"
            lines.append(f"| {r['library']} | {r['option']} | {r['turns']} | {r['seals']} | "
                         f"{once if r['turns'] else '—'} | {effect} | {_gap(r['parity'])} | {_gap(r['trap'])} | "
                         f"{r['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Run every (library, option) case against the loopback server and "
                                                 "write its row to the compatibility table.")
    parser.add_argument("--label", required=True, help="the run's name in the table, e.g. before or after")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "compat-matrix.md"),
                        help="the table (its runs are kept beside it, in the .json of the same name)")
    parser.add_argument("--only", nargs="*", choices=sorted(DRIVERS), help="run these libraries only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.monotonic()
    bench = build_bench()
    results = []
    try:
        for case in CASES:
            if args.only and case.library not in args.only:
                continue
            result = run_case(bench, case)
            print(f"{case.name:60s} {result.verdict:9s} {result.detail[:90]}", flush=True)
            results.append(dataclasses.asdict(result))
    finally:
        bench.server.stop()
    store = os.path.splitext(args.out)[0] + ".json"
    runs = json.load(open(store)) if os.path.exists(store) else {}
    tree = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    runs[args.label] = {"tree": tree.stdout.strip() + (" + uncommitted changes" if dirty else ""),
                        "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": time.monotonic() - start,
                        "results": results}
    with open(store, "w") as f:
        json.dump(runs, f, indent=1)
    with open(args.out, "w") as f:
        f.write(render(runs))
    print(f"wrote {args.out} and {store}")


if __name__ == "__main__":
    main()
