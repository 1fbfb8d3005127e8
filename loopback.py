# loopback.py — token-exact chat sessions, and the OpenAI / Anthropic wire server that wraps them.
#
# Owns: `ChatSession`, one per rollout, which turns a chat request (a message list) into engine prompt
# ids, generates, and commits the turn to the rollout's TokenLedger; `ChatTurn`, what a turn returns;
# the Hermes/Qwen `<tool_call>` parser that gives the reply its structure.
#
# Keeps invariant 1 (token identity) for agents that only speak text. An agent echoes the assistant's
# reply back as *text*; rendering that text again and re-encoding it would not give back the sampled ids
# (BPE splits are many-to-one, tool JSON is re-serialized, templates strip <think>). So a new request
# that only appends messages is served as: the ledger's exact tokens + the encoded *delta* text. Anything
# else (edited history, a template that rewrote an earlier turn, compaction) is re-rendered from scratch
# and the ledger seals the segment (the new prompt is not a bitwise extension of the old tokens).
# A turn is committed only after generation succeeds (Molt bug 41); the sampled text is never re-encoded.
# A retried request (identical messages, tools and sampling to the last one) is answered from the record:
# the same ChatTurn again, nothing generated, nothing appended (a client retry must not sample twice).
#
# The wire layer (`LoopbackServer`) serves ChatSessions over HTTP, one session per rollout under
# /s/<id>/v1 with its own key: OpenAI chat completions and Anthropic messages (streaming or not) both
# decode to the same canonical messages and go through the same ChatSession.turn, so token accounting
# does not depend on the wire. Bad input is refused with a 4xx in the wire's own error format before
# anything reaches the session, so nothing is recorded. Streaming replays a finished generation as
# deltas (the engine has no token callback), after the turn is committed, so a client that disconnects
# mid-stream leaves a complete turn that a retry can fetch. Standalone (`python loopback.py --model ...`)
# it serves one model behind a BatchingEngine and opens sessions on `POST /sessions`, so an agent author
# can check token capture before training. Never: computes rewards or trains.
from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from aiohttp import web
from jinja2 import TemplateError

import data
import invariants
import models
from rollout import (MAX_TOP_LOGPROBS, BatchingEngine, EmbeddedEngine, Generation, IncrementalText, SamplingParams,
                     find_stop, validate_sampling)


@dataclass
class ChatTurn:
    message: dict                  # the assistant message returned to the agent (structured tool calls parsed)
    generation: Generation         # ids, behavior logprobs, versions and routes, exactly as sampled
    extended: bool                 # False when this request did not extend the record (a seal, or the first turn)


# ---- tool calls: read structure out of the sampled text, never write it back ------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call_arguments(call: dict) -> dict | None:
    """A call's arguments as an object: absent means {}; a JSON string holding an object (the way the OpenAI
    wire carries them, and how some models write them) is that object; anything else is not a call."""
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return arguments if isinstance(arguments, dict) else None


def parse_hermes_tool_calls(text: str, call_prefix: str) -> dict:
    """Hermes/Qwen style: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an
    OpenAI-shaped tool call. A block that is not valid JSON with a string name and object arguments stays in
    the content as text: the model's error is shown to the agent, never repaired. The token record is not
    touched."""
    calls, kept = [], []
    last = 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        arguments = _call_arguments(call) if isinstance(call, dict) and isinstance(call.get("name"), str) else None
        if arguments is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"{call_prefix}-{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    if not calls:       # the reply is returned byte for byte, so an echo of it extends the record
        return {"role": "assistant", "content": text}
    kept.append(text[last:])
    # only trailing whitespace goes (the template writes its own separator before a call); the start is kept
    content = "".join(kept).rstrip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def reply_text(tokenizer, gen: Generation) -> str:
    """The reply as the agent reads it: the sampled ids decoded (special tokens skipped), cut before the stop
    string that ended it (OpenAI and Anthropic both leave it out)."""
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    hit = find_stop(text, (gen.stop_string,)) if gen.stop_string else None
    return text[:hit[0]] if hit else text


