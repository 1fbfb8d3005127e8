# wires/anthropic.py — the Anthropic messages wire (POST /v1/messages, and count_tokens), to and from the canonical
# chat turn.
#
# Owns: decoding an Anthropic messages request (every field as wire_params.ANTHROPIC_FIELDS decides; count_tokens's
# as ANTHROPIC_COUNT_FIELDS) into the canonical request the chat and Responses wires decode to (`wires.WireRequest`),
# so token accounting does not depend on the wire: the system text, user turns with images and documents, tool_result
# blocks (text, images, tool references) as tool messages, client tools, tool_choice, thinking and output_config;
# encoding a finished `wires.ChatTurn` as a message, whole (`anthropic_reply`) or as the server-sent events the SDKs
# and Claude Code parse (`AnthropicStream`), its usage naming the prompt tokens the engine took from its prefix cache
# as Anthropic does (cache_read_input_tokens, apart from input_tokens).
# Thinking: a reply that opens with <think>...</think> is a thinking block, whose signature carries the opening exactly
# as sampled (wires.split_thinking, wires.opening_signature: the Responses wire's reasoning item carries the same),
# and a text block. Echoed, they decode back to that text byte for byte, so the echo extends the record (invariant
# 1); a thought the agent edited is rendered as edited (the session then sees an edit and seals), and a
# redacted_thinking block this server did not sign is refused (no model here can read another's encrypted thought).
# Tools: a deferred tool (defer_loading) is offered but not rendered (TurnOptions.deferred_tools), and enters the
# context where a tool_reference names it, so the rendered tools (and the record) stay the same when a harness's tool
# search finds one; a server tool cannot run here and is refused (a server-side tool search is dropped).
# Errors are Anthropic's shape (wires.WireError.body), a prompt over the context Claude Code's "prompt is too long".
# Never: holds state past one reply, generates, records, or encodes text into ids. wires/__init__.py holds what the wires share
# and never imports this file.
from __future__ import annotations

import json

from engines import SamplingParams
from engines import constraints
from wires.params import ANTHROPIC_COUNT_FIELDS, ANTHROPIC_FIELDS
from wires import (THINK_CLOSE, THINK_OPEN, ChatTurn, LiveStream, TextBound, WireError, WireRequest,
                   arguments_to_json, assistant_message, budget_usage, check_fields, constraint_spec, flag_field,
                   function_call_record, function_tool, join_parts, number_field, object_field, opening_signature,
                   partial_suffix, require, sampling_from, signed_opening, split_thinking,
                   stop_strings_field, template_kwargs_of, text_only, token_extras, tool_options_of, wire_finish_reason)


# ---- decoding: an Anthropic messages request -> the canonical request ---------------------------------

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


