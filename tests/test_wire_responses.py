# The OpenAI Responses wire (wires/responses.py). Without a server: a Responses conversation decodes to the canonical
# request the chat wire decodes the same conversation to; Codex's real first request (its shape, trimmed) decodes;
# refusals say what is accepted; a session keeps its last stored responses; the output items a stream builds are the
# finished reply's over thousands of random replies (thoughts, calls whose arguments stream token by token, broken
# calls, stop strings), armed by a stream that treats the reply so far as finished; the items of any reply echo back
# to the parser's message (armed: other encrypted_content or arguments decode to another). Over real HTTP with the
# real openai SDK against a LoopbackServer on a tiny Qwen3 taught each reply from the prompt the server built for it:
# plain, instructions, usage, streamed (text deltas concatenate to the final text, call-argument deltas to the
# arguments), tool calls whose echo with function_call_output extends the record (one segment; armed: edited
# arguments seal), structured output validated by jsonschema, reasoning items echoed with encrypted_content (extends;
# without it the documented seal; an altered one seals), previous_response_id and item_reference, logprobs, dropped
# and namespaced tools, no-ops, errors in the OpenAI format that record nothing, a failure mid-stream as
# response.failed; the OpenAI Agents SDK on its default OpenAIResponsesModel running a tool episode, whole and
# streamed.
import copy
import json
import random

import jsonschema
import openai
import pytest

import data
import models
import wires
from engines import Generation, SamplingParams, find_stop
from engines import constraints
from engines.harvest import ScriptEngine
from loopback import LoopbackServer
from router import EngineFailure
from session import ChatSession
from wires import CALL_OPENING, parse_hermes_tool_calls
from wires import responses as wire_responses
from test_loopback_http import trace, trainable_ids
from test_session import CountingEngine, teach
from wires import ChatTurn, LiveText, WireError, decode_openai
from wires.params import NO_OP, RESPONSES_FIELDS
from wires.responses import ResponsesStream, ResponseStore, decode_responses, layout, responses_reply

BASE = SamplingParams(max_tokens=16)
SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
TOOLS = [{"type": "function", "name": "bash", "description": "Run a command.", "parameters": SCHEMA, "strict": False}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": SCHEMA,
                                                "strict": False}}]


# ---- decoding -------------------------------------------------------------------------------------------

def test_a_conversation_decodes_to_the_chat_wires_canonical_request():
    responses = decode_responses({
        "instructions": "Be brief.", "tools": TOOLS, "max_output_tokens": 8, "temperature": 0.5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "List "},
                                               {"type": "input_text", "text": "files."}]},
                  {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": '{"cmd": "ls"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
                  {"role": "user", "content": "Thanks."}]}, BASE, ResponseStore()).request
    chat = decode_openai({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "List files."},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
                     {"role": "user", "content": "Thanks."}],
        "tools": CHAT_TOOLS, "max_tokens": 8, "temperature": 0.5}, BASE)
    assert responses.messages == chat.messages and responses.tools == chat.tools
    assert responses.sampling == chat.sampling


# Codex CLI 0.171's first request (`codex exec`), its shape kept and its long texts cut: developer messages with
# several input_text parts, item ids, function tools with strict false, a namespace tool, web_search, reasoning
# summary auto, store false, include encrypted reasoning, client_metadata.
CODEX_FIRST_REQUEST = {
    "model": "policy", "instructions": "", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a23e01-9921-7852-b748-46e986d08ec0",
    "client_metadata": {"x-codex-window-id": "01a23e01-9921-7852-b748-46e986d08ec0:0",
                        "x-codex-installation-id": "92746b50-308c-4aba-af07-0e5c499fe0d4",
                        "turn_id": "01a23e01-9935-7183-ad21-69050baf6873"},
    "input": [
        {"type": "message", "id": "msg_ca404424", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
        {"type": "message", "id": "msg_01a23e01-994d", "role": "developer",
         "content": [{"type": "input_text", "text": "<skills_instructions>\n## Skills\n</skills_instructions>"},
                     {"type": "input_text", "text": "<permissions instructions>\nread-only\n"
                                                    "</permissions instructions>"}]},
        {"type": "message", "id": "msg_01a23e01-994d-7713", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/tmp/w</cwd>\n"
                                                    "</environment_context>"}]},
        {"type": "message", "id": "msg_01a23e01-9952", "role": "user",
         "content": [{"type": "input_text", "text": "Say hello."}]}],
    "tools": [
        {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                        "additionalProperties": False}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
         "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
                    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}},
                   {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                    "parameters": {"type": "object", "properties": {}}}]},
        {"type": "web_search", "external_web_access": False}]}


