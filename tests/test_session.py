# Invariant 1 (token identity) through chat sessions (invariants.py, section 1): a real engine on a tiny model
# that was *taught* to emit the dangerous outputs - non-canonical byte-level BPE splits, compact tool-call
# JSON, <think> blocks - shows that trained ids equal sampled ids, seals happen exactly where they must,
# and every sampled id is trainable in exactly one row.
import copy
import json
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import data
import invariants
import models
from engines import SamplingParams
from rollout import EmbeddedEngine
from session import ChatSession, ContextOverflow, session_trace
from wires import TurnOptions, parse_hermes_tool_calls

GREEDY = SamplingParams(top_k=1, max_tokens=48)


@pytest.fixture(scope="module")
def tok():
    return models.bpe_tokenizer()


def teach(model, pairs: list[tuple[list[int], list[int]]], max_steps: int = 400) -> None:
    """Overfit `model` until greedy decoding of every prompt yields exactly its response."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(max_steps):
        losses, correct = [], True
        for prompt, response in pairs:
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            target = torch.tensor(response)
            losses.append(F.cross_entropy(logits, target))
            correct &= bool((logits.argmax(-1) == target).all()) and \
                bool((logits.topk(2).values[:, 0] - logits.topk(2).values[:, 1]).min() > 1.0)
        if correct:
            return
        opt.zero_grad()
        torch.stack(losses).sum().backward()
        opt.step()
    raise AssertionError("the tiny model did not learn its script")


def byte_tokens(tok, text: str) -> list[int]:
    """One token per byte: a split no BPE encoder produces for common words."""
    ids = [tok.convert_tokens_to_ids(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(ch)[0][0])
           for ch in text]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in ids)
    return ids


def run_script(tok, template: str):
    """Three turns: a compact tool call, a thought followed by a non-canonically split word, a short reply.
    The model is taught each reply right before the turn and pushed to the engine as a new version."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = [
        tok.encode('<tool_call>\n{"name":"bash","arguments":{"cmd":"ls"}}\n</tool_call>') + [im_end],
        tok.encode("<think>one file</think>") + byte_tokens(tok, " having") + [im_end],
        tok.encode("ok") + [im_end],
    ]
    student = models.tiny_model("qwen3", seed=0).train()
    engine = EmbeddedEngine(copy.deepcopy(student).eval(), version=0)
    session = ChatSession(engine, tok, "rollout-1", "group-1", template=template, sampling=GREEDY)
    messages = [{"role": "system", "content": "You can run bash."}, {"role": "user", "content": "List files."}]
    taught, turns = [], []
    for k, reply in enumerate(replies):
        prompt = session.prompt_ids(messages)
        taught.append((prompt, reply))
        teach(student, taught)
        engine.update_weights(student.state_dict(), version=k + 1)
        turn = session.turn(messages)
        assert turn.generation.token_ids == reply            # the engine emitted the script exactly
        turns.append(turn)
        messages = messages + [turn.message]                 # the agent echoes what it was given
        messages.append({"role": "tool", "content": "a.txt", "tool_call_id": turn.message["tool_calls"][0]["id"]}
                        if k == 0 else {"role": "user", "content": "Thanks."})
    return session, turns, replies


def check_rows(session, turns):
    rows = session.ledger.rows()
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=0)
    invariants.check_token_identity(batch, rows)                 # trainer ids == sampled ids
    invariants.check_sampled_once(rows, [t.generation for t in turns])
    # ART #883: each sampled token is trainable only in a row whose prefix is the one it was sampled under
    for turn in turns:
        gen = turn.generation
        homes = [row for row in rows if row.token_ids[:len(gen.prompt_ids)] == gen.prompt_ids
                 and row.token_ids[len(gen.prompt_ids):len(gen.prompt_ids) + len(gen.token_ids)] == gen.token_ids]
        assert len(homes) == 1
        start = len(gen.prompt_ids)
        assert all(homes[0].trainable[start:start + len(gen.token_ids)])
        assert homes[0].policy_versions[start:start + len(gen.token_ids)] == gen.policy_versions
    return rows


