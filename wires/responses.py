# wires/responses.py — the OpenAI Responses wire (POST /v1/responses), to and from the canonical chat turn.
#
# Owns: decoding a Responses request (every field as wire_params.RESPONSES_FIELDS decides) into the canonical request
# the chat and Anthropic wires decode to (`wires.WireRequest`), so token accounting does not depend on the wire;
# laying a finished `wires.ChatTurn` out as Responses output items and encoding it as a `Response`, whole or as the
# server-sent events the SDKs and Codex parse (`ResponsesStream`); the responses a session stores for
# previous_response_id and item_reference (`ResponseStore`).
# Layout: a reply is read from its text as sampled (`ChatTurn.text`) and the parser's message. A reply that opens with
# <think>...</think> is a reasoning item whose encrypted_content carries the opening exactly as sampled (the Anthropic
# wire's thinking signature), then a message item with the text before the first tool call, then one function_call
# item per <tool_call> block (a custom tool's call with one string `input`: a custom_tool_call item, its input that
# string, sent whole once its block has closed), then a message with any text after the calls. Echoed back as input
# items, consecutive assistant output items (reasoning, messages, calls) merge into one canonical assistant message,
# exactly the shape wires.parse_hermes_tool_calls returned (text concatenated, calls with their ids), so the echo
# compares equal and extends the record (invariant 1). A reasoning item's opening holds the whitespace after </think>
# only when text follows it (before a call the parser drops it: the reply's text is then the message's, whitespace
# first).
# Streaming sends text, thoughts and call arguments as their tokens are sampled, but only what the finished reply is
# sure to hold: a call's item opens once its block shows `{"name": "...", "arguments": {`, its arguments then stream as
# the raw sampled JSON (never past the object's closing brace, nor into what may be '</tool_call>'), and that raw text
# is the call's `arguments` (it decodes to the parser's object). A block that opened an item and then does not parse
# (bad JSON, cut by max_output_tokens or a stop string) ends as a function_call item of status 'incomplete': its text
# stays in the message, as the parser kept it, and an echoed incomplete call is dropped. With logprobs asked for, a
# message item stays open to the end (its logprobs are the whole reply's), so calls after it are sent at the end.
# Hosted tools: retrieval (web_search, file_search, tool_search) is dropped from the prompt and listed in the
# response's `dropped_tools` (Codex sends web_search by default and runs unchanged without it); the rest is refused.
# Never: generates, records, or encodes text into ids.
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import wires
from engines import IncrementalText, SamplingParams
from wires.params import RESPONSES_FIELDS
from wires import (THINK_CLOSE, THINK_OPEN, ChatTurn, TextBound, WireError, WireRequest, arguments_from_json,
                   assistant_message, check_fields, flag_field, function_call_record, function_tool, join_parts,
                   number_field, object_field, opening_signature, partial_suffix, require,
                   response_format_kind, sampling_from, signed_opening, split_thinking, text_chars,
                   text_only, token_extras, tool_options_of)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


# ---- the responses a session stores: previous_response_id and item_reference ---------------------------

MAX_STORED_RESPONSES = 16      # per session; the oldest is forgotten first


@dataclass
class StoredResponse:
    messages: list[dict]           # the conversation after it: its input (instructions left out) and its reply
    items: dict[str, dict]         # its output items by id (what an item_reference names)


class ResponseStore:
    """A session's last MAX_STORED_RESPONSES stored responses (used on the server's event loop only)."""

    def __init__(self):
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def conversation(self, response_id) -> list[dict]:
        require(isinstance(response_id, str) and response_id in self._responses,
                f"previous_response_id {response_id!r:.60} is no response this session stored (it keeps its last "
                f"{MAX_STORED_RESPONSES} made with store not false); send the conversation's items in 'input'")
        return self._responses[response_id].messages

    def item(self, item_id) -> dict | None:
        return next((stored.items[item_id] for stored in reversed(self._responses.values()) if item_id in stored.items),
                    None)

    def remember(self, response_id: str, request: ResponsesRequest, turn: ChatTurn, output: list[dict]) -> None:
        if not request.store:
            return
        history = request.history
        if self._responses:          # an echo of the last stored conversation shares its messages (and images)
            last = next(reversed(self._responses.values())).messages
            if history[:len(last)] == last:
                history = last + history[len(last):]
        self._responses[response_id] = StoredResponse([*history, turn.message], {item["id"]: item for item in output})
        while len(self._responses) > MAX_STORED_RESPONSES:
            self._responses.popitem(last=False)