class ChatSession:
    """One rollout's conversation with the engine, token-exact across turns."""

    def __init__(self, engine, tokenizer, rollout_id: str, group_id: str = "", template: str | None = None,
                 sampling: SamplingParams | None = None, max_length: int = 4096):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.sampling = sampling or SamplingParams()
        self.max_length = max_length
        self.ledger = invariants.TokenLedger(rollout_id, group_id)
        self.lock = threading.Lock()           # one turn at a time per session
        self.ledger_lock = threading.Lock()    # held only while a turn commits: the trace never waits on a generation
        # What the next request must start with to count as an extension: the last request's messages
        # plus the reply as we returned it, and their rendering up to the generation prompt.
        self._expected: list[dict] | None = None
        self._expected_prompt_text = ""
        self._echo_text = ""                   # how the last reply must open its echoed assistant block
        self.turns = 0                         # generations committed to the ledger
        self.clipped_turns = 0                 # of those, replies that hit max_tokens before a stop token
        self._last_request: tuple | None = None   # (messages, tools, sampling) of the last committed turn
        self._last_turn: ChatTurn | None = None

    def turn(self, messages: list[dict], tools: list[dict] | None = None, sampling: SamplingParams | None = None,
             on_token: Callable[[list[int], int], None] | None = None) -> ChatTurn:
        """Generate the assistant's reply to `messages` and commit it. `on_token(prompt_ids, token_id)` is
        called as each token is sampled (a streaming server's hook); a retry answered from the record never
        calls it."""
        params = sampling or self.sampling
        with self.lock:
            if self._last_request == (messages, tools, params):   # a retry: answer from the record
                return self._last_turn
            turn = self._generate_and_commit(messages, tools, params, on_token)
            self._last_request, self._last_turn = (copy.deepcopy(messages), copy.deepcopy(tools), params), turn
            return turn

    def _generate_and_commit(self, messages: list[dict], tools, params: SamplingParams, on_token) -> ChatTurn:
        prompt_ids, extends = self._prompt_ids(messages, tools)
        room = self.max_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt holds {len(prompt_ids)} tokens, at or over the session's context "
                             f"of {self.max_length}; shorten the conversation")
        relay = None if on_token is None else (lambda _, token_id: on_token(prompt_ids, token_id))
        gen = self.engine.generate([prompt_ids], replace(params, max_tokens=min(params.max_tokens, room)), relay)[0]
        # commit: only now does the ledger change (a failed generate leaves the session as it was)
        with self.ledger_lock:
            self.ledger.extend_or_seal(gen.prompt_ids)
            self.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions)
            if gen.routes is not None:
                self.ledger.absorb_routes(gen.routes)
        text = reply_text(self.tokenizer, gen)
        message = parse_hermes_tool_calls(text, f"call-{self.ledger.rollout_id}-{self.turns}")
        self.turns += 1
        self.clipped_turns += gen.finish_reason == "length"
        self._expected = [*messages, message]
        self._expected_prompt_text = self._render(messages, tools, generation_prompt=True)
        # An echo must open with the reply as sampled, stop token included ("...<|im_end|>"). A reply cut at a
        # stop string opens with the text the agent got: the record keeps the ids that wrote the stop string
        # (the model did write them) and the template's closing follows them as context.
        self._echo_text = text if gen.stop_string else self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        return ChatTurn(message, gen, extends)

    def _render(self, messages, tools, generation_prompt: bool) -> str:
        return data.render_prompt_text(self.tokenizer, messages, tools, self.template, generation_prompt)

    def _prompt_ids(self, messages: list[dict], tools) -> tuple[list[int], bool]:
        """The engine prompt for this request, and whether it extends the record."""
        full = self._render(messages, tools, generation_prompt=True)
        delta = self._delta_text(messages, tools, full)
        if delta is None:
            return self.tokenizer.encode(full, add_special_tokens=False), False
        return self.ledger.open_token_ids + self.tokenizer.encode(delta, add_special_tokens=False), True

    def _delta_text(self, messages, tools, full: str) -> str | None:
        """Text to append after the record's exact tokens, or None when this request is not an append.
        Three checks, each of which must hold: (1) the messages start with the last request plus our
        reply, unedited; (2) rendering that prefix is a string prefix of the new rendering (a template
        that strips earlier <think> fails here); (3) the prefix's assistant block starts with exactly the
        reply as sampled (re-serialized tool JSON fails here). What the template writes after the sampled text
        (the '\\n' after <|im_end|>, or a closing <|im_end|> when the reply hit max_tokens or a stop string)
        is context."""
        if self._expected is None or messages[:len(self._expected)] != self._expected:
            return None
        prefix = self._render(self._expected, tools, generation_prompt=False)
        if not full.startswith(prefix) or not prefix.startswith(self._expected_prompt_text):
            return None
        assistant_block = prefix[len(self._expected_prompt_text):]
        if not assistant_block.startswith(self._echo_text):
            return None
        return assistant_block[len(self._echo_text):] + full[len(prefix):]


# ---- wire decoding: OpenAI / Anthropic requests -> canonical messages ---------------------------------
# Canonical form (what ChatSession, the template and parse_hermes_tool_calls speak): OpenAI-style dicts,
# content a string (text parts joined; the template concatenates them anyway) or a part list when it holds
# images ({"type": "image", "image": url}), tool-call arguments as the decoded JSON object. An assistant
# message is built in exactly the shape parse_hermes_tool_calls returns, so an echoed reply compares equal.