def test_retokenization_traps_are_armed(tok):
    word = byte_tokens(tok, " having")
    assert tok.decode(word) == " having" and tok.encode(" having") != word     # BPE: decode->encode differs
    compact = '{"name":"bash","arguments":{"cmd":"ls"}}'
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"type": "function", "function": json.loads(compact)}]}
    rendered = data.render_prompt_text(tok, [message], template=data.CHATML_TEMPLATE, add_generation_prompt=False)
    assert compact not in rendered and '{"cmd": "ls"}' in rendered                # tojson re-serializes
    thought = {"role": "assistant", "content": "<think>x</think>y"}
    later = [{"role": "user", "content": "a"}, thought, {"role": "user", "content": "b"}]
    stripped = data.render_prompt_text(tok, later, template=data.THINK_STRIPPING_TEMPLATE)
    assert "<think>x</think>" not in stripped                                     # earlier thoughts vanish


def test_prefix_preserving_template_seals_only_at_the_reserialized_tool_call(tok):
    session, turns, replies = run_script(tok, data.CHATML_TEMPLATE)
    assert [t.extended for t in turns] == [False, False, True]
    rows = check_rows(session, turns)
    assert len(rows) == 2
    assert rows[0].seal_reason == "non_extension" and 0 < rows[0].common_prefix_len < len(rows[0].token_ids)
    # the sealed row ends with the compact call as sampled; the next row's prompt re-renders it (context only)
    assert rows[0].token_ids[-len(replies[0]):] == replies[0]
    assert replies[0][:-1] != rows[1].token_ids[:len(replies[0]) - 1]
    # the non-canonical split survives into training, untouched, in the row it was sampled in
    word = byte_tokens(tok, " having")
    text_ids = rows[1].token_ids
    at = next(i for i in range(len(text_ids)) if text_ids[i:i + len(word)] == word)
    assert all(rows[1].trainable[at:at + len(word)])
    assert turns[0].message["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"cmd": "ls"}}


def test_think_stripping_template_also_seals_when_a_thought_disappears(tok):
    session, turns, _ = run_script(tok, data.THINK_STRIPPING_TEMPLATE)
    assert [t.extended for t in turns] == [False, False, False]
    rows = check_rows(session, turns)
    assert len(rows) == 3 and all(r.seal_reason == "non_extension" for r in rows[:2])
    assert "<think>" not in tok.decode(rows[2].token_ids)


def test_edited_history_seals_and_an_identical_append_extends(tok):
    engine = EmbeddedEngine(models.tiny_model("qwen3", seed=1))
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, sampling=SamplingParams(max_tokens=6, seed=0))
    first = [{"role": "user", "content": "hi"}]
    reply = session.turn(first).message
    assert session.turn(first + [reply, {"role": "user", "content": "more"}]).extended
    edited = first + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "more"}]
    assert not session.turn(edited).extended
    assert len(session.ledger.rows()) == 2 and session.ledger.rows()[0].seal_reason == "non_extension"


def test_the_trace_counts_each_turns_prefill_computed_and_taken_from_the_engines_prefix_cache(tok):
    """A turn that extends the last computes only what it adds; one whose history was edited (the ledger seals) still
    takes the positions it shares with an earlier turn; after a weight update nothing is taken (invariant 2)."""
    model = models.tiny_model("qwen3", seed=1)
    engine = EmbeddedEngine(model)
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE,
                          sampling=SamplingParams(max_tokens=6, seed=0))
    first = [{"role": "system", "content": "You can run bash."}, {"role": "user", "content": "hi"}]
    one = session.turn(first)
    two = session.turn(first + [one.message, {"role": "user", "content": "more"}])
    edited = session.turn(first + [{"role": "assistant", "content": "something else"},
                                   {"role": "user", "content": "more"}])
    engine.update_weights(model.state_dict(), version=1)
    after = session.turn(first + [{"role": "assistant", "content": "something else"},
                                  {"role": "user", "content": "and more"}])
    assert [two.extended, edited.extended] == [True, False]
    seen = (two.generation.prompt_ids + two.generation.token_ids)[:-1]          # what the engine kept of turn two
    shared = next(i for i, (a, b) in enumerate(zip(seen, edited.generation.prompt_ids)) if a != b)
    prefill = session_trace(session, tok)["prefill"]
    assert [turn["prompt_tokens"] for turn in prefill] == [len(t.generation.prompt_ids)
                                                          for t in (one, two, edited, after)]
    assert [turn["cached_prompt_tokens"] for turn in prefill] == [
        0, len(one.generation.prompt_ids) + len(one.generation.token_ids) - 1, shared, 0]
    assert all(turn["computed_prompt_tokens"] == turn["prompt_tokens"] - turn["cached_prompt_tokens"]
               for turn in prefill)
    assert 0 < shared < len(edited.generation.prompt_ids) - 1


