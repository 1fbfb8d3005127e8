# data.py — prompt datasets, chat templates and images.
# Owns: the ChatML chat templates (plain and Qwen3-style think-stripping), rendering a conversation to
# prompt token ids (render once, encode once), text that stays text (a special-token string inside a message
# or an observation is encoded as its characters; only the template's own control tokens are control tokens),
# images (data URLs -> PIL -> ImageInput, one pad id -> one pad run per image), the Task record, and the
# built-in arithmetic dataset.
# Never: tokenizes a response back into ids (sampled ids come from the engine), touches the network (an image
# arrives as a PIL image or a data: URL, never fetched).
# Invariant: CHATML_TEMPLATE is prefix-preserving — for any conversation m and k >= 1,
#   render(m[:k]) is a string prefix of render(m[:k+1]) (both without generation prompt), and
#   render(m[:k], add_generation_prompt=True) is a prefix of render(m[:k] + [assistant turn]).
#   Each message renders to a self-contained block that depends only on itself (and, for the first
#   block, on `tools`). THINK_STRIPPING_TEMPLATE deliberately breaks this (earlier thoughts vanish).
import base64
import binascii
import functools
import io
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from invariants import ImageInput

# ---- chat templates ----
# ChatML blocks: "<|im_start|>{role}\n{content}<|im_end|>\n". Tools go into the system preamble as one
# JSON schema per line inside <tools></tools> (Hermes/Qwen convention). An assistant tool call renders as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; dict arguments pass through `tojson`, which
# re-serializes them ({"a":1} -> {"a": 1}), so a rendered tool call need not equal the sampled bytes.
# A tool result renders as its own user block wrapping <tool_response>...</tool_response> (never merged
# with a neighbour, which keeps the prefix property). Images in list content render as Qwen2-VL
# placeholders <|vision_start|><|image_pad|><|vision_end|>.

_TOOLS_PREAMBLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call the functions described below. Their JSON signatures are listed inside "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with one JSON object per call inside <tool_call></tool_call>:"
    "\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call><|im_end|>\\n' }}"
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
        + "{{- '<|im_start|>assistant\\n' + ns.text }}"
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
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHATML_TEMPLATE = _chatml(strip_earlier_thoughts=False)
THINK_STRIPPING_TEMPLATE = _chatml(strip_earlier_thoughts=True)


def render_prompt_text(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                       add_generation_prompt: bool = True) -> str:
    """Render `messages` with `template` (default: the tokenizer's own chat template) to text, every special-token
    string inside the messages and tools marked as plain text (see `encode_text`, which reads the marks)."""
    if template is None and tokenizer.chat_template is None:
        raise ValueError("tokenizer has no chat_template; pass template=data.CHATML_TEMPLATE or use a chat model")
    return tokenizer.apply_chat_template(_mark_specials(tokenizer, messages), tools=_mark_specials(tokenizer, tools),
                                         chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                      add_generation_prompt: bool = True) -> list[int]:
    """Render once and encode the text once, adding no special tokens (the template already wrote them)."""
    return encode_text(tokenizer, render_prompt_text(tokenizer, messages, tools, template, add_generation_prompt))


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


def encode_text(tokenizer, text: str) -> list[int]:
    """Encode once, adding no special tokens: marked spans (`plain`, `render_prompt_text`) as characters, the
    rest with its special-token strings as control tokens."""
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
        out.append(ImageInput(processed["pixel_values"].to(torch.float32), (t, h, w),
                              t * h * w // processor.merge_size ** 2))
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