class WireError(Exception):
    """A refused request: its HTTP status, the error type, and a message saying what was wrong."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind

    def body(self, wire: str) -> dict:
        """The error in the wire's own format (what the SDKs parse into their exception classes)."""
        if wire == "anthropic":
            return {"type": "error", "error": {"type": self.kind, "message": str(self)}}
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": None}}

    def response(self, wire: str) -> web.Response:
        return web.json_response(self.body(wire), status=self.status)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise WireError(400, message)


@dataclass
class WireRequest:
    messages: list[dict]           # canonical messages
    tools: list[dict] | None       # OpenAI function schemas, as the template renders them
    sampling: SamplingParams       # the session's defaults overridden by the request
    stream: bool
    logprobs: bool = False         # OpenAI: return the behavior logprob of each sampled token
    return_token_ids: bool = False  # extension: return prompt_token_ids and token_ids


def _arguments_from_json(text: str):
    """OpenAI carries tool arguments as a JSON string, the template and parser the object; non-JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _arguments_to_json(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call(call_id, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content, tool_calls: list[dict]) -> dict:
    if tool_calls:
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    return {"role": "assistant", "content": content or ""}


def _function_tool(name, description, parameters, where: str) -> dict:
    _require(isinstance(name, str) and name, f"{where} needs a string 'name'")
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        _require(isinstance(parameters, dict), f"{where}: the parameter schema must be a JSON object")
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _join_parts(parts: list[dict]) -> str | list[dict]:
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _text_only(content, where: str) -> str:
    _require(isinstance(content, str), f"{where} must be text (a string or text parts), got images or {content!r:.60}")
    return content


def _number(body: dict, key: str, integer: bool = False):
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    _require(ok and not isinstance(value, bool), f"'{key}' must be {'an integer' if integer else 'a number'}, "
                                                 f"got {value!r:.40}")
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    _require(isinstance(value, bool) or value is None, f"'{key}' must be true or false, got {value!r:.40}")
    return bool(value)


def _stop_strings(value, key: str) -> tuple[str, ...] | None:
    """OpenAI `stop` (a string or a list) or Anthropic `stop_sequences` (a list) -> a tuple of stop strings."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    _require(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
             f"'{key}' must be a non-empty string or a list of them, got {value!r:.60}")
    return tuple(stops)


def _sampling(base: SamplingParams, **overrides) -> SamplingParams:
    params = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    try:
        validate_sampling(params)
    except ValueError as error:
        raise WireError(400, str(error)) from None
    return params


def _unknown_keys(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    _require(not unknown, f"unsupported parameter(s) {unknown}; this server honours {sorted(allowed)}")


OPENAI_PARAMS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                 "max_completion_tokens", "seed", "stop", "logprobs", "top_logprobs", "n", "stream",
                 "stream_options", "return_token_ids", "user"}


def _openai_content(content, where: str):
    if content is None or isinstance(content, str):
        return content
    _require(isinstance(content, list), f"{where}.content must be a string, null or a list of parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance(url := (part.get("image_url") or {}).get("url"), str):
            parts.append({"type": "image", "image": url})
        else:
            raise WireError(400, f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} or "
                                 f"{{'type': 'image_url', 'image_url': {{'url': str}}}}, got {part!r:.80}")
    return _join_parts(parts)


