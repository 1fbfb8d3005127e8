# wires.py — the OpenAI and Anthropic wire formats, to and from one canonical chat turn.
#
# Owns: decoding an OpenAI chat.completions or Anthropic messages request into canonical messages, tools and
# sampling parameters (`WireRequest`), refusing what cannot be honoured (`WireError`, in each wire's own error
# format), and encoding a finished `ChatTurn` (what a loopback.ChatSession returns) as each wire's reply,
# whole or as server-sent events whose text goes out token by token as it is sampled (`LiveText`,
# `OpenAIStream`, `AnthropicStream`).
# Canonical form (what ChatSession, the chat template and the tool-call parser speak): OpenAI-style dicts,
# content a string (text parts joined; the template concatenates them anyway) or a part list when it holds
# images ({"type": "image", "image": url}), tool-call arguments as the decoded JSON object. An assistant
# message is built in exactly the shape the tool-call parser returns, so an echoed reply compares equal and
# the session can tell an append from an edit.
# Keeps invariant 1 at the edge: both wires decode to the same canonical request, so token accounting does
# not depend on the wire; nothing here encodes text into ids. Never: holds state, generates, or records.
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from rollout import MAX_TOP_LOGPROBS, Generation, IncrementalText, SamplingParams, find_stop, validate_sampling


@dataclass
class ChatTurn:
    """What a chat session's turn hands to the wire: the reply as the agent reads it, and the tokens behind it."""
    message: dict                  # the assistant message (structured tool calls parsed), canonical form
    generation: Generation         # ids, behavior logprobs, versions and routes, exactly as sampled
    extended: bool                 # the ledger's answer: False when this request sealed the segment (or was the
                                   # first turn), True when its prompt extended the record bitwise


# ---- decoding: OpenAI / Anthropic requests -> one canonical request ----------------------------------

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



def require(condition: bool, message: str) -> None:
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
    require(isinstance(name, str) and name, f"{where} needs a string 'name'")
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        require(isinstance(parameters, dict), f"{where}: the parameter schema must be a JSON object")
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _join_parts(parts: list[dict]) -> str | list[dict]:
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _text_only(content, where: str) -> str:
    require(isinstance(content, str), f"{where} must be text (a string or text parts), got images or {content!r:.60}")
    return content


def number_field(body: dict, key: str, integer: bool = False):
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    require(ok and not isinstance(value, bool), f"'{key}' must be {'an integer' if integer else 'a number'}, "
                                                f"got {value!r:.40}")
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    require(isinstance(value, bool) or value is None, f"'{key}' must be true or false, got {value!r:.40}")
    return bool(value)


