# recipes/tool_use.py — multi-turn tool use: look facts up in a small knowledge table, compute with a calculator,
# answer in \boxed{}. Each question needs two or three lookups and a calculation, so a good episode takes several
# turns; GRPO on the graded answer.
#
# The whole recipe: the knowledge table, the two tools, the questions, the defaults and the agent (a ToolEnv).
# Defaults: SmolLM2-135M-Instruct on a CPU (it rarely writes a well-formed call: expect tool errors and low reward
# at first); Qwen2.5-1.5B-Instruct, which writes Hermes tool calls natively, with CUDA.
import random

import data
import models
from agents import EnvRunner
from agents.graders import to_sympy
from agents.tools import Tool, ToolEnv, ToolError

# name -> facts. Populations in millions, areas in thousands of km², rounded; enough to ask real questions of.
KNOWLEDGE = {
    "France": {"capital": "Paris", "population": 68, "area": 552, "founded": 843},
    "Japan": {"capital": "Tokyo", "population": 124, "area": 378, "founded": 660},
    "Brazil": {"capital": "Brasilia", "population": 203, "area": 8516, "founded": 1822},
    "Egypt": {"capital": "Cairo", "population": 105, "area": 1010, "founded": 1922},
    "Canada": {"capital": "Ottawa", "population": 40, "area": 9985, "founded": 1867},
    "Kenya": {"capital": "Nairobi", "population": 55, "area": 580, "founded": 1963},
    "Norway": {"capital": "Oslo", "population": 6, "area": 385, "founded": 872},
    "Mexico": {"capital": "Mexico City", "population": 129, "area": 1964, "founded": 1821},
}
NUMERIC = ("population", "area", "founded")


def lookup(arguments: dict) -> str:
    entity, field = arguments.get("entity"), arguments.get("field")
    if entity not in KNOWLEDGE:
        raise ToolError(f"[error] no entry {entity!r}; the table has: {', '.join(KNOWLEDGE)}")
    if field not in KNOWLEDGE[entity]:
        raise ToolError(f"[error] no field {field!r}; the fields are: {', '.join(KNOWLEDGE[entity])}")
    return str(KNOWLEDGE[entity][field])


def calculate(arguments: dict) -> str:
    """Arithmetic through the graders' whitelisted parser (never eval): + - * / ^, parentheses, sqrt."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ToolError('[error] calculator needs {"expression": "<arithmetic>"}')
    try:
        value = to_sympy(expression)
    except Exception as error:         # the parser's refusal is the model's to read
        raise ToolError(f"[error] cannot evaluate {expression!r}: {error}") from None
    if not value.is_number:
        raise ToolError(f"[error] {expression!r} is not arithmetic on numbers")
    exact = value.is_rational and value.q == 1
    return str(int(value)) if exact else f"{float(value.evalf()):.6g}"


TOOLS = [
    Tool("lookup", "Look up one fact in the knowledge table.",
         {"type": "object", "properties": {"entity": {"type": "string", "enum": list(KNOWLEDGE)},
                                           "field": {"type": "string", "enum": ["capital", *NUMERIC]}},
          "required": ["entity", "field"]}, lookup),
    Tool("calculator", "Evaluate an arithmetic expression (+ - * / ^, parentheses, sqrt).",
         {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
         calculate),
]

ON_GPU = models.gpu_defaults()
DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-1.5B-Instruct" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 10,
    "rollout.prompts_per_step": 16 if ON_GPU else 4,
    "rollout.max_turns": 4,                   # up to three tool turns, then the answer
    "rollout.max_tokens": 256 if ON_GPU else 64,
    "rollout.max_length": 2048 if ON_GPU else 1024,
    "actor.lr": 1e-6 if ON_GPU else 2e-5,
}

INSTRUCTION = "Use the tools; do not guess facts. Give the final answer in \\boxed{}."
_QUESTIONS = [  # (template, fields used, answer from the two entities' facts)
    ("How many million more people live in {a} than in {b}?", lambda a, b: a["population"] - b["population"]),
    ("What is the combined population of {a} and {b}, in millions?", lambda a, b: a["population"] + b["population"]),
    ("How many years passed between the founding of {b} and the founding of {a}?",
     lambda a, b: a["founded"] - b["founded"]),
    ("How many thousand km² larger is {a} than {b}?", lambda a, b: a["area"] - b["area"]),
]


def tasks(split: str, seed: int) -> list[data.Task]:
    """Every ordered pair of entities with every question kind, shuffled by split (train and held-out take
    disjoint pairs)."""
    pairs = [(a, b) for a in KNOWLEDGE for b in KNOWLEDGE if a != b]
    random.Random(seed).shuffle(pairs)
    cut = len(pairs) * 3 // 4
    chosen = pairs[:cut] if split == "train" else pairs[cut:]
    out = []
    for index, (a, b) in enumerate(chosen):
        for kind, (template, answer) in enumerate(_QUESTIONS):
            big, small = (a, b) if answer(KNOWLEDGE[a], KNOWLEDGE[b]) >= 0 else (b, a)
            question = template.format(a=big, b=small)
            out.append(data.Task(f"tool-use-{split}-{index}-{kind}",
                                 [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                                 str(answer(KNOWLEDGE[big], KNOWLEDGE[small]))))
    return out


class ToolUseEnv(ToolEnv):
    tools = TOOLS


class AgentRunner(EnvRunner):
    env_cls = ToolUseEnv