def _openai_message(message, where: str) -> dict:
    _require(isinstance(message, dict), f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    content = _openai_content(message.get("content"), where)
    if role in ("system", "developer"):
        return {"role": "system", "content": _text_only(content, f"{where}.content")}
    if role == "user":
        return {"role": "user", "content": content if content is not None else ""}
    if role == "tool":
        return {"role": "tool", "content": _text_only(content, f"{where}.content"),
                "tool_call_id": message.get("tool_call_id")}
    _require(role == "assistant", f"{where}.role must be system, developer, user, assistant or tool, got {role!r:.40}")
    calls = message.get("tool_calls") or []
    _require(isinstance(calls, list), f"{where}.tool_calls must be a list")
    canonical = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        _require(isinstance(function, dict) and isinstance(function.get("name"), str)
                 and isinstance(function.get("arguments"), str),
                 f"{where}.tool_calls[{i}] must be {{'id', 'type': 'function', 'function': {{'name': str, "
                 f"'arguments': a JSON string}}}}")
        canonical.append(_call(call.get("id"), function["name"], _arguments_from_json(function["arguments"])))
    return _assistant(_text_only(content or "", f"{where}.content"), canonical)


def decode_openai(body: dict, base: SamplingParams) -> WireRequest:
    """An OpenAI chat.completions request -> the canonical request; anything it cannot honour is a WireError."""
    _unknown_keys(body, OPENAI_PARAMS)
    _require(body.get("n") in (None, 1), f"n must be 1 (got {body.get('n')!r}): a session samples one completion "
                                        "per request; send n separate requests (or sessions) for n samples")
    top_logprobs = _number(body, "top_logprobs", integer=True)
    _require(top_logprobs in (None, 0) or body.get("logprobs") is True,
             "'top_logprobs' needs 'logprobs': true (as on the OpenAI API)")
    _require(top_logprobs is None or 0 <= top_logprobs <= MAX_TOP_LOGPROBS,
             f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    _require(body.get("tool_choice") in (None, "auto"), f"tool_choice must be 'auto', got "
                                                        f"{body.get('tool_choice')!r:.60}; the model decides")
    messages = body.get("messages")
    _require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    tools = body.get("tools")
    _require(tools is None or isinstance(tools, list), "'tools' must be a list of {type: function, function} objects")
    canonical_tools = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        _require(isinstance(function, dict), f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
        canonical_tools.append(_function_tool(function.get("name"), function.get("description"),
                                              function.get("parameters"), f"tools[{i}].function"))
    max_tokens = _number(body, "max_completion_tokens", integer=True)
    max_tokens = _number(body, "max_tokens", integer=True) if max_tokens is None else max_tokens
    sampling = _sampling(base, temperature=_number(body, "temperature"), top_p=_number(body, "top_p"),
                         max_tokens=max_tokens, seed=_number(body, "seed", integer=True),
                         stop=_stop_strings(body.get("stop"), "stop"), top_logprobs=top_logprobs)
    return WireRequest([_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)],
                       canonical_tools or None, sampling, _flag(body, "stream"), _flag(body, "logprobs"),
                       _flag(body, "return_token_ids"))


ANTHROPIC_PARAMS = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                    "stream", "tools", "tool_choice", "metadata"}


def _anthropic_text(blocks, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    _require(isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                              and isinstance(b.get("text"), str) for b in blocks),
             f"{where} must be a string or a list of {{'type': 'text', 'text': str}} blocks")
    return "".join(b["text"] for b in blocks)


def _anthropic_image(block: dict, where: str) -> dict:
    source = block.get("source")
    _require(isinstance(source, dict), f"{where}.source must be an object")
    if source.get("type") == "base64":
        _require(isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str),
                 f"{where}.source needs 'media_type' and base64 'data'")
        return {"type": "image", "image": f"data:{source['media_type']};base64,{source['data']}"}
    _require(source.get("type") == "url" and isinstance(source.get("url"), str),
             f"{where}.source.type must be 'base64' or 'url'")
    return {"type": "image", "image": source["url"]}


def _anthropic_messages(message, where: str) -> list[dict]:
    """One Anthropic message -> canonical messages (a user turn's tool_result blocks become tool messages)."""
    _require(isinstance(message, dict) and message.get("role") in ("user", "assistant"),
             f"{where} must be an object with role 'user' or 'assistant' and content")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    _require(isinstance(content, list), f"{where}.content must be a string or a list of content blocks")
    out, parts, calls = [], [], []
    for i, block in enumerate(content):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}.content[{i}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_anthropic_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            _require(isinstance(block.get("name"), str) and isinstance(block.get("input"), dict),
                     f"{at} (tool_use) needs 'id', a string 'name' and an object 'input'")
            calls.append(_call(block.get("id"), block["name"], block["input"]))
        elif kind == "tool_result" and role == "user":
            if parts:               # keep the order: text before a tool result is its own user turn
                out.append({"role": "user", "content": _join_parts(parts)})
                parts = []
            out.append({"role": "tool", "content": _anthropic_text(block.get("content", ""), f"{at}.content"),
                        "tool_call_id": block.get("tool_use_id")})
        else:
            takes = "text, image and tool_result" if role == "user" else "text and tool_use"
            raise WireError(400, f"{at}: a {role} message takes {takes} blocks, got {block!r:.80}")
    if role == "assistant":
        return [_assistant(_text_only(_join_parts(parts), f"{where}.content"), calls)]
    return out + ([{"role": "user", "content": _join_parts(parts)}] if parts or not out else [])


def decode_anthropic(body: dict, base: SamplingParams) -> WireRequest:
    """An Anthropic messages request -> the canonical request; anything it cannot honour is a WireError."""
    _unknown_keys(body, ANTHROPIC_PARAMS)
    _require(not isinstance(body.get("stop_sequences"), str), "'stop_sequences' must be a list of strings")
    _require(body.get("tool_choice") in (None, {"type": "auto"}), "tool_choice must be {'type': 'auto'}; "
                                                                 "the model decides whether to call a tool")
    max_tokens = _number(body, "max_tokens", integer=True)
    _require(max_tokens is not None, "'max_tokens' is required")
    messages = body.get("messages")
    _require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    canonical = [] if body.get("system") is None else [{"role": "system",
                                                        "content": _anthropic_text(body["system"], "system")}]
    for i, message in enumerate(messages):
        canonical += _anthropic_messages(message, f"messages[{i}]")
    tools = body.get("tools")
    _require(tools is None or isinstance(tools, list), "'tools' must be a list of {name, description, input_schema}")
    _require(all(isinstance(t, dict) for t in tools or []), "each tool must be an object {name, input_schema}")
    canonical_tools = [_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]")
                       for i, t in enumerate(tools or [])]
    sampling = _sampling(base, temperature=_number(body, "temperature"), top_p=_number(body, "top_p"),
                         top_k=_number(body, "top_k", integer=True), max_tokens=max_tokens,
                         stop=_stop_strings(body.get("stop_sequences"), "stop_sequences"))
    return WireRequest(canonical, canonical_tools or None, sampling, _flag(body, "stream"))


