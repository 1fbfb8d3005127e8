# Every request field of the stock SDKs is answered deliberately (wires/params.py): the tables decide each field the
# installed openai (chat completions and responses) and anthropic SDKs define; over real HTTP with those SDKs, each
# honoured field reaches the recorded sampling of every token it drew (and the trainer's recompute at that record
# matches the behavior logprobs, while a recompute without the field does not); tokens the server forces are
# context; a forced-call conversation echoed by the SDK extends without sealing; tool_choice none produces no call,
# parallel false one; a grammar-constrained reply parses and validates; a response format with tools offered under
# auto lets the model call a tool and then answer in the format; thinking blocks round-trip; every refusal is a 400
# naming what is accepted, records nothing, and the server keeps serving.
import copy
import dataclasses
import json
import math
import os

import anthropic
import jsonschema
import openai
import pytest

import actor
import data
import invariants
import models
import wires
from engines import SamplingParams, constraints
from loopback import LoopbackServer
from session import ChatSession
from wires import CALL_OPENING
from test_session import CountingEngine, teach
from test_loopback_http import anthropic_client, openai_client, trace, trainable_ids
from wires.params import (ANTHROPIC_COUNT_FIELDS, ANTHROPIC_FIELDS, HONOURED, NO_OP, OPENAI_FIELDS, REFUSED,
                         RESPONSES_FIELDS)

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                                  "parameters": SCHEMA}},
                {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "path": {"type": "string"}}, "required": ["path"]}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
ASK = [{"role": "system", "content": "You can run bash."}, {"role": "user", "content": "List files."}]
ASK_TWICE = [ASK[0], {"role": "user", "content": "List files twice."}]
COUNT = [{"role": "user", "content": "Count the files."}]


def call(cmd: str) -> str:
    return json.dumps({"name": "bash", "arguments": {"cmd": cmd}})


FORCED = [call("ls") + "\n</tool_call>", call("cat a.txt") + "\n</tool_call>", call("wc a.txt") + "\n</tool_call>"]
RESULTS = ["a.txt", "hello"]
THOUGHT_REPLY = "<think>count them</think>\n\nOne file."
GREEDY = SamplingParams(top_k=1, max_tokens=80)
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
           "required": ["ok", "n"]}
VERDICT_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT,
                                                                             "strict": True}}}
ASK_JSON = [ASK[0], {"role": "user", "content": "List files, then say in JSON if it is done."}]
VERDICT_REPLY = '{"ok": true, "n": 1}'


# ---- the tables decide every field the installed SDKs define ---------------------------------------------

def sdk_fields(*typed_dicts) -> set[str]:
    return set().union(*(t.__required_keys__ | t.__optional_keys__ for t in typed_dicts))


def undecided(typed_dicts, table: dict) -> set[str]:
    return sdk_fields(*typed_dicts) - set(table)


def openai_params():
    from openai.types.chat import completion_create_params as p
    return [p.CompletionCreateParamsStreaming, p.CompletionCreateParamsNonStreaming]


def responses_params():
    from openai.types.responses import response_create_params as p
    return [p.ResponseCreateParamsStreaming, p.ResponseCreateParamsNonStreaming]


def anthropic_params():
    """The messages create params, and their beta twin (client.beta.messages, Claude Code: one route, ?beta=true)."""
    from anthropic.types import message_create_params as p
    from anthropic.types.beta import message_create_params as beta
    return [p.MessageCreateParamsStreaming, p.MessageCreateParamsNonStreaming, beta.MessageCreateParamsStreaming,
            beta.MessageCreateParamsNonStreaming]


def anthropic_count_params():
    from anthropic.types import message_count_tokens_params as p
    from anthropic.types.beta import message_count_tokens_params as beta
    return [p.MessageCountTokensParams, beta.MessageCountTokensParams]


EXTRAS = {"top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "return_token_ids"}
CLAUDE_CODE_EXTRAS = {"safeguards"}     # sent by Claude Code 2.1.332 (auto permission mode), typed by no SDK yet


def test_every_field_of_the_sdks_create_params_has_a_disposition():
    for typed_dicts, table, extras in [(openai_params(), OPENAI_FIELDS, EXTRAS),
                                       (responses_params(), RESPONSES_FIELDS, EXTRAS | {"client_metadata"}),
                                       (anthropic_params(), ANTHROPIC_FIELDS,
                                        EXTRAS | {"temperature", "top_p"} | CLAUDE_CODE_EXTRAS)]:
        assert undecided(typed_dicts, table) == set()
        assert set(table) - sdk_fields(*typed_dicts) == extras      # no row for a field nobody sends
        assert {d for d, _ in table.values()} <= {HONOURED, NO_OP, REFUSED} and all(r for _, r in table.values())
    # count_tokens takes exactly the SDKs' count params, each decided as for a messages request
    assert ANTHROPIC_COUNT_FIELDS == sdk_fields(*anthropic_count_params()) and ANTHROPIC_COUNT_FIELDS <= set(
        ANTHROPIC_FIELDS)
    # armed: a field a new SDK adds is caught before it is served
    class NewerParams(openai_params()[0], total=False):
        decoding_strategy: str
    assert undecided([NewerParams], OPENAI_FIELDS) == {"decoding_strategy"}


def disposition_tables() -> str:
    out = []
    for title, table in [("OpenAI chat.completions", OPENAI_FIELDS), ("OpenAI responses", RESPONSES_FIELDS),
                         ("Anthropic messages", ANTHROPIC_FIELDS)]:
        out += [f"## {title}", "", "| field | disposition | what it does |", "|---|---|---|"]
        out += [f"| `{name}` | {disposition} | {reason} |" for name, (disposition, reason) in table.items()]
        out.append("")
    return "\n".join(out)


def test_the_docs_table_is_the_code_table():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "wire-params.md")
    with open(path) as f:
        assert disposition_tables() in f.read(), "docs/wire-params.md is stale: paste disposition_tables() into it"