def test_codex_first_request_decodes():
    decoded = decode_responses(copy.deepcopy(CODEX_FIRST_REQUEST), BASE, ResponseStore())
    request = decoded.request
    assert [m["role"] for m in request.messages] == ["system", "system", "user", "user"]
    assert request.messages[1]["content"].startswith("<skills_instructions>") and \
        request.messages[1]["content"].endswith("</permissions instructions>")
    assert [t["function"]["name"] for t in request.tools] == ["exec_command", "spawn_agent", "close_agent"]
    assert decoded.namespaces == {"spawn_agent": "multi_agent_v1", "close_agent": "multi_agent_v1"}
    assert decoded.dropped_tools == ["web_search"] and not decoded.store
    assert request.stream and request.no_ops == ("client_metadata", "model", "prompt_cache_key")


@pytest.mark.parametrize("body, message", [
    ({"input": "hi", "conversation": "conv_1"}, "no Conversations API here"),
    ({"input": "hi", "background": True}, "'background': true is refused"),
    ({"input": "hi", "truncation": "auto"}, "truncation must be 'disabled'"),
    ({"input": "hi", "previous_response_id": "resp_x"}, "is no response this session stored"),
    ({"input": [{"type": "item_reference", "id": "msg_x"}]}, "names no output item"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "items of hosted, MCP, shell"),
    ({"input": "hi", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "run code"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]}, "no grammar can hold it"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "an image goes in a user message or a function_call_output"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}, "tools": TOOLS},
     "send only the allowed tools"),
    ({"input": "hi", "tools": TOOLS + [{"type": "namespace", "name": "n", "description": "",
                                        "tools": [TOOLS[0]]}]}, "name more than one function"),
    ({"input": "hi", "include": ["everything"]}, "'include' must be a list of"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "extract its text"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "gAAAAAB"}]},
     "not written by this server"),
    ({"input": "hi", "seed": 3}, "unsupported parameter(s) ['seed']"),
])
def test_refusals_say_what_is_accepted(body, message):
    with pytest.raises(WireError, match=None) as refused:
        decode_responses(body, BASE, ResponseStore())
    assert refused.value.status == 400 and message in str(refused.value), str(refused.value)


def test_a_session_keeps_its_last_stored_responses_and_nothing_when_store_is_false():
    store, turn = ResponseStore(), ChatTurn({"role": "assistant", "content": "Yo."}, Generation([1], [2], [0.0], [0],
                                                                                                None, "stop"), False)
    request = decode_responses({"input": "hi"}, BASE, store)
    for k in range(wire_responses.MAX_STORED_RESPONSES + 1):
        store.remember(f"resp_{k}", request, turn, [{"id": f"msg_{k}", "type": "message"}])
    assert store.conversation(f"resp_{k}") == [{"role": "user", "content": "hi"}, turn.message]
    assert store.item(f"msg_{k}") == {"id": f"msg_{k}", "type": "message"} and store.item("msg_0") is None
    with pytest.raises(WireError, match="is no response this session stored"):
        store.conversation("resp_0")                                    # the oldest is forgotten
    store.remember("resp_x", decode_responses({"input": "hi", "store": False}, BASE, store), turn, [])
    with pytest.raises(WireError):
        store.conversation("resp_x")


# ---- layout: a stream builds the finished reply's items ---------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "plan", "\n", "\n\n", " ", "Hi", "done.", "<", "<tool", "_call>", "<tool_call>",
             "</tool_call>", "</tool", '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>',
             '{"name": "bash", "arguments": ', '{"cmd": "a}b", "n": [1, {"x": 2}]}', "}", "\n}", '"', '\\"',
             '{"name": 3}', '{"arguments": {"cmd": "pwd"}, "name": "bash"}', "STOP", "ST", "é", "x",
             '<tool_call>\n{"name": "patch", "arguments": {"input": "+a\\n\\"é"}}\n</tool_call>',
             '{"name": "patch", "arguments": ', '{"input": "x"}', '{"input": 3}']
PATCH = {"type": "custom", "name": "patch", "description": "Apply a patch.", "format": {"type": "text"}}


def reply_of(text: str, tok, stops: tuple, opening: str = ""):
    """What the engine and session make of a sampled text: its ids (cut where a stop string completes), and the
    reply as the agent reads it."""
    ids, kept = tok.encode(text, add_special_tokens=False), []
    for token_id in ids:
        kept.append(token_id)
        if stops and find_stop(tok.decode(kept), stops):
            break
    reply = tok.decode(kept)
    hit = find_stop(reply, stops) if stops else None
    return kept, opening + (reply[:hit[0]] if hit else reply)