class CountingEngine(EmbeddedEngine):
    """The real engine, counting how often it is asked to generate."""
    calls = 0

    def generate(self, prompts, params, on_token=None, images=None):
        self.calls += 1
        return super().generate(prompts, params, on_token, images=images)


def test_an_identical_retry_is_answered_from_the_record_without_generating(tok):
    engine = CountingEngine(models.tiny_model("qwen3", seed=1))
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, sampling=SamplingParams(max_tokens=6))
    messages = [{"role": "user", "content": "hi"}]
    first = session.turn(messages)
    def record():
        return [(s.token_ids[:], s.trainable[:], s.behavior_logprobs[:]) for s in session.ledger.segments]
    before = record()
    assert session.turn([{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=6)) is first
    assert engine.calls == 1 and record() == before                            # nothing generated or appended
    # armed: the same messages with other sampling, or the caller's list grown in place, are new turns
    session.turn(messages, sampling=SamplingParams(max_tokens=6, seed=3))
    assert engine.calls == 2 and len(session.ledger.segments) == 2
    messages += [first.message, {"role": "user", "content": "more"}]
    session.turn(messages, sampling=SamplingParams(max_tokens=6, seed=3))
    assert engine.calls == 3


def test_failed_generation_commits_nothing_and_overlong_prompts_are_refused(tok):
    engine = EmbeddedEngine(models.tiny_model("qwen3", seed=1))
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, sampling=SamplingParams(max_tokens=4, seed=0),
                          max_length=64)
    session.turn([{"role": "user", "content": "hi"}])
    before = list(session.ledger.open_token_ids)
    with pytest.raises(ValueError, match="temperature"):
        session.turn([{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="context"):
        session.turn([{"role": "user", "content": "a very long message " * 20}])
    assert session.ledger.open_token_ids == before and len(session.ledger.segments) == 1



def test_a_prompt_past_the_context_is_a_context_overflow_naming_its_tokens_and_commits_nothing(tok):
    engine = CountingEngine(models.tiny_model("qwen3", seed=1))
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, max_length=64)
    long = [{"role": "user", "content": "a very long message " * 20}]
    with pytest.raises(ContextOverflow, match="no room for a reply") as caught:
        session.turn(long)
    tokens = len(data.render_prompt_ids(tok, long, template=data.CHATML_TEMPLATE))
    assert (caught.value.prompt_tokens, caught.value.context) == (tokens, 64) and tokens > 64
    # the character bound, before anything is rendered: a lower bound on the tokens, still past the context
    huge = [{"role": "user", "content": "x" * (64 * data.longest_token_chars(tok) + 1)}]
    with pytest.raises(ContextOverflow, match="characters") as caught:
        session.turn(huge)
    assert caught.value.prompt_tokens > caught.value.context == 64
    assert engine.calls == 0 and session.ledger.segments == [] and session.turns == 0
    # a prompt of exactly the context leaves no room; one token less gets a one-token reply, whatever max_tokens says
    ask = [{"role": "user", "content": "hi"}]
    n = len(data.render_prompt_ids(tok, ask, template=data.CHATML_TEMPLATE))
    with pytest.raises(ContextOverflow):
        ChatSession(engine, tok, "at", template=data.CHATML_TEMPLATE, max_length=n).turn(ask)
    under = ChatSession(engine, tok, "under", template=data.CHATML_TEMPLATE, max_length=n + 1,
                        sampling=SamplingParams(max_tokens=50, stop_token_ids=(9999,)))
    assert len(under.turn(ask).generation.token_ids) == 1


def test_a_session_is_as_long_as_its_engine_serves_and_a_reply_takes_the_rest_of_it(tok):
    engine = EmbeddedEngine(models.tiny_model("qwen3", seed=1))
    whole = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE)
    assert whole.max_length == engine.max_model_len == 65536 and whole.sampling.max_tokens == 65536
    with pytest.raises(ValueError, match="65536"):
        ChatSession(engine, tok, "r", max_length=65537)
    ask = [{"role": "user", "content": "hi"}]
    n = len(data.render_prompt_ids(tok, ask, template=data.CHATML_TEMPLATE))
    short = ChatSession(engine, tok, "s", template=data.CHATML_TEMPLATE, max_length=n + 80)
    never_stops = replace(short.sampling, stop_token_ids=(9999,), seed=0)      # the session's max_tokens unchanged
    generation = short.turn(ask, sampling=never_stops).generation
    assert len(generation.token_ids) == 80 and generation.finish_reason == "length"     # not 64, the old default


