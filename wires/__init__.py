# wires/ — the loopback server's three wire formats, each whole and streamed, decoded to one canonical request.
#   __init__.py     (this file) the canonical request and turn, what the wires share, and OpenAI chat completions
#   anthropic.py    Anthropic messages (and count_tokens)
#   responses.py    OpenAI Responses
#   params.py       every request field of each wire, and what it does (honoured, a no-op, refused)
# They serve loopback.py and session.py; they import invariants.py, engines/ and each other, never a stage.
#
# This file: the canonical chat request and turn that every wire decodes to and encodes from, what the wires share,
# and the OpenAI chat completions wire.
#
# Owns: the canonical request (`WireRequest`, `TurnOptions`) and turn (`ChatTurn`: what a session.ChatSession
# returns); refusing what cannot be honoured (`WireError`, in each wire's own error format; `ContextLengthExceeded`);
# answering every request field as wires/params.py's tables decide (honoured, a documented no-op, or refused with what
# would be accepted instead) and the decoding every wire shares (fields, sampling, tool options, template switches);
# the signed thought (`split_thinking`, `signed_opening`); a reply's token extras and live streaming: text goes out
# token by token as it is sampled (`LiveText`; `LiveStream`, what loopback's streaming drives); and the OpenAI
# chat.completions wire itself (`decode_openai`, `openai_reply`, `OpenAIStream`). The other two wires build on this
# file: wires/anthropic.py (Anthropic messages) and wires/responses.py (OpenAI Responses); it imports neither.
# Canonical form (what ChatSession, the chat template and the tool-call parser speak): OpenAI-style dicts,
# content a string (text parts joined; the template concatenates them anyway) or a part list when it holds
# images ({"type": "image", "image": url}), tool-call arguments as the decoded JSON object. An assistant
# message is built in exactly the shape the tool-call parser returns, so an echoed reply compares equal and
# the session can tell an append from an edit. A reply that opens with <think>...</think> goes out signed with the
# exact sampled text (Anthropic's thinking block, the Responses reasoning item); echoed, it decodes back to that
# text, so the echo still extends the record.
# Every field changes sampling only through `SamplingParams` (recorded per token by the engine, so the trainer
# recomputes the distribution each token was drawn from: invariant 3) or through `TurnOptions` (tool use and the
# chat template's switches, which change the prompt the ledger records); a no-op changes neither, and a reply asked
# for it (`return_token_ids`) lists the no-ops it got and the sampling that was enforced.
# Refuses at the boundary what would fail later, where it could hurt others: JSON nested past MAX_JSON_DEPTH,
# lone surrogates, integers Python will not convert, sampling values the fp32 sampler cannot honour
# (engines.validate_sampling), images and parts in the wrong shape; a field in neither table (it might change what
# is sampled, and a guess would train on a distribution nobody recorded).
# Keeps invariant 1 at the edge: every wire decodes to the same canonical request, so token accounting does
# not depend on the wire; nothing here encodes text into ids. A reply's usage names the prompt tokens the engine
# took from its prefix cache (Generation.cached_prompt_tokens) as each wire does: OpenAI's cached_tokens, within
# prompt_tokens. Never: holds state, generates, or records.
from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from engines import Generation, IncrementalText, SamplingParams, find_stop, validate_sampling
from engines import constraints
from invariants import MAX_ABS_LOGIT_BIAS, Sampling
from wires.params import NO_OP, OPENAI_FIELDS, REFUSED


@dataclass
class BudgetCut:
    """What a rollout's budget (session.Budget) did to a request: the most its reply could sample, below what the
    request asked (0: the budget was spent, and nothing was sampled), and what the budget had left for it. A reply's
    usage carries it as `rollout_budget` (`budget_usage`)."""
    max_tokens: int
    turns_left: int
    tokens_left: int
    message: str                   # the same, in words naming the budget


@dataclass
class ChatTurn:
    """What a chat session's turn hands to the wire: the reply as the agent reads it, and the tokens behind it."""
    message: dict                  # the assistant message (structured tool calls parsed), canonical form
    generation: Generation         # ids, behavior logprobs, versions and routes, exactly as sampled
    extended: bool                 # the ledger's answer: False when this request's prompt sealed the segment (or
                                   # was the first turn), True when it extended the record bitwise (an MoE turn at a
                                   # new version then still seals: seal reason route_version)
    stop_sequence: str | None = None   # the agent's stop string that ended the reply (cut from it), or None
    text: str = ""                 # the reply as the agent reads it, before its tool calls were parsed out
    call_prefix: str = ""          # its calls' ids are this prefix and each <tool_call> block's ordinal
    budget: BudgetCut | None = None    # what the rollout's budget enforced on it; None: nothing