def assembled(events: list) -> list[dict]:
    """The output items an SDK builds from a stream's events (added, deltas, done), checking every delta
    concatenates to the item's final text and sequence numbers increase."""
    items, texts, done = {}, {}, set()
    numbers = [event["sequence_number"] for _, event in events]
    assert numbers == list(range(len(numbers)))
    for name, event in events:
        index = event.get("output_index")
        if name == "response.output_item.added":
            assert index not in items and index == len(items)
            items[index], texts[index] = event["item"], ""
        elif name.endswith(".delta"):
            assert index in items and index not in done          # never into an item not open
            texts[index] += event["delta"]
        elif name == "response.output_item.done":
            item = event["item"]
            final = item.get("arguments", item.get("input")) if item["type"].endswith("call") else \
                item["content"][0]["text"]
            assert texts[index] == final, (texts[index], final)
            items[index] = item
            done.add(index)
    assert done == set(items)
    return [items[i] for i in sorted(items)]


def streamed_and_whole(stream_class, tok, text: str, stops: tuple, choice: str):
    opening = CALL_OPENING if choice == "required" else ""
    body = {"input": "x", "tools": TOOLS + [PATCH], "tool_choice": choice, "stream": True}
    request = decode_responses(body, SamplingParams(max_tokens=16, stop=stops), ResponseStore())
    stream, live = stream_class(request, tok, "m", "resp_0", ResponseStore()), LiveText(tok, stops, opening)
    ids, reply = reply_of(text, tok, stops, opening)
    events = stream.start([1])
    for token_id in ids:
        events += stream.push(live, token_id, "call-r-0")
    message = {"role": "assistant", "content": reply} if choice == "none" else parse_hermes_tool_calls(reply,
                                                                                                        "call-r-0")
    turn = ChatTurn(message, Generation([1], ids, [0.0] * len(ids), [0] * len(ids), None, "stop"), False, None,
                    reply, "call-r-0")
    events += stream.finish(turn, "")
    whole = responses_reply(turn, request, tok, "m", "resp_0")
    assert events[-1][1]["response"]["output"] == whole["output"]
    return assembled(events), whole["output"], reply, message


class EagerStream(ResponsesStream):
    """The negative control: lays the reply so far out as if it were finished (closing items, deciding what follows
    a thought, opening calls) before the rest is sampled."""

    def push(self, live, token_id, call_prefix):
        live.push(token_id)
        text = live.settled()
        return self._events(layout(text, self.calls_parsed, call_prefix, parse_hermes_tool_calls(text, call_prefix),
                                   custom=self.request.custom), None)


def first_mismatch(stream_class, tok, replies: int):
    rng = random.Random(2)
    for _ in range(replies):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        stops, choice = rng.choice([(), (), ("STOP",)]), rng.choice(["auto", "auto", "required", "none"])
        try:
            streamed, whole, _, _ = streamed_and_whole(stream_class, tok, text, stops, choice)
        except (RuntimeError, AssertionError) as error:
            return text, stops, choice, str(error)
        if streamed != whole:
            return text, stops, choice, streamed, whole
    return None


def test_streamed_items_are_the_finished_replys_items():
    tok = models.bpe_tokenizer()
    assert first_mismatch(EagerStream, tok, 300) is not None      # armed: a reply so far is not the finished one
    assert first_mismatch(ResponsesStream, tok, 2500) is None


def echo_items(output: list[dict]) -> list[dict]:
    return [{"role": "user", "content": "x"}, *output]


def test_the_items_of_any_reply_echo_back_to_the_parsers_message():
    """The invariant an echo's extension rests on: the output items, sent back as input, decode to exactly the
    message the parser made of the reply (armed: an altered encrypted_content or arguments decodes to another)."""
    tok, rng = models.bpe_tokenizer(), random.Random(3)
    for _ in range(800):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        choice = rng.choice(["auto", "required", "none"])
        _, whole, reply, message = streamed_and_whole(ResponsesStream, tok, text, (), choice)
        decoded = decode_responses({"input": echo_items(whole)}, BASE, ResponseStore()).request.messages
        assert decoded[1:] == [message], (reply, whole)
    reply = '<think>plan</think>\n\nHi <tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    _, whole, _, message = streamed_and_whole(ResponsesStream, tok, reply, (), "auto")
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]
    assert whole[1]["content"][0]["text"] == "Hi" and whole[2]["arguments"] == '{"cmd": "ls"}'
    # armed: an encrypted_content carrying another opening, or other arguments, decode to another message
    for index, key, value in [(0, "encrypted_content", wires.opening_signature("<think>plan</think>\n")),
                              (2, "arguments", '{"cmd": "pwd"}')]:
        changed = [{**item, key: value} if i == index else item for i, item in enumerate(whole)]
        assert decode_responses({"input": echo_items(changed)}, BASE, ResponseStore()).request.messages[1] != message
    # a custom tool's call: its input is the JSON string the model sampled, decoded (armed: another input, another call)
    patch = '<tool_call>\n{"name": "patch", "arguments": {"input": "+a\\n\\"é"}}\n</tool_call>'
    _, custom, _, called = streamed_and_whole(ResponsesStream, tok, patch, (), "auto")
    assert [(item["type"], item["name"], item["input"]) for item in custom] == \
        [("custom_tool_call", "patch", '+a\n"é')]
    assert decode_responses({"input": echo_items(custom)}, BASE, ResponseStore()).request.messages[1] == called
    assert decode_responses({"input": echo_items([{**custom[0], "input": '+a\n"e'}])}, BASE,
                            ResponseStore()).request.messages[1] != called
    foreign = [{**whole[0], "encrypted_content": "gAAAAABo" + whole[0]["encrypted_content"][14:]}, *whole[1:]]
    with pytest.raises(WireError, match="not written by this server"):
        decode_responses({"input": echo_items(foreign)}, BASE, ResponseStore())


