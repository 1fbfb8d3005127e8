# Token identity survives what agents do to their context, through real HTTP, the real `openai` and
# `anthropic` SDKs, a real LoopbackServer and a real EmbeddedEngine on a tiny Qwen3 taught a script of replies:
# a non-canonical BPE split echoed as text still trains as sampled (and the echo extends); a template that
# strips an earlier <think> seals the segment; an agent that compacts its history seals exactly there; and
# streamed multi-turn tool use is parsed into each wire's tool blocks while the trained ids stay the sampled
# ids. Each test first shows its trap is armed; streamed and non-streamed replies must agree.
import json
from dataclasses import dataclass

import pytest

import data
import invariants
import models
from engines import SamplingParams
from loopback import LoopbackServer
from rollout import EmbeddedEngine
from test_session import byte_tokens, teach
from test_loopback_http import (ANTHROPIC_TOOLS, ASK, OPENAI_TOOLS, SYSTEM, TOOL_CALL, anthropic_client,
                                openai_client, trace, trainable_ids)

MAX_TOKENS = 48
GREEDY = SamplingParams(top_k=1, max_tokens=MAX_TOKENS)
WIRES = ["openai", "anthropic"]

# ---- the script: each conversation as canonical messages, and what the model is taught to reply ----------

RETOKENIZE_SYSTEM, RETOKENIZE_ASK, RETOKENIZE_AGAIN = "Answer in two words.", "What are you doing?", "Why?"
THINK_SYSTEM, THINK_ASK, THINK_AGAIN = "Think before you answer.", "How many files?", "Sure?"
THOUGHT = "<think>count them</think>"
FIX_SYSTEM, FIX_ASK, FIX_AGAIN = "You fix bugs.", "Fix app.py.", "Continue."
SUMMARY = "Summary of earlier work: app.py was patched. Check it."
TOOL_RESULT = "a.txt"
QUOTED_ASK = "List files; quote the arguments."
QUOTED_CALL = '<tool_call>\n{"name": "bash", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>'

REPLY_TEXTS = {"because": "Because.", "think": THOUGHT + "One file.", "sure": "Yes.", "looking": "Looking.",
               "patched": "Patched.", "checked": "Checked.", "tool_call": TOOL_CALL, "listed": "One file: a.txt.",
               "quoted_call": QUOTED_CALL}


def echo(text: str) -> dict:
    """The canonical assistant message an agent echoes for a text reply."""
    return {"role": "assistant", "content": text}