def _stop_strings(value, key: str) -> tuple[str, ...] | None:
    """OpenAI `stop` (a string or a list) or Anthropic `stop_sequences` (a list) -> a tuple of stop strings."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    require(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
            f"'{key}' must be a non-empty string or a list of them, got {value!r:.60}")
    return tuple(stops)


def sampling_from(base: SamplingParams, **overrides) -> SamplingParams:
    params = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    try:
        validate_sampling(params)
    except ValueError as error:
        raise WireError(400, str(error)) from None
    return params


def refuse_unknown_keys(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    require(not unknown, f"unsupported parameter(s) {unknown}; this server honours {sorted(allowed)}")


OPENAI_PARAMS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                 "max_completion_tokens", "seed", "stop", "logprobs", "top_logprobs", "n", "stream",
                 "stream_options", "return_token_ids", "user"}


def _openai_content(content, where: str):
    if content is None or isinstance(content, str):
        return content
    require(isinstance(content, list), f"{where}.content must be a string, null or a list of parts")
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
    require(isinstance(message, dict), f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    content = _openai_content(message.get("content"), where)
    if role in ("system", "developer"):
        return {"role": "system", "content": _text_only(content, f"{where}.content")}
    if role == "user":
        return {"role": "user", "content": content if content is not None else ""}
    if role == "tool":
        return {"role": "tool", "content": _text_only(content, f"{where}.content"),
                "tool_call_id": message.get("tool_call_id")}
    require(role == "assistant", f"{where}.role must be system, developer, user, assistant or tool, got {role!r:.40}")
    calls = message.get("tool_calls") or []
    require(isinstance(calls, list), f"{where}.tool_calls must be a list")
    canonical = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        require(isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str),
                f"{where}.tool_calls[{i}] must be {{'id', 'type': 'function', 'function': {{'name': str, "
                f"'arguments': a JSON string}}}}")
        canonical.append(_call(call.get("id"), function["name"], _arguments_from_json(function["arguments"])))
    return _assistant(_text_only(content or "", f"{where}.content"), canonical)


def decode_openai(body: dict, base: SamplingParams) -> WireRequest:
    """An OpenAI chat.completions request -> the canonical request; anything it cannot honour is a WireError."""
    refuse_unknown_keys(body, OPENAI_PARAMS)
    require(body.get("n") in (None, 1), f"n must be 1 (got {body.get('n')!r}): a session samples one completion "
                                       "per request; send n separate requests (or sessions) for n samples")
    top_logprobs = number_field(body, "top_logprobs", integer=True)
    require(top_logprobs in (None, 0) or body.get("logprobs") is True,
            "'top_logprobs' needs 'logprobs': true (as on the OpenAI API)")
    require(top_logprobs is None or 0 <= top_logprobs <= MAX_TOP_LOGPROBS,
            f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    require(body.get("tool_choice") in (None, "auto"), f"tool_choice must be 'auto', got "
                                                       f"{body.get('tool_choice')!r:.60}; the model decides")
    messages = body.get("messages")
    require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    tools = body.get("tools")
    require(tools is None or isinstance(tools, list), "'tools' must be a list of {type: function, function} objects")
    canonical_tools = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        require(isinstance(function, dict), f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
        canonical_tools.append(_function_tool(function.get("name"), function.get("description"),
                                              function.get("parameters"), f"tools[{i}].function"))
    max_tokens = number_field(body, "max_completion_tokens", integer=True)
    max_tokens = number_field(body, "max_tokens", integer=True) if max_tokens is None else max_tokens
    sampling = sampling_from(base, temperature=number_field(body, "temperature"), top_p=number_field(body, "top_p"),
                             max_tokens=max_tokens, seed=number_field(body, "seed", integer=True),
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
    require(isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                             and isinstance(b.get("text"), str) for b in blocks),
            f"{where} must be a string or a list of {{'type': 'text', 'text': str}} blocks")
    return "".join(b["text"] for b in blocks)


def _anthropic_image(block: dict, where: str) -> dict:
    source = block.get("source")
    require(isinstance(source, dict), f"{where}.source must be an object")
    if source.get("type") == "base64":
        require(isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str),
                f"{where}.source needs 'media_type' and base64 'data'")
        return {"type": "image", "image": f"data:{source['media_type']};base64,{source['data']}"}
    require(source.get("type") == "url" and isinstance(source.get("url"), str),
            f"{where}.source.type must be 'base64' or 'url'")
    return {"type": "image", "image": source["url"]}


def _anthropic_messages(message, where: str) -> list[dict]:
    """One Anthropic message -> canonical messages (a user turn's tool_result blocks become tool messages)."""
    require(isinstance(message, dict) and message.get("role") in ("user", "assistant"),
            f"{where} must be an object with role 'user' or 'assistant' and content")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    require(isinstance(content, list), f"{where}.content must be a string or a list of content blocks")
    out, parts, calls = [], [], []
    for i, block in enumerate(content):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}.content[{i}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_anthropic_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            require(isinstance(block.get("name"), str) and isinstance(block.get("input"), dict),
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
    refuse_unknown_keys(body, ANTHROPIC_PARAMS)
    require(not isinstance(body.get("stop_sequences"), str), "'stop_sequences' must be a list of strings")
    require(body.get("tool_choice") in (None, {"type": "auto"}), "tool_choice must be {'type': 'auto'}; "
                                                                "the model decides whether to call a tool")
    max_tokens = number_field(body, "max_tokens", integer=True)
    require(max_tokens is not None, "'max_tokens' is required")
    messages = body.get("messages")
    require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    canonical = [] if body.get("system") is None else [{"role": "system",
                                                        "content": _anthropic_text(body["system"], "system")}]
    for i, message in enumerate(messages):
        canonical += _anthropic_messages(message, f"messages[{i}]")
    tools = body.get("tools")
    require(tools is None or isinstance(tools, list), "'tools' must be a list of {name, description, input_schema}")
    require(all(isinstance(t, dict) for t in tools or []), "each tool must be an object {name, input_schema}")
    canonical_tools = [_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]")
                       for i, t in enumerate(tools or [])]
    sampling = sampling_from(base, temperature=number_field(body, "temperature"), top_p=number_field(body, "top_p"),
                             top_k=number_field(body, "top_k", integer=True), max_tokens=max_tokens,
                             stop=_stop_strings(body.get("stop_sequences"), "stop_sequences"))
    return WireRequest(canonical, canonical_tools or None, sampling, _flag(body, "stream"))


# ---- encoding: a ChatTurn -> OpenAI / Anthropic replies, whole or streamed ---------------------------

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