# ---- a tiny model taught the replies these tests need, through the sessions that serve them ----------------

class Teacher:
    """Teaches a tiny Qwen3 each reply right before the turn that samples it, from the very prompt the session builds
    (forced openings, the ledger's tokens on later turns), so an HTTP conversation that repeats it gets the same."""

    def __init__(self, tok):
        self.tok, self.student = tok, models.tiny_model("qwen3", seed=3).train()
        self.engine = CountingEngine(copy.deepcopy(self.student).eval(), tokenizer=tok)
        self.pairs: list = []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def converse(self, body: dict, replies: list[str], follow_ups: list[list[dict]] = ()) -> None:
        request = wires.decode_openai({**body, "messages": [{"role": "user", "content": "-"}]}, GREEDY)
        session = ChatSession(self.engine, self.tok, f"teach-{len(self.pairs)}", template=data.CHATML_TEMPLATE)
        messages = [dict(m) for m in body["messages"]]
        for k, text in enumerate(replies):
            prompt = session.prompt_ids(messages, request.tools, request.options)
            self.pairs.append((prompt, self.tok.encode(text, add_special_tokens=False) + [self.im_end]))
            teach(self.student, self.pairs, max_steps=1500)
            self.engine.update_weights(self.student.state_dict(), self.engine.version + 1)
            turn = session.turn(messages, request.tools, request.sampling, options=request.options)
            assert turn.generation.token_ids == self.pairs[-1][1]
            later = follow_ups[k] if k < len(follow_ups) else []
            messages += [turn.message, *later]


@pytest.fixture(scope="module")
def server():
    tok = models.bpe_tokenizer()
    teacher = Teacher(tok)
    tools = {"tools": OPENAI_TOOLS}
    teacher.converse({"messages": ASK, **tools}, ['<tool_call>\n' + call("ls") + "\n</tool_call>"])
    teacher.converse({"messages": ASK, **tools, "tool_choice": "required"}, FORCED,
                     [[{"role": "tool", "content": r}] for r in RESULTS])
    teacher.converse({"messages": ASK_TWICE, **tools},
                     ["<tool_call>\n" + call("ls") + "\n</tool_call>\n<tool_call>\n" + call("pwd") + "\n</tool_call>"])
    teacher.converse({"messages": COUNT}, [THOUGHT_REPLY, "Still one."], [[{"role": "user", "content": "Again?"}]])
    teacher.converse({"messages": COUNT, "chat_template_kwargs": {"enable_thinking": False}}, ["One.", "Still one."],
                     [[{"role": "user", "content": "Again?"}]])
    loopback = LoopbackServer(teacher.engine, tok, template=data.CHATML_TEMPLATE)
    loopback.start()
    yield loopback
    loopback.stop()


@pytest.fixture(scope="module")
def format_server():
    """A model taught to call a tool, then answer in a JSON schema, with both offered (its own model: teaching the
    first one more would move the distributions the recompute traps below are measured on)."""
    tok = models.bpe_tokenizer()
    teacher = Teacher(tok)
    teacher.converse({"messages": ASK_JSON, "tools": OPENAI_TOOLS, **VERDICT_FORMAT},
                     ["<tool_call>\n" + call("ls") + "\n</tool_call>", VERDICT_REPLY],
                     [[{"role": "tool", "content": RESULTS[0]}]])
    loopback = LoopbackServer(teacher.engine, tok, template=data.CHATML_TEMPLATE)
    loopback.start()
    yield loopback
    loopback.stop()


def prompt_of(info) -> list[int]:
    """The first turn's prompt: the record's tokens before its first sampled one."""
    segment = trace(info)["segments"][0]
    return segment["token_ids"][:segment["trainable"].index(True)]


def samplings_of_sampled_tokens(info) -> list[dict]:
    record = trace(info)
    return [record["samplings"][i] for s in record["segments"] for i, m in zip(s["sampling"], s["trainable"]) if m]


def recorded(**fields) -> dict:
    return wires.sampling_json(invariants.Sampling(**fields))


# ---- honoured: each field reaches the recorded sampling of every token it drew -----------------------------

BASE = dict(temperature=0.8, max_tokens=6)


@pytest.mark.parametrize("wire, fields, expected", [
    ("openai", {"temperature": 0}, dict(top_k=1)),
    ("anthropic", {"temperature": 0}, dict(top_k=1)),
    ("openai", {"temperature": 0.7, "top_p": 0.9}, dict(temperature=0.7, top_p=0.9)),
    ("openai", {"top_k": 5}, dict(temperature=0.8, top_k=5)),
    ("anthropic", {"top_k": 5, "min_p": 0.05}, dict(temperature=0.8, top_k=5, min_p=0.05)),
    ("openai", {"min_p": 0.1}, dict(temperature=0.8, min_p=0.1)),
    ("openai", {"logit_bias": {"7": -100, "5": 2.5}}, dict(temperature=0.8, logit_bias=((5, 2.5), (7, -100.0)))),
    ("openai", {"frequency_penalty": 0.5}, dict(temperature=0.8, frequency_penalty=0.5, generation_start=True)),
    ("openai", {"presence_penalty": -0.3}, dict(temperature=0.8, presence_penalty=-0.3, generation_start=True)),
    ("openai", {"repetition_penalty": 1.3}, dict(temperature=0.8, repetition_penalty=1.3, generation_start=True)),
    ("anthropic", {"repetition_penalty": 1.3}, dict(temperature=0.8, repetition_penalty=1.3, generation_start=True)),
    # zero penalties, repetition 1 and an empty bias are no change at all
    ("openai", {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}},
     dict(temperature=0.8)),
])
def test_each_honoured_sampling_field_is_the_recorded_sampling_of_every_sampled_token(server, wire, fields, expected):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=4))
    if wire == "openai":         # the SDK's own parameters as such, the vLLM-style extras in extra_body
        sdk = {k: v for k, v in fields.items() if k in sdk_fields(*openai_params())}
        reply = openai_client(info).chat.completions.create(
            model="policy", messages=COUNT, **sdk, extra_body={**{k: v for k, v in fields.items() if k not in sdk},
                                                               "return_token_ids": True})
        assert reply.model_extra["sampling"] == samplings_of_sampled_tokens(info)[0]   # the reply says so too
    else:
        anthropic_client(info).messages.create(model="policy", max_tokens=6, messages=COUNT, extra_body=fields)
    sampled = trainable_ids(trace(info))
    if expected.get("generation_start"):
        expected["generation_start"] = len(prompt_of(info))
    assert sampled and samplings_of_sampled_tokens(info) == [recorded(**expected)] * len(sampled)
    if expected.get("top_k") == 1:     # greedy: the point mass, logprob 0 on every sampled token
        assert all(lp == 0.0 for s in trace(info)["segments"] for lp, m in zip(s["behavior_logprobs"], s["trainable"])
                   if m)