def _anthropic_document(block: dict, where: str) -> list[dict]:
    """A document block as the parts the model reads: its title, context and text (a content source's images stay
    images), then a blank line. A PDF or a file has no text here to read, so it is refused."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    require(kind in ("text", "content"),
            f"{where}: a document's source must be plain text {{'type': 'text', 'media_type': 'text/plain', 'data': "
            f"str}} or content {{'type': 'content', 'content': [text or image blocks]}}; a {kind!r:.20} source (a "
            f"PDF or a file) has no text this server can read: extract its text and send that")
    head = "".join(f"{block[k]}\n\n" for k in ("title", "context") if isinstance(block.get(k), str) and block[k])
    if kind == "text":
        require(isinstance(source.get("data"), str), f"{where}.source.data must be the document's text")
        body = [{"type": "text", "text": source["data"]}]
    else:
        content = source.get("content")
        content = [{"type": "text", "text": content}] if isinstance(content, str) else content
        require(isinstance(content, list) and all(isinstance(b, dict) for b in content),
                f"{where}.source.content must be a string or a list of text and image blocks")
        body = [_anthropic_image(b, f"{where}.source.content[{i}]") if b.get("type") == "image"
                else {"type": "text", "text": _anthropic_text([b], f"{where}.source.content[{i}]")}
                for i, b in enumerate(content)]
    return [{"type": "text", "text": head}, *body, {"type": "text", "text": "\n\n"}]


def _tool_definition(tool: dict) -> str:
    """A referenced tool as the model reads it where the reference stands: one <function> line of its description, name
    and parameters (the encoding Claude Code's ToolSearch describes to the model)."""
    function = tool["function"]
    return "<function>" + json.dumps({"description": function.get("description", ""), "name": function["name"],
                                      "parameters": function.get("parameters", {})}, ensure_ascii=False) + "</function>"


def _tool_result_content(content, tools: dict[str, dict], where: str):
    """A tool_result's content as canonical content: its text and image blocks, and each run of tool_reference blocks
    (a harness's tool search found these deferred tools) as one <functions> block of those tools' definitions."""
    if content is None or isinstance(content, str):
        return content or ""
    require(isinstance(content, list), f"{where} must be a string or a list of text, image and tool_reference blocks")
    parts, references = [], []
    for j, block in enumerate([*content, None]):
        if isinstance(block, dict) and block.get("type") == "tool_reference":
            name = block.get("tool_name")
            require(isinstance(name, str) and name in tools,
                    f"{where}[{j}] references the tool {name!r:.60}, which is not in 'tools'; send its definition "
                    f"there (defer_loading true keeps it out of the prompt until a tool_reference names it)")
            references.append(_tool_definition(tools[name]))
            continue
        if references:
            parts.append({"type": "text", "text": "<functions>\n" + "\n".join(references) + "\n</functions>"})
            references = []
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append(_anthropic_image(block, f"{where}[{j}]"))
        elif block is not None:
            parts.append({"type": "text", "text": _anthropic_text([block], f"{where}[{j}]")})
    return join_parts(parts)


def _thought_text(block: dict, where: str) -> str:
    """An echoed thinking or redacted_thinking block -> the text the reply opened with."""
    opening = signed_opening(block.get("signature" if block["type"] == "thinking" else "data"))
    if block["type"] == "redacted_thinking":
        require(opening is not None, f"{where}: this redacted_thinking block's data was not written by this server "
                                     f"(another model's encrypted thought, which this model cannot read); leave the "
                                     f"block out")
        return opening
    thought = block.get("thinking")
    require(isinstance(thought, str), f"{where} (thinking) needs a string 'thinking' and its 'signature'")
    if opening is not None and thought in ("", split_thinking(opening)[1]):   # "": omitted (display 'omitted')
        return opening
    return f"{THINK_OPEN}{thought}{THINK_CLOSE}"


def _anthropic_messages(message, where: str, tools: dict[str, dict]) -> list[dict]:
    """One Anthropic message -> canonical messages (a user turn's tool_result blocks become tool messages; `tools`,
    every tool offered by name, is what a tool_reference in a result may name)."""
    require(isinstance(message, dict) and message.get("role") in ("user", "assistant", "system"),
            f"{where} must be an object with role 'user', 'assistant' or 'system' and content")
    role, content = message["role"], message.get("content")
    if role == "system":
        return [{"role": "system", "content": _anthropic_text(content, f"{where}.content")}]
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
        elif kind == "document" and role == "user":
            parts += _anthropic_document(block, at)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            parts.append({"type": "text", "text": _thought_text(block, at)})
        elif kind == "tool_use" and role == "assistant":
            require(isinstance(block.get("name"), str) and isinstance(block.get("input"), dict),
                    f"{at} (tool_use) needs 'id', a string 'name' and an object 'input'")
            calls.append(function_call_record(block.get("id"), block["name"], block["input"]))
        elif kind == "tool_result" and role == "user":
            if parts:               # keep the order: text before a tool result is its own user turn
                out.append({"role": "user", "content": join_parts(parts)})
                parts = []
            out.append({"role": "tool", "content": _tool_result_content(block.get("content"), tools, f"{at}.content"),
                        "tool_call_id": block.get("tool_use_id")})
        else:
            takes = "text, image, document and tool_result" if role == "user" else \
                "text, thinking, redacted_thinking and tool_use"
            raise WireError(400, f"{at}: a {role} message takes {takes} blocks (server tools' blocks are not "
                                 f"served), got {block!r:.80}")
    if role == "assistant":
        return [assistant_message(text_only(join_parts(parts), f"{where}.content"), calls)]
    return out + ([{"role": "user", "content": join_parts(parts)}] if parts or not out else [])


TOOL_SEARCH_TYPES = ("tool_search_tool_bm25", "tool_search_tool_regex")   # server-side tool search (any date suffix)


def _is_tool_search(tool) -> bool:
    return isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"].startswith(TOOL_SEARCH_TYPES)


def _anthropic_tools(tools) -> tuple[list[dict], list[dict]]:
    """(the tools the template renders, the deferred ones). A deferred tool (defer_loading) stays out of the rendered
    list, as on Anthropic's API, and enters the context where a tool_reference names it, so the rendered list (and the
    record) stays the same when a harness adds a tool its search found. A server-side tool search cannot run here and
    is dropped; with one, nothing could ever name a deferred tool, so they are rendered like any."""
    require(tools is None or isinstance(tools, list), "'tools' must be a list of {name, description, input_schema}")
    searched = any(_is_tool_search(tool) for tool in tools or [])
    rendered, deferred = [], []
    for i, tool in enumerate(tools or []):
        if _is_tool_search(tool):
            continue
        require(isinstance(tool, dict), f"tools[{i}] must be an object {{name, description, input_schema}}")
        require(tool.get("type") in (None, "custom"),
                f"tools[{i}] is the server tool {tool.get('type')!r:.40}, which runs on Anthropic's servers and not "
                f"here; declare a client tool {{'name', 'description', 'input_schema'}} and run it in the agent")
        require(isinstance(tool.get("defer_loading", False), bool), f"tools[{i}].defer_loading must be true or false")
        canonical = function_tool(tool, f"tools[{i}]", "input_schema")
        (deferred if tool.get("defer_loading") and not searched else rendered).append(canonical)
    return rendered, deferred


def _anthropic_tool_choice(choice) -> tuple[str, str | None, bool]:
    """(mode, name, parallel) from {'type': auto | any | tool | none, 'name', 'disable_parallel_tool_use'}."""
    if choice is None:
        return "auto", None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}.get(kind)
    require(mode is not None and (mode != "named" or isinstance(choice.get("name"), str))
            and isinstance(choice.get("disable_parallel_tool_use", False), bool),
            "tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': <a tool's name>} or "
            f"{{'type': 'none'}} (with 'disable_parallel_tool_use': bool), got {choice!r:.80}")
    return mode, choice.get("name"), not choice.get("disable_parallel_tool_use", False)