# ---- decoding: a Responses request -> the canonical request --------------------------------------------

@dataclass
class ResponsesRequest:
    """The canonical request, and what the Responses wire needs besides to answer it."""
    request: WireRequest
    body: dict                     # the request as sent (a Response echoes its settings)
    history: list[dict]            # the canonical messages without the instructions (what a stored response keeps)
    namespaces: dict[str, str] = field(default_factory=dict)   # a namespaced function's name -> its namespace
    custom: frozenset[str] = frozenset()                        # the custom (free-form text) tools' names
    dropped_tools: list[str] = field(default_factory=list)     # hosted tools left out of the prompt
    store: bool = True


DROPPED_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                 "file_search", "tool_search")
REFUSED_TOOLS = {
    "code_interpreter": "it would run code on OpenAI's servers", "image_generation": "this model writes text",
    "mcp": "this server reaches no MCP server", "programmatic_tool_calling": "no program runs tools here",
    **{kind: f"the client runs it through {items} items" for kind, items in [
        ("computer", "computer_call"), ("computer_use_preview", "computer_call"), ("local_shell", "local_shell_call"),
        ("shell", "shell_call"), ("apply_patch", "apply_patch_call")]}}
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
# A custom tool (free-form text in, as Codex's apply_patch) is offered to the template as a function of one string
# parameter, `input`; a call to it that the parser reads with exactly that argument is a custom_tool_call item whose
# input is that string (the JSON string the model sampled, decoded), and an echoed one is that call again. A grammar
# format is refused: an automatic call is parsed as written, never masked, so no grammar could hold its input.
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                "additionalProperties": False}


def _tools(tools) -> tuple[list[dict], dict[str, str], list[str], frozenset[str]]:
    """(function schemas as the template renders them, namespaced name -> namespace, dropped tools, custom tools)."""
    require(tools is None or isinstance(tools, list), "'tools' must be a list of tool objects")
    canonical, namespaces, dropped, custom = [], {}, [], set()
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            canonical.append(function_tool(tool, f"tools[{i}]"))
        elif kind == "custom":
            require(tool.get("format") in (None, {"type": "text"}),
                    f"tools[{i}] (custom): the format {tool.get('format')!r:.60} is refused (the model writes the "
                    f"input as a JSON string, parsed as written, never masked: no grammar can hold it); send format "
                    f"{{'type': 'text'}} and check the input in the agent, or a function tool with a JSON schema")
            # offered as a function of one string `input` (CUSTOM_INPUT), never strict
            canonical.append(function_tool({**tool, "parameters": CUSTOM_INPUT, "strict": None}, f"tools[{i}]"))
            custom.add(tool["name"])
        elif kind == "namespace":
            require(isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list),
                    f"tools[{i}] (namespace) needs a string 'name' and a list of 'tools'")
            for j, function in enumerate(tool["tools"]):
                require(isinstance(function, dict) and function.get("type") == "function",
                        f"tools[{i}].tools[{j}] must be a function tool")
                canonical.append(function_tool(function, f"tools[{i}].tools[{j}]"))
                namespaces[function["name"]] = tool["name"]
        elif kind in DROPPED_TOOLS:
            dropped.append(kind)
        else:
            require(False, f"tools[{i}] is a {kind!r:.40} tool, which is not served here"
                           + (f" ({REFUSED_TOOLS[kind]})" if kind in REFUSED_TOOLS else "")
                           + ": declare a function tool {'type': 'function', 'name', 'parameters'} and run it in the "
                             "agent")
    names = [t["function"]["name"] for t in canonical]
    clash = sorted({n for n in names if names.count(n) > 1})
    require(not clash, f"tools: {clash} name more than one function (a namespace's functions are offered under their "
                       f"own names); rename one")
    return canonical, namespaces, dropped, frozenset(custom)


TOOL_CHOICE = ("'auto', 'none', 'required' or {'type': 'function', 'name': <a tool's name>} (for allowed_tools, "
               "send only the allowed tools in 'tools'; choices of hosted, MCP, custom, shell and apply_patch tools "
               "are not served)")