def test_seed_stop_and_max_tokens_are_honoured_and_logprobs_are_the_behavior_logprobs(server):
    sessions = [server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=30)) for _ in range(3)]
    replies = [openai_client(i).chat.completions.create(model="policy", messages=COUNT, seed=11, max_tokens=9,
                                                        logprobs=True, top_logprobs=3,
                                                        extra_body={"return_token_ids": True}) for i in sessions[:2]]
    assert replies[0].model_extra["token_ids"] == replies[1].model_extra["token_ids"]        # the seed
    assert len(replies[0].model_extra["token_ids"]) <= 9
    content = replies[0].choices[0].logprobs.content
    record = trace(sessions[0])["segments"][0]
    assert [c.logprob for c in content] == [lp for lp, m in zip(record["behavior_logprobs"], record["trainable"]) if m]
    assert all(len(c.top_logprobs) == 3 for c in content)
    text = replies[0].choices[0].message.content
    assert len(text) > 2
    stop = text[1:3]                   # a stop string the reply would write: it ends there, cut from the text
    stopped = openai_client(sessions[2]).chat.completions.create(model="policy", messages=COUNT, seed=11,
                                                                 max_tokens=9, stop=[stop])
    assert stopped.choices[0].message.content == text[:text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_top_logprobs_of_a_greedy_reply_are_strict_json_and_only_tokens_the_distribution_could_draw(server):
    import httpx
    info = server.create_session(sampling=SamplingParams(max_tokens=6))
    reply = httpx.post(f"{info.base_url}/chat/completions", headers={"Authorization": f"Bearer {info.api_key}"},
                       json={"model": "policy", "messages": COUNT, "temperature": 0, "logprobs": True,
                             "top_logprobs": 5}, timeout=60)

    def no_infinities(constant):       # Python's json reads -Infinity; JSON (and most clients) do not
        raise AssertionError(f"the reply holds {constant}, which is not JSON")
    content = json.loads(reply.text, parse_constant=no_infinities)["choices"][0]["logprobs"]["content"]
    assert content and all(c["logprob"] == 0.0 for c in content)      # greedy: a point mass
    assert all([top["logprob"] for top in c["top_logprobs"]] == [0.0] for c in content)
    recorded = server._sessions[info.session_id][0].generations[0].top_logprobs
    assert all(len(top) == 5 and any(not math.isfinite(v) for _, v in top) for top in recorded)   # the trap is armed


def test_stream_options_include_usage_sends_a_last_chunk_with_the_usage_and_no_choices(server):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=1))
    chunks = list(openai_client(info).chat.completions.create(model="policy", messages=COUNT, stream=True,
                                                              stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(trainable_ids(trace(info)))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None


# ---- tool_choice: forced calls, none, one call at a time ------------------------------------------------

def forced_conversation(server, wire: str, stream: bool = False):
    """Three turns under a forced call (OpenAI required / Anthropic any), each reply echoed as the SDK returned it."""
    info = server.create_session(sampling=GREEDY)
    replies, messages = [], list(ASK)
    for k in range(3):
        if wire == "openai":
            reply = openai_client(info).chat.completions.create(
                model="policy", messages=messages, tools=OPENAI_TOOLS, tool_choice="required",
                extra_body={"return_token_ids": True})
            message = reply.choices[0].message
            messages += [message.model_dump(exclude_none=True)]
            if k < 2:
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": RESULTS[k]})
            replies.append(([(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls],
                            reply.choices[0].finish_reason, reply.model_extra))
        else:
            claude, history = anthropic_client(info), messages[1:]
            request = dict(model="policy", max_tokens=40, system=ASK[0]["content"], messages=history,
                           tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
            if stream:
                with claude.messages.stream(**request) as events:
                    reply = events.get_final_message()
            else:
                reply = claude.messages.create(**request)
            calls = [b for b in reply.content if b.type == "tool_use"]
            messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]}]
            if k < 2:
                messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                              "content": RESULTS[k]}]})
            replies.append(([(b.name, b.input) for b in calls], reply.stop_reason, None))
    return info, replies


