# data.py — prompt datasets, chat templates and images.
# Owns: the ChatML chat templates (plain and Qwen3-style think-stripping, both with Qwen3's enable_thinking
# switch), rendering a conversation to prompt token ids (render once, encode once) with the template's switches,
# the tools a template leaves out (SmolLM2's has no tools block) written into the messages in the Hermes/Qwen form,
# text that stays text (a special-token string inside a message or an observation is encoded as its characters;
# only the template's own control tokens are control tokens),
# images (data URLs -> PIL -> ImageInput, one pad id -> one pad run per image), the Task record, the built-in
# arithmetic dataset, and geo3k (hiyouga/geometry3k through `datasets`, or a synthetic stand-in drawn with PIL).
# Never: tokenizes a response back into ids (sampled ids come from the engine), touches the network (an image
# arrives as a PIL image or a data: URL, never fetched).
# Prefix property (what lets loopback.py extend a record instead of sealing it: invariant 1, token identity):
#   CHATML_TEMPLATE is prefix-preserving — for any conversation m and k >= 1,
#   render(m[:k]) is a string prefix of render(m[:k+1]) (both without generation prompt), and
#   render(m[:k], add_generation_prompt=True) is a prefix of render(m[:k] + [assistant turn]).
#   Each message renders to a self-contained block that depends only on itself (and, for the first
#   block, on `tools`; every block, on the template switches). THINK_STRIPPING_TEMPLATE deliberately breaks
#   this (earlier thoughts vanish).
import base64
import binascii
import functools
import inspect
import io
import json
import os
import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw
from transformers import PreTrainedTokenizerBase

from invariants import ImageInput

# ---- chat templates ----
# ChatML blocks: "<|im_start|>{role}\n{content}<|im_end|>\n". Tools go into the system preamble as one
# JSON schema per line inside <tools></tools> (Hermes/Qwen convention). An assistant tool call renders as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; dict arguments pass through `tojson`, which
# re-serializes them ({"a":1} -> {"a": 1}), so a rendered tool call need not equal the sampled bytes.
# A tool result renders as its own user block wrapping <tool_response>...</tool_response> (never merged
# with a neighbour, which keeps the prefix property). Images in list content render as Qwen2-VL
# placeholders <|vision_start|><|image_pad|><|vision_end|>.
# Thinking switch (Qwen3's convention): with enable_thinking=False every assistant turn opens with an empty think
# block "<think>\n\n</think>\n\n", the generation prompt included, so a thinking model answers at once; the block is
# template glue (context), and rendering it in every assistant turn keeps the prefix property. Absent or true,
# nothing changes.

# The tools section, in the template below and in the fallback for a template without one (tools_as_messages)
TOOLS_OPENING = ("# Tools\n\nYou can call the functions described below. Their JSON signatures are listed inside "
                 "<tools></tools>:\n<tools>")
TOOLS_CLOSING = ("\n</tools>\n\nTo call a function, answer with one JSON object per call inside "
                 "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<arguments-object>}\n</tool_call>")


def _jinja_text(text: str) -> str:
    """`text` as the inside of a single-quoted Jinja string literal."""
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


_TOOLS_PREAMBLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    f"{{{{- '{_jinja_text(TOOLS_OPENING)}' }}}}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    f"{{{{- '{_jinja_text(TOOLS_CLOSING)}<|im_end|>\\n' }}}}"
    "{%- endif %}"
)

_CONTENT = (  # renders `message.content` (a string, None, or a list of text/image parts) into `ns.text`
    "{%- if message.content is string %}{%- set ns.text = message.content %}"
    "{%- elif message.content is none %}{%- set ns.text = '' %}"
    "{%- else %}{%- set ns.text = '' %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{%- set ns.text = ns.text + part.text %}"
    "{%- elif part.type in ('image', 'image_url') %}"
    "{%- set ns.text = ns.text + '<|vision_start|><|image_pad|><|vision_end|>' %}{%- endif %}"
    "{%- endfor %}{%- endif %}"
)

_STRIP_EARLIER_THOUGHTS = (  # Qwen3 behaviour: an assistant turn before the last user turn loses its thoughts
    "{%- if loop.index0 < ns.last_user and '</think>' in ns.text %}"
    "{%- set ns.text = ns.text.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
)