def _anthropic_thinking(value) -> tuple[bool | None, bool]:
    """(enable_thinking, omit the thoughts from the reply) from `thinking`."""
    if value is None:
        return None, False
    given = value if isinstance(value, dict) else {}
    kind, budget, display = given.get("type"), given.get("budget_tokens"), given.get("display")
    require(kind in ("enabled", "adaptive", "between_tools", "disabled")
            and display in (None, "summarized", "omitted", "updates")
            and (kind != "enabled" or (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1)),
            "thinking must be {'type': 'enabled', 'budget_tokens': int >= 1}, {'type': 'adaptive'}, {'type': "
            f"'between_tools'}} or {{'type': 'disabled'}} (display 'summarized', 'omitted' or 'updates'), got "
            f"{value!r:.80}")
    return kind != "disabled", display == "omitted"


def _output_format(config: dict) -> str | None:
    """Anthropic output_config -> the grammar of its format (None: unconstrained); effort is a no-op."""
    require(set(config) <= {"effort", "format"}, f"'output_config' takes effort and format, got {sorted(config)}")
    form = config.get("format")
    if form is None:
        return None
    require(isinstance(form, dict) and form.get("type") == "json_schema" and isinstance(form.get("schema"), dict),
            f"output_config.format must be {{'type': 'json_schema', 'schema': <a JSON schema>}}, got {form!r:.80}")
    return constraint_spec(constraints.json_schema_spec, form["schema"], True)


def _referenced_chars(messages: list, tools: dict[str, dict]) -> int:
    """The characters the tool_reference blocks of tool results will expand to: each named tool's definition, once
    per reference (what _tool_result_content builds), read from the request's structure before anything is built."""
    names = [block["tool_name"]
             for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
             for result in message["content"] if isinstance(result, dict) and result.get("type") == "tool_result"
             and isinstance(result.get("content"), list)
             for block in result["content"] if isinstance(block, dict) and block.get("type") == "tool_reference"
             and isinstance(block.get("tool_name"), str) and block["tool_name"] in tools]
    sizes = {name: len(_tool_definition(tools[name])) for name in set(names)}
    return sum(sizes[name] for name in names)