# ---- wire encoding: a ChatTurn -> OpenAI / Anthropic replies, whole or streamed ----------------------

OPENAI_FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "tool": "tool_calls"}
ANTHROPIC_STOP = {"stop": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens", "tool": "tool_use"}


def _finish_reason(turn: ChatTurn, names: dict[str, str]) -> str:
    gen = turn.generation
    if turn.message.get("tool_calls") and gen.finish_reason == "stop":
        return names["tool"]
    return names["stop_string" if gen.stop_string is not None else gen.finish_reason]


def _openai_tool_calls(message: dict) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": _arguments_to_json(c["function"]["arguments"])}}
            for c in message.get("tool_calls") or []]


def _openai_logprobs(tokenizer, gen: Generation) -> dict:
    """Each sampled token's behavior logprob (the distribution it was drawn from), with the top alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    tops = gen.top_logprobs or [[] for _ in gen.token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, lp, top in zip(gen.token_ids, gen.behavior_logprobs, tops)]}


def _openai_extras(turn: ChatTurn, request: WireRequest) -> dict:
    gen = turn.generation
    usage = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.token_ids),
             "total_tokens": len(gen.prompt_ids) + len(gen.token_ids)}
    ids = {"prompt_token_ids": gen.prompt_ids, "token_ids": gen.token_ids} if request.return_token_ids else {}
    return {"usage": usage, **ids}


def openai_reply(turn: ChatTurn, request: WireRequest, tokenizer, model: str, reply_id: str) -> dict:
    message = {"role": "assistant", "content": turn.message["content"]}
    if turn.message.get("tool_calls"):
        message["tool_calls"] = _openai_tool_calls(turn.message)
    choice = {"index": 0, "message": message,
              "finish_reason": _finish_reason(turn, OPENAI_FINISH),
              "logprobs": _openai_logprobs(tokenizer, turn.generation) if request.logprobs else None}
    return {"id": reply_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], **_openai_extras(turn, request)}


def _anthropic_blocks(message: dict) -> list[dict]:
    calls = message.get("tool_calls") or []
    text = [{"type": "text", "text": message["content"]}] if message["content"] or not calls else []
    return text + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": c["function"]["arguments"]} for c in calls]


def anthropic_reply(turn: ChatTurn, model: str, reply_id: str) -> dict:
    gen = turn.generation
    return {"id": reply_id, "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(turn.message), "stop_reason": _finish_reason(turn, ANTHROPIC_STOP),
            "stop_sequence": gen.stop_string, "usage": {"input_tokens": len(gen.prompt_ids),
                                                        "output_tokens": len(gen.token_ids)}}


# Streaming sends each token's text as it is sampled, but only text the final message is sure to begin
# with: never past a stop string (or the start of one), never into a `<tool_call>` (or what may become
# one: the call is parsed into structure when the reply is done), never trailing whitespace (a reply with
# tool calls drops it). The finished turn then sends the rest, the tool calls and the finish reason, so
# the streamed text always equals the non-streamed reply.

def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class LiveText:
    """The part of a reply, as it is sampled, that can be sent now (see above)."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.decoded, self.stops, self.sent = IncrementalText(tokenizer), stops, ""

    def push(self, token_id: int) -> str:
        """Add a sampled id; returns the newly sendable text ('' when it must wait)."""
        self.decoded.push(token_id)
        text = self.decoded.text
        hit = find_stop(text, self.stops) if self.stops else None
        safe = text[:hit[0]] if hit else text
        safe = safe[:len(safe) - _partial_suffix(safe, (*self.stops, "<tool_call>"))]
        call = safe.find("<tool_call>")
        safe = (safe[:call] if call >= 0 else safe).rstrip()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece

    def rest(self, content: str | None) -> str:
        """What the finished reply's content adds to the text already sent."""
        return (content or "")[len(self.sent):]