@pytest.mark.parametrize("wire, stream", [("openai", False), ("anthropic", False), ("anthropic", True)])
def test_a_forced_call_conversation_echoed_by_the_sdk_extends_and_the_forced_opening_is_context(server, wire, stream):
    tok = server.tokenizer
    info, replies = forced_conversation(server, wire, stream)
    assert [calls for calls, _, _ in replies] == [[("bash", {"cmd": c})] for c in ("ls", "cat a.txt", "wc a.txt")]
    assert {stop for _, stop, _ in replies} == ({"tool_calls"} if wire == "openai" else {"tool_use"})
    record = trace(info)
    assert [s["seal_reason"] for s in record["segments"]] == [""]          # every echo extended
    segment = record["segments"][0]
    opening = tok.encode(CALL_OPENING, add_special_tokens=False)
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")] for t in FORCED]
    assert trainable_ids(record) == [t for ids in sampled for t in ids]   # the opening was never sampled
    ids, mask = segment["token_ids"], segment["trainable"]
    for ids_k in sampled:                              # each reply's sampled run follows its forced opening, context
        start = next(i for i in range(len(ids)) if ids[i:i + len(ids_k)] == ids_k and mask[i])
        assert ids[start - len(opening):start] == opening and not any(mask[start - len(opening):start])
    spec = constraints.bind(constraints.tool_call_spec(wires.decode_openai(
        {"messages": ASK, "tools": OPENAI_TOOLS}, GREEDY).tools), [tok.convert_tokens_to_ids("<|im_end|>")])
    assert {s["constraint"] for s in samplings_of_sampled_tokens(info)} == {spec}   # the tools' grammar, recorded
    if wire == "openai":
        assert replies[0][2]["sampling"]["constraint"] == spec
        assert replies[0][2]["prompt_token_ids"][-len(opening):] == opening


def test_a_named_tool_is_the_one_called_on_both_wires(server):
    openai_info, anthropic_info = server.create_session(sampling=GREEDY), server.create_session(sampling=GREEDY)
    reply = openai_client(openai_info).chat.completions.create(
        model="policy", messages=ASK, tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "read"}})
    assert reply.choices[0].message.tool_calls[0].function.name == "read"            # taught "bash"; masked to "read"
    message = anthropic_client(anthropic_info).messages.create(
        model="policy", max_tokens=40, system=ASK[0]["content"], messages=ASK[1:], tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "read"})
    assert [b.name for b in message.content if b.type == "tool_use"] == ["read"]
    assert "path" in next(b for b in message.content if b.type == "tool_use").input


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_tool_choice_none_produces_no_call_and_bans_the_one_token_opening(server, wire):
    tok = server.tokenizer
    opening_id = tok.convert_tokens_to_ids("<tool_call>")
    auto, none = server.create_session(sampling=GREEDY), server.create_session(sampling=GREEDY)
    if wire == "openai":
        def ask(info, **kwargs):
            message = openai_client(info).chat.completions.create(model="policy", messages=ASK, tools=OPENAI_TOOLS,
                                                                  **kwargs).choices[0].message
            return message.tool_calls or [], message.content or ""
        armed, (calls, text) = ask(auto), ask(none, tool_choice="none")
    else:
        def ask(info, **kwargs):
            message = anthropic_client(info).messages.create(model="policy", max_tokens=40, system=ASK[0]["content"],
                                                             messages=ASK[1:], tools=ANTHROPIC_TOOLS, **kwargs)
            return ([b for b in message.content if b.type == "tool_use"],
                    "".join(b.text for b in message.content if b.type == "text"))
        armed, (calls, text) = ask(auto), ask(none, tool_choice={"type": "none"})
    assert armed[0] and calls == [] and "<tool_call>" not in text       # armed: the same prompt under auto calls
    assert opening_id not in trainable_ids(trace(none))
    assert {tuple(map(tuple, s["logit_bias"])) for s in samplings_of_sampled_tokens(none)} == {((opening_id, "-inf"),)}
    assert prompt_of(none) == prompt_of(auto)               # the tools stay rendered: the prompt auto sampled from


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_without_parallel_calls_sampling_ends_at_the_first_call(server, wire):
    tok = server.tokenizer
    counts = []
    for parallel in (True, False):
        info = server.create_session(sampling=GREEDY)
        if wire == "openai":
            reply = openai_client(info).chat.completions.create(model="policy", messages=ASK_TWICE, tools=OPENAI_TOOLS,
                                                                parallel_tool_calls=parallel)
            counts.append(len(reply.choices[0].message.tool_calls))
            assert reply.choices[0].finish_reason == "tool_calls"
        else:
            choice = {"type": "auto", "disable_parallel_tool_use": not parallel}
            reply = anthropic_client(info).messages.create(model="policy", max_tokens=80, system=ASK[0]["content"],
                                                           messages=ASK_TWICE[1:], tools=ANTHROPIC_TOOLS,
                                                           tool_choice=choice)
            counts.append(sum(b.type == "tool_use" for b in reply.content))
            assert reply.stop_reason == "tool_use" and reply.stop_sequence is None
        sampled = trainable_ids(trace(info))
    assert counts == [2, 1]                                   # armed: with parallel calls the model writes two
    assert sampled[-1] == tok.convert_tokens_to_ids("</tool_call>")   # ended there, the closing token trainable


# ---- response_format: the reply is masked by the schema's grammar ------------------------------------------

@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_json_schema_reply_parses_and_validates_and_its_grammar_is_recorded(server, wire):
    im_end = server.tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = []
    for constrained in (True, False):
        info = server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=5))
        ask = [{"role": "user", "content": "Is it done? Answer in JSON."}]
        if wire == "openai":
            form = {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT,
                                                                              "strict": True}}} if constrained else {}
            texts.append(openai_client(info).chat.completions.create(model="policy", messages=ask, **form)
                         .choices[0].message.content)
        else:
            form = {"output_config": {"format": {"type": "json_schema", "schema": VERDICT}}} if constrained else {}
            texts.append(anthropic_client(info).messages.create(model="policy", max_tokens=24, messages=ask, **form)
                         .content[0].text)
        if constrained:
            spec = constraints.bind(constraints.json_schema_spec(VERDICT, strict=True), [im_end])
            assert {s["constraint"] for s in samplings_of_sampled_tokens(info)} == {spec}
    jsonschema.validate(json.loads(texts[0]), VERDICT)
    with pytest.raises((ValueError, jsonschema.ValidationError)):   # armed: unconstrained, no such JSON
        jsonschema.validate(json.loads(texts[1]), VERDICT)