def test_tools_reach_a_template_without_a_tools_block_and_an_echoed_call_extends(tok):
    """SmolLM2's own template writes role and content only: the tools go into a system section and the call into
    the assistant's text (data.tools_as_messages), so the model sees them and the echo of a call is an extension."""
    template = models.load_tokenizer(models.resolve_model("smollm2")).chat_template
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                               "parameters": {"type": "object"}}}]
    student = models.tiny_model("qwen3", seed=0).train()
    engine = EmbeddedEngine(copy.deepcopy(student).eval())
    session = ChatSession(engine, tok, "r", template=template, sampling=GREEDY)
    ask = [{"role": "user", "content": "List files."}]
    prompt = session._prompt(None, ask, tools)[0]
    assert "Run a command." in tok.decode(prompt) and "<tools>" in tok.decode(prompt)
    reply = tok.encode('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>') + \
        [tok.convert_tokens_to_ids("<|im_end|>")]
    teach(student, [(prompt, reply)])
    engine.update_weights(student.state_dict(), version=1)
    first = session.turn(ask, tools)
    assert first.generation.token_ids == reply
    assert first.message["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"cmd": "ls"}}
    result = {"role": "tool", "content": "a.txt", "tool_call_id": first.message["tool_calls"][0]["id"]}
    second = session.turn(ask + [first.message, result], tools)
    assert second.extended and len(session.ledger.segments) == 1

def test_unparseable_tool_calls_stay_text():
    message = parse_hermes_tool_calls('x <tool_call>{"name": "f", "arguments": {</tool_call>', "c")
    assert "tool_calls" not in message and message["content"].startswith("x <tool_call>")
    for arguments in ('[1, 2]', '"ls"', '"{not json"'):         # arguments must be an object (or hold one)
        text = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
        assert parse_hermes_tool_calls(text, "c") == {"role": "assistant", "content": text}
    parsed = parse_hermes_tool_calls('Let me look.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n', "c")
    assert parsed["content"] == "Let me look." and parsed["tool_calls"][0]["function"] == {"name": "f",
                                                                                          "arguments": {"a": 1}}
    quoted = parse_hermes_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "c")
    assert quoted["content"] is None and quoted["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_a_request_that_fails_commits_nothing_however_deep_its_tools(tok):
    """A tool schema nested 700 levels deep renders fine but used to fail copying the request after the turn had
    committed: the client got a 500 with the turn already in the ledger, retried, and sampled again. Whatever
    fails now fails before the commit (the wires refuse such depth anyway)."""
    engine = CountingEngine(models.tiny_model("qwen3", seed=1))
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, sampling=SamplingParams(max_tokens=4))
    schema: dict = {}
    for _ in range(700):
        schema = {"a": schema}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    limit = sys.getrecursionlimit()     # Python's default: torch._inductor raises it to 2000 once it has compiled
    sys.setrecursionlimit(1000)
    try:
        with pytest.raises(RecursionError):
            session.turn([{"role": "user", "content": "hi"}], tools=tools)
    finally:
        sys.setrecursionlimit(limit)
    assert session.ledger.segments == [] and session.turns == 0 and engine.calls == 0
    assert session.turn([{"role": "user", "content": "hi"}]).generation.token_ids       # and it still serves