CALL_ECHO = {"role": "assistant", "content": None,       # TOOL_CALL as parsed, then echoed
             "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]}


def extension_prompt(tok, template: str, messages: list[dict], reply: list[int], later: list[dict],
                     tools=None) -> list[int]:
    """How an append-only request must reach the engine: the exact tokens of the last prompt and reply, then
    the encoded text the template writes after the reply (invariant 1; never the reply re-encoded)."""
    before = data.render_prompt_text(tok, messages, tools, template) + tok.decode(reply, skip_special_tokens=False)
    after = data.render_prompt_text(tok, later, tools, template)
    assert after.startswith(before), "this conversation is not an append under the template"
    return data.render_prompt_ids(tok, messages, tools, template) + reply + \
        tok.encode(after[len(before):], add_special_tokens=False)


@dataclass
class Script:
    tok: object                    # models.bpe_tokenizer()
    replies: dict                  # name -> the token ids the model is taught to emit (ending in <|im_end|>)
    chatml: LoopbackServer         # data.CHATML_TEMPLATE (prefix-preserving)
    think: LoopbackServer          # data.THINK_STRIPPING_TEMPLATE (earlier thoughts vanish), same engine


@pytest.fixture(scope="module")
def script():
    tok = models.bpe_tokenizer()
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    replies = {name: tok.encode(text) + end for name, text in REPLY_TEXTS.items()}
    replies["having"] = tok.encode("Still") + byte_tokens(tok, " having") + end    # a split BPE never makes
    chatml, think = data.CHATML_TEMPLATE, data.THINK_STRIPPING_TEMPLATE

    def text(name):
        return tok.decode(replies[name], skip_special_tokens=True)

    def ids(messages, template=chatml, tools=None):
        return data.render_prompt_ids(tok, messages, tools, template)

    retokenize = [{"role": "system", "content": RETOKENIZE_SYSTEM}, {"role": "user", "content": RETOKENIZE_ASK}]
    thinking = [{"role": "system", "content": THINK_SYSTEM}, {"role": "user", "content": THINK_ASK}]
    fix = [{"role": "system", "content": FIX_SYSTEM}, {"role": "user", "content": FIX_ASK}]
    compacted = [fix[0], {"role": "user", "content": SUMMARY}]
    tool_use = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    pairs = [
        (ids(retokenize), replies["having"]),
        (extension_prompt(tok, chatml, retokenize, replies["having"],
                          retokenize + [echo(text("having")), {"role": "user", "content": RETOKENIZE_AGAIN}]),
         replies["because"]),
        (ids(thinking, think), replies["think"]),
        (ids(thinking + [echo(text("think")), {"role": "user", "content": THINK_AGAIN}], think), replies["sure"]),
        (ids(fix), replies["looking"]),
        (extension_prompt(tok, chatml, fix, replies["looking"],
                          fix + [echo(text("looking")), {"role": "user", "content": FIX_AGAIN}]), replies["patched"]),
        (ids(compacted), replies["checked"]),
        (ids(tool_use, tools=OPENAI_TOOLS), replies["tool_call"]),
        (extension_prompt(tok, chatml, tool_use, replies["tool_call"],
                          tool_use + [CALL_ECHO, {"role": "tool", "content": TOOL_RESULT}], OPENAI_TOOLS),
         replies["listed"]),
        (ids([tool_use[0], {"role": "user", "content": QUOTED_ASK}], tools=OPENAI_TOOLS), replies["quoted_call"]),
    ]
    student = models.tiny_model("qwen3", seed=2).train()
    teach(student, pairs, max_steps=800)
    engine = EmbeddedEngine(student.eval())
    servers = [LoopbackServer(engine, tok, template=template) for template in (chatml, think)]
    for server in servers:
        server.start()
    yield Script(tok, replies, *servers)
    for server in servers:
        server.stop()


# ---- agents: keep their history in their wire's own shape and echo each reply as the SDK returned it ----

@dataclass
class Reply:
    text: str                          # the reply's text ("" when it holds only tool calls)
    tool_calls: list[tuple[str, dict]]  # (name, arguments) of each structured tool call
    stop: str                          # finish_reason / stop_reason, in the wire's words
    token_ids: list[int] | None        # OpenAI (return_token_ids): the sampled ids; None on Anthropic
    prompt_token_ids: list[int] | None


def _stream_extra(chunks, key: str) -> list[int] | None:
    """Token ids an OpenAI stream carried under `key` (concatenated over the chunks that carry them)."""
    carried = [c.model_extra[key] for c in chunks if (c.model_extra or {}).get(key) is not None]
    return [t for ids in carried for t in ids] if carried else None


class OpenAIAgent:
    def __init__(self, info, system: str, tools=None):
        self.client, self.tools = openai_client(info), tools
        self.messages = [{"role": "system", "content": system}]

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def send_tool_result(self, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": self.messages[-1]["tool_calls"][0]["id"],
                              "content": text})

    def compact(self, summary: str) -> None:
        self.messages = [self.messages[0], {"role": "user", "content": summary}]

    def turn(self, stream: bool) -> Reply:
        request = dict(model="policy", messages=self.messages, extra_body={"return_token_ids": True},
                       **({"tools": self.tools} if self.tools else {}))
        if not stream:
            reply = self.client.chat.completions.create(**request)
            message, stop = reply.choices[0].message.model_dump(), reply.choices[0].finish_reason
            token_ids, prompt_ids = reply.model_extra["token_ids"], reply.model_extra["prompt_token_ids"]
        else:   # what a streaming agent does: join the content deltas, assemble each tool call by index
            chunks = list(self.client.chat.completions.create(stream=True, **request))
            calls = {}
            for delta in (d for c in chunks for d in c.choices[0].delta.tool_calls or []):
                call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] += delta.function.arguments or ""
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
            stop = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices[0].finish_reason)
            token_ids, prompt_ids = _stream_extra(chunks, "token_ids"), _stream_extra(chunks, "prompt_token_ids")
        self.messages.append(message)
        parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message.get("tool_calls") or []]
        return Reply(message["content"] or "", parsed, stop, token_ids, prompt_ids)