def test_call_arguments_stream_token_by_token_before_the_call_closes():
    tok = models.bpe_tokenizer()
    request = decode_responses({"input": "x", "tools": TOOLS, "stream": True}, BASE, ResponseStore())
    stream, live = ResponsesStream(request, tok, "m", "resp_0", ResponseStore()), LiveText(tok, ())
    reply = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la /tmp && wc -l a.txt"}}\n' \
            '</tool_call>'
    ids = tok.encode(reply, add_special_tokens=False)
    closing = next(k for k in range(len(ids)) if "</tool_call>" in tok.decode(ids[:k + 1]))
    per_token = [stream.push(live, token_id, "call-r-0") for token_id in ids]
    deltas = [(k, e["delta"]) for k, events in enumerate(per_token) for name, e in events
              if name == "response.function_call_arguments.delta"]
    assert len(deltas) >= 5 and all(k < closing for k, _ in deltas)      # token by token, before '</tool_call>'
    assert "".join(d for _, d in deltas) == '{"cmd": "ls -la /tmp && wc -l a.txt"}'
    names = [name for events in per_token for name, _ in events]       # the message closes before the call opens
    assert names.index("response.output_item.done") < names.index("response.function_call_arguments.delta")


# ---- over real HTTP: the openai SDK and the Agents SDK against a LoopbackServer -----------------------------

GREEDY = SamplingParams(top_k=1, max_tokens=60)
COUNT = "How many files are there?"
CALL = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
THOUGHT = "<think>count them</think>\n\nOne file."
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
           "required": ["ok", "n"], "additionalProperties": False}


def client(info):
    return openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)


def segments(info) -> list[str]:
    return [s["seal_reason"] for s in trace(info)["segments"]]


class Tutor:
    """A tiny Qwen3 behind a LoopbackServer, taught each reply of a real client's conversation right before the turn
    that samples it, from the very prompt the server built for that turn (read back from the session)."""

    def __init__(self):
        self.tok = models.bpe_tokenizer()
        self.student = models.tiny_model("qwen3", seed=5).train()
        self.engine = CountingEngine(copy.deepcopy(self.student).eval(), tokenizer=self.tok)
        self.server = LoopbackServer(self.engine, self.tok, template=data.CHATML_TEMPLATE)
        self.server.start()
        self.pairs: list = []

    def teach(self, conversation, replies: list[str]) -> None:
        im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        for k, reply in enumerate(replies):
            info = self.server.create_session(sampling=GREEDY)
            try:
                conversation(info)
            except Exception:          # the turns after the untaught one see what an untrained model writes
                pass
            session: ChatSession = self.server.close_session(info.session_id)
            self.pairs.append((session.generations[k].prompt_ids,
                               self.tok.encode(reply, add_special_tokens=False) + [im_end]))
            teach(self.student, self.pairs, max_steps=1500)
            self.engine.update_weights(self.student.state_dict(), self.engine.version + 1)


def first_response(sdk, ask: dict, stream: bool):
    """The first response to `ask`, streamed (with its events' kinds) or not (no kinds)."""
    if not stream:
        return sdk.responses.create(**ask), []
    with sdk.responses.stream(**ask) as events:
        kinds = [event.type for event in events]
        return events.get_final_response(), kinds