def test_a_json_schema_with_tools_offered_lets_the_model_call_a_tool_then_answer_in_the_schema(format_server):
    server, tok = format_server, format_server.tokenizer
    info = server.create_session(sampling=GREEDY)
    client, messages = openai_client(info), list(ASK_JSON)
    first = client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS, **VERDICT_FORMAT,
                                           extra_body={"return_token_ids": True})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("bash", {"cmd": "ls"})]
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": RESULTS[0]}]
    final = client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS, **VERDICT_FORMAT)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    jsonschema.validate(json.loads(final.choices[0].message.content), VERDICT)
    record = trace(info)
    assert [s["seal_reason"] for s in record["segments"]] == [""]        # the SDK's echo extended the record
    opening = tok.convert_tokens_to_ids("<tool_call>")
    assert trainable_ids(record)[0] == opening != first.model_extra["prompt_token_ids"][-1]   # sampled, not forced
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    spec = constraints.bind(constraints.with_tool_calls(constraints.json_schema_spec(VERDICT), wires.decode_openai(
        {"messages": ASK, "tools": OPENAI_TOOLS}, GREEDY).tools, True), [im_end])
    assert {s["constraint"] for s in samplings_of_sampled_tokens(info)} == {spec} == {first.model_extra["sampling"][
        "constraint"]}
    # armed: the format alone (what the server recorded before) cannot write the call this conversation made
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        constraints.replay_masks(constraints.bind(constraints.json_schema_spec(VERDICT), [im_end]), tok,
                                 trainable_ids(record), len(tok))
    # tool_choice none keeps the format alone: the same request writes JSON, no call
    info = server.create_session(sampling=GREEDY)
    reply = openai_client(info).chat.completions.create(model="policy", messages=ASK_JSON, tools=OPENAI_TOOLS,
                                                        tool_choice="none", **VERDICT_FORMAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), VERDICT)
    assert {s["constraint"] for s in samplings_of_sampled_tokens(info)} == {
        constraints.bind(constraints.json_schema_spec(VERDICT), [im_end])}


def test_an_anthropic_output_format_with_tools_offered_calls_the_tool_then_answers_in_the_schema(format_server):
    info = format_server.create_session(sampling=GREEDY)
    claude, history = anthropic_client(info), list(ASK_JSON[1:])
    request = dict(model="policy", max_tokens=40, system=ASK_JSON[0]["content"], tools=ANTHROPIC_TOOLS,
                   output_config={"format": {"type": "json_schema", "schema": VERDICT}})
    first = claude.messages.create(messages=history, **request)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and [(b.name, b.input) for b in calls] == [("bash", {"cmd": "ls"})]
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                              "content": RESULTS[0]}]}]
    final = claude.messages.create(messages=history, **request)
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["text"]
    jsonschema.validate(json.loads(final.content[0].text), VERDICT)
    assert [s["seal_reason"] for s in trace(info)["segments"]] == [""]


def test_response_format_text_is_unconstrained_and_json_object_records_its_grammar(server):
    im_end = server.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain, text = (server.create_session(sampling=SamplingParams(**BASE, seed=2)) for _ in range(2))
    openai_client(plain).chat.completions.create(model="policy", messages=COUNT)
    openai_client(text).chat.completions.create(model="policy", messages=COUNT, response_format={"type": "text"})
    assert trainable_ids(trace(text)) == trainable_ids(trace(plain))
    info = server.create_session(sampling=SamplingParams(**BASE, seed=2))
    openai_client(info).chat.completions.create(model="policy", messages=COUNT,
                                                response_format={"type": "json_object"})
    spec = constraints.bind(constraints.json_object_spec(), [im_end])
    assert {s["constraint"] for s in samplings_of_sampled_tokens(info)} == {spec}
    assert server.tokenizer.decode(trainable_ids(trace(info))).startswith("{")


# ---- thinking: the template's switch, and thinking blocks that round-trip --------------------------------

def test_an_anthropic_thinking_block_round_trips_without_a_seal_streamed_or_not_and_omitted(server):
    for variant in ("plain", "streamed", "omitted", "redacted"):
        info = server.create_session(sampling=GREEDY)
        claude = anthropic_client(info)
        thinking = {"type": "enabled", "budget_tokens": 1024, **({"display": "omitted"} if variant == "omitted"
                                                                  else {})}
        request = dict(model="policy", max_tokens=40, messages=COUNT, thinking=thinking)
        if variant == "streamed":
            with claude.messages.stream(**request) as events:
                first = events.get_final_message()
        else:
            first = claude.messages.create(**request)
        assert [b.type for b in first.content] == ["thinking", "text"] and first.content[1].text == "One file."
        assert first.content[0].thinking == ("" if variant == "omitted" else "count them")
        blocks = [b.model_dump() for b in first.content]
        if variant == "redacted":
            blocks[0] = {"type": "redacted_thinking", "data": blocks[0]["signature"]}
        second = claude.messages.create(model="policy", max_tokens=40, thinking=thinking, messages=[
            *COUNT, {"role": "assistant", "content": blocks}, {"role": "user", "content": "Again?"}])
        assert second.content[0].text == "Still one."
        assert [s["seal_reason"] for s in trace(info)["segments"]] == [""], variant
    # armed: an edited thought is an edit, and seals
    edited = server.create_session(sampling=GREEDY)
    claude = anthropic_client(edited)
    first = claude.messages.create(model="policy", max_tokens=40, messages=COUNT)
    blocks = [{**first.content[0].model_dump(), "thinking": "count them twice"}, first.content[1].model_dump()]
    claude.messages.create(model="policy", max_tokens=4, messages=[
        *COUNT, {"role": "assistant", "content": blocks}, {"role": "user", "content": "Again?"}])
    assert [s["seal_reason"] for s in trace(edited)["segments"]] == ["non_extension", ""]