def test_extended_is_the_ledgers_answer_even_when_the_text_check_says_no(tok):
    """An echo with an extra key on the assistant message fails the text-level append check, so the prompt is
    rendered whole; with a canonical reply that prompt is a bitwise extension anyway. The turn reports what the
    ledger did (extended), not what the text check guessed."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    student = models.tiny_model("qwen3", seed=0).train()
    engine = EmbeddedEngine(copy.deepcopy(student).eval())
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE, sampling=GREEDY)
    first = [{"role": "user", "content": "Say ok."}]
    reply_ids = tok.encode("ok") + [im_end]
    teach(student, [(session.prompt_ids(first), reply_ids)])
    engine.update_weights(student.state_dict(), version=1)
    turn = session.turn(first)
    assert turn.generation.token_ids == reply_ids and not turn.extended      # the first turn opens a segment
    echo = {**turn.message, "name": "assistant"}                           # the template ignores the extra key
    # armed: the text check says "edited"
    assert session._delta_text(session.main_line, first + [echo], None, "") is None
    second = session.turn(first + [echo, {"role": "user", "content": "Again."}])
    assert second.extended and len(session.ledger.segments) == 1           # and the ledger extended bitwise


# ---- the echo rule: a recorded call in the agent's rendering extends; an edit seals -------------------------------

EDIT_SCHEMA = {"type": "object", "properties": {
    "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
    "replace_all": {"type": "boolean", "default": False},
    "options": {"type": "object", "properties": {"backup": {"type": "boolean", "default": True},
                                                 "encoding": {"type": "string"}}}},
    "required": ["file_path", "old_string", "new_string"]}
EDIT_TOOLS = [{"type": "function", "function": {"name": "Edit", "description": "Replace text in a file.",
                                                "parameters": EDIT_SCHEMA}}]
SAMPLED_EDIT = {"new_string": "bye", "old_string": "hello", "file_path": "/w/a.txt", "options": {"encoding": "utf8"}}


def edit_call(arguments: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c-0", "type": "function", "function": {"name": "Edit", "arguments": arguments}}]}


def test_the_echo_rule_takes_reordered_keys_and_declared_defaults_and_nothing_else():
    from session import is_echo, same_json
    schemas = {"Edit": EDIT_SCHEMA}
    recorded = edit_call(SAMPLED_EDIT)
    # Claude Code's echo: the schema's order, replace_all at its default; a nested default added too
    claude_code = {"replace_all": False, "file_path": "/w/a.txt", "old_string": "hello", "new_string": "bye",
                   "options": {"backup": True, "encoding": "utf8"}}
    assert list(claude_code) != list(SAMPLED_EDIT) and is_echo(edit_call(claude_code), recorded, schemas)
    assert is_echo(edit_call(dict(reversed(list(SAMPLED_EDIT.items())))), recorded, schemas)
    edits = [{**claude_code, "replace_all": True},                  # a default changed is a changed call
             {**claude_code, "replace_all": 0},                     # 0 is not false
             {**claude_code, "new_string": "BYE"},                  # a value changed
             {**claude_code, "dry_run": False},                     # a key with no declared default
             {k: v for k, v in claude_code.items() if k != "old_string"},     # a key dropped
             {**claude_code, "options": {"backup": False, "encoding": "utf8"}}]
    assert not any(is_echo(edit_call(e), recorded, schemas) for e in edits)
    assert not is_echo(edit_call(claude_code), recorded, {})        # no schema, no defaults
    renamed = edit_call(SAMPLED_EDIT)
    renamed["tool_calls"][0]["function"]["name"] = "Write"
    assert not is_echo(renamed, recorded, schemas)
    assert same_json({"a": 1, "b": [1.0]}, {"b": [1], "a": 1}) and not same_json(True, 1) and not same_json("1", 1)


def edit_session(tok):
    """A session on a tiny model taught to answer the task with one Edit call, arguments in the model's own order."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    student = models.tiny_model("qwen3", seed=0).train()
    engine = EmbeddedEngine(copy.deepcopy(student).eval())
    session = ChatSession(engine, tok, "r", template=data.CHATML_TEMPLATE,
                          sampling=SamplingParams(top_k=1, max_tokens=120))
    task = [{"role": "system", "content": "You edit files."}, {"role": "user", "content": "Say bye in a.txt."}]
    call = '<tool_call>\n{"name": "Edit", "arguments": ' + json.dumps(SAMPLED_EDIT) + '}\n</tool_call>'
    reply = tok.encode(call) + [im_end]
    teach(student, [(session.prompt_ids(task, EDIT_TOOLS), reply)])
    engine.update_weights(student.state_dict(), version=1)
    return session, task, reply