def _chatml(strip_earlier_thoughts: bool) -> str:
    return (
        "{%- set ns = namespace(text='', last_user=-1) %}"
        "{%- set _no_think = '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and enable_thinking is false "
        "else '' %}"
        "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        + _TOOLS_PREAMBLE
        + "{%- for message in messages %}"
        + _CONTENT
        + "{%- if message.role == 'system' %}"
        "{%- if not (tools and loop.first) %}{{- '<|im_start|>system\\n' + ns.text + '<|im_end|>\\n' }}{%- endif %}"
        "{%- elif message.role == 'user' %}{{- '<|im_start|>user\\n' + ns.text + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        + (_STRIP_EARLIER_THOUGHTS if strip_earlier_thoughts else "")
        + "{{- '<|im_start|>assistant\\n' + _no_think + ns.text }}"
        "{%- for tool_call in message.tool_calls or [] %}"
        "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
        "{%- if ns.text or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
        "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + ns.text + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- else %}{{- raise_exception('unknown chat role ' + message.role + '; expected system, user, "
        "assistant or tool') }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' + _no_think }}{%- endif %}"
    )


CHATML_TEMPLATE = _chatml(strip_earlier_thoughts=False)
THINK_STRIPPING_TEMPLATE = _chatml(strip_earlier_thoughts=True)


def render_prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                       add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
    """Render `messages` with `template` (default: the tokenizer's own chat template) to text, every special-token
    string inside the messages, tools and template switches marked as plain text (see `encode_text`, which reads
    the marks), and the tools a template leaves out written into the messages (tools_as_messages). `template_kwargs`
    are the template's own switches (e.g. {"enable_thinking": False}); a template that does not read one ignores
    it."""
    if template is None and tokenizer.chat_template is None:
        raise ValueError("tokenizer has no chat_template; pass template=data.CHATML_TEMPLATE or use a chat model")
    switches = _template_switches(tokenizer, template_kwargs or {})
    messages, tools = tools_as_messages(tokenizer, template, _mark_specials(tokenizer, messages),
                                        _mark_specials(tokenizer, tools))
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **switches)


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                      add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """Render once and encode the text once, adding no special tokens (the template already wrote them)."""
    return encode_text(tokenizer, render_prompt_text(tokenizer, messages, tools, template, add_generation_prompt,
                                                     template_kwargs))


# apply_chat_template's own arguments, and names every template reads from the renderer: a switch of that name
# would rewrite the conversation, the generation prompt or a control token instead of flipping a template switch
_RENDERER_NAMES = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {
    "messages", "raise_exception", "strftime_now"}


def _template_switches(tokenizer, switches: dict) -> dict:
    """The template switches, special-token strings in their text marked plain; a name the renderer itself uses (or
    a special token's: eos_token, ...) is refused with the reason."""
    taken = sorted(k for k in switches if k in _RENDERER_NAMES or k in tokenizer.special_tokens_map
                   or k.endswith("_token"))
    if taken:
        raise ValueError(f"chat template switch(es) {taken} name the renderer's own inputs (the messages, tools, "
                         f"generation prompt or a special token), not a template switch; send switches such as "
                         f"enable_thinking")
    return _mark_specials(tokenizer, switches)


# ---- tools a chat template leaves out ----
# A harness's tools must reach the model, whatever the chat template. Some templates have no tools block: SmolLM2's
# writes each message's role and content and nothing else, so the tools a request brings (an assistant's tool calls,
# the tool results) would leave the prompt without a word. `tool_rendering` finds out once per template what it
# renders, by rendering sentinels and looking for them; `tools_as_messages` writes what it leaves out into the
# messages, in the Hermes/Qwen form that wires.parse_hermes_tool_calls reads and CHATML_TEMPLATE writes: the tools
# as one JSON object per line inside <tools></tools> in a system section (after the first system message's text, or
# a system message of its own), each call as '<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>' after the
# assistant's text, each tool result as a user message inside <tool_response></tool_response>. Deterministic, and
# each message's text depends on that message alone (the system section on the tools too), so an echoed reply still
# extends the record (invariant 1).