def tool_conversation(info, stream: bool = False):
    """Ask for the files with the bash tool; run the call; echo the output items and the call's output."""
    sdk = client(info)
    ask = dict(model="policy", instructions="You can run bash.", input="List files.", tools=TOOLS)
    first, kinds = first_response(sdk, ask, stream)
    calls = [item for item in first.output if item.type == "function_call"]
    second = sdk.responses.create(**{**ask, "input": [
        {"role": "user", "content": "List files."}, *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"}]})
    return first, second, kinds


PATCH_INPUT = '*** Begin Patch\n+é "x"\n*** End Patch'
PATCH_CALL = '<tool_call>\n{"name": "patch", "arguments": ' + json.dumps({"input": PATCH_INPUT}, ensure_ascii=False) + \
    '}\n</tool_call>'


def custom_conversation(info, stream: bool = False, edit: str | None = None):
    """Ask for a patch with the custom tool; run the call; echo its custom_tool_call item (its input replaced by `edit`)
    and the call's custom_tool_call_output."""
    sdk = client(info)
    ask = dict(model="policy", input="Fix a.txt.", tools=[PATCH], extra_body={"return_token_ids": True})
    first, kinds = first_response(sdk, ask, stream)
    items = [item.model_dump(exclude_none=True) for item in first.output]
    items[-1]["input"] = items[-1].get("input") if edit is None else edit
    second = sdk.responses.create(**{**ask, "input": [
        {"role": "user", "content": "Fix a.txt."}, *items,
        {"type": "custom_tool_call_output", "call_id": items[-1].get("call_id"), "output": "Patched a.txt."}]})
    return first, second, kinds


def thought_conversation(info, echo=lambda item: item):
    sdk = client(info)
    first = sdk.responses.create(model="policy", input=COUNT)
    items = [echo(item.model_dump(exclude_none=True)) for item in first.output]
    second = sdk.responses.create(model="policy", input=[{"role": "user", "content": COUNT}, *items,
                                                         {"role": "user", "content": "Again?"}])
    return first, second


def agent_episode(info, stream: bool = False):
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    async def run():
        async with openai.AsyncOpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0) as sdk:
            agent = Agent(name="adder", instructions="Use the add tool.", tools=[add],
                          model=OpenAIResponsesModel(model="policy", openai_client=sdk))
            if stream:
                result = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3,
                                             run_config=RunConfig(tracing_disabled=True))
                async for _ in result.stream_events():
                    pass
                return result
            return await Runner.run(agent, "What is 2 + 3?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
    import asyncio
    return asyncio.run(run())


@pytest.fixture(scope="module")
def tutor():
    tutor = Tutor()
    tutor.teach(lambda info: client(info).responses.create(model="policy", input="Say hi."), ["Hello there."])
    tutor.teach(tool_conversation, [CALL, "Done."])
    tutor.teach(thought_conversation, [THOUGHT, "Still one."])
    tutor.teach(agent_episode, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                                "The answer is 5."])
    yield tutor
    tutor.server.stop()


def test_a_plain_response_with_instructions_and_usage(tutor):
    info = tutor.server.create_session(sampling=GREEDY)
    reply = client(info).responses.create(model="policy", input="Say hi.", extra_body={"return_token_ids": True})
    assert reply.status == "completed" and reply.output_text == "Hello there." and reply.id.startswith("resp_")
    assert [item.type for item in reply.output] == ["message"]
    sampled = trainable_ids(trace(info))
    assert reply.model_extra["token_ids"] == sampled
    assert reply.usage.output_tokens == len(sampled) and reply.usage.input_tokens_details.cached_tokens == 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.input_tokens == len(reply.model_extra["prompt_token_ids"])
    briefed = tutor.server.create_session(sampling=SamplingParams(top_k=1, max_tokens=4))
    short = client(briefed).responses.create(model="policy", input="Say hi.", instructions="Be brief.")
    context = tutor.tok.decode(trace(briefed)["segments"][0]["token_ids"])
    assert context.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi.")
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_the_text_as_sampled_and_equals_the_whole_one(tutor):
    info = tutor.server.create_session(sampling=GREEDY)
    with client(info).responses.stream(model="policy", input="Say hi.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text == "Hello there."
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    plain = client(tutor.server.create_session(sampling=GREEDY)).responses.create(model="policy", input="Say hi.")
    assert [(i.type, i.status, i.content[0].text) for i in final.output] == \
        [(i.type, i.status, i.content[0].text) for i in plain.output]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_and_its_echo_with_the_output_extend_the_record(tutor, stream):
    info = tutor.server.create_session(sampling=GREEDY)
    first, second, kinds = tool_conversation(info, stream)
    call = next(item for item in first.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments), call.status) == ("bash", {"cmd": "ls"}, "completed")
    assert second.output_text == "Done."
    assert segments(info) == [""]                                   # the echo extended: one segment
    if stream:
        assert kinds.count("response.function_call_arguments.delta") >= 2
    # armed: the same echo with other arguments is an edit, and seals
    edited = tutor.server.create_session(sampling=GREEDY)
    sdk = client(edited)
    ask = dict(model="policy", instructions="You can run bash.", tools=TOOLS)
    first = sdk.responses.create(**ask, input="List files.")
    items = [item.model_dump(exclude_none=True) for item in first.output]
    items[-1]["arguments"] = '{"cmd": "ls -a"}'
    sdk.responses.create(**ask, input=[{"role": "user", "content": "List files."}, *items,
                                       {"type": "function_call_output", "call_id": items[-1]["call_id"],
                                        "output": "a.txt"}])
    assert segments(edited) == ["non_extension", ""]


@pytest.mark.parametrize("stream", [False, True])
def test_a_custom_tool_call_returns_the_sampled_input_and_its_echo_with_the_output_extends(stream):
    """The model is offered the custom tool as a function of one string `input` (a scripted engine writes its call);
    the call comes back as a custom_tool_call whose input is, byte for byte, the JSON string it sampled (read here from
    the sampled ids themselves), and the echo with custom_tool_call_output extends the record. Armed: a parse that kept
    the JSON escapes, or trimmed the input, is not what was sampled; an echo with another input seals."""
    tok = models.bpe_tokenizer()
    engine = ScriptEngine(tok)
    server = LoopbackServer(engine, tok, template=data.CHATML_TEMPLATE)
    server.start()
    try:
        engine.replies = [PATCH_CALL, "Applied the patch.", PATCH_CALL, "Applied."]
        info, edited = server.create_session(sampling=GREEDY), server.create_session(sampling=GREEDY)
        first, second, kinds = custom_conversation(info, stream)
        custom_conversation(edited, edit=PATCH_INPUT.replace("é", "e"))
        assert segments(info) == [""] and segments(edited) == ["non_extension", ""]   # the echo extends; an edit seals
        assert trainable_ids(trace(info)) == first.model_extra["token_ids"] + second.model_extra["token_ids"]
    finally:
        server.stop()
    prompt = tok.decode(first.model_extra["prompt_token_ids"])
    assert '{"type": "function", "function": {"name": "patch", "description": "Apply a patch.", "parameters": ' \
           '{"type": "object", "properties": {"input": {"type": "string"}}' in prompt      # how the model is told
    call = first.output[-1]
    assert (call.type, call.name, call.status) == ("custom_tool_call", "patch", "completed")
    sampled = tok.decode(first.model_extra["token_ids"], skip_special_tokens=True)
    written = json.loads(sampled[sampled.index("{"):sampled.rindex("}") + 1])["arguments"]["input"]
    assert call.input == written == PATCH_INPUT and second.output_text == "Applied the patch."
    for corrupted in (json.dumps(written, ensure_ascii=False)[1:-1], written.strip("*\n ")):
        assert corrupted != written
    if stream:
        assert kinds.count("response.custom_tool_call_input.delta") == 1 and \
            "response.custom_tool_call_input.done" in kinds


def test_a_reasoning_item_echoed_with_its_encrypted_content_extends(tutor):
    info = tutor.server.create_session(sampling=GREEDY)
    first, second = thought_conversation(info)
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "count them"
    assert message.content[0].text == "One file." and second.output_text == "Still one."
    assert first.usage.output_tokens_details.reasoning_tokens == \
        len(tutor.tok.encode("<think>count them</think>", add_special_tokens=False))
    assert segments(info) == [""]
    # without encrypted_content the thought is rendered <think>...</think> with no whitespace after it: this reply
    # wrote "\n\n" there, so the session sees an edit and seals (documented)
    bare = tutor.server.create_session(sampling=GREEDY)
    thought_conversation(bare, lambda item: {k: v for k, v in item.items() if k != "encrypted_content"})
    assert segments(bare) == ["non_extension", ""]
    # armed: an encrypted_content of another opening (ours, well-formed) seals as well
    altered = tutor.server.create_session(sampling=GREEDY)
    other = wires.opening_signature("<think>count them</think>\n")
    thought_conversation(altered, lambda item: {**item, "encrypted_content": other} if item["type"] == "reasoning"
                         else item)
    assert segments(altered) == ["non_extension", ""]


def test_previous_response_id_and_item_references_extend_the_record(tutor):
    info = tutor.server.create_session(sampling=GREEDY)
    sdk = client(info)
    first = sdk.responses.create(model="policy", input=COUNT)
    second = sdk.responses.create(model="policy", previous_response_id=first.id, input="Again?")
    assert second.output_text == "Still one." and segments(info) == [""]
    referenced = tutor.server.create_session(sampling=GREEDY)
    sdk = client(referenced)
    first = sdk.responses.create(model="policy", input=COUNT)
    second = sdk.responses.create(model="policy", input=[
        {"role": "user", "content": COUNT}, *[{"type": "item_reference", "id": item.id} for item in first.output],
        {"role": "user", "content": "Again?"}])
    assert second.output_text == "Still one." and segments(referenced) == [""]
    unstored = tutor.server.create_session(sampling=GREEDY)
    sdk = client(unstored)
    first = sdk.responses.create(model="policy", input=COUNT, store=False)
    with pytest.raises(openai.BadRequestError, match="is no response this session stored"):
        sdk.responses.create(model="policy", previous_response_id=first.id, input="Again?")


def test_structured_output_follows_the_json_schema(tutor):
    info = tutor.server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=5))
    reply = client(info).responses.create(model="policy", input="Is it done? Answer in JSON.", text={
        "format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), VERDICT)
    record = trace(info)
    spec = constraints.bind(constraints.json_schema_spec(VERDICT, strict=True),
                            [tutor.tok.convert_tokens_to_ids("<|im_end|>")])
    assert {record["samplings"][i]["constraint"] for s in record["segments"]            # the grammar, recorded
            for i, sampled in zip(s["sampling"], s["trainable"]) if sampled} == {spec}


@pytest.mark.parametrize("fields, message", [
    ({"extra_body": {"best_of": 2}}, "unsupported parameter(s) ['best_of']"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "'moderation' is refused"),
    ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "is not served here"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]}, "reaches no MCP server"),
])
def test_errors_are_openai_errors_record_nothing_and_the_server_keeps_serving(tutor, fields, message):
    info = tutor.server.create_session(sampling=GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        client(info).responses.create(**{"model": "policy", "input": "Say hi.", **fields})
    assert refused.value.status_code == 400 and message in refused.value.message
    assert refused.value.body["type"] == "invalid_request_error"
    assert trace(info)["segments"] == []
    assert client(info).responses.create(model="policy", input="Say hi.").output_text == "Hello there."


def test_web_search_is_dropped_and_listed_and_a_namespaced_call_names_its_namespace(tutor):
    info = tutor.server.create_session(sampling=GREEDY)
    tools = [{"type": "namespace", "name": "shell", "description": "Shell tools.", "tools": TOOLS},
             {"type": "web_search"}]
    reply = client(info).responses.create(model="policy", instructions="You can run bash.", input="List files.",
                                          tools=tools)
    call = reply.output[-1]
    assert (call.type, call.name, call.namespace) == ("function_call", "bash", "shell")
    assert reply.model_extra["dropped_tools"] == ["web_search"]
    assert "web_search" not in tutor.tok.decode(trace(info)["segments"][0]["token_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_the_agents_sdk_runs_a_tool_episode_on_its_responses_model(tutor, stream):
    info = tutor.server.create_session(sampling=GREEDY)
    result = agent_episode(info, stream)
    assert result.final_output == "The answer is 5."
    assert any(item.type == "tool_call_output_item" and item.output == "5" for item in result.new_items)
    assert segments(info) == [""] and tutor.server._sessions[info.session_id][0].turns == 2


RESPONSES_NO_OPS = dict(access_programs={"cyber": "standard"}, image={"context_compression": "auto"}, max_tool_calls=3,
                        metadata={"run": "x"}, prompt_cache_key="k", prompt_cache_options={"mode": "implicit"},
                        prompt_cache_retention="24h", safety_identifier="s", service_tier="auto",
                        stream_options={"include_obfuscation": False}, user="u1",
                        extra_body={"client_metadata": {"x-codex-window-id": "w"}})


def test_no_op_fields_change_nothing_and_the_reply_lists_them(tutor):
    names = set(RESPONSES_NO_OPS) - {"extra_body"} | {"client_metadata", "model"}
    assert {k for k, (d, _) in RESPONSES_FIELDS.items() if d == NO_OP} == names          # every no-op is exercised
    sessions = [tutor.server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=9))
                for _ in range(2)]
    for info, extra in zip(sessions, ({}, RESPONSES_NO_OPS)):
        extra = {**extra, "extra_body": {**extra.get("extra_body", {}), "return_token_ids": True}}
        reply = client(info).responses.create(model="policy", input="Say hi.", **extra)
    assert reply.model_extra["no_op_params"] == sorted(names)
    assert trace(sessions[0])["segments"][0]["token_ids"] == trace(sessions[1])["segments"][0]["token_ids"]
    assert trace(sessions[0])["samplings"] == trace(sessions[1])["samplings"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_behavior_logprobs_of_the_sampled_tokens(tutor, stream):
    info = tutor.server.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=3))
    ask = dict(model="policy", input="Tell me a story.", include=["message.output_text.logprobs"], top_logprobs=2)
    if stream:
        events = list(client(info).responses.create(**ask, stream=True))
        kinds = [event.type for event in events]
        assert "response.output_text.delta" in kinds
        message_done = kinds.index("response.output_item.done")
        assert message_done > max(i for i, kind in enumerate(kinds) if kind.endswith(".delta"))  # held to the end
        reply = events[-1].response                                # completed, or incomplete (max_output_tokens)
    else:
        reply = client(info).responses.create(**ask)
    part = next(item for item in reply.output if item.type == "message").content[0]
    record = trace(info)["segments"][0]
    assert [p.logprob for p in part.logprobs] == [lp for lp, m in zip(record["behavior_logprobs"],
                                                                       record["trainable"]) if m]
    assert all(len(p.top_logprobs) <= 2 for p in part.logprobs) and any(p.top_logprobs for p in part.logprobs)


