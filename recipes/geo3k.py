# recipes/geo3k.py — geometry with diagrams: a vision-language model reads the figure, may run Python in the
# sandbox for a few turns, sees what it printed, and answers in \boxed{} (or <answer>); GRPO on the graded answer.
#
# The whole recipe: where its model and data come from, the defaults it changes, the tasks, and the agent (a
# ToolEnv with the `python` tool; recipes/geo3k_chat.py is the same agent written against the OpenAI SDK).
# Defaults: with CUDA and a reachable hub, Qwen2.5-VL-3B-Instruct on hiyouga/geometry3k (a learning run). Without
# them, a tiny Qwen2.5-VL taught only the tool-call format, on the synthetic geo3k: a pipeline run that exercises
# every stage (images, tool calls, the sandbox, multi-turn ledgers, training) in minutes and learns nothing.
from __future__ import annotations

import torch

import data
import models
from agents import EnvRunner
from agents.graders import to_sympy
from agents.tools import ToolEnv, python_tool

GPU_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
CPU_MODEL = "tiny-qwen2.5-vl-geo3k"
HUB_DATA = "hiyouga/geometry3k"
SYNTHETIC_ROWS = {"train": 512, "validation": 100, "test": 100}


ON_GPU = models.gpu_defaults()

# Overrides of the config's defaults (config.py); any of them can still be changed with --section.key value.
DEFAULTS = {
    "run.model": GPU_MODEL if ON_GPU else CPU_MODEL,
    "run.steps": 100 if ON_GPU else 3,
    "rollout.prompts_per_step": 16 if ON_GPU else 2,
    "rollout.samples_per_prompt": 8 if ON_GPU else 2,
    "rollout.max_turns": 3,                          # the turn budget: two tool calls, then an answer
    "rollout.max_tokens": 768 if ON_GPU else 64,     # per turn; a tool call of the tiny model is ~45 tokens
    "rollout.max_length": 6144 if ON_GPU else 1024,
    "actor.lr": 1e-6 if ON_GPU else 1e-4,
    "actor.micro_batch_size": 2 if ON_GPU else 4,
}


# ---- data ----

def tasks(split: str, seed: int, source: str = "") -> list[data.Task]:
    """`source`: "" = hiyouga/geometry3k when `datasets` is installed and the hub answers, else the synthetic set;
    "synthetic"; a hub name; or a local copy's folder. An explicit source that fails is an error."""
    if not source:
        why = "`datasets` is not installed" if not _has_datasets() else "no hub" if not models.hub_reachable() else ""
        source = "synthetic" if why else HUB_DATA
    else:
        why = "asked for"
    if source == "synthetic":
        rows = data.synthetic_geo3k(split, SYNTHETIC_ROWS.get(split, 100), seed)
        print(f"geo3k data: the synthetic geo3k ({why}): {len(rows)} {split} diagrams drawn with PIL", flush=True)
    else:
        rows = data.load_geo3k(split, source)
        print(f"geo3k data: {source}, {len(rows)} {split} rows", flush=True)
    return [data.geo3k_task(row, f"geo3k-{split}-{index}") for index, row in enumerate(rows)]


def _has_datasets() -> bool:
    try:
        import datasets  # noqa: F401
        return True
    except ImportError:
        return False


def notice(cfg: dict) -> str:
    """What this run is, printed before it starts (train.py prints what the python tool's sandbox enforces)."""
    model = cfg["run"].model
    if model != CPU_MODEL:
        return f"geo3k: model {model}"
    why = "no CUDA device" if not torch.cuda.is_available() else "the model hub is not reachable"
    return (f"geo3k: a PIPELINE run, not a learning run ({why}): the model is {CPU_MODEL}, a 2-layer random-init "
            f"Qwen2.5-VL taught only the shape of a python tool call and a boxed answer; it exercises images, tool "
            f"calls in the sandbox, multi-turn rollouts and training, and learns nothing. With CUDA and the hub the "
            f"default is {GPU_MODEL}; or pass --model.")


# ---- the CPU model: a tiny VLM that writes tool calls ----

def _demonstration(tokenizer, row: dict) -> tuple[str, list]:
    """One rendered conversation and its image: the question with its diagram, a python call that prints the
    answer, its output, and the boxed answer."""
    value = to_sympy(row["answer"])
    code = f"from sympy import *\nprint({value})"
    messages = [*data.geo3k_task(row, "demonstration").messages,
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "python",
                                                                               "arguments": {"code": code}}}]},
                {"role": "tool", "content": str(value)},
                {"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}]
    text = data.render_prompt_text(tokenizer, messages, tools=[python_tool().schema], add_generation_prompt=False)
    return text, row["images"]


def taught_tiny_vlm() -> str:
    tokenizer = models.bpe_tokenizer()
    rows = data.synthetic_geo3k("train", 64, seed=12345)
    return models.taught_tiny_model_dir("qwen2_5_vl", [_demonstration(tokenizer, row) for row in rows])


models.MODEL_NAMES[CPU_MODEL] = taught_tiny_vlm


# ---- the agent ----

class Geo3kEnv(ToolEnv):
    tools = [python_tool()]


class AgentRunner(EnvRunner):
    env_cls = Geo3kEnv