# ---- refusals, and the request body --------------------------------------------------------------

class WireError(Exception):
    """A refused request: its HTTP status, the error type, a message saying what was wrong and, on OpenAI-shaped
    wires, the machine-readable code and the request field at fault (`param`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def body(self, wire: str) -> dict:
        """The error in the wire's own format (what the SDKs parse into their exception classes)."""
        if wire == "anthropic":
            return {"type": "error", "error": {"type": self.kind, "message": str(self)}}
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class ContextLengthExceeded(WireError):
    """A prompt over the session's context (session.ContextOverflow), in the words each wire's harnesses compact on:
    OpenAI's code context_length_exceeded (Codex), Anthropic's "prompt is too long: N tokens > M maximum" (Claude
    Code). `param`: the request field that holds the prompt (messages; the Responses API's input). M is the longest
    prompt the context serves: a reply needs one position at least."""

    def __init__(self, prompt_tokens: int, context: int, detail: str, param: str):
        super().__init__(400, f"This model's maximum context length is {context} tokens. However, your {param} "
                              f"resulted in {prompt_tokens} tokens: {detail}", code="context_length_exceeded",
                         param=param)
        self.prompt_tokens, self.context = prompt_tokens, context

    def body(self, wire: str) -> dict:
        if wire == "anthropic":
            too_long = f"prompt is too long: {self.prompt_tokens} tokens > {self.context - 1} maximum"
            return {"type": "error", "error": {"type": self.kind, "message": too_long}}
        return super().body(wire)