class OpenAIStream:
    """chat.completion.chunk events: the role, content deltas as tokens arrive, then the rest of the content,
    one delta per tool call, and the finish chunk (usage, and token ids / logprobs when asked)."""
    wire, done_marker = "openai", True

    def __init__(self, request: WireRequest, tokenizer, model: str, reply_id: str):
        self.request, self.tokenizer, self.model, self.reply_id = request, tokenizer, model, reply_id

    def _chunk(self, delta: dict, finish_reason=None, logprobs=None, **extra) -> tuple[None, dict]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return None, {"id": self.reply_id, "object": "chat.completion.chunk", "created": int(time.time()),
                      "model": self.model, "choices": [choice], **extra}

    def start(self, prompt_ids: list[int]) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list:
        return [self._chunk({"content": piece})]

    def finish(self, turn: ChatTurn, rest: str) -> list:
        events = self.text(rest) if rest else []
        events += [self._chunk({"tool_calls": [{"index": i, **call}]})
                   for i, call in enumerate(_openai_tool_calls(turn.message))]
        logprobs = _openai_logprobs(self.tokenizer, turn.generation) if self.request.logprobs else None
        return events + [self._chunk({}, _finish_reason(turn, OPENAI_FINISH), logprobs,
                                     **_openai_extras(turn, self.request))]