class AnthropicAgent:
    def __init__(self, info, system: str, tools=None):
        self.client, self.system, self.tools = anthropic_client(info), system, tools
        self.messages: list[dict] = []

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def send_tool_result(self, text: str) -> None:
        call = next(b for b in self.messages[-1]["content"] if b["type"] == "tool_use")
        self.messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                                           "content": text}]})

    def compact(self, summary: str) -> None:
        self.messages = [{"role": "user", "content": summary}]

    def turn(self, stream: bool) -> Reply:
        request = dict(model="policy", max_tokens=MAX_TOKENS, system=self.system, messages=self.messages,
                       **({"tools": self.tools} if self.tools else {}))
        if stream:
            with self.client.messages.stream(**request) as events:
                reply = events.get_final_message()
        else:
            reply = self.client.messages.create(**request)
        self.messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        # a reply that opens with a thought comes as a thinking block, then the text: read as the model wrote them
        return Reply("".join(f"<think>{b.thinking}</think>" if b.type == "thinking" else b.text
                             for b in reply.content if b.type in ("thinking", "text")),
                     [(b.name, b.input) for b in reply.content if b.type == "tool_use"], reply.stop_reason, None, None)


def agent(wire: str, info, system: str, tools: bool = False):
    if wire == "openai":
        return OpenAIAgent(info, system, OPENAI_TOOLS if tools else None)
    return AnthropicAgent(info, system, ANTHROPIC_TOOLS if tools else None)


def sampled_as_taught(script: Script, reply: Reply, name: str) -> list[int]:
    """The ids the engine sampled for `reply`: the taught script (the wire must agree with it)."""
    ids = script.replies[name]
    followed = reply.tool_calls == [("bash", {"cmd": "ls"})] if name == "tool_call" else \
        reply.text == script.tok.decode(ids, skip_special_tokens=True)
    assert followed, f"the model did not follow its script for {name!r}: got {reply}"
    if reply.token_ids is not None:
        assert reply.token_ids == ids
    return ids


# ---- 1. the retokenization trap, echoed through the OpenAI SDK --------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_non_canonically_split_reply_echoed_as_text_extends_and_trains_as_sampled(script, stream):
    tok = script.tok
    info = script.chatml.create_session(rollout_id=f"retokenize-{stream}", sampling=GREEDY)
    talker = OpenAIAgent(info, RETOKENIZE_SYSTEM)
    talker.say(RETOKENIZE_ASK)
    first = talker.turn(stream)
    assert first.token_ids == script.replies["having"] and first.text == "Still having"
    # armed: re-encoding the text the agent holds does not give back the ids the engine sampled
    assert tok.decode(first.token_ids[:-1]) == first.text and tok.encode(first.text) != first.token_ids[:-1]
    assert trainable_ids(trace(info)) == first.token_ids        # the record holds the split as sampled
    talker.say(RETOKENIZE_AGAIN)                                # the echo, then a second user turn
    second = talker.turn(stream)
    assert second.token_ids == script.replies["because"]
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.token_ids)] == \
        first.prompt_token_ids + first.token_ids               # the second prompt extends the exact tokens
    record = trace(info)
    assert [s["seal_reason"] for s in record["segments"]] == [""]
    assert trainable_ids(record) == first.token_ids + second.token_ids
    session = script.chatml.close_session(info.session_id)
    rows = session.ledger.rows()
    batch = invariants.build_batch(rows, [1.0], pad_id=tok.pad_token_id)
    invariants.check_token_identity(batch, rows)                # trainer ids == sampled ids, split intact
    assert [g.token_ids for g in session.generations] == [first.token_ids, second.token_ids]
    invariants.check_sampled_once(rows, session.generations)
    # armed: a trainer that re-encoded the row's text would be caught
    reencoded = tok.encode(tok.decode(rows[0].token_ids, skip_special_tokens=False), add_special_tokens=False)
    assert len(reencoded) < len(rows[0].token_ids)
    batch.input_ids[0] = tok.pad_token_id
    batch.input_ids[0, :len(reencoded)] = batch.input_ids.new_tensor(reencoded)
    with pytest.raises(ValueError, match="token identity violated"):
        invariants.check_token_identity(batch, rows)


