# data.py — prompt datasets and chat templates.
# Owns: the ChatML chat templates (plain and Qwen3-style think-stripping), rendering a conversation to
# prompt token ids (render once, encode once), the Task record, and the built-in arithmetic dataset.
# Never: tokenizes a response back into ids (sampled ids come from the engine), touches the network.
# Invariant: CHATML_TEMPLATE is prefix-preserving — for any conversation m and k >= 1,
#   render(m[:k]) is a string prefix of render(m[:k+1]) (both without generation prompt), and
#   render(m[:k], add_generation_prompt=True) is a prefix of render(m[:k] + [assistant turn]).
#   Each message renders to a self-contained block that depends only on itself (and, for the first
#   block, on `tools`). THINK_STRIPPING_TEMPLATE deliberately breaks this (earlier thoughts vanish).
import random
from dataclasses import dataclass

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
    """Render `messages` with `template` (default: the tokenizer's own chat template) to text."""
    if template is None and tokenizer.chat_template is None:
        raise ValueError("tokenizer has no chat_template; pass template=data.CHATML_TEMPLATE or use a chat model")
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def render_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                      add_generation_prompt: bool = True) -> list[int]:
    """Render once and encode the text once, adding no special tokens (the template already wrote them)."""
    text = render_prompt_text(tokenizer, messages, tools, template, add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


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