_SENTINEL = "tracerl_sentinel"     # + what each probe looks for: _tool, _call, _result


@dataclass(frozen=True)
class ToolRendering:
    """What a chat template renders of a conversation's tools."""
    tools: bool        # the tool definitions it is given
    calls: bool        # an assistant message's tool calls
    results: bool      # a tool message's content


def tool_rendering(tokenizer, template: str | None = None) -> ToolRendering:
    """What `template` (default: the tokenizer's own) renders of tools, found once per template."""
    own = tokenizer.chat_template
    return _probe(tokenizer, template, template if template is not None else repr(own))


@functools.lru_cache(maxsize=32)
def _probe(tokenizer, template: str | None, _text: str) -> ToolRendering:
    def renders(needle: str, messages: list[dict], tools: list[dict] | None = None) -> bool:
        try:
            return needle in tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                                           tokenize=False)
        except Exception:      # a template that fails on it (a tool call with no content: None + str) renders none
            return False
    ask = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": f"{_SENTINEL}_tool", "description": "a sentinel",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-0", "type": "function", "function": {"name": f"{_SENTINEL}_call", "arguments": {}}}]}
    calls = renders(f"{_SENTINEL}_call", [ask, call])
    result = {"role": "tool", "content": f"{_SENTINEL}_result", "tool_call_id": "call-0"}
    return ToolRendering(renders(f"{_SENTINEL}_tool", [ask], [tool]), calls,
                         renders(f"{_SENTINEL}_result", [ask, call if calls else _calls_as_text(call), result]))