def test_reasoning_effort_is_the_templates_thinking_switch():
    def switches(reasoning):
        return decode_responses({"input": "hi", "reasoning": reasoning}, BASE,
                                ResponseStore()).request.options.template_kwargs
    assert switches({"effort": "none"}) == {"enable_thinking": False, "reasoning_effort": "none"}
    assert switches({"effort": "high", "summary": "auto"}) == {"enable_thinking": True, "reasoning_effort": "high"}
    assert switches({"summary": "detailed"}) == {}                        # a summary alone switches nothing


class DyingEngine(CountingEngine):
    """The real engine, whose turn fails after its tokens reached the client (an engine lost mid-turn)."""

    def generate(self, prompts, params, on_token=None, images=None):
        super().generate(prompts, params, on_token, images=images)
        raise EngineFailure("the engine serving this turn died")


def test_a_failure_after_the_first_event_is_a_response_failed_event_and_records_nothing():
    tok = models.bpe_tokenizer()
    loopback = LoopbackServer(DyingEngine(models.tiny_model("qwen3", seed=3), tokenizer=tok), tok,
                              template=data.CHATML_TEMPLATE)
    loopback.start()
    try:
        info = loopback.create_session(sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=1))
        events = list(client(info).responses.create(model="policy", input="Say hi.", stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.failed"
        assert events[-1].response.status == "failed" and "retry it" in events[-1].response.error.message
        assert trace(info)["segments"] == []
        with pytest.raises(openai.InternalServerError):                  # not streamed: a plain 503
            client(info).responses.create(model="policy", input="Say hi.")
    finally:
        loopback.stop()


def test_a_prompt_past_the_context_is_context_length_exceeded_on_input_streamed_or_not(tutor):
    """What Codex compacts its conversation on: OpenAI's code context_length_exceeded, naming the Responses field that
    holds the prompt (input); nothing recorded, and the session serves the next request."""
    info = tutor.server.create_session(sampling=GREEDY, max_length=48)
    sdk = client(info)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model="policy", input="a long message " * 20, stream=stream)
        error = caught.value
        assert (error.code, error.param, error.type) == ("context_length_exceeded", "input", "invalid_request_error")
        assert "maximum context length is 48 tokens" in error.message
    assert trace(info)["segments"] == []
    assert sdk.responses.create(model="policy", input="Say hi.").status in ("completed", "incomplete")


def test_the_next_turn_reports_the_prompt_tokens_the_prefix_cache_held(tutor):
    """input_tokens_details.cached_tokens: a tool episode's second turn extends the first, so at least all of the first
    turn but its last sampled id (whose KV the sampling step never wrote) came from the engine's prefix cache."""
    info = tutor.server.create_session(sampling=GREEDY)
    sdk = client(info)
    ask = dict(model="policy", instructions="You can run bash.", tools=TOOLS, extra_body={"return_token_ids": True})
    first = sdk.responses.create(**ask, input="List files.")
    items = [item.model_dump(exclude_none=True) for item in first.output]
    call = next(item for item in items if item["type"] == "function_call")
    second = sdk.responses.create(**ask, input=[{"role": "user", "content": "List files."}, *items,
                                               {"type": "function_call_output", "call_id": call["call_id"],
                                                "output": "a.txt"}])
    extra = first.model_extra
    assert second.usage.input_tokens == len(second.model_extra["prompt_token_ids"])
    # at least the first turn's prompt and reply (the same conversation in an earlier session may have left more)
    assert len(extra["prompt_token_ids"]) + len(extra["token_ids"]) - 1 <= \
        second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    assert segments(info) == [""]