@pytest.mark.parametrize("wire, switch", [
    ("openai", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
    ("openai", {"reasoning_effort": "none"}), ("anthropic", {"thinking": {"type": "disabled"}})])
def test_thinking_off_writes_the_templates_empty_think_block_as_context_and_the_echo_extends(server, wire, switch):
    tok = server.tokenizer
    stub = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    info = server.create_session(sampling=GREEDY)
    messages, texts = list(COUNT), []
    for follow_up in ("Again?", None):
        if wire == "openai":
            reply = openai_client(info).chat.completions.create(model="policy", messages=messages, **switch)
            texts.append(reply.choices[0].message.content)
        else:
            texts.append(anthropic_client(info).messages.create(model="policy", max_tokens=40, messages=messages,
                                                                **switch).content[0].text)
        messages += [{"role": "assistant", "content": texts[-1]}] + ([{"role": "user", "content": follow_up}]
                                                                      if follow_up else [])
    assert texts == ["One.", "Still one."]                    # what the model learnt after the empty think block
    segment = trace(info)["segments"]
    assert [s["seal_reason"] for s in segment] == [""]
    ids, mask = segment[0]["token_ids"], segment[0]["trainable"]
    first_sampled = mask.index(True)
    assert ids[first_sampled - len(stub):first_sampled] == stub and not any(mask[:first_sampled])


def test_template_switches_are_part_of_a_requests_identity(server):
    info = server.create_session(sampling=GREEDY)
    client, calls = openai_client(info), server.engine.calls
    client.chat.completions.create(model="policy", messages=COUNT)
    client.chat.completions.create(model="policy", messages=COUNT)              # a retry: answered from the record
    assert server.engine.calls == calls + 1
    client.chat.completions.create(model="policy", messages=COUNT, reasoning_effort="none")   # not a retry
    assert server.engine.calls == calls + 2 and len(trace(info)["segments"]) == 2


def test_a_plain_text_document_reaches_the_model_as_text_with_its_title(server):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
    document = {"type": "document", "title": "notes.txt", "source": {"type": "text", "media_type": "text/plain",
                                                                     "data": "a.txt holds hello"}}
    anthropic_client(info).messages.create(model="policy", max_tokens=4, messages=[
        {"role": "user", "content": [document, {"type": "text", "text": "What does a.txt hold?"}]}])
    context = server.tokenizer.decode([t for s in trace(info)["segments"]
                                       for t, m in zip(s["token_ids"], s["trainable"]) if not m])
    assert "notes.txt\n\na.txt holds hello\n\nWhat does a.txt hold?" in context


# ---- Claude Code's wire: deferred tools, context management, count_tokens ----------------------------------

SEARCH_TOOL = {"name": "ToolSearch", "description": "Fetches deferred tools.",
               "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}


def deferred(name: str, description: str, defer: bool = True) -> dict:
    return {"name": name, "description": description, "defer_loading": defer,
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


FOUND = [{"role": "user", "content": "Find the notebook tool."},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                            "input": {"query": "select:NotebookEdit"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
             {"type": "tool_reference", "tool_name": "NotebookEdit"}]}, {"type": "text", "text": "Tool loaded."}]}]


def context_text(info) -> str:
    return "".join(t for s in trace(info)["segments"] for t, m in zip(s["tokens"], s["trainable"]) if not m)


def tool_list(info) -> str:
    """The tools the template rendered at the top of the prompt (data.CHATML_TEMPLATE's <tools> block)."""
    text = context_text(info)
    start = text.index("<tools>\n")
    return text[start:text.index("</tools>", start)]


def test_a_deferred_tool_enters_the_context_where_a_tool_reference_names_it_and_adding_it_never_seals(server):
    notebook = "Replaces a cell in a Jupyter notebook."
    runs = {}
    for defer in (True, False):      # False: the control, every tool rendered in the prompt's tool list
        info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
        client = anthropic_client(info).beta.messages
        tools = [SEARCH_TOOL, deferred("NotebookEdit", notebook, defer)]
        first = client.create(model="policy", max_tokens=6, messages=FOUND, tools=tools,
                              betas=["advanced-tool-use-2025-11-20"])
        # the harness's search finds another tool and adds it to `tools` (Claude Code: in name order, deferred)
        later = [*FOUND, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": "Go on."}]
        client.create(model="policy", max_tokens=6, messages=later, betas=["advanced-tool-use-2025-11-20"],
                      tools=[SEARCH_TOOL, deferred("NotebookEdit", notebook, defer), deferred("Monitor", "Watch.",
                                                                                               defer)])
        runs[defer] = info
    text, listed = context_text(runs[True]), tool_list(runs[True])
    assert "ToolSearch" in listed and "NotebookEdit" not in listed and "Monitor" not in listed
    assert '<tool_response>\n<functions>\n<function>{"description": "' + notebook + '", "name": "NotebookEdit", ' \
        '"parameters": {"type": "object"' in text                   # where the reference stands
    assert [s["seal_reason"] for s in trace(runs[True])["segments"]] == [""]
    # armed: rendered in the tool list, the tool a search adds rewrites the record's opening, and the record seals
    assert [s["seal_reason"] for s in trace(runs[False])["segments"]] == ["non_extension", ""]
    # a server-side tool search cannot run here: dropped, and the deferred tools are rendered like any
    info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
    anthropic_client(info).beta.messages.create(
        model="policy", max_tokens=4, messages=COUNT, betas=["advanced-tool-use-2025-11-20"],
        tools=[{"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
               deferred("NotebookEdit", notebook)])
    assert "NotebookEdit" in tool_list(info) and "tool_search" not in tool_list(info)


@pytest.mark.parametrize("stream", [False, True])
def test_context_management_is_accepted_no_edit_is_applied_and_the_reply_says_so(server, stream):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
    client = anthropic_client(info).beta.messages
    # an edit whose trigger the conversation passes at once: still none is applied, the history is kept whole
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1}},
                       {"type": "clear_thinking_20251015", "keep": "all"}]}
    ask = dict(model="policy", max_tokens=6, context_management=edits, betas=["context-management-2025-06-27"])
    messages = list(COUNT)
    for _ in range(2):
        if stream:
            with client.stream(messages=messages, **ask) as events:
                reply = events.get_final_message()
        else:
            reply = client.create(messages=messages, **ask)
        assert reply.context_management.applied_edits == []
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": "Again?"}]
    assert [s["seal_reason"] for s in trace(info)["segments"]] == [""]       # the echo extended: nothing was cleared
    plain = anthropic_client(info).messages.create(model="policy", max_tokens=6, messages=COUNT)
    assert "context_management" not in plain.model_dump(exclude_none=True)   # only a request that set it is told


