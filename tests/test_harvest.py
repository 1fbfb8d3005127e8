# engines/harvest.py: a ScriptEngine behind the real loopback server answers a real SDK (streaming) with its script, the
# session records the prompt exactly as it renders it for the policy, and teaching_texts keeps one text per
# conversation that extends (a sealed conversation keeps each of its texts).
import json

import openai
import pytest

import models
from engines import SamplingParams
from engines.harvest import ScriptEngine, teaching_texts
from loopback import LoopbackServer

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def harvest_server():
    tokenizer = models.bpe_tokenizer()
    engine = ScriptEngine(tokenizer)
    server = LoopbackServer(engine, tokenizer)
    server.start()
    yield engine, server, tokenizer
    server.stop()


def converse(server, engine, replies: list[str], rewrite_history: bool = False):
    """A two-turn tool conversation through the OpenAI SDK, streaming; returns the session and the SDK's replies."""
    engine.replies = list(replies)
    info = server.create_session(sampling=SamplingParams(max_tokens=64))
    client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True))
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}
    if rewrite_history:              # an edited reply: the ids no longer begin with the record's, so the turn seals
        call["function"]["arguments"] = json.dumps({"city": "Lyon"})
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return server.close_session(info.session_id), calls, answer.choices[0].message.content


def test_the_script_answers_a_streaming_sdk_and_the_session_records_what_the_server_rendered(harvest_server):
    engine, server, tokenizer = harvest_server
    session, calls, answer = converse(server, engine, [CALL, "It is sunny."])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("lookup", {"city": "Paris"})]
    assert answer == "It is sunny." and engine.replies == []              # the whole script, in order
    first, second = session.generations
    assert tokenizer.decode(first.token_ids, skip_special_tokens=False) == CALL + "<|im_end|>"
    assert all(lp == 0.0 for g in session.generations for lp in g.behavior_logprobs)   # nothing sampled
    texts = teaching_texts(tokenizer, session.generations)
    assert len(texts) == 1                      # the second turn extends the first: one text teaches both
    assert texts[0].startswith(tokenizer.decode(first.prompt_ids, skip_special_tokens=False))
    assert texts[0].endswith("<|im_start|>assistant\nIt is sunny.<|im_end|>")
    assert "Weather in Paris?" in texts[0] and "<tool_response>\nsunny\n</tool_response>" in texts[0]


def test_a_conversation_that_seals_keeps_each_text_and_a_spent_script_answers_empty(harvest_server):
    engine, server, tokenizer = harvest_server
    session, _, answer = converse(server, engine, [CALL], rewrite_history=True)
    assert answer == ""                                                   # the script ran out: an empty reply
    assert len(session.ledger.segments) == 2                              # the rewritten history sealed
    texts = teaching_texts(tokenizer, session.generations)
    assert len(texts) == 2 and not texts[1].startswith(texts[0])
    # the dedup is armed: the same turns twice over are still two texts, not four
    assert teaching_texts(tokenizer, session.generations * 2) == texts