@dataclass(frozen=True)
class TextBound:
    """The most text a prompt may hold, known before anything is rendered or encoded: no token spans more than
    `token_chars` characters (data.longest_token_chars), so more than context * token_chars characters is more than
    the context's tokens. A session's (session.ChatSession.text_bound); the wires refuse with it what a request's
    references would expand to, before building it."""
    context: int                   # the session's context, in tokens
    token_chars: int               # characters in the tokenizer's longest vocabulary entry

    @property
    def chars(self) -> int:
        return self.context * self.token_chars

    def refuse_over(self, chars: int, what: str, param: str) -> None:
        """ContextLengthExceeded (in each wire's own words) when `chars` characters cannot fit the context."""
        if chars > self.chars:
            raise ContextLengthExceeded(-(-chars // self.token_chars), self.context,
                                        f"{what} come to {chars} characters of text, more than a context of "
                                        f"{self.context} tokens can hold (at most {self.chars}); send fewer or "
                                        f"shorter ones", param)


def text_chars(value) -> int:
    """Characters in every string of a JSON-like value, keys included (the wires bound its depth)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(k) + text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


def require(condition: bool, message: str) -> None:
    if not condition:
        raise WireError(400, message)


MAX_JSON_DEPTH = 64        # deeper is refused: copying, rendering and re-serializing a value recurse once per level
_SURROGATE = re.compile("[\ud800-\udfff]")


# A value's separator or opening outside a string (',', ':' after a key, '[', '{'), or a whole string, skipped: its
# commas are text. A body holds at most one value more than it has separators and openings.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[,:\[{]')


def max_json_values(context: int) -> int:
    """The most JSON values (keys included) a request body may hold for a session of `context` tokens. Every value
    of a request that fits the context is rendered into its prompt at a token or more (a message, a part, a tool
    schema's key), so 8 a token, and 65,536 for what is not rendered (sampling fields, deferred tools, a logit bias),
    is several times what one needs; json.loads builds each value at about 100 bytes, so a 32 MiB body of 16 M
    values would build 1.7 GB."""
    return 8 * context + 2**16


def too_many_values(raw: bytes, limit: int) -> bool:
    """Whether `raw` holds more than `limit` JSON values, read before json.loads builds any: a count of separators and
    openings at memchr speed (an upper bound: it counts those inside strings too), then, only past the limit, one
    regular-expression pass that skips strings and stops at the limit (its cost is bounded by the body's bytes and
    the limit, and it allocates nothing that grows with the body)."""
    if sum(map(raw.count, (b",", b":", b"[", b"{"))) <= limit:
        return False
    found = 0
    for token in _JSON_TOKEN.finditer(raw):
        found += token.end() - token.start() == 1          # a string is 2 bytes or more
        if found > limit:
            return True
    return False


def parse_body(raw: bytes, max_values: int) -> dict:
    """A request body -> its JSON object, or a WireError saying why not: more than `max_values` JSON values (checked
    before any is built: max_json_values), invalid JSON or UTF-8, an integer of more than 4,300 digits (Python
    refuses to convert it), nesting deeper than MAX_JSON_DEPTH, a lone surrogate escape (\\ud800: no character, and
    no tokenizer can encode it). CPU-bound for a large body: call it off an event loop."""
    require(not too_many_values(raw, max_values),
            f"the request body holds more than {max_values:,} JSON values (keys included), more than any request "
            f"within this session's context needs; send fewer messages, parts or tool fields")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:     # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError(400, f"the request body is not valid JSON ({str(error)[:200]}); send a JSON object") from None
    require(isinstance(body, dict), f"the request body must be a JSON object, got {type(body).__name__}")
    check_json(body, "the request body")
    return body


def check_json(value, where: str) -> None:
    """Refuse a JSON value nested deeper than MAX_JSON_DEPTH or holding a lone surrogate (iterative: any depth)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str) and (bad := _SURROGATE.search(item)):
            raise WireError(400, f"{where} holds a lone surrogate (U+{ord(bad.group()):04X}), which is no character; "
                                 f"send valid Unicode text")
        if isinstance(item, (dict, list)):
            require(depth < MAX_JSON_DEPTH, f"{where} is nested deeper than {MAX_JSON_DEPTH} levels; flatten it")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


# ---- fields: each one honoured, a documented no-op, or refused (wires/params.py's tables) ----------------

def check_fields(body: dict, fields: dict[str, tuple[str, str]]) -> tuple[str, ...]:
    """Refuse a key in no row and a refused field that is set; returns the no-op fields the body holds."""
    unknown = sorted(set(body) - set(fields))
    require(not unknown, f"unsupported parameter(s) {unknown}: this server decides every field it takes, and these "
                         f"are none of them; it takes {sorted(fields)} (docs/wire-params.md says what each does)")
    for key in sorted(body):
        disposition, reason = fields[key]
        require(disposition != REFUSED or body[key] is None, f"'{key}' is refused: {reason}")
    return tuple(sorted(key for key in body if fields[key][0] == NO_OP))


def refuse_unknown_keys(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    require(not unknown, f"unsupported parameter(s) {unknown}; this server honours {sorted(allowed)}")


# ---- decoding: the canonical request, and what every wire decodes with --------------------------------

@dataclass
class TurnOptions:
    """What a request asks of its turn besides the sampling: how tools may be used, and the chat template's switches.
    Part of a request's identity (a retry must match it); the switches are part of the extension check (the record
    is rendered with them)."""
    tool_choice: str = "auto"      # "auto" | "none" (no call parsed, a one-token '<tool_call>' banned) | "required"
                                   # (a call to some tool) | "named" (a call to tool_name): the last two force the
                                   # opening '<tool_call>\n' as context and carry the tools' grammar in the sampling
    tool_name: str | None = None
    parallel_tool_calls: bool = True   # False: sampling ends at the first '</tool_call>'
    template_kwargs: dict = field(default_factory=dict)   # the template's switches, e.g. {"enable_thinking": False}
    deferred_tools: list[dict] = field(default_factory=list)   # Anthropic defer_loading tools: offered, not rendered
                                   # (a tool_reference writes one's definition where it names it); callable like any
    thread: str = ""               # the sub-agent a harness names on the request ("": the conversation it started
                                   # with; loopback.client_thread): a request joins only a line of its own thread


@dataclass
class WireRequest:
    messages: list[dict]           # canonical messages
    tools: list[dict] | None       # OpenAI function schemas, as the template renders them
    sampling: SamplingParams       # the session's defaults overridden by the request
    stream: bool
    logprobs: bool = False         # OpenAI: return the behavior logprob of each sampled token
    return_token_ids: bool = False  # extension: return the token ids, the recorded sampling and the no-ops
    options: TurnOptions = field(default_factory=TurnOptions)
    include_usage: bool = False    # OpenAI stream_options.include_usage: a last chunk with the usage
    no_ops: tuple[str, ...] = ()   # the no-op fields the request held
    omit_thinking: bool = False    # Anthropic thinking.display 'omitted': thoughts go back empty (signature kept)
    prompt_field: str = "messages"     # the field holding the prompt, named when the prompt overflows the context
    context_management: bool = False   # Anthropic: the request set it, so the reply says which edits applied (none)


def arguments_from_json(text: str):
    """OpenAI carries tool arguments as a JSON string, the template and parser the object; non-JSON stays text."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError):
        return text
    check_json(arguments, "a tool call's 'arguments'")
    return arguments


def arguments_to_json(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def function_call_record(call_id, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(content, tool_calls: list[dict]) -> dict:
    if tool_calls:
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    return {"role": "assistant", "content": content or ""}


def function_tool(spec: dict, where: str, schema: str = "parameters") -> dict:
    """A declared tool (its name, description, parameter schema under `schema` and strict) as the template renders it
    and constraints.tool_call_spec reads it (strict: a forced call's arguments follow the schema strictly)."""
    name, parameters, strict = spec.get("name"), spec.get(schema), spec.get("strict")
    require(isinstance(name, str) and name, f"{where} needs a string 'name'")
    require(strict is None or isinstance(strict, bool), f"{where}: 'strict' must be true or false")
    require(parameters is None or isinstance(parameters, dict), f"{where}: the parameter schema must be a JSON object")
    function = {"name": name, "description": spec.get("description"), "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def join_parts(parts: list[dict]) -> str | list[dict]:
    return "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts


def text_only(content, where: str) -> str:
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


def real_field(body: dict, key: str) -> float | None:
    value = number_field(body, key)
    return None if value is None else float(value)


def flag_field(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    require(isinstance(value, bool) or value is None, f"'{key}' must be true or false, got {value!r:.40}")
    return default if value is None else value


def object_field(body: dict, key: str) -> dict:
    value = body.get(key)
    require(value is None or isinstance(value, dict), f"'{key}' must be an object, got {value!r:.60}")
    return value or {}


def stop_strings_field(value, key: str) -> tuple[str, ...] | None:
    """OpenAI `stop` (a string or a list) or Anthropic `stop_sequences` (a list) -> a tuple of stop strings."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    require(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
            f"'{key}' must be a non-empty string or a list of them, got {value!r:.60}")
    return tuple(stops)


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"<token id>": bias} -> (id, bias) pairs sorted by id (the sampler bounds the bias and the ids)."""
    if value is None:
        return None
    require(isinstance(value, dict) and all(isinstance(k, str) and re.fullmatch(r"[0-9]{1,10}", k) for k in value),
            f"'logit_bias' must map token ids (decimal strings, as {{\"1234\": -100}}) to numbers, got {value!r:.80}")
    biases = {}
    for key, bias in value.items():
        require(isinstance(bias, (int, float)) and not isinstance(bias, bool) and abs(bias) <= MAX_ABS_LOGIT_BIAS,
                f"'logit_bias' values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] (-100 all "
                f"but bans a token), got {bias!r:.40} for token {key}")
        biases[int(key)] = float(bias)
    return tuple(sorted(biases.items()))


def constraint_spec(make, *args) -> str:
    """A engines/constraints.py spec, its ValueError (what is wrong, what is accepted) a 400."""
    try:
        return make(*args)
    except ValueError as error:
        raise WireError(400, str(error)) from None


def sampling_from(base: SamplingParams, body: dict, **overrides) -> SamplingParams:
    """The base overridden by what the request set: the sampling fields every wire shares (wires/params.py's _SHARED
    rows), read from `body`, and the wire's own `overrides`; temperature 0 is greedy decoding, recorded as what it
    is: top_k 1, the point mass (temperature and top_p cannot change it, so they are recorded as off)."""
    shared = dict(temperature=number_field(body, "temperature"), top_p=number_field(body, "top_p"),
                  top_k=number_field(body, "top_k", integer=True), min_p=real_field(body, "min_p"),
                  repetition_penalty=real_field(body, "repetition_penalty"))
    overrides = {k: v for k, v in {**shared, **overrides}.items() if v is not None}
    if overrides.get("temperature") == 0:
        overrides.update(temperature=1.0, top_p=1.0, top_k=1)
    params = replace(base, **overrides)
    try:
        validate_sampling(params)
    except ValueError as error:
        raise WireError(400, str(error)) from None
    # in range, so an integer temperature or top_p converts exactly as the sampler will use it
    return replace(params, temperature=float(params.temperature), top_p=float(params.top_p))


def template_kwargs_of(body: dict, enable_thinking: bool | None, extra: dict) -> dict:
    """chat_template_kwargs, with the thinking switch a wire field asked for (a contradiction is refused)."""
    kwargs = object_field(body, "chat_template_kwargs")
    require(all(isinstance(k, str) and k.isidentifier() for k in kwargs)
            and all(v is None or isinstance(v, (bool, int, float, str)) for v in kwargs.values()),
            "'chat_template_kwargs' must map names to true/false, numbers, strings or null, got "
            f"{kwargs!r:.80}")
    if enable_thinking is not None:
        asked = kwargs.get("enable_thinking", enable_thinking)
        require(asked == enable_thinking, f"chat_template_kwargs.enable_thinking={asked} contradicts the request's "
                                          f"thinking setting (enable_thinking={enable_thinking}); send one of them")
        kwargs = {"enable_thinking": enable_thinking, **extra, **kwargs}
    return kwargs


def tool_options_of(mode: str, name: str | None, tools: list[dict] | None, parallel: bool, kwargs: dict,
                  deferred: list[dict] | None = None) -> tuple[TurnOptions, str | None]:
    """The turn options and, for a forced call, the grammar of a call to any tool offered, deferred ones included (the
    text after the forced '<tool_call>\\n'; no tools, or a name that is none of theirs, is refused by
    constraints.tool_call_spec saying so)."""
    offered = (tools or []) + (deferred or [])
    forced = constraint_spec(constraints.tool_call_spec, offered, name) if mode in ("required", "named") else None
    return TurnOptions(mode, name, parallel, kwargs, deferred or []), forced


# ---- decoding: an OpenAI chat.completions request -> the canonical request ----------------------------

OPENAI_TOOL_CHOICE = ("'auto', 'none', 'required' or {'type': 'function', 'function': {'name': <a tool's name>}} "
                      "(for allowed_tools, send only the allowed tools in 'tools')")


def tool_choice_of(choice, function: dict | None, accepted: str) -> tuple[str, str | None]:
    """An OpenAI wire's tool_choice -> (mode, name): 'auto' (or unset), 'none', 'required', or a named function
    ({'type': 'function'} whose `function` object, the choice itself on the Responses wire, holds the name)."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto", None
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
    require(named and isinstance(function.get("name"), str), f"tool_choice must be {accepted}, got {choice!r:.80}")
    return "named", function["name"]


def response_format_kind(value) -> str | None:
    """OpenAI response_format -> the grammar spec its reply is masked by (None: unconstrained text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return constraints.json_object_spec()
    schema = value.get("json_schema") if kind == "json_schema" else None
    require(isinstance(schema, dict) and isinstance(schema.get("schema", {}), dict)
            and isinstance(schema.get("strict", False), (bool, type(None))),
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            f"'json_schema': {{'name', 'schema': <a JSON schema>, 'strict': bool}}}}, got {value!r:.80}")
    return constraint_spec(constraints.json_schema_spec, schema.get("schema", {}), bool(schema.get("strict")))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort_kwargs(body: dict, effort, where: str) -> dict:
    """A reasoning effort's template switches: 'none' turns thinking off, another on (the template reads it too)."""
    require(effort is None or effort in REASONING_EFFORTS,
            f"{where} must be one of {list(REASONING_EFFORTS)}, got {effort!r:.40}")
    return template_kwargs_of(body, None if effort is None else effort != "none",
                              {} if effort is None else {"reasoning_effort": effort})


def _openai_content(content, where: str):
    if content is None or isinstance(content, str):
        return content
    require(isinstance(content, list), f"{where}.content must be a string, null or a list of parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance(part.get("image_url"), dict) \
                and isinstance(url := part["image_url"].get("url"), str):
            parts.append({"type": "image", "image": url})
        else:
            raise WireError(400, f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} or "
                                 f"{{'type': 'image_url', 'image_url': {{'url': str}}}}, got {part!r:.80}")
    return join_parts(parts)


def _openai_message(message, where: str) -> dict:
    require(isinstance(message, dict), f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    content = _openai_content(message.get("content"), where)
    if role in ("system", "developer"):
        return {"role": "system", "content": text_only(content, f"{where}.content")}
    if role == "user":
        return {"role": "user", "content": content if content is not None else ""}
    if role == "tool":          # a tool result's images reach a VLM in the tool turn, as its template renders them
        require(content is not None, f"{where}.content must be a string or a list of text and image_url parts")
        return {"role": "tool", "content": content, "tool_call_id": message.get("tool_call_id")}
    require(role == "assistant", f"{where}.role must be system, developer, user, assistant or tool, got {role!r:.40}"
                                 + ("; 'function' messages go with the deprecated 'functions': send tool messages"
                                    if role == "function" else ""))
    calls = message.get("tool_calls") or []
    require(isinstance(calls, list), f"{where}.tool_calls must be a list")
    canonical = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        require(isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str),
                f"{where}.tool_calls[{i}] must be {{'id', 'type': 'function', 'function': {{'name': str, "
                f"'arguments': a JSON string}}}}")
        canonical.append(function_call_record(call.get("id"), function["name"],
                                              arguments_from_json(function["arguments"])))
    return assistant_message(text_only(content or "", f"{where}.content"), canonical)


def _openai_tools(tools) -> list[dict]:
    require(tools is None or isinstance(tools, list), "'tools' must be a list of {type: function, function} objects")
    canonical = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        require(isinstance(function, dict), f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}: "
                                            f"declare a function tool (custom tools are served on the Responses wire)")
        canonical.append(function_tool(function, f"tools[{i}].function"))
    return canonical


def decode_openai(body: dict, base: SamplingParams) -> WireRequest:
    """An OpenAI chat.completions request -> the canonical request; anything it cannot honour is a WireError."""
    no_ops = check_fields(body, OPENAI_FIELDS)
    require(body.get("n") in (None, 1), f"n must be 1 (got {body.get('n')!r:.20}): {OPENAI_FIELDS['n'][1]}")
    require(body.get("modalities") in (None, ["text"]), f"'modalities' must be ['text']: this server writes text, "
                                                        f"not audio; got {body.get('modalities')!r:.60}")
    stream_options = object_field(body, "stream_options")
    require(set(stream_options) <= {"include_usage", "include_obfuscation"}, "'stream_options' takes include_usage "
                                                                             "and include_obfuscation")
    top_logprobs = number_field(body, "top_logprobs", integer=True)
    require(top_logprobs in (None, 0) or body.get("logprobs") is True,
            "'top_logprobs' needs 'logprobs': true (as on the OpenAI API)")
    messages = body.get("messages")
    require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    tools = _openai_tools(body.get("tools")) or None
    kwargs = effort_kwargs(body, body.get("reasoning_effort"), "'reasoning_effort'")
    choice = body.get("tool_choice")
    mode, name = tool_choice_of(choice, choice.get("function") if isinstance(choice, dict) else None,
                                OPENAI_TOOL_CHOICE)
    options, forced = tool_options_of(mode, name, tools, flag_field(body, "parallel_tool_calls", True), kwargs)
    max_tokens = number_field(body, "max_completion_tokens", integer=True)
    max_tokens = number_field(body, "max_tokens", integer=True) if max_tokens is None else max_tokens
    sampling = sampling_from(base, body, max_tokens=max_tokens, seed=number_field(body, "seed", integer=True),
                             stop=stop_strings_field(body.get("stop"), "stop"), top_logprobs=top_logprobs,
                             logit_bias=_logit_bias(body.get("logit_bias")),
                             frequency_penalty=real_field(body, "frequency_penalty"),
                             presence_penalty=real_field(body, "presence_penalty"),
                             constraint=forced or response_format_kind(body.get("response_format")))
    return WireRequest([_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)], tools, sampling,
                       flag_field(body, "stream"), flag_field(body, "logprobs"), flag_field(body, "return_token_ids"),
                       options, flag_field(stream_options, "include_usage"), no_ops)


# ---- thinking: a reply's opening <think>...</think>, signed as it was sampled -------------------------
# The signature (Anthropic's thinking block, wires/anthropic.py; the Responses reasoning item's encrypted_content,
# wires/responses.py) carries the exact text that was sampled (the tags and the whitespace after them included), so
# an echo decodes to the reply as it was written, byte for byte, and extends the record.

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SIGNATURE = "tracerl-think:"


def split_thinking(content: str) -> tuple[str, str, str] | None:
    """A reply that opens with a thought -> (its opening as sampled: the tags, the thought and the whitespace after
    them; the thought; the rest), or None. A thought never closed (max_tokens) is the whole reply."""
    if not content.startswith(THINK_OPEN):
        return None
    end = content.find(THINK_CLOSE, len(THINK_OPEN))
    if end < 0:
        return content, content[len(THINK_OPEN):], ""
    rest = content[end + len(THINK_CLOSE):].lstrip()
    return content[:len(content) - len(rest)], content[len(THINK_OPEN):end], rest


def opening_signature(opening: str) -> str:
    return _SIGNATURE + base64.b64encode(opening.encode()).decode()


def signed_opening(sealed) -> str | None:
    """The opening one of our signatures carries (a whole thought as sampled), or None for any other value."""
    if not (isinstance(sealed, str) and sealed.startswith(_SIGNATURE)):
        return None
    try:
        opening = base64.b64decode(sealed[len(_SIGNATURE):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    split = split_thinking(opening)
    return opening if split is not None and split[2] == "" else None


# ---- tool calls: read structure out of the sampled text, never write it back ------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPENING, CALL_CLOSING = "<tool_call>\n", "</tool_call>"    # a forced call's opening; where one call ends


def _reply_json(text: str, where: str):
    """`text` as a JSON value a reply can be answered with (one that re-serializes), or None when it is not."""
    try:
        value = json.loads(text)
        check_json(value, where)
    except (ValueError, RecursionError, WireError):
        return None
    return value


def _call_arguments(call: dict) -> dict | None:
    """A call's arguments as an object: absent means {}; a JSON string holding an object (the way the OpenAI
    wire carries them, and how some models write them) is that object; anything else is not a call."""
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _reply_json(arguments, "a tool call's arguments")
    return arguments if isinstance(arguments, dict) else None


def tool_call_blocks(text: str) -> Iterator[tuple[int, re.Match, dict | None]]:
    """Each `<tool_call>...</tool_call>` block of a reply in order: its ordinal, its match, and its call {"name",
    "arguments"}, or None when it is not one (not valid JSON with a string name and object arguments)."""
    for ordinal, match in enumerate(TOOL_CALL.finditer(text)):
        call = _reply_json(match.group(1), "a tool call")
        arguments = _call_arguments(call) if isinstance(call, dict) and isinstance(call.get("name"), str) else None
        yield ordinal, match, None if arguments is None else {"name": call["name"], "arguments": arguments}


def parse_hermes_tool_calls(text: str, call_prefix: str) -> dict:
    """Hermes/Qwen style: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an
    OpenAI-shaped tool call, its id the prefix and the block's ordinal (a streaming wire names a call by it before
    the block is whole). A block that is not valid JSON with a string name and object arguments stays in
    the content as text: the model's error is shown to the agent, never repaired. The token record is not
    touched."""
    calls, kept = [], []
    last = 0
    for ordinal, match, call in tool_call_blocks(text):
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"{call_prefix}-{ordinal}", "type": "function", "function": call})
    if not calls:       # the reply is returned byte for byte, so an echo of it extends the record
        return {"role": "assistant", "content": text}
    kept.append(text[last:])
    # only trailing whitespace goes (the template writes its own separator before a call); the start is kept
    content = "".join(kept).rstrip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


# ---- encoding: a ChatTurn -> an OpenAI chat completion, whole or streamed; what every reply shares ----

OPENAI_FINISH = {"stop": "stop", "stop_string": "stop", "length": "length", "tool": "tool_calls"}


def wire_finish_reason(turn: ChatTurn, names: dict[str, str]) -> str:
    gen = turn.generation
    if turn.message.get("tool_calls") and gen.finish_reason == "stop":
        return names["tool"]
    return names["stop_string" if turn.stop_sequence is not None else gen.finish_reason]


def _openai_tool_calls(message: dict) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": arguments_to_json(c["function"]["arguments"])}}
            for c in message.get("tool_calls") or []]


def openai_logprobs(tokenizer, gen: Generation) -> dict:
    """Each sampled token's behavior logprob (the distribution it was drawn from), with the top alternatives that
    distribution could draw: one a ban, a grammar, top-k or greedy decoding removed has logprob -inf, which JSON
    cannot carry and no client should read as a choice, so it is left out (fewer than top_logprobs remain)."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    tops = gen.top_logprobs or [[] for _ in gen.token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top if math.isfinite(v)]}
                        for t, lp, top in zip(gen.token_ids, gen.behavior_logprobs, tops)]}


def sampling_json(sampling: Sampling) -> dict:
    """A token's recorded sampling as JSON (a ban's -inf bias as the string "-inf": JSON has no infinities)."""
    record = asdict(sampling)
    record["logit_bias"] = [[t, b if math.isfinite(b) else str(b)] for t, b in sampling.logit_bias]
    return record


def token_extras(turn: ChatTurn, request: WireRequest) -> dict:
    """What `return_token_ids` asks for: the ids, the sampling every sampled token was drawn with (what the server
    enforced: greedy, a grammar, a ban), and the no-op fields the request held."""
    if not request.return_token_ids:
        return {}
    gen = turn.generation
    return {"prompt_token_ids": gen.prompt_ids, "token_ids": gen.token_ids, "sampling": sampling_json(gen.sampling),
            "no_op_params": list(request.no_ops)}


def budget_usage(turn: ChatTurn) -> dict:
    """What every wire's usage adds when the rollout's budget enforced something on the reply (an SDK keeps a usage
    field it does not know: `usage.model_extra["rollout_budget"]`)."""
    return {} if turn.budget is None else {"rollout_budget": asdict(turn.budget)}


def _openai_usage(turn: ChatTurn) -> dict:
    """OpenAI counts cached prompt tokens inside prompt_tokens, and names them apart in prompt_tokens_details."""
    gen = turn.generation
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.token_ids),
            "total_tokens": len(gen.prompt_ids) + len(gen.token_ids),
            "prompt_tokens_details": {"cached_tokens": gen.cached_prompt_tokens}, **budget_usage(turn)}



def openai_reply(turn: ChatTurn, request: WireRequest, tokenizer, model: str, reply_id: str) -> dict:
    message = {"role": "assistant", "content": turn.message["content"]}
    if turn.message.get("tool_calls"):
        message["tool_calls"] = _openai_tool_calls(turn.message)
    choice = {"index": 0, "message": message,
              "finish_reason": wire_finish_reason(turn, OPENAI_FINISH),
              "logprobs": openai_logprobs(tokenizer, turn.generation) if request.logprobs else None}
    return {"id": reply_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _openai_usage(turn), **token_extras(turn, request)}


# Streaming sends each token's text as it is sampled, but only text the final message is sure to begin
# with: never past a stop string (or the start of one), never into a `<tool_call>` (or what may become
# one: the call is parsed into structure when the reply is done), never trailing whitespace (a reply with
# tool calls drops it). The finished turn then sends the rest, the tool calls and the finish reason, so
# the streamed text always equals the non-streamed reply. A reply the server opened ('<tool_call>\n' for a
# forced call) is read with its opening, so nothing of a forced call is sent as text.

def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`. Called once per sampled
    token, so only the prefixes that end in text's last character are compared (a 1,000-character stop string
    costs a few comparisons per token, not a thousand)."""
    best = 0
    for marker in markers:
        k = min(len(marker) - 1, len(text))
        while k > best:
            k = marker.rfind(text[-1], 0, k) + 1          # the longest prefix up to k ending in text[-1]
            if k > best and text.endswith(marker[:k]):
                best = k
                break
            k -= 1
    return best


class LiveText:
    """The part of a reply, as it is sampled, that can be sent now (see above)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], opening: str = ""):
        self.decoded, self.stops, self.opening, self.sent = IncrementalText(tokenizer), stops, opening, ""

    def settled(self) -> str:
        """The reply so far that no stop string can cut: its opening and the text before the stop that ended it, or
        before what may begin one (so it only grows)."""
        text = self.decoded.text
        hit = find_stop(text, self.stops) if self.stops else None
        return self.opening + text[:hit[0] if hit else len(text) - partial_suffix(text, self.stops)]

    def push(self, token_id: int) -> str:
        """Add a sampled id; returns the newly sendable text ('' when it must wait)."""
        self.decoded.push(token_id)
        safe = self.settled()
        call = safe.find("<tool_call>")
        safe = (safe[:call] if call >= 0 else safe[:len(safe) - partial_suffix(safe, ("<tool_call>",))]).rstrip()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece

    def rest(self, content: str | None) -> str:
        """What the finished reply's content adds to the text already sent."""
        return (content or "")[len(self.sent):]


class LiveStream:
    """What loopback's streaming drives: each sampled id goes through the turn's LiveText (what text can be sent),
    the stream turns what it may send into events; a failure after the first event is one event of the wire's."""

    def push(self, live: LiveText, token_id: int, call_prefix: str) -> list:
        piece = live.push(token_id)
        return self.text(piece) if piece else []

    def failure(self, error: WireError) -> list:
        return [("error", error.body(self.wire))]


class OpenAIStream(LiveStream):
    """chat.completion.chunk events: the role, content deltas as tokens arrive, then the rest of the content,
    one delta per tool call, and the finish chunk (token ids / logprobs when asked; the usage, or with
    stream_options.include_usage a last chunk with the usage and no choices)."""
    wire, done_marker = "openai", True

    def __init__(self, request: WireRequest, tokenizer, model: str, reply_id: str):
        self.request, self.tokenizer, self.model, self.reply_id = request, tokenizer, model, reply_id

    def _chunk(self, delta: dict | None, finish_reason=None, logprobs=None, **extra) -> tuple[None, dict]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                             "logprobs": logprobs}]
        usage = {"usage": None} if self.request.include_usage else {}
        return None, {"id": self.reply_id, "object": "chat.completion.chunk", "created": int(time.time()),
                      "model": self.model, "choices": choices, **usage, **extra}

    def start(self, prompt_ids: list[int]) -> list:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list:
        return [self._chunk({"content": piece})]

    def finish(self, turn: ChatTurn, rest: str) -> list:
        events = self.text(rest) if rest else []
        events += [self._chunk({"tool_calls": [{"index": i, **call}]})
                   for i, call in enumerate(_openai_tool_calls(turn.message))]
        logprobs = openai_logprobs(self.tokenizer, turn.generation) if self.request.logprobs else None
        usage = {"usage": _openai_usage(turn)}       # in a last chunk of its own when include_usage asks for one
        last = [self._chunk(None, **usage)] if self.request.include_usage else []
        return events + [self._chunk({}, wire_finish_reason(turn, OPENAI_FINISH), logprobs, **({} if last else usage),
                                     **token_extras(turn, self.request))] + last