# ---- 2. a template that strips earlier thoughts seals ---------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_think_stripping_template_seals_and_the_next_context_holds_no_thought(script, wire, stream):
    tok = script.tok
    info = script.think.create_session(rollout_id=f"think-{wire}-{stream}", sampling=GREEDY)
    talker = agent(wire, info, THINK_SYSTEM)
    talker.say(THINK_ASK)
    first = talker.turn(stream)
    thought_ids = sampled_as_taught(script, first, "think")
    assert first.text.startswith(THOUGHT)                       # the agent sees (and echoes) the thought
    talker.say(THINK_AGAIN)
    second = talker.turn(stream)
    answer_ids = sampled_as_taught(script, second, "sure")
    # armed: under this template the echoed thought vanishes from the next prompt (ChatML would keep it)
    history = [{"role": "system", "content": THINK_SYSTEM}, {"role": "user", "content": THINK_ASK}, echo(first.text),
               {"role": "user", "content": THINK_AGAIN}]
    assert THOUGHT in data.render_prompt_text(tok, history, template=data.CHATML_TEMPLATE)
    assert THOUGHT not in data.render_prompt_text(tok, history, template=data.THINK_STRIPPING_TEMPLATE)
    record = trace(info)
    assert [s["seal_reason"] for s in record["segments"]] == ["non_extension", ""]
    sealed, now = record["segments"]
    assert THOUGHT in "".join(sealed["tokens"])                 # trained where it was sampled
    context = tok.decode([t for t, m in zip(now["token_ids"], now["trainable"]) if not m])
    assert "One file." in context and "<think>" not in context and "count them" not in context
    session = script.think.close_session(info.session_id)
    rows = session.ledger.rows()
    assert [g.token_ids for g in session.generations] == [thought_ids, answer_ids]
    invariants.check_sampled_once(rows, session.generations)
    invariants.check_token_identity(invariants.build_batch(rows, [1.0, 1.0], pad_id=tok.pad_token_id), rows)


# ---- 3. compaction seals exactly where the history was replaced -----------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("wire", WIRES)
def test_compacting_the_history_seals_exactly_at_the_compaction(script, wire, stream):
    rollout_id = f"compaction-{wire}-{stream}"
    info = script.chatml.create_session(rollout_id=rollout_id, sampling=GREEDY)
    talker = agent(wire, info, FIX_SYSTEM)
    talker.say(FIX_ASK)
    sampled = [sampled_as_taught(script, talker.turn(stream), "looking")]
    talker.say(FIX_AGAIN)
    sampled.append(sampled_as_taught(script, talker.turn(stream), "patched"))
    before = trace(info)
    assert [s["seal_reason"] for s in before["segments"]] == [""]          # turns 1 and 2 extend
    talker.compact(SUMMARY)
    sampled.append(sampled_as_taught(script, talker.turn(stream), "checked"))
    record = trace(info)
    assert [s["seal_reason"] for s in record["segments"]] == ["non_extension", ""]
    sealed, now = record["segments"]
    assert sealed["token_ids"] == before["segments"][0]["token_ids"]       # sealed as it stood, nothing appended
    assert sealed["token_ids"][-len(sampled[1]):] == sampled[1]            # it ends with the last pre-compaction reply
    # armed: the compacted prompt is not an extension of the record (it diverges inside the first user turn)
    assert sealed["common_prefix_len"] < len(sealed["token_ids"])
    assert now["token_ids"][:len(sealed["token_ids"])] != sealed["token_ids"]
    assert SUMMARY in "".join(now["tokens"]) and FIX_ASK not in "".join(now["tokens"])
    assert trainable_ids({"segments": [sealed]}) == sampled[0] + sampled[1]
    assert trainable_ids({"segments": [now]}) == sampled[2]
    session = script.chatml.close_session(info.session_id)
    rows = session.ledger.rows()
    assert len(rows) == 2 and {r.rollout_id for r in rows} == {rollout_id}
    assert [g.token_ids for g in session.generations] == sampled
    invariants.check_sampled_once(rows, session.generations)
    invariants.check_token_identity(invariants.build_batch(rows, [1.0, 1.0], pad_id=script.tok.pad_token_id), rows)