def decode_anthropic(body: dict, base: SamplingParams, bound: TextBound | None = None) -> WireRequest:
    """An Anthropic messages request -> the canonical request; anything it cannot honour is a WireError. `bound`
    (the session's): tool references that would expand past the text a context holds are refused before they are
    (a few KB of references to a long definition would otherwise build hundreds of MB)."""
    no_ops = check_fields(body, ANTHROPIC_FIELDS)
    require(not isinstance(body.get("stop_sequences"), str), "'stop_sequences' must be a list of strings")
    max_tokens = number_field(body, "max_tokens", integer=True)
    require(max_tokens is not None, "'max_tokens' is required")
    messages = body.get("messages")
    require(isinstance(messages, list) and messages, "'messages' must be a non-empty list of {role, content} objects")
    require(not (isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"),
            "the last message is the assistant's (a prefill to continue), which this server does not continue: end "
            "with a user message (a turn's reply is sampled whole, from the chat template's generation prompt)")
    rendered, deferred = _anthropic_tools(body.get("tools"))
    offered = {tool["function"]["name"]: tool for tool in rendered + deferred}
    if bound is not None:
        bound.refuse_over(_referenced_chars(messages, offered), "the tool definitions the tool_reference blocks name",
                          "messages")
    canonical = [] if body.get("system") is None else [{"role": "system",
                                                        "content": _anthropic_text(body["system"], "system")}]
    for i, message in enumerate(messages):
        canonical += _anthropic_messages(message, f"messages[{i}]", offered)
    tools = rendered or None
    enable_thinking, omit_thinking = _anthropic_thinking(body.get("thinking"))
    kwargs = template_kwargs_of(body, enable_thinking, {})
    mode, name, parallel = _anthropic_tool_choice(body.get("tool_choice"))
    options, forced = tool_options_of(mode, name, tools, parallel, kwargs, deferred)
    object_field(body, "context_management")         # an object, or absent; no edit is applied (wires/params.py)
    sampling = sampling_from(base, body, max_tokens=max_tokens,
                             stop=stop_strings_field(body.get("stop_sequences"), "stop_sequences"),
                             constraint=forced or _output_format(object_field(body, "output_config")))
    return WireRequest(canonical, tools, sampling, flag_field(body, "stream"), False,
                       flag_field(body, "return_token_ids"), options, no_ops=no_ops, omit_thinking=omit_thinking,
                       context_management=body.get("context_management") is not None)


def decode_anthropic_count(body: dict, base: SamplingParams, bound: TextBound | None = None) -> WireRequest:
    """A count_tokens request -> the canonical request a messages request with its fields would decode to."""
    require(set(body) <= ANTHROPIC_COUNT_FIELDS, f"count_tokens takes {sorted(ANTHROPIC_COUNT_FIELDS)}, not "
                                                 f"{sorted(set(body) - ANTHROPIC_COUNT_FIELDS)}")
    return decode_anthropic({**body, "max_tokens": 1}, base, bound)


# ---- encoding: a ChatTurn -> an Anthropic message, whole or streamed ----------------------------------

ANTHROPIC_STOP = {"stop": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens", "tool": "tool_use"}


def _event(kind: str, **fields) -> tuple[str, dict]:
    return kind, {"type": kind, **fields}


def _anthropic_usage(turn: ChatTurn) -> dict:
    """Anthropic counts cached prompt tokens apart from input_tokens (a harness sums the two for the context)."""
    gen = turn.generation
    return {"input_tokens": len(gen.prompt_ids) - gen.cached_prompt_tokens,
            "cache_read_input_tokens": gen.cached_prompt_tokens, "output_tokens": len(gen.token_ids),
            **budget_usage(turn)}


def _anthropic_blocks(message: dict, omit_thinking: bool) -> list[dict]:
    """The reply as content blocks: its opening thought (if any), its text (if any, or if nothing else), its calls."""
    calls, text, blocks = message.get("tool_calls") or [], message["content"] or "", []
    if (thinking := split_thinking(text)) is not None:
        opening, thought, text = thinking
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else thought,
                       "signature": opening_signature(opening)})
    if text or not (calls or blocks):
        blocks.append({"type": "text", "text": text})
    return blocks + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                      "input": c["function"]["arguments"]} for c in calls]