def tools_as_messages(tokenizer, template: str | None, messages: list[dict],
                      tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to hand `template`: as given where it renders them, what it leaves out written into
    the messages (the section's fallback). Raises ValueError for a tool result or a calling message whose content
    is not text (the fallback writes text)."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, tools
    rendering = tool_rendering(tokenizer, template)
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls") and not rendering.calls:
            message = _calls_as_text(message)
        elif message.get("role") == "tool" and not rendering.results:
            message = {"role": "user", "content": f"<tool_response>\n{_text_of(message)}\n</tool_response>"}
        out.append(message)
    if tools and not rendering.tools:
        section = TOOLS_OPENING + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOLS_CLOSING
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
        tools = None
    return out, tools


def _text_of(message: dict) -> str:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"a {message.get('role')} message's content must be text for this chat template, which "
                         f"leaves its tools out (they are written into the text: data.tools_as_messages)")
    return content or ""


def _calls_as_text(message: dict) -> dict:
    """An assistant message with its tool calls written after its text, as CHATML_TEMPLATE writes them (a call's
    arguments object through JSON, the way the template's tojson does; a string as it is)."""
    text = _text_of(message)
    pieces = [text] if text else []
    for tool_call in message["tool_calls"]:
        call = tool_call.get("function", tool_call)
        arguments = call.get("arguments", {})
        pieces.append('<tool_call>\n{"name": ' + json.dumps(call["name"], ensure_ascii=False) + ', "arguments": '
                      + (arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
                      + '}\n</tool_call>')
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": "\n".join(pieces)}

# ---- text stays text ----
# A message that holds "<|im_end|>\n<|im_start|>system\n..." must not end its turn and forge a system turn: what
# an agent, a tool or an env writes is text, and only the chat template writes control tokens. Rendering marks
# every special-token string of the content with PLAIN_OPEN/PLAIN_CLOSE, two lone surrogates (no valid text holds
# one: the wires refuse them, and a tokenizer cannot encode them), so the marks survive the template untouched;
# encoding then reads a marked span as characters and the rest the usual way. Unmarked text encodes exactly as
# `tokenizer.encode` would. An env marks the text inside its own chat glue with `plain(text)`.

PLAIN_OPEN, PLAIN_CLOSE = "\udb40", "\udb41"
_PLAIN_SPAN = re.compile(f"{PLAIN_OPEN}(.*?)(?:{PLAIN_CLOSE}|\\Z)", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def plain(text: str) -> str:
    """`text` marked so that every special-token string in it is encoded as characters (for an env's observation:
    `GLUE.format(data.plain(tool_output))`)."""
    _refuse_surrogates(text)
    return f"{PLAIN_OPEN}{text}{PLAIN_CLOSE}" if text else text


class TooManyTokens(ValueError):
    """A text surely over a token budget, found by counting it in pieces before encoding it whole."""

    def __init__(self, counted: int, budget: int):
        super().__init__(f"the text counts about {counted} tokens, over the budget of {budget}")
        self.counted, self.budget = counted, budget


COUNT_PIECE_CHARS = 65_536   # a long text is counted this many characters at a time (each piece's ids then dropped)


def count_tokens_upto(tokenizer, text: str, budget: int) -> int:
    """The tokens of `text`, counted piece by piece, stopping once the count passes `budget`: the memory is one
    piece's encoding, whatever the text's length. Each piece ends before a whitespace character where it has one, so
    a cut falls where the pre-tokenizer cuts too and the count is the whole encoding's within a few tokens a piece
    (special-token strings count as control tokens, a marked span's as no more than its characters)."""
    counted, start = 0, 0
    while start < len(text) and counted <= budget:
        end = min(start + COUNT_PIECE_CHARS, len(text))
        if end < len(text):
            space = max(text.rfind(c, start + COUNT_PIECE_CHARS // 2, end) for c in " \n")
            end = space if space > 0 else end
        piece = text[start:end].replace(PLAIN_OPEN, "").replace(PLAIN_CLOSE, "")
        counted += len(_encode(tokenizer, piece, split_special_tokens=False))
        start = end
    return counted


def encode_text(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Encode once, adding no special tokens: marked spans (`plain`, `render_prompt_text`) as characters, the
    rest with its special-token strings as control tokens. With `max_tokens`, no more than about twice that many
    tokens are ever encoded: a text that may hold more (a token is at most 4 UTF-8 bytes' worth of characters, so
    more than max_tokens / 2 characters) is counted first (count_tokens_upto), and one that counts more than
    2 * max_tokens is refused with TooManyTokens (the margin leaves the piecewise count's few tokens of error no
    say in what is refused) before its whole encoding is built."""
    if max_tokens is not None and 2 * len(text) > max_tokens:
        counted = count_tokens_upto(tokenizer, text, 2 * max_tokens)
        if counted > 2 * max_tokens:
            raise TooManyTokens(counted, max_tokens)
    ids, last = [], 0
    for span in _PLAIN_SPAN.finditer(text):
        ids += _encode(tokenizer, text[last:span.start()], split_special_tokens=False)
        ids += _encode(tokenizer, span.group(1), split_special_tokens=True)
        last = span.end()
    return ids + _encode(tokenizer, text[last:].replace(PLAIN_CLOSE, ""), split_special_tokens=False)


def _encode(tokenizer, text: str, split_special_tokens: bool) -> list[int]:
    _refuse_surrogates(text)
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens) if text else []


def _refuse_surrogates(text: str) -> None:
    if (bad := _SURROGATE.search(text)) is not None:
        raise ValueError(f"the text holds a lone surrogate (U+{ord(bad.group()):04X}) at index {bad.start()}, which "
                         f"is no character and cannot be encoded; send valid Unicode text")


def _mark_specials(tokenizer, value):
    """A copy of a message list / tool list / JSON value with the special-token strings of every string marked."""
    pattern = _special_pattern(tokenizer)
    if pattern is None or value is None:
        return value

    def mark(item):
        if isinstance(item, str):
            _refuse_surrogates(item)
            return pattern.sub(lambda m: f"{PLAIN_OPEN}{m.group()}{PLAIN_CLOSE}", item)
        if isinstance(item, dict):
            return {mark(key): mark(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [mark(v) for v in item]
        return item                   # numbers, None, a PIL image
    return mark(value)


@functools.lru_cache(maxsize=16)
def longest_token_chars(tokenizer) -> int:
    """Characters in the longest vocabulary entry (a byte-level entry spells each byte as one character, so this
    also bounds the bytes, hence the characters, one token can stand for)."""
    return max(len(token) for token in tokenizer.get_vocab())


@functools.lru_cache(maxsize=16)
def _special_pattern(tokenizer) -> re.Pattern | None:
    """One regex of the tokenizer's special-token strings (longest first), or None if it has none."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


# ---- images ----
# The template writes one IMAGE_PAD per image; the model needs one per image token. An image's token count is
# known only after its processor ran (its patch grid), so the prompt is rendered and encoded once, then each
# single pad id is expanded to its image's n_tokens — the ids are never re-encoded from text.

IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"   # what an env writes per image it shows
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


def decode_image(url: str) -> Image.Image:
    """A `data:image/...;base64,...` URL -> a decoded PIL image. Anything else is refused: offline, nothing is
    fetched."""
    match = _DATA_URL.fullmatch(url.strip()) if isinstance(url, str) else None
    if match is None:
        raise ValueError(f"image {str(url)[:60]!r}: only data URLs (data:image/<type>;base64,<data>) are accepted "
                         f"offline; embed the image bytes in the URL instead of linking to them")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(match.group(1), validate=True)))
        image.load()   # decode now, so a truncated or corrupt file fails here and not inside the processor
    except (binascii.Error, OSError, Image.DecompressionBombError) as error:
        raise ValueError(f"image data URL {url[:40]!r}...: the data does not decode to an image ({error}); send "
                         f"the base64 of a PNG, JPEG or other PIL-readable file") from None
    return image


def prompt_images(messages: list[dict], images: Sequence | None = None) -> list:
    """The image of every image part of `messages`, in order: the part's own image (`{"type": "image", "image":
    PIL image or data URL}` or `{"type": "image_url", "image_url": {"url": ...}}`), else the next of `images` (a
    Task's images, for parts written as a bare `{"type": "image"}`). Raises ValueError if the counts disagree."""
    found, spare = [], list(images or [])
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url")
                if not isinstance(url, str):
                    raise ValueError(f"an image_url part needs {{'image_url': {{'url': str}}}}, got {part!r:.80}")
                found.append(url)
            elif part.get("type") == "image":
                if part.get("image") is not None:
                    found.append(part["image"])
                elif spare:
                    found.append(spare.pop(0))
                else:
                    raise ValueError("an image part without its own image, and no images left to fill it; pass "
                                     "the task's images in the order of its image parts")
    if spare:
        raise ValueError(f"{len(spare)} images left over after filling every image part of the messages; each image "
                         f"needs an image part ({{'type': 'image'}}) where the prompt shows it")
    return found


def image_data_url(image) -> str:
    """A PIL image as a lossless PNG data URL, the way a stock SDK carries it (a data URL is returned as is)."""
    if isinstance(image, str):
        return image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def sdk_messages(messages: list[dict], images: Sequence | None = None) -> list[dict]:
    """The messages as an OpenAI SDK sends them: every image part (a bare one filled from `images`, in order)
    becomes {"type": "image_url", "image_url": {"url": <data URL>}}; everything else is unchanged."""
    urls = iter([image_data_url(image) for image in prompt_images(messages, images)])
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": next(urls)}}
                       if part.get("type") in ("image", "image_url") else part for part in content]
        out.append({**message, "content": content})
    return out


def image_inputs(processor, images: list) -> list[ImageInput]:
    """Run the model's image processor once per image (a PIL image or a data URL) -> ImageInput each, in order."""
    out = []
    for image in images:
        if isinstance(image, str):
            image = decode_image(image)
        processed = processor(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in processed["image_grid_thw"][0])
        # the resize the processor made, made again (PIL, same filter): processing this copy is exact
        resized = image.convert("RGB").resize((w * processor.patch_size, h * processor.patch_size),
                                              resample=Image.Resampling(processor.resample))
        out.append(ImageInput(processed["pixel_values"].to(torch.float32), (t, h, w),
                              t * h * w // processor.merge_size ** 2, resized))
    return out


def expand_image_pads(ids: list[int], images: Sequence[ImageInput], pad_id: int) -> list[int]:
    """Replace the k-th single pad id of `ids` by images[k].n_tokens pad ids. The rendered prompt must hold
    exactly one pad per image."""
    pads = sum(1 for t in ids if t == pad_id)
    if pads != len(images):
        raise ValueError(f"the prompt holds {pads} image pad tokens but {len(images)} images were given; write one "
                         f"{IMAGE_PAD} (inside {IMAGE_PLACEHOLDER}) per image, in the images' order")
    expanded, next_image = [], iter(images)
    for t in ids:
        expanded.extend([t] * next(next_image).n_tokens if t == pad_id else [t])
    return expanded


# ---- tasks ----

@dataclass
class Task:
    task_id: str               # unique within a dataset, stable under its seed
    messages: list[dict]       # the chat prompt (OpenAI-style messages)
    label: str                 # exact reference answer, graded by agents/graders.py
    images: list | None = None  # PIL images referenced by image parts of `messages`, in order


# ---- arithmetic word problems ----
# One-step addition/subtraction stories with small operands. SmolLM2-135M-Instruct (greedy, 64 tokens, operands
# up to 10) gets about a third right, in words ("The final answer is 7."), and rambles on the rest — a real,
# learnable RL target on a CPU: the grader rewards the right number wherever the answer states it.

ARITHMETIC_INSTRUCTION = "Give the final answer as a number in \\boxed{}."
_NAMES = ["Sam", "Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lily"]
_THINGS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "shells"]
_ADDITION = [
    "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
    "There are {a} {things} in a box. {name} puts {b} more {things} in the box. How many {things} are in the box?",
    "{name} found {a} {things} on Monday and {b} {things} on Tuesday. How many {things} did {name} find in total?",
]
_SUBTRACTION = [  # the story starts with a + b things and takes b away, so every answer is a >= 0
    "{name} has {total} {things} and gives {b} to a friend. How many {things} does {name} have left?",
    "There are {total} {things} on the table. {name} takes {b} of them. How many {things} are still on the table?",
    "{name} had {total} {things} and lost {b}. How many {things} does {name} have now?",
]


def arithmetic_tasks(n: int, seed: int, max_operand: int = 10) -> list[Task]:
    """`n` word problems with operands in [1, max_operand] and exact integer labels; deterministic in `seed`
    (use one seed for training and another for a held-out split)."""
    rng = random.Random(seed)
    tasks = []
    for index in range(n):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        name, things = rng.choice(_NAMES), rng.choice(_THINGS)
        if rng.random() < 0.5:
            story, answer = rng.choice(_ADDITION).format(name=name, things=things, a=a, b=b), a + b
        else:
            story, answer = rng.choice(_SUBTRACTION).format(name=name, things=things, total=a + b, b=b), a
        messages = [{"role": "user", "content": f"{story} {ARITHMETIC_INSTRUCTION}"}]
        tasks.append(Task(task_id=f"arithmetic-{seed}-{index}", messages=messages, label=str(answer)))
    return tasks


# ---- geo3k: geometry problems with diagrams ----
# The real set is hiyouga/geometry3k (train 2,101 / validation 300 / test 601 rows; fields `images` (a list with
# one PIL diagram), `problem` ("<image>Find x."), `answer` ("2\\sqrt{13}")). Offline, `synthetic_geo3k` draws
# problems of the same kinds with PIL and the same fields: labelled points, lengths and angles written on the
# diagram, questions in geo3k's words, exact answers. Most givens are only in the image, as in geo3k, so a model
# that ignores the picture cannot answer.

# A synthetic problem belongs to the split its parameters hash to (a tenth each to validation and test), so the
# splits never share a problem however many rows are drawn.
GEO3K_SPLITS = {"validation": (0,), "test": (1,), "train": tuple(range(2, 10))}
GEO3K_INSTRUCTION = ("Think step by step. You may run Python to compute. Give the final answer in \\boxed{}, "
                     "exact (e.g. 2\\sqrt{13}, 10\\pi) or to two decimals.")
_SIZE = 336          # pixels; a processor resizes to its own grid (the tiny VLM's: at most 112 x 112)


@functools.lru_cache(maxsize=None)
def _font(size: int = 22):
    from PIL import ImageFont
    return ImageFont.load_default(size=size)


def _label(draw, xy: tuple[float, float], text: str, size: int = 22) -> None:
    draw.text(xy, text, fill="black", font=_font(size), anchor="mm")


def _offset(p, q, centre, distance: float = 22.0) -> tuple[float, float]:
    """The midpoint of pq pushed `distance` pixels away from `centre`: where a side's length is written."""
    mx, my = (p[0] + q[0]) / 2, (p[1] + q[1]) / 2
    dx, dy = mx - centre[0], my - centre[1]
    norm = max((dx * dx + dy * dy) ** 0.5, 1e-6)
    return mx + distance * dx / norm, my + distance * dy / norm


def _triangle(draw, points: dict[str, tuple[float, float]]) -> tuple[float, float]:
    a, b, c = points.values()
    draw.polygon([a, b, c], outline="black", width=3)
    centre = ((a[0] + b[0] + c[0]) / 3, (a[1] + b[1] + c[1]) / 3)
    for name, p in points.items():
        _label(draw, _offset(p, p, centre, 20), name)
    return centre


def _right_triangle(rng: random.Random, draw):
    """Legs written on the diagram, the hypotenuse marked x: Find x. (an exact radical when not a triple)."""
    import sympy
    a, b = rng.randint(3, 12), rng.randint(3, 12)
    scale = 220 / max(a, b)
    c_point = (60, 280)
    points = {"A": (60, 280 - a * scale), "B": (60 + b * scale, 280), "C": c_point}
    centre = _triangle(draw, points)
    draw.rectangle([60, 262, 78, 280], outline="black", width=2)           # the right-angle mark at C
    _label(draw, _offset(points["A"], c_point, centre), str(a))
    _label(draw, _offset(points["B"], c_point, centre), str(b))
    _label(draw, _offset(points["A"], points["B"], centre), "x")
    return "<image>Find x.", sympy.latex(sympy.sqrt(a * a + b * b)), (a, b)


def _triangle_angles(rng: random.Random, draw):
    """Two angles written inside the triangle; the question names the third by its vertices or marks it x."""
    a, b = rng.randint(30, 80), rng.randint(30, 80)
    points = {"A": (40, 280), "B": (rng.randint(120, 220), 60), "C": (296, 280)}
    centre = _triangle(draw, points)
    for vertex, value in (("A", a), ("C", b)):
        p = points[vertex]
        _label(draw, (p[0] + 0.3 * (centre[0] - p[0]), p[1] + 0.3 * (centre[1] - p[1])), f"{value}°", 18)
    if rng.random() < 0.5:
        b_point = points["B"]
        _label(draw, (b_point[0] + 0.35 * (centre[0] - b_point[0]), b_point[1] + 0.35 * (centre[1] - b_point[1])),
               "x°", 18)
        return "<image>Find x.", str(180 - a - b), (a, b, "x")
    return "<image>Find m \\angle ABC.", str(180 - a - b), (a, b, "ABC")


def _linear_pair(rng: random.Random, draw):
    """A ray on a straight line: two angles written as expressions in x that add to 180. Find x."""
    x = rng.randint(5, 30)
    k1, k2 = rng.randint(1, 4), rng.randint(1, 4)
    c1 = rng.randint(0, 40)
    c2 = 180 - (k1 + k2) * x - c1
    draw.line([(20, 220), (316, 220)], fill="black", width=3)
    ray_end = (rng.randint(120, 220), 50)
    draw.line([(168, 220), ray_end], fill="black", width=3)
    for name, p in (("A", (20, 240)), ("B", (168, 240)), ("C", (316, 240)), ("D", (ray_end[0], 30))):
        _label(draw, p, name)
    _label(draw, (100, 195), f"({k1}x + {c1})°" if c1 else f"{k1}x°", 18)
    _label(draw, (245, 195), f"({k2}x {'+' if c2 >= 0 else '-'} {abs(c2)})°", 18)
    return "<image>Find x.", str(x), (x, k1, k2, c1)


def _circle(rng: random.Random, draw):
    """A circle with its radius drawn and written; the question asks for the circumference or the area."""
    r = rng.randint(2, 15)
    draw.ellipse([48, 48, 288, 288], outline="black", width=3)
    draw.line([(168, 168), (288, 168)], fill="black", width=3)
    _label(draw, (160, 186), "O")
    _label(draw, (228, 150), str(r))
    if rng.random() < 0.5:
        return "<image>Find the circumference of \\odot O.", f"{2 * r}\\pi", (r, "circumference")
    return "<image>Find the area of \\odot O.", f"{r * r}\\pi", (r, "area")


def _rectangle_diagonal(rng: random.Random, draw):
    """One side given in the text, the other only on the diagram: find the diagonal."""
    import sympy
    w, h = rng.randint(3, 12), rng.randint(3, 12)
    scale = 200 / max(w, h)
    a, b, c, d = (60, 60), (60 + w * scale, 60), (60 + w * scale, 60 + h * scale), (60, 60 + h * scale)
    draw.polygon([a, b, c, d], outline="black", width=3)
    draw.line([a, c], fill="black", width=2)
    for name, p, shift in (("A", a, (-16, -16)), ("B", b, (16, -16)), ("C", c, (16, 16)), ("D", d, (-16, 16))):
        _label(draw, (p[0] + shift[0], p[1] + shift[1]), name)
    _label(draw, (c[0] + 22, (b[1] + c[1]) / 2), str(h))
    return f"<image>ABCD is a rectangle with AB = {w}. Find AC.", sympy.latex(sympy.sqrt(w * w + h * h)), (w, h)


_GEO3K_KINDS = [_right_triangle, _triangle_angles, _linear_pair, _circle, _rectangle_diagonal]


def synthetic_geo3k(split: str, n: int, seed: int = 0) -> list[dict]:
    """`n` rows of a PIL-drawn geo3k stand-in, as hiyouga/geometry3k's: {"images": [PIL image], "problem":
    "<image>...", "answer": exact LaTeX}. Deterministic in (split, seed); the splits never share a problem."""
    if split not in GEO3K_SPLITS:
        raise ValueError(f"unknown geo3k split {split!r}; expected one of {sorted(GEO3K_SPLITS)}")
    rng = random.Random(f"geo3k-{split}-{seed}")
    rows = []
    for index in range(n):
        kind = _GEO3K_KINDS[index % len(_GEO3K_KINDS)]
        while True:        # draw until the problem falls in this split (1 to 10 draws)
            image = Image.new("RGB", (_SIZE, _SIZE), "white")
            problem, answer, params = kind(rng, ImageDraw.Draw(image))
            if zlib.crc32(repr((kind.__name__, params)).encode()) % 10 in GEO3K_SPLITS[split]:
                break
        rows.append({"images": [image], "problem": problem, "answer": answer})
    return rows


def load_geo3k(split: str, source: str = "hiyouga/geometry3k") -> list[dict]:
    """hiyouga/geometry3k's `split` through the `datasets` library: a hub name, or a local copy (a folder written
    by `save_to_disk`, or one holding the dataset's parquet files). Raises ImportError without `datasets` and
    OSError-like errors from `datasets` when neither the hub nor the folder is reachable."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("loading hiyouga/geometry3k needs the `datasets` package (pip install datasets), which "
                          "tracerl does not require; without it the recipe uses the synthetic geo3k") from error
    if os.path.isdir(source) and os.path.exists(os.path.join(source, "dataset_dict.json")):
        table = datasets.load_from_disk(source)[split]
    else:
        table = datasets.load_dataset(source, split=split)
    return [{"images": list(row["images"]), "problem": row["problem"], "answer": str(row["answer"])} for row in table]


def geo3k_task(row: dict, task_id: str) -> Task:
    """A geo3k row as a Task: every <image> of the problem becomes an image part (filled from the row's images in
    order), then the question and the answer format."""
    pieces = row["problem"].split("<image>")
    if len(pieces) - 1 != len(row["images"]):
        raise ValueError(f"geo3k row {task_id}: {len(pieces) - 1} <image> markers but {len(row['images'])} images")
    content: list[dict] = []
    for index, piece in enumerate(pieces):
        if index:
            content.append({"type": "image"})
        if piece.strip():
            content.append({"type": "text", "text": piece.strip()})
    content.append({"type": "text", "text": " " + GEO3K_INSTRUCTION})
    return Task(task_id=task_id, messages=[{"role": "user", "content": content}], label=row["answer"],
                images=list(row["images"]))