# ---- 4. streamed multi-turn tool use ---------------------------------------------------------------------
# test_loopback_http covers a non-streamed tool round trip and a streamed first turn; here the agent streams
# every turn, echoes the tool call it assembled from the stream, and sends the tool result back.

def converse_with_tools(script: Script, wire: str, stream: bool) -> tuple[list[Reply], dict]:
    info = script.chatml.create_session(rollout_id=f"tools-{wire}-{stream}", sampling=GREEDY)
    talker = agent(wire, info, SYSTEM, tools=True)
    talker.say(ASK)
    call = talker.turn(stream)
    talker.send_tool_result(TOOL_RESULT)
    answer = talker.turn(stream)
    return [call, answer], trace(info)


@pytest.mark.parametrize("wire", WIRES)
def test_streamed_multi_turn_tool_use_is_parsed_and_trains_the_sampled_ids(script, wire):
    streamed, record = converse_with_tools(script, wire, stream=True)
    call, answer = streamed
    assert call.tool_calls == [("bash", {"cmd": "ls"})] and call.text == ""
    assert call.stop == {"openai": "tool_calls", "anthropic": "tool_use"}[wire]
    assert answer.tool_calls == [] and answer.stop == {"openai": "stop", "anthropic": "end_turn"}[wire]
    sampled = [sampled_as_taught(script, call, "tool_call"), sampled_as_taught(script, answer, "listed")]
    assert [s["seal_reason"] for s in record["segments"]] == [""]           # the echoed call extended
    assert trainable_ids(record) == sampled[0] + sampled[1]
    if wire == "openai":                                                  # the ids the stream returned
        assert trainable_ids(record) == call.token_ids + answer.token_ids
    assert TOOL_CALL in "".join(record["segments"][0]["tokens"])          # the call trains byte for byte
    # stream and non-stream agree: same replies, same record
    plain, plain_record = converse_with_tools(script, wire, stream=False)
    assert plain == streamed and plain_record["segments"] == record["segments"]


# ---- known bug: a call whose arguments are a JSON string cannot be echoed on the Anthropic wire ------------

@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")   # the SDK's own complaint about that input
def test_a_call_with_json_string_arguments_round_trips_on_the_anthropic_wire(script):
    calls = {}
    for stream in (False, True):
        info = script.chatml.create_session(rollout_id=f"quoted-{stream}", sampling=GREEDY)
        talker = AnthropicAgent(info, SYSTEM, ANTHROPIC_TOOLS)
        talker.say(QUOTED_ASK)
        calls[stream] = talker.turn(stream)
        # armed: the model really wrote its arguments as a JSON string, not an object
        assert QUOTED_CALL in "".join(trace(info)["segments"][0]["tokens"])
        talker.send_tool_result(TOOL_RESULT)
        talker.turn(stream)                      # the echoed tool_use input is an object the wire accepts
        assert trainable_ids(trace(info))[:len(script.replies["quoted_call"])] == script.replies["quoted_call"]
    assert calls[False] == calls[True] and calls[True].tool_calls == [("bash", {"cmd": "ls"})]