class AnthropicStream:
    """message_start, a text block whose deltas arrive as tokens do, a tool_use block per call
    (input_json_delta), message_delta with the stop reason, message_stop."""
    wire, done_marker = "anthropic", False

    def __init__(self, request: WireRequest, tokenizer, model: str, reply_id: str):
        self.model, self.reply_id = model, reply_id
        self.text_open = False

    def start(self, prompt_ids: list[int]) -> list:
        message = {"id": self.reply_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message})]

    def text(self, piece: str) -> list:
        events = [] if self.text_open else \
            [("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})]
        self.text_open = True
        return events + [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": piece}})]

    def finish(self, turn: ChatTurn, rest: str) -> list:
        blocks = _anthropic_blocks(turn.message)
        events = self.text(rest) if rest or (blocks[0]["type"] == "text" and not self.text_open) else []
        for index, block in enumerate(blocks):
            if block["type"] == "tool_use":
                json_delta = {"type": "input_json_delta", "partial_json": _arguments_to_json(block["input"])}
                events += [("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": {**block, "input": {}}}),
                           ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": json_delta})]
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        gen = turn.generation
        return events + [("message_delta", {"type": "message_delta", "usage": {"output_tokens": len(gen.token_ids)},
                                            "delta": {"stop_reason": _finish_reason(turn, ANTHROPIC_STOP),
                                                      "stop_sequence": gen.stop_string}}),
                         ("message_stop", {"type": "message_stop"})]


def session_trace(session: ChatSession, tokenizer) -> dict:
    """The session's ledger as JSON: what the trainer will see, token by token."""
    with session.ledger_lock:
        segments = [{"segment_id": s.segment_id, "token_ids": s.token_ids,
                     "tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in s.token_ids],
                     "trainable": s.trainable, "behavior_logprobs": s.behavior_logprobs,
                     "policy_versions": s.policy_versions, "seal_reason": s.seal_reason,
                     "common_prefix_len": s.common_prefix_len} for s in session.ledger.segments]
    return {"rollout_id": session.ledger.rollout_id, "group_id": session.ledger.group_id, "segments": segments}


# ---- the server ---------------------------------------------------------------------------------

@dataclass
class SessionInfo:
    session_id: str
    api_key: str                   # send as `Authorization: Bearer <key>` (OpenAI) or `x-api-key` (Anthropic)
    base_url: str                  # http://HOST:PORT/s/<id>/v1 — OpenAI(base_url=...)
    session_url: str               # http://HOST:PORT/s/<id> — Anthropic(base_url=...); DELETE it to close
    trace_url: str                 # http://HOST:PORT/s/<id>/trace — the session's segments, token by token


MAX_BODY_BYTES = 32 * 2**20            # a request body larger than this is refused with a 413


class LoopbackServer:
    """OpenAI and Anthropic HTTP wires over ChatSessions, on an aiohttp loop in a background thread.
    engine.generate runs in a thread pool, so the loop keeps serving other sessions while one generates.
    The engine is used as given: wrap it in a BatchingEngine to batch concurrent sessions' turns."""

    def __init__(self, engine, tokenizer, template: str | None = None, model_name: str = "policy",
                 host: str = "127.0.0.1", port: int = 0, max_length: int = 4096):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.model_name, self.host, self.port = model_name, host, port
        self.max_length = max_length               # context of a session that does not ask for less
        self._sessions: dict[str, tuple[ChatSession, str]] = {}   # id -> (session, api key)
        self._registry_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="loopback-generate")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (called from synchronous code) --

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port."""
        ready, failure = threading.Event(), []
        self._thread = threading.Thread(target=self._serve, args=(ready, failure), name="loopback-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"loopback server could not listen on {self.host}:{self.port}: {failure[0]}")
        return self.port

    def _serve(self, ready: threading.Event, failure: list) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for wire, method, path, handler in [("openai", "GET", "/s/{sid}/v1/models", self._models),
                                            ("openai", "POST", "/s/{sid}/v1/chat/completions", self._chat),
                                            ("anthropic", "POST", "/s/{sid}/v1/messages", self._messages),
                                            ("openai", "GET", "/s/{sid}/trace", self._trace),
                                            ("openai", "POST", "/sessions", self._open),
                                            ("openai", "DELETE", "/s/{sid}", self._close)]:
            app.router.add_route(method, path, self._endpoint(wire, handler))
        runner = web.AppRunner(app)
        try:
            self._loop.run_until_complete(runner.setup())
            self._loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
            self.port = runner.addresses[0][1]
        except Exception as error:        # reported by start(), which would otherwise wait forever
            failure.append(error)
        ready.set()
        if failure:
            return
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = None
        self._executor.shutdown(wait=True)

    # -- the session registry --

    def create_session(self, rollout_id: str | None = None, group_id: str = "", sampling: SamplingParams | None = None,
                       max_length: int | None = None) -> SessionInfo:
        if self._thread is None:
            raise RuntimeError("start() the server before creating sessions: their URLs carry the bound port")
        session_id = secrets.token_hex(8)
        api_key = f"sk-loopback-{secrets.token_urlsafe(24)}"
        session = ChatSession(self.engine, self.tokenizer, rollout_id or session_id, group_id, self.template,
                              sampling, max_length or self.max_length)
        with self._registry_lock:
            self._sessions[session_id] = (session, api_key)
        session_url = f"http://{self.host}:{self.port}/s/{session_id}"
        return SessionInfo(session_id, api_key, f"{session_url}/v1", session_url, f"{session_url}/trace")

    def close_session(self, session_id: str) -> ChatSession:
        """Forget the session (its URLs answer 404 from now on) and hand back its ChatSession and ledger."""
        with self._registry_lock:
            if session_id not in self._sessions:
                raise KeyError(f"no open session {session_id!r}; open sessions: {sorted(self._sessions)[:5]}")
            return self._sessions.pop(session_id)[0]

    # -- request plumbing --

    def _endpoint(self, wire: str, handler):
        async def serve(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except WireError as error:
                return error.response(wire)
        return serve

    def _authorize(self, request: web.Request) -> ChatSession:
        session_id = request.match_info["sid"]
        with self._registry_lock:
            entry = self._sessions.get(session_id)
        if entry is None:
            raise WireError(404, f"no session {session_id!r} on this server (closed, or never created); "
                                 "create one with POST /sessions or LoopbackServer.create_session", "not_found_error")
        bearer = request.headers.get("Authorization", "")
        key = bearer[len("Bearer "):] if bearer.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), entry[1].encode()):
            raise WireError(401, f"wrong or missing API key for session {session_id!r}; send this session's key "
                                 "as 'Authorization: Bearer <key>' or 'x-api-key: <key>'", "authentication_error")
        return entry[0]

    async def _body(self, request: web.Request, optional: bool = False) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise WireError(413, f"the request body is over this server's limit of {MAX_BODY_BYTES // 2**20} MiB; "
                                 "send smaller images or a shorter conversation", "request_too_large") from None
        if optional and not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise WireError(400, f"the request body is not valid JSON ({error}); send a JSON object") from None
        _require(isinstance(body, dict), f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _turn(self, session: ChatSession, request: WireRequest, on_token=None) -> ChatTurn:
        for message in request.messages:
            _require(not isinstance(message["content"], list), "this server's engine is text-only; "
                                                               "remove the image parts from the conversation")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, session.turn, request.messages, request.tools, request.sampling, on_token)
        except (ValueError, TemplateError) as error:   # an overlong prompt, a template that refuses the messages
            raise WireError(400, str(error)) from None

    async def _stream(self, request: web.Request, session: ChatSession, wire_request: WireRequest,
                      stream: OpenAIStream | AnthropicStream) -> web.StreamResponse:
        """Serve one turn as server-sent events, text sent as its tokens are sampled. Nothing is sent before
        the first token, so a request refused by the session is still a plain 4xx. A client that hangs up
        does not stop the turn: it is committed, and a retry gets it from the record."""
        loop = asyncio.get_running_loop()
        sampled: asyncio.Queue = asyncio.Queue()

        def on_token(prompt_ids: list[int], token_id: int) -> None:     # runs on the engine's thread
            loop.call_soon_threadsafe(sampled.put_nowait, (prompt_ids, token_id))

        job = asyncio.ensure_future(self._turn(session, wire_request, on_token))
        job.add_done_callback(lambda done: done.cancelled() or done.exception())   # retrieved even if we hang up
        live, response = LiveText(self.tokenizer, wire_request.sampling.stop), None
        try:
            while not (job.done() and sampled.empty()):
                arrival = asyncio.ensure_future(sampled.get())
                await asyncio.wait({arrival, job}, return_when=asyncio.FIRST_COMPLETED)
                if not arrival.done():
                    arrival.cancel()
                    continue
                prompt_ids, token_id = arrival.result()
                if response is None:
                    response = await self._open_stream(request, stream.start(prompt_ids))
                if piece := live.push(token_id):
                    await self._send(response, stream.text(piece))
            try:
                turn = job.result()
            except WireError as error:
                if response is None:
                    raise
                await self._send(response, [("error", error.body(stream.wire))])
                return response
            if response is None:          # a retry answered from the record: no token was sampled live
                response = await self._open_stream(request, stream.start(turn.generation.prompt_ids))
            await self._send(response, stream.finish(turn, live.rest(turn.message["content"])))
            if stream.done_marker:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:      # the client hung up; the turn still commits and a retry returns it
            pass
        return response

    async def _open_stream(self, request: web.Request, first_events: list) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._send(response, first_events)
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, events: list[tuple[str | None, dict]]) -> None:
        for name, event in events:
            head = f"event: {name}\n" if name else ""
            await response.write(f"{head}data: {json.dumps(event)}\n\n".encode())

    # -- endpoints --

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                              "owned_by": "tracerl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._authorize(request)
        wire_request = decode_openai(await self._body(request), session.sampling)
        reply_id = f"chatcmpl-{secrets.token_hex(8)}"
        if wire_request.stream:
            stream = OpenAIStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, wire_request, stream)
        turn = await self._turn(session, wire_request)
        return web.json_response(openai_reply(turn, wire_request, self.tokenizer, self.model_name, reply_id))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session = self._authorize(request)
        wire_request = decode_anthropic(await self._body(request), session.sampling)
        reply_id = f"msg_{secrets.token_hex(12)}"
        if wire_request.stream:
            stream = AnthropicStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, wire_request, stream)
        turn = await self._turn(session, wire_request)
        return web.json_response(anthropic_reply(turn, self.model_name, reply_id))

    async def _trace(self, request: web.Request) -> web.Response:
        session = self._authorize(request)
        trace = await asyncio.get_running_loop().run_in_executor(self._executor, session_trace, session, self.tokenizer)
        return web.json_response(trace)


    async def _open(self, request: web.Request) -> web.Response:
        """POST /sessions (loopback needs no auth): an optional {temperature, max_tokens, max_length} body
        sets the session's defaults; the reply carries its id, key and URLs."""
        body = await self._body(request, optional=True)
        _unknown_keys(body, {"temperature", "max_tokens", "max_length"})
        max_length = _number(body, "max_length", integer=True)
        _require(max_length is None or 1 < max_length <= self.max_length,
                 f"'max_length' must be an integer in [2, {self.max_length}] (the server's --max-length), "
                 f"got {max_length}")
        sampling = _sampling(SamplingParams(), temperature=_number(body, "temperature"),
                             max_tokens=_number(body, "max_tokens", integer=True))
        return web.json_response(asdict(self.create_session(sampling=sampling, max_length=max_length)))

    async def _close(self, request: web.Request) -> web.Response:
        self._authorize(request)
        self.close_session(request.match_info["sid"])
        return web.json_response({"session_id": request.match_info["sid"], "closed": True})


# ---- standalone: serve one model until interrupted ---------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve a model on token-exact OpenAI and Anthropic wires. Open a session with "
                    "`POST /sessions`, point an SDK at its base_url with its api_key, read what the trainer "
                    "would see at its trace_url, close it with `DELETE /s/<id>`.")
    parser.add_argument("--model", required=True, help="a model folder, or one of " + ", ".join(models.MODEL_NAMES))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--template", choices=["chatml", "model"], default="model",
                        help="chat template: the model's own (default) or tracerl's ChatML")
    parser.add_argument("--max-length", type=int, default=4096, help="most tokens a session's context may hold")
    args = parser.parse_args()
    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    engine = BatchingEngine(EmbeddedEngine(models.load_model(path), tokenizer=tokenizer))   # sessions share batches
    template = data.CHATML_TEMPLATE if args.template == "chatml" else None
    server = LoopbackServer(engine, tokenizer, template, args.model, args.host, args.port, args.max_length)
    port = server.start()
    print(f"tracerl loopback serving {args.model} at http://{args.host}:{port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