def _text_format(text: dict) -> str | None:
    """text.format -> the grammar its reply is masked by (the chat wire's response_format, in the Responses shape)."""
    require(set(text) <= {"format", "verbosity"}, f"'text' takes format and verbosity, got {sorted(text)}")
    form = text.get("format")
    if isinstance(form, dict) and form.get("type") == "json_schema":
        require(set(form) <= {"type", "name", "schema", "description", "strict"},
                f"text.format (json_schema) takes name, schema, description and strict, got {sorted(form)}")
        form = {"type": "json_schema", "json_schema": {k: form[k] for k in ("name", "schema", "strict") if k in form}}
    require(form is None or isinstance(form, dict) and form.get("type") in ("text", "json_object", "json_schema"),
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'name', "
            f"'schema': <a JSON schema>, 'strict': bool}}, got {form!r:.80}")
    return response_format_kind(form)


def _parts(content, where: str, role: str):
    """A message's content (a string or parts) -> canonical content: text, or parts when it holds images."""
    if isinstance(content, str):
        return content
    require(isinstance(content, list), f"{where}.content must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        kind, at = part.get("type") if isinstance(part, dict) else None, f"{where}.content[{i}]"
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and role in ("user", "tool") and isinstance(part.get("image_url"), str):
            parts.append({"type": "image", "image": part["image_url"]})
        else:
            why = {"input_image": "an image goes in a user message or a function_call_output, as 'image_url' (a "
                                  "URL or data URL; a file_id names an upload this server does not have)",
                   "input_file": "no file is read here: extract its text and send that",
                   "input_audio": "this model reads text and images, not audio"}.get(kind, "")
            raise WireError(400, f"{at}: a {role} message takes input_text, output_text and refusal parts"
                                 f"{' and input_image' if role in ('user', 'tool') else ''}, got {part!r:.80}"
                                 + (f"; {why}" if why else ""))
    return join_parts(parts)


def _reasoning_text(item: dict, where: str) -> str:
    """An echoed reasoning item -> the text the reply opened with: our encrypted_content's opening as sampled, unless
    its reasoning_text was edited (then the edit, as <think>...</think>); without one, its reasoning_text (or summary)
    as <think>...</think>, which equals the sampled text only if no whitespace followed the thought."""
    sealed = item.get("encrypted_content")
    opening = signed_opening(sealed)
    require(sealed is None or opening is not None,
            f"{where}: this reasoning item's encrypted_content was not written by this server (another model's "
            f"encrypted reasoning, which this model cannot read); leave the item out")
    texts = [[p.get("text") for p in item.get(key) or [] if isinstance(p, dict)] for key in ("content", "summary")]
    require(all(isinstance(t, str) for t in texts[0] + texts[1]),
            f"{where}: reasoning content and summary parts need a string 'text'")
    shown = "".join(texts[0])
    if opening is not None and shown in ("", split_thinking(opening)[1]):
        return opening
    thought = shown or "".join(texts[1])
    return f"{THINK_OPEN}{thought}{THINK_CLOSE}" if thought or opening is not None else ""


def _input_messages(items, store: ResponseStore) -> list[dict]:
    """Input items -> canonical messages. Consecutive assistant output items (messages, reasoning, function calls)
    are one assistant message; a call's `namespace` is left out (its function is offered under its own name)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    require(isinstance(items, list), "'input' must be a string or a list of input items")
    out, texts, calls, turn_open = [], [], [], False
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, dict) and item.get("type") == "item_reference":
            referenced = store.item(item.get("id"))
            require(referenced is not None, f"{where}: item_reference {item.get('id')!r:.60} names no output item of "
                                            f"a response this session stored; send the item itself")
            item = referenced
        require(isinstance(item, dict), f"{where} must be an input item object")
        kind, role = item.get("type", "message"), item.get("role")
        if kind in ("reasoning", "function_call", "custom_tool_call") or (kind == "message" and role == "assistant"):
            turn_open = True
            if kind == "reasoning":
                texts.append(_reasoning_text(item, where))
            elif kind in ("function_call", "custom_tool_call"):       # arguments: a JSON string; input: the text
                key = "arguments" if kind == "function_call" else "input"
                require(all(isinstance(item.get(k), str) for k in ("call_id", "name", key)),
                        f"{where} ({kind}) needs a string 'call_id', 'name' and '{key}'")
                if item.get("status") != "incomplete":      # a block that never became a call: its text is a message's
                    calls.append(function_call_record(item["call_id"], item["name"], {"input": item["input"]}
                                                      if key == "input" else arguments_from_json(item["arguments"])))
            else:
                texts.append(text_only(_parts(item.get("content"), where, "assistant"), f"{where}.content"))
            continue
        if turn_open:
            out.append(assistant_message("".join(texts), calls))
            texts, calls, turn_open = [], [], False
        if kind == "message":
            require(role in ("user", "system", "developer"),
                    f"{where}.role must be user, system, developer or assistant, got {role!r:.40}")
            content = _parts(item.get("content"), where, role)
            out.append({"role": "user", "content": content} if role == "user" else
                       {"role": "system", "content": text_only(content, f"{where}.content")})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            require(isinstance(item.get("call_id"), str), f"{where} ({kind}) needs a string 'call_id'")
            out.append({"role": "tool", "content": _parts(item.get("output"), f"{where}.output", "tool"),
                        "tool_call_id": item["call_id"]})
        else:
            require(False, f"{where}: a {kind!r:.40} item is not served here (nor any other items of hosted, MCP, "
                           f"shell and other tools this server does not run); send message, function_call, "
                           f"function_call_output, custom_tool_call, custom_tool_call_output, reasoning or "
                           f"item_reference items")
    if turn_open:
        out.append(assistant_message("".join(texts), calls))
    return out


def _referenced_chars(items, store: ResponseStore) -> int:
    """The characters the item_reference items will expand to: each named stored item's text, once per reference,
    read from the request's structure before anything is built."""
    return sum(text_chars(store.item(item.get("id")) if isinstance(item.get("id"), str) else None)
               for item in (items if isinstance(items, list) else [])
               if isinstance(item, dict) and item.get("type") == "item_reference")


def decode_responses(body: dict, base: SamplingParams, store: ResponseStore,
                     bound: TextBound | None = None) -> ResponsesRequest:
    """A Responses create request -> the canonical request; anything it cannot honour is a WireError. `bound` (the
    session's): item references that would expand past the text a context holds are refused before they are (a few
    bytes of reference to a long stored reply would otherwise build hundreds of MB)."""
    no_ops = check_fields(body, RESPONSES_FIELDS)
    require(body.get("background") in (None, False),
            f"'background': true is refused: {RESPONSES_FIELDS['background'][1]}")
    require(body.get("truncation") in (None, "disabled"),
            f"truncation must be 'disabled': {RESPONSES_FIELDS['truncation'][1]}, got {body.get('truncation')!r:.20}")
    include = body.get("include") or []
    require(isinstance(include, list) and all(value in INCLUDABLE for value in include),
            f"'include' must be a list of {list(INCLUDABLE)}, got {include!r:.80}")
    require(set(object_field(body, "stream_options")) <= {"include_obfuscation"}, "'stream_options' takes "
                                                                             "include_obfuscation")
    number_field(body, "max_tool_calls", integer=True)
    instructions = body.get("instructions")
    require(instructions is None or isinstance(instructions, str), "'instructions' must be a string")
    if bound is not None:
        bound.refuse_over(_referenced_chars(body.get("input"), store), "the stored items the item_reference items "
                                                                       "name", "input")
    previous = body.get("previous_response_id")
    history = ([] if previous is None else list(store.conversation(previous))) + \
        _input_messages(body.get("input", []), store)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    require(bool(messages), "'input' must hold at least one item (or name a previous_response_id)")
    tools, namespaces, dropped, custom = _tools(body.get("tools"))
    reasoning = object_field(body, "reasoning")
    require(set(reasoning) <= {"effort", "summary", "generate_summary", "context", "mode"},
            f"'reasoning' takes effort, summary, generate_summary, context and mode, got {sorted(reasoning)}")
    kwargs = wires.effort_kwargs(body, reasoning.get("effort"), "reasoning.effort")
    choice = body.get("tool_choice")
    mode, name = wires.tool_choice_of(choice, choice, TOOL_CHOICE)
    options, forced = tool_options_of(mode, name, tools or None, flag_field(body, "parallel_tool_calls", True), kwargs)
    sampling = sampling_from(base, body, max_tokens=number_field(body, "max_output_tokens", integer=True),
                             top_logprobs=number_field(body, "top_logprobs", integer=True),
                             constraint=forced or _text_format(object_field(body, "text")))
    request = WireRequest(messages, tools or None, sampling, flag_field(body, "stream"),
                          "message.output_text.logprobs" in include, flag_field(body, "return_token_ids"), options,
                          no_ops=no_ops, prompt_field="input")
    return ResponsesRequest(request, body, history, namespaces, custom, dropped, flag_field(body, "store", True))


# ---- layout: a reply's text -> its output items -------------------------------------------------------
# One function lays out a finished reply (the parser's message given) and the reply so far while it streams (only
# what the finished reply is sure to hold, open items marked so), so the items a stream builds are the whole reply's.

_HEAD = re.compile(r'<tool_call>[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,'
                   r'[ \t\n\r]*"arguments"[ \t\n\r]*:[ \t\n\r]*(?=\{)')


# each item kind's streamed events (response.<stem>.delta and .done), the field its .done names the whole text by,
# and its id's prefix
_STREAMED = {"message": ("output_text", "text", "msg"), "reasoning": ("reasoning_text", "text", "rs"),
             "function_call": ("function_call_arguments", "arguments", "fc"),
             "custom_tool_call": ("custom_tool_call_input", "input", "ctc")}


@dataclass
class Item:
    kind: str                      # "reasoning" | "message" | "function_call" | "custom_tool_call"
    text: str                      # what streams: the thought, the message's text, the call's arguments or input
    closed: bool
    opening: str = ""              # reasoning: the reply's opening as sampled (its encrypted_content)
    name: str = ""                 # function_call: the function, its call id, completed or incomplete
    call_id: str = ""
    status: str = "completed"


def _head(text: str, at: int, close: int) -> str | None:
    """The function a <tool_call> block at `at` names before its arguments object opens, or None."""
    match = _HEAD.match(text, at)
    if match is None or 0 <= close < match.end():
        return None
    try:
        return json.loads(match.group(1))             # a JSON string literal (the pattern's quotes): a str
    except ValueError:
        return None


def _object_end(text: str, start: int, limit: int) -> int | None:
    """Where the JSON object opening at text[start] ends (after its '}'), if it does before `limit`."""
    depth, in_string, escaped = 0, False, False
    for at in range(start, limit):
        char = text[at]
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
    return None


def _custom_call(call: dict, call_id: str, custom: frozenset[str]) -> Item | None:
    """A parsed call as a custom_tool_call item: a custom tool's, with exactly one string argument `input`."""
    name, arguments = call["name"], call["arguments"]
    if name in custom and list(arguments) == ["input"] and isinstance(arguments["input"], str):
        return Item("custom_tool_call", arguments["input"], True, name=name, call_id=call_id)
    return None


def _call_item(text: str, at: int, blocks: dict, call_prefix: str, final: bool, live: bool,
               custom: frozenset[str]) -> Item | None:
    """The function_call (or custom_tool_call) item of the <tool_call> block at `at`, or None when it is text. A
    function's block whose head is shown (live) is an item from then on: completed if it parses, else incomplete;
    another (a custom tool's: its input is JSON-decoded) is an item only once it has closed and parses."""
    close = text.find(CALL_CLOSE, at + len(CALL_OPEN))
    ordinal, call = blocks.get(at, (len(blocks), None))
    call_id = f"{call_prefix}-{ordinal}"
    name = _head(text, at, close)
    if name is not None and live and name not in custom:
        start = _HEAD.match(text, at).end()
        limit = close if close >= 0 else len(text) if final else len(text) - partial_suffix(text, (CALL_CLOSE,))
        end = _object_end(text, start, limit)
        status = "completed" if close >= 0 and call is not None else "incomplete"
        return Item("function_call", text[start:end or limit], close >= 0 or final, name=name, call_id=call_id,
                    status=status)
    if close < 0 or call is None:
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    if name is not None and (end := _object_end(text, _HEAD.match(text, at).end(), close)) is not None:
        raw = text[_HEAD.match(text, at).end():end]       # the object as sampled, when it is the parser's
        arguments = raw if arguments_from_json(raw) == call["arguments"] else arguments
    return _custom_call(call, call_id, custom) or Item("function_call", arguments, True, name=call["name"],
                                                       call_id=call_id)


def layout(text: str, calls_parsed: bool, call_prefix: str, message: dict | None = None,
           hold_messages: bool = False, custom: frozenset[str] = frozenset()) -> list[Item]:
    """A reply's output items: the finished reply's when `message` (the parser's) is given, else what the reply so
    far (`text`: the settled text, session.reply_text's prefix) is sure to begin with. calls_parsed: False under
    tool_choice none (no call is parsed). hold_messages: keep a message open until the end (logprobs). custom: the
    custom tools' names."""
    final = message is not None
    content = (message or {}).get("content") or ""
    if not final and len(text) < len(THINK_OPEN) and THINK_OPEN.startswith(text):
        return []                                       # it may still open a thought
    markers = (THINK_CLOSE, CALL_OPEN) if calls_parsed else (THINK_CLOSE,)
    items, start = [], 0
    if text.startswith(THINK_OPEN):
        end = text.find(THINK_CLOSE, len(THINK_OPEN))
        region = text[len(THINK_OPEN):end if end >= 0 else len(text)]
        inner = region.find(CALL_OPEN) if calls_parsed else -1
        if inner >= 0:                                  # a call inside the thought: laid out from the parsed message
            return _parsed_layout(message, custom) if final else [Item("reasoning", region[:inner], False)]
        if end < 0:                                     # the thought goes on (or max_output_tokens cut it)
            thought = region if final else region[:len(region) - partial_suffix(region, markers)]
            return [Item("reasoning", thought, final, opening=text if final else "")]
        after = text[end + len(THINK_CLOSE):].lstrip()
        if not final and (not after or calls_parsed and len(after) < len(CALL_OPEN) and CALL_OPEN.startswith(after)):
            return [Item("reasoning", region, False)]   # the whitespace after it may go on, or come before a call
        start = end + len(THINK_CLOSE) if calls_parsed and after.startswith(CALL_OPEN) else len(text) - len(after)
        items.append(Item("reasoning", region, True, opening=text[:start]))
    blocks = {m.start(): (ordinal, call) for ordinal, m, call in wires.tool_call_blocks(text)} if calls_parsed else {}
    # the text before the first block that is a call item (text blocks before it are the message's)
    at, first, pending = start, -1, -1
    while calls_parsed and (at := text.find(CALL_OPEN, at)) >= 0:
        if _call_item(text, at, blocks, call_prefix, final, True, custom) is not None:
            first = at
            break
        close = text.find(CALL_CLOSE, at + len(CALL_OPEN))
        if close < 0:                                   # an open block: it may still show a head (or it is text)
            pending = at
            break
        at = close + len(CALL_CLOSE)
    if first < 0:
        if final:
            shown = content[start:]
            return items + [Item("message", shown, True)] if shown or not items else items
        shown = text[start:pending if pending >= 0 else len(text)]
        shown = shown[:len(shown) - (partial_suffix(shown, (CALL_OPEN,)) if calls_parsed else 0)].rstrip()
        return items + ([Item("message", shown, False)] if shown else [])
    before = text[start:first].rstrip()
    if before:
        items.append(Item("message", before, final or not hold_messages))
        if not items[-1].closed:
            return items
    # the run of calls from there, one block after another (whitespace between), streamed as they are sampled
    at, live = first, True
    while at >= 0:
        item = _call_item(text, at, blocks, call_prefix, final, live, custom)
        if item is not None:
            items.append(item)
        close = text.find(CALL_CLOSE, at + len(CALL_OPEN))
        if close < 0 or (item is None and not final) or (item is not None and not item.closed):
            break
        following = text[close + len(CALL_CLOSE):]
        live = live and item is not None and following.lstrip().startswith(CALL_OPEN)
        if not final and not live:
            break
        at = text.find(CALL_OPEN, close + len(CALL_CLOSE))
    if final:
        after_calls = content[start + len(before):]
        items += [Item("message", after_calls, True)] if after_calls else []
    return items


def _parsed_layout(message: dict, custom: frozenset[str]) -> list[Item]:
    """A reply with a call inside its thought: its thought, text and calls as the parser left them."""
    opening, thought, rest = split_thinking(message["content"] or "")
    return [Item("reasoning", thought, True, opening=opening)] + ([Item("message", rest, True)] if rest else []) + \
        [_custom_call(c["function"], c["id"], custom) or
         Item("function_call", json.dumps(c["function"]["arguments"], ensure_ascii=False), True,
              name=c["function"]["name"], call_id=c["id"]) for c in message.get("tool_calls") or []]


# ---- encoding: the output items, the Response, and its events ------------------------------------------

def _item_id(kind: str, reply_id: str, index: int) -> str:
    return f"{_STREAMED[kind][2]}_{reply_id[5:]}_{index}"


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _output_item(item: Item, index: int, reply_id: str, namespaces: dict[str, str], done: bool,
                 logprobs: list | None = None) -> dict:
    """The item as the Response lists it (done) or as output_item.added opens it (empty, in progress)."""
    head = {"id": _item_id(item.kind, reply_id, index), "type": item.kind}
    status = item.status if done else "in_progress"
    if item.kind == "reasoning":
        return {**head, "summary": [], "content": [{"type": "reasoning_text", "text": item.text}] if done else [],
                "encrypted_content": opening_signature(item.opening) if done else None, "status": status}
    if item.kind == "message":
        return {**head, "role": "assistant", "status": status,
                "content": [_text_part(item.text, logprobs)] if done else []}
    namespace = {"namespace": namespaces[item.name]} if item.name in namespaces else {}
    return {**head, "call_id": item.call_id, "name": item.name, **namespace,
            "input" if item.kind == "custom_tool_call" else "arguments": item.text if done else "", "status": status}


def _reasoning_tokens(tokenizer, turn: ChatTurn) -> int:
    """How many of the reply's sampled tokens wrote its opening thought (through '</think>')."""
    if not turn.text.startswith(THINK_OPEN):
        return 0
    decoded, searched = IncrementalText(tokenizer), 0
    for count, token_id in enumerate(turn.generation.token_ids, 1):
        decoded.push(token_id)
        if decoded.text.find(THINK_CLOSE, searched) >= 0:
            return count
        searched = max(0, len(decoded.text) - len(THINK_CLOSE))
    return len(turn.generation.token_ids)


def _response(request: ResponsesRequest, reply_id: str, model: str, created: float, status: str,
              output: list[dict], **extra) -> dict:
    """A Response object: its output and status, and the request's settings as it was served."""
    wire, body = request.request, request.body
    return {"id": reply_id, "object": "response", "created_at": created, "status": status, "background": False,
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": body.get("max_tool_calls"),
            "metadata": body.get("metadata") or {}, "model": model, "output": output,
            "parallel_tool_calls": wire.options.parallel_tool_calls,
            "previous_response_id": body.get("previous_response_id"),
            "prompt_cache_key": body.get("prompt_cache_key"), "reasoning": body.get("reasoning"),
            "safety_identifier": body.get("safety_identifier"), "service_tier": "default", "store": request.store,
            "temperature": body.get("temperature", wire.sampling.temperature),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_logprobs": body.get("top_logprobs") or 0, "top_p": body.get("top_p", wire.sampling.top_p),
            "truncation": "disabled", "usage": None, "user": body.get("user"),
            **({"dropped_tools": request.dropped_tools} if request.dropped_tools else {}), **extra}


def responses_reply(turn: ChatTurn, request: ResponsesRequest, tokenizer, model: str, reply_id: str,
                    created: float | None = None) -> dict:
    """The finished turn as a Response (usage in the Responses shape; token ids when asked)."""
    items = layout(turn.text, request.request.options.tool_choice != "none", turn.call_prefix, turn.message,
                   custom=request.custom)
    logprobs = wires.openai_logprobs(tokenizer, turn.generation)["content"] if request.request.logprobs else None
    first_message = next((i for i, item in enumerate(items) if item.kind == "message"), None)
    output = [_output_item(item, i, reply_id, request.namespaces, True, logprobs if i == first_message else None)
              for i, item in enumerate(items)]
    gen = turn.generation
    cut = gen.finish_reason == "length"
    usage = {"input_tokens": len(gen.prompt_ids), "input_tokens_details": {"cached_tokens": gen.cached_prompt_tokens, "cache_write_tokens": 0},
             "output_tokens": len(gen.token_ids),
             "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(tokenizer, turn)},
             "total_tokens": len(gen.prompt_ids) + len(gen.token_ids), **wires.budget_usage(turn)}
    return _response(request, reply_id, model, time.time() if created is None else created,
                     "incomplete" if cut else "completed", output, usage=usage, completed_at=time.time(),
                     incomplete_details={"reason": "max_output_tokens"} if cut else None,
                     **token_extras(turn, request.request))


class ResponsesStream(wires.LiveStream):
    """response.created and response.in_progress; then each output item as the layout above grows it:
    output_item.added, content_part.added (a message's output_text, a reasoning item's reasoning_text), the deltas
    (output_text, reasoning_text, function_call_arguments; a custom tool call's input, whole, as custom_tool_call_input)
    as tokens arrive, their .done events and output_item.done;
    response.completed (response.incomplete when max_output_tokens cut the reply) with the whole Response. A failure
    after the first event is response.failed. Every event carries an increasing sequence_number."""
    wire, done_marker = "openai", False

    def __init__(self, request: ResponsesRequest, tokenizer, model: str, reply_id: str, store: ResponseStore):
        self.request, self.tokenizer, self.model, self.reply_id, self.store = request, tokenizer, model, reply_id, store
        self.created, self.sequence = time.time(), 0
        self.calls_parsed = request.request.options.tool_choice != "none"
        self.sent: list[Item] = []     # each item as sent so far: its text, whether it is done

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, **fields, "sequence_number": self.sequence - 1}

    def start(self, prompt_ids: list[int]) -> list:
        response = _response(self.request, self.reply_id, self.model, self.created, "in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def push(self, live: wires.LiveText, token_id: int, call_prefix: str) -> list:
        live.push(token_id)
        return self._events(layout(live.settled(), self.calls_parsed, call_prefix,
                                   hold_messages=self.request.request.logprobs, custom=self.request.custom), None)

    def _events(self, items: list[Item], output: list[dict] | None) -> list:
        """The events that take the items sent so far to `items` (done ones as `output` lists them, at the end)."""
        events, namespaces = [], self.request.namespaces
        for index, item in enumerate(items):
            item_id, (stem, key, _) = _item_id(item.kind, self.reply_id, index), _STREAMED[item.kind]
            where = {"item_id": item_id, "output_index": index, **({"content_index": 0} if key == "text" else {})}
            if index == len(self.sent):
                events.append(self._event("response.output_item.added", output_index=index,
                                          item=_output_item(item, index, self.reply_id, namespaces, False)))
                if key == "text":
                    part = _text_part("", None) if item.kind == "message" else {"type": "reasoning_text", "text": ""}
                    events.append(self._event("response.content_part.added", **where, part=part))
                self.sent.append(Item(item.kind, "", False, name=item.name, call_id=item.call_id))
            sent = self.sent[index]
            if (sent.kind, sent.name, sent.call_id) != (item.kind, item.name, item.call_id) \
                    or not item.text.startswith(sent.text):
                raise RuntimeError(f"output item {index} was streamed as a {sent.kind} the finished reply does not "
                                   f"hold (a {item.kind}): the layout's partial and final views disagree")
            if len(item.text) > len(sent.text):
                events.append(self._event(f"response.{stem}.delta", **where, delta=item.text[len(sent.text):],
                                          **({"logprobs": []} if item.kind == "message" else {})))
                sent.text = item.text
            if item.closed and not sent.closed:
                done = output[index] if output is not None else \
                    _output_item(item, index, self.reply_id, namespaces, True)
                extra = {"logprobs": done["content"][0]["logprobs"]} if item.kind == "message" else \
                    {"name": item.name} if item.kind == "function_call" else {}
                events.append(self._event(f"response.{stem}.done", **where, **{key: item.text}, **extra))
                if key == "text":
                    events.append(self._event("response.content_part.done", **where, part=done["content"][0]))
                events.append(self._event("response.output_item.done", output_index=index, item=done))
                sent.closed = True
        if output is not None and len(items) != len(self.sent):
            raise RuntimeError(f"{len(self.sent)} output items were streamed, the finished reply holds {len(items)}")
        return events

    def finish(self, turn: ChatTurn, rest: str) -> list:
        reply = responses_reply(turn, self.request, self.tokenizer, self.model, self.reply_id, self.created)
        items = layout(turn.text, self.calls_parsed, turn.call_prefix, turn.message, custom=self.request.custom)
        events = self._events(items, reply["output"])
        self.store.remember(self.reply_id, self.request, turn, reply["output"])
        kind = "response.completed" if reply["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=reply)]

    def failure(self, error: WireError) -> list:
        failed = _response(self.request, self.reply_id, self.model, self.created, "failed", [],
                           error={"code": "server_error", "message": str(error)})
        return [self._event("response.failed", response=failed)]