def test_an_echo_in_another_rendering_extends_the_record_and_an_edit_seals(tok):
    session, task, reply = edit_session(tok)
    first = session.turn(task, EDIT_TOOLS)
    assert first.generation.token_ids == reply and first.message["tool_calls"][0]["function"]["arguments"] == \
        SAMPLED_EDIT
    echo = copy.deepcopy(first.message)
    echo["tool_calls"][0]["function"]["arguments"] = {"replace_all": False, "file_path": "/w/a.txt",
                                                      "old_string": "hello", "new_string": "bye",
                                                      "options": {"encoding": "utf8", "backup": True}}
    result = {"role": "tool", "content": "The file has been updated.", "tool_call_id": echo["tool_calls"][0]["id"]}
    # armed: the echo rendered as sent is other ids at the recorded positions of the sampled call
    recorded = session.ledger.open_token_ids
    as_sent = data.render_prompt_ids(tok, [*task, echo, result], EDIT_TOOLS, data.CHATML_TEMPLATE)
    sampled_at = len(first.generation.prompt_ids)
    assert invariants.common_prefix_len(recorded, as_sent) < sampled_at + len(reply) - 1
    second = session.turn([*task, echo, result], EDIT_TOOLS)
    assert second.extended and len(session.ledger.segments) == 1
    # the engine's context at the recorded positions is the sampled call, as sampled
    assert second.generation.prompt_ids[:len(recorded)] == recorded
    assert second.generation.prompt_ids[sampled_at:sampled_at + len(reply)] == reply
    check_rows(session, [first, second])
    # an edited echo is an edit: the record seals (each on a fresh session of the same first turn)
    for changed in ({"replace_all": True}, {"new_string": "BYE"}, {"dry_run": False}):
        session, _, _ = edit_session(tok)
        first = session.turn(task, EDIT_TOOLS)
        edited = copy.deepcopy(first.message)
        edited["tool_calls"][0]["function"]["arguments"] = {**SAMPLED_EDIT, **changed}
        assert not session.turn([*task, edited, result], EDIT_TOOLS).extended
        assert [s.seal_reason for s in session.ledger.segments] == ["non_extension", ""]


# ---- lines: side requests keep records of their own ----------------------------------------------------------