def test_count_tokens_is_the_prompt_the_next_turn_gets_and_records_nothing(server):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
    client = anthropic_client(info)
    first = client.messages.create(model="policy", max_tokens=6, messages=COUNT)
    later = [*COUNT, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": "Again?"}]
    calls, before = server.engine.calls, trace(info)
    counted = client.messages.count_tokens(model="policy", messages=later)
    assert server.engine.calls == calls and trace(info) == before              # nothing generated or recorded
    second = client.messages.create(model="policy", max_tokens=6, messages=later)
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens   # Anthropic counts cache reads apart
    assert counted.input_tokens == prompt == len(trace(info)["segments"][0]["token_ids"]) - \
        second.usage.output_tokens                                             # the record's tokens, extended
    with pytest.raises(anthropic.BadRequestError, match="count_tokens takes"):
        client.messages.count_tokens(model="policy", messages=COUNT, extra_body={"max_tokens": 5})
    assert client.messages.count_tokens(model="policy", messages=COUNT, system="Be brief.").input_tokens > 0


# ---- no-ops and refusals -----------------------------------------------------------------------------------

OPENAI_NO_OPS = dict(store=True, metadata={"run": "x"}, user="u1", service_tier="auto", prompt_cache_key="k",
                     safety_identifier="s", prediction={"type": "content", "content": "One file."}, verbosity="low",
                     prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"})
SAFEGUARDS = [{"type": "dangerous_tool_use", "classifier_context": {"v": 1, "permission_mode": "auto"}}]
ANTHROPIC_NO_OPS = dict(metadata={"user_id": "u1"}, service_tier="auto", cache_control={"type": "ephemeral"},
                        inference_geo="us", speed="fast", diagnostics={"previous_message_id": "m"},
                        # the SDK sends the first two as headers; in a body they are no-ops as well; the rest are the
                        # beta wire's (client.beta.messages) and Claude Code's
                        extra_body={"workspace_id": "w", "user_profile_id": "p", "betas": ["effort-2025-11-24"],
                                    "billing_policy": {"type": "billing_policy", "bill_to": "self"},
                                    "fallback_credit_token": "t", "fallbacks": "default", "safeguards": SAFEGUARDS,
                                    "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                      "keep": "all"}]}})


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_no_op_fields_change_nothing_and_the_reply_lists_them(server, wire):
    no_ops = OPENAI_NO_OPS if wire == "openai" else ANTHROPIC_NO_OPS
    names = set(no_ops) - {"extra_body"} | set(no_ops.get("extra_body", {})) | {"model"}
    assert {k for k, (d, _) in (OPENAI_FIELDS if wire == "openai" else ANTHROPIC_FIELDS).items()
            if d == NO_OP} == names                            # every no-op is exercised
    sessions = [server.create_session(sampling=SamplingParams(**BASE, seed=9)) for _ in range(2)]
    listed = None
    for info, extra in zip(sessions, ({}, no_ops)):
        extra = {**extra, "extra_body": {**extra.get("extra_body", {}), "return_token_ids": True}}
        if wire == "openai":
            reply = openai_client(info).chat.completions.create(model="policy", messages=COUNT, **extra)
        else:
            reply = anthropic_client(info).messages.create(model="policy", max_tokens=6, messages=COUNT, **extra)
        listed = reply.model_extra["no_op_params"]
    assert listed == sorted(names)
    assert trace(sessions[0])["segments"][0]["token_ids"] == trace(sessions[1])["segments"][0]["token_ids"]
    assert trace(sessions[0])["samplings"] == trace(sessions[1])["samplings"]


REFUSALS = [   # (wire, request fields, what the 400 must say)
    ("openai", {"audio": {"voice": "alloy", "format": "wav"}}, "'audio' is refused: this server writes text"),
    ("openai", {"moderation": {"model": "omni-moderation-latest"}}, "'moderation' is refused"),
    ("openai", {"web_search_options": {}}, "give the agent a search tool of its own"),
    ("openai", {"functions": [{"name": "bash"}]}, "send tools=[{'type': 'function'"),
    ("openai", {"function_call": "auto"}, "send tool_choice"),
    ("openai", {"n": 2}, "n samples of a prompt are n sessions of one group"),
    ("openai", {"modalities": ["text", "audio"]}, "'modalities' must be ['text']"),
    ("openai", {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
                "tools": OPENAI_TOOLS}, "send only the allowed tools in 'tools'"),
    ("openai", {"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "declare a function tool"),
    ("openai", {"tool_choice": "required"}, "needs a tool to call"),
    ("openai", {"tool_choice": {"type": "function", "function": {"name": "rm"}}, "tools": OPENAI_TOOLS},
     "not among the tools"),
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "not a JSON Schema the grammar engine can enforce"),
    ("openai", {"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of"),
    ("openai", {"reasoning_effort": "high", "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
     "send one of them"),
    ("openai", {"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}},
     "send switches such as enable_thinking"),
    ("openai", {"logit_bias": {"x": 1}}, "'logit_bias' must map token ids"),
    ("openai", {"logit_bias": {"5": 101}}, "'logit_bias' values must be numbers in [-100, 100]"),
    ("openai", {"frequency_penalty": 3}, "frequency_penalty must be a number in [-2, 2]"),
    ("openai", {"logit_bias": {"99999": 1}}, "logit_bias must be a tuple of (token id < "),   # past the vocabulary
    ("openai", {"extra_body": {"best_of": 2}}, "unsupported parameter(s) ['best_of']"),
    ("anthropic", {"container": "c"}, "'container' is refused"),
    ("anthropic", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "declare a client tool"),
    ("anthropic", {"tool_choice": {"type": "any"}}, "needs a tool to call"),
    ("anthropic", {"thinking": {"type": "enabled"}}, "'budget_tokens': int >= 1"),
    ("anthropic", {"output_config": {"format": {"type": "json_object"}}}, "output_config.format must be"),
    ("anthropic", {"messages": [*COUNT, {"role": "assistant", "content": "The answer is"}]}, "end with a user message"),
    ("anthropic", {"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]}, "extract its text and send that"),
    ("anthropic", {"messages": [*COUNT, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}, {"type": "text", "text": "One."}]},
        {"role": "user", "content": "Again?"}]}, "leave the block out"),
    ("anthropic", {"extra_body": {"logit_bias": {"5": 1}}}, "unsupported parameter(s) ['logit_bias']"),
    ("anthropic", {"extra_body": {"compaction": {"type": "compact"}}}, "the harness's own compaction"),
    ("anthropic", {"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}},
     "offer their tools as client tools"),
    ("anthropic", {"extra_body": {"thread": {"type": "create"}}}, "send the whole conversation every turn"),
    ("anthropic", {"extra_body": {"context_management": ["clear"]}}, "'context_management' must be an object"),
    ("anthropic", {"thinking": {"type": "adaptive", "display": "full"}}, "display 'summarized', 'omitted' or 'updates'"),
    ("anthropic", {"tools": ANTHROPIC_TOOLS, "messages": [*COUNT, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "select:Nope"}}]}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "Nope"}]}]}]}, "references the tool 'Nope', which is not in"),
]