def anthropic_reply(turn: ChatTurn, request: WireRequest, model: str, reply_id: str) -> dict:
    return {"id": reply_id, "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(turn.message, request.omit_thinking),
            "stop_reason": wire_finish_reason(turn, ANTHROPIC_STOP), "stop_sequence": turn.stop_sequence,
            "usage": _anthropic_usage(turn),
            **_context_management(request), **token_extras(turn, request)}


def _context_management(request: WireRequest) -> dict:
    """What a request that set context_management is told: no edit was applied (wires/params.py says why)."""
    return {"context_management": {"applied_edits": []}} if request.context_management else {}


class AnthropicStream(LiveStream):
    """message_start; a thinking block (thinking_delta, then signature_delta) when the reply opens with a thought,
    and a text block, their deltas sent as tokens arrive; a tool_use block per call (input_json_delta);
    message_delta with the stop reason; message_stop. The blocks are those of the non-streamed reply."""
    wire, done_marker = "anthropic", False

    def __init__(self, request: WireRequest, tokenizer, model: str, reply_id: str):
        self.request, self.model, self.reply_id = request, model, reply_id
        self.content = ""            # the reply's content received so far (LiveText's sendable pieces)
        self.sent: list[list] = []   # per block opened: [its type, the text sent in it, closed]

    def start(self, prompt_ids: list[int]) -> list:
        message = {"id": self.reply_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}
        return [_event("message_start", message=message)]

    def _sendable(self) -> list[tuple[str, str, str | None]]:
        """The blocks the content so far surely opens with: (type, text, the thought's opening once it is whole)."""
        content = self.content
        if len(content) < len(THINK_OPEN) and THINK_OPEN.startswith(content):
            return []                                # it may still open a thought
        if not content.startswith(THINK_OPEN):
            return [("text", content, None)]
        opening, thought, rest = split_thinking(content)
        if not rest:                                 # the thought, or the whitespace after it, may go on
            inside = content[len(THINK_OPEN):]
            return [("thinking", thought if thought != inside else
                     inside[:len(inside) - partial_suffix(inside, (THINK_CLOSE,))], None)]
        return [("thinking", thought, opening), ("text", rest, None)]

    def _events(self, blocks: list[tuple[str, str, str | None]], final: bool) -> list:
        events = []
        for index, (kind, text, opening) in enumerate(blocks):
            if index == len(self.sent):
                start = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
                events.append(_event("content_block_start", index=index, content_block=start))
                self.sent.append([kind, "", False])
            sent = self.sent[index]
            shown = "" if kind == "thinking" and self.request.omit_thinking else text
            if len(shown) > len(sent[1]):
                delta = {"type": f"{kind}_delta", kind: shown[len(sent[1]):]}     # thinking_delta or text_delta
                events.append(_event("content_block_delta", index=index, delta=delta))
                sent[1] = shown
            if not sent[2] and (index < len(blocks) - 1 or final):
                if kind == "thinking":
                    signature = {"type": "signature_delta", "signature": opening_signature(opening)}
                    events.append(_event("content_block_delta", index=index, delta=signature))
                events.append(_event("content_block_stop", index=index))
                sent[2] = True
        return events

    def text(self, piece: str) -> list:
        self.content += piece
        return self._events(self._sendable(), final=False)

    def finish(self, turn: ChatTurn, rest: str) -> list:
        blocks = _anthropic_blocks(turn.message, omit_thinking=False)
        opening = (split_thinking(turn.message["content"] or "") or [None])[0]
        events = self._events([(b["type"], b.get("thinking", b.get("text")), opening)
                               for b in blocks if b["type"] != "tool_use"], final=True)
        for index, block in enumerate(blocks):
            if block["type"] == "tool_use":
                json_delta = {"type": "input_json_delta", "partial_json": arguments_to_json(block["input"])}
                events += [_event("content_block_start", index=index, content_block={**block, "input": {}}),
                           _event("content_block_delta", index=index, delta=json_delta),
                           _event("content_block_stop", index=index)]
        # the whole usage again: message_start's was counted before the engine knew its prefix-cache reuse, and the
        # SDK's accumulated message takes message_delta's counts
        return events + [_event("message_delta", usage=_anthropic_usage(turn),
                                delta={"stop_reason": wire_finish_reason(turn, ANTHROPIC_STOP),
                                       "stop_sequence": turn.stop_sequence},
                                **_context_management(self.request), **token_extras(turn, self.request)),
                         _event("message_stop")]