def test_side_requests_keep_lines_of_their_own_and_the_main_line_never_seals(tok):
    session, task, reply = edit_session(tok)
    title = [{"role": "system", "content": "Name this session."}, {"role": "user", "content": "Say bye in a.txt."}]
    helper = [{"role": "system", "content": "You are a helper agent."}, {"role": "user", "content": "Read a.txt."}]
    other_helper = [helper[0], {"role": "user", "content": "Read b.txt."}]
    named = session.turn(title)                                     # a title request first, without tools
    first = session.turn(task, EDIT_TOOLS)
    assert session.main_line.ledger is session.lines[1].ledger      # the first line with tools is the main line
    assert [s.line for line in session.lines for s in line.ledger.segments] == ["side-0", "main"]
    sub = session.turn(helper, EDIT_TOOLS)
    other = session.turn(other_helper, EDIT_TOOLS)                  # a second sub-agent: its own line
    # armed: one record would have sealed at every switch between conversations
    control = invariants.TokenLedger("control")
    assert [control.extend_or_seal(t.generation.prompt_ids) for t in (named, first, sub, other)] == [False] * 4
    result = {"role": "tool", "content": "updated", "tool_call_id": first.message["tool_calls"][0]["id"]}
    second = session.turn([*task, first.message, result], EDIT_TOOLS)
    sub_two = session.turn([*helper, sub.message, {"role": "user", "content": "Go on."}], EDIT_TOOLS)
    assert second.extended and sub_two.extended
    assert [len(line.ledger.segments) for line in session.lines] == [1, 1, 1, 1]
    assert all(not s.seal_reason for line in session.lines for s in line.ledger.segments)
    assert [line.turns for line in session.lines] == [1, 2, 2, 1] and session.turns == 2
    # what a rollout trains: the main line alone, or every line, each sampled token once
    rows, generations = session.record("none")
    assert [r.line for r in rows] == ["main"] and generations == session.main_line.generations
    invariants.check_sampled_once(rows, generations)
    rows, generations = session.record("all")
    assert [r.line for r in rows] == ["main", "side-0", "side-2", "side-3"]
    invariants.check_sampled_once(rows, generations)
    assert len(generations) == 6
    # a rewritten main history (same opening) still seals the main line; a compaction (the main system prompt, a new
    # first message) goes to the main line and seals it too; neither touches a side line
    session.turn([*task, {"role": "assistant", "content": "I edited it."}, {"role": "user", "content": "Thanks."}],
                 EDIT_TOOLS)
    session.turn([task[0], {"role": "user", "content": "Summary: a.txt says bye. Go on."}], EDIT_TOOLS)
    assert [s.seal_reason for s in session.main_line.ledger.segments] == ["non_extension", "non_extension", ""]
    assert [len(line.ledger.segments) for line in session.side_lines] == [1, 1, 1]


def test_a_sub_agent_its_harness_names_keeps_a_line_of_its_own_though_it_has_the_main_system_prompt(tok):
    """Codex's sub-agents have the main agent's system prompt, and a forked one continues its history: only the thread
    the harness names on their requests (TurnOptions.thread) tells them from a compaction or the main line's next turn.
    A sub-agent that compacts goes back to its own thread's line, and seals there."""
    def episode(threads: bool):
        session, task, _ = edit_session(tok)
        first = session.turn(task, EDIT_TOOLS)
        result = {"role": "tool", "content": "updated", "tool_call_id": first.message["tool_calls"][0]["id"]}
        spawned = [task[0], {"role": "user", "content": "Read a.txt."}]
        forked = [*task, first.message, result, {"role": "user", "content": "You are a forked sub-agent: read b.txt."}]
        agent_1, agent_2 = (TurnOptions(thread=name if threads else "") for name in ("agent-1", "agent-2"))
        sub = session.turn(spawned, EDIT_TOOLS, options=agent_1)
        session.turn(forked, EDIT_TOOLS, options=agent_2)
        second = session.turn([*task, first.message, result], EDIT_TOOLS)
        session.turn([*spawned, sub.message, {"role": "user", "content": "Go on."}], EDIT_TOOLS, options=agent_1)
        # the first sub-agent compacts: the (shared) system prompt, a new first message
        session.turn([task[0], {"role": "user", "content": "Summary: a.txt read. Go on."}], EDIT_TOOLS, options=agent_1)
        return session, second
    # armed: without their threads, the sub-agents join the main line (by its system prompt, or as its continuation)
    # and every switch between agents (five of six turns) seals it
    session, second = episode(threads=False)
    assert session.side_lines == [] and not second.extended
    assert [s.seal_reason for s in session.main_line.ledger.segments] == ["non_extension"] * 5 + [""]
    session, second = episode(threads=True)
    main, (one, two) = session.main_line, session.side_lines
    assert second.extended and [s.seal_reason for s in main.ledger.segments] == [""] and main.turns == 2
    assert (one.thread, one.turns, two.thread, two.turns) == ("agent-1", 3, "agent-2", 1)
    assert [s.seal_reason for s in one.ledger.segments] == ["non_extension", ""]     # its compaction sealed its own
    rows, generations = session.record("all")
    assert [r.line for r in rows] == ["main", "side-1", "side-1", "side-2"]
    invariants.check_sampled_once(rows, generations)