@pytest.mark.parametrize("wire, fields, message", REFUSALS, ids=[f"{w}-{m[:30]}" for w, _, m in REFUSALS])
def test_each_refusal_is_a_400_naming_what_is_accepted_and_the_server_keeps_serving(server, wire, fields, message):
    info = server.create_session(sampling=SamplingParams(**BASE, seed=0))
    if wire == "openai":
        create = openai_client(info).chat.completions.create
        with pytest.raises(openai.BadRequestError) as refused:
            create(**{"model": "policy", "messages": COUNT, **fields})
    else:
        create = anthropic_client(info).messages.create
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(**{"model": "policy", "max_tokens": 6, "messages": COUNT, **fields})
    assert refused.value.status_code == 400 and message in str(refused.value)
    assert trace(info)["segments"] == []                       # nothing recorded
    kept = create(model="policy", messages=COUNT, **({} if wire == "openai" else {"max_tokens": 6}))
    assert kept and len(trace(info)["segments"]) == 1          # and the same session goes on serving


# ---- the trainer recomputes the distribution each honoured field drew from --------------------------------

STORY = [{"role": "user", "content": "Tell me a story."}]     # untaught: the model's own, wide distribution


def test_the_recompute_matches_under_each_honoured_field_and_misses_without_it(server, tmp_path):
    tok = server.tokenizer
    folder = str(tmp_path / "taught")
    server.engine.model.save_pretrained(folder)
    tok.save_pretrained(folder)
    policy = actor.Actor(folder, actor.ActorConfig(precision="fp32", micro_batch_size=4), total_steps=1)
    cases = {"temperature 0": {"temperature": 0},
             "logit_bias": {"logit_bias": {str(tok.convert_tokens_to_ids("<think>")): 3.0, "9": -100}},
             "penalties": {"frequency_penalty": 1.5, "presence_penalty": 0.8,
                           "extra_body": {"repetition_penalty": 1.6}},
             "min_p": {"extra_body": {"min_p": 0.2, "top_k": 40}},
             "json_schema": {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "v", "schema": VERDICT}}},
             "tool_choice required": {"tools": OPENAI_TOOLS, "tool_choice": "required"},
             "json_schema with tools (auto)": {"tools": OPENAI_TOOLS, **VERDICT_FORMAT}}
    results = {}
    for name, fields in cases.items():
        info = server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=16, seed=3))
        openai_client(info).chat.completions.create(model="policy", messages=STORY, **fields)
        rows = server.close_session(info.session_id).ledger.rows()
        batch = invariants.build_batch(rows, [1.0], pad_id=tok.pad_token_id, grammar_masks=constraints.mask_replayer(
                                           tok, policy.model.config.vocab_size))
        mask = batch.loss_mask.bool()
        gap = (policy.recompute_logprobs(batch) - batch.behavior_logprobs)[mask].abs().max().item()
        # armed: the same rows recomputed as if the field had not been sent
        plain = [dataclasses.replace(r, sampling=[invariants.Sampling(s.temperature) if s != invariants.UNSAMPLED
                                                  else s for s in r.sampling]) for r in rows]
        unrecorded = invariants.build_batch(plain, [1.0], pad_id=tok.pad_token_id)
        missed = (policy.recompute_logprobs(unrecorded) - batch.behavior_logprobs)[mask].abs().max().item()
        print(f"{name}: max |recompute - behavior| {gap:.1e} at the recorded sampling, {missed:.2f} without the field")
        results[name] = (gap, missed)
    assert all(gap < 1e-4 and missed > 1e-2 and math.isfinite(gap) for gap, missed in results.values()), results
