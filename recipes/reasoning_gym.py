# recipes/reasoning_gym.py — GRPO on a reasoning-gym procedural task set, graded by its own scorer.
#
# The whole recipe: the dataset and its config, the defaults and the agent. agents/envs.py's reasoning_gym_tasks
# makes the problems (train and held-out from disjoint seeds) and ReasoningGymEnv grades each reply with
# reasoning-gym's <answer> extraction and the dataset's score_answer; agent/answered is the fraction of replies
# that used the tags. `--run.data NAME` picks another of reasoning-gym's datasets (at its default config, with
# reasoning-gym's default prompt).
# Defaults: SmolLM2-135M-Instruct on a CPU, one-digit sums after two worked examples; with CUDA,
# Qwen3-0.6B on two- to three-term arithmetic with reasoning-gym's own prompt.
import data
import models
from agents import EnvRunner
from agents.envs import ReasoningGymEnv, reasoning_gym_tasks

ON_GPU = models.gpu_defaults()
DATASET = "basic_arithmetic"
CONFIG = ({"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2} if ON_GPU else
          {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+",),
           "allow_negation": False, "allow_parentheses": False})
TAGS = " Answer in <answer></answer> tags."
SHOTS = [("Calculate 2 + 5.", "7"), ("Calculate 3 + 1.", "4")]


def few_shot_prompt(question: str) -> list[dict]:
    """Two worked examples, then the question. On 64 training problems (temperature 0.7) SmolLM2-135M used the
    tags in no reply under reasoning-gym's own system prompt, and in all 64 after these examples (mean score 0.18)."""
    shots = [m for q, a in SHOTS for m in ({"role": "user", "content": q + TAGS},
                                           {"role": "assistant", "content": f"<answer>{a}</answer>"})]
    return [*shots, {"role": "user", "content": question + TAGS}]


DEFAULTS = {
    "run.model": "Qwen/Qwen3-0.6B" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 24,
    "rollout.prompts_per_step": 16 if ON_GPU else 8,
    "rollout.temperature": 1.0,              # the worked examples make the answers peaked: keep groups varied
    "rollout.max_tokens": 256 if ON_GPU else 24,
    "rollout.max_length": 1024 if ON_GPU else 256,
    "train.minibatches": 2,
    "actor.lr": 1e-6 if ON_GPU else 1e-5,    # 3e-5 collapsed the entropy in one step (0.30 -> 0.02): one answer
}


def tasks(split: str, seed: int, source: str = "") -> list[data.Task]:
    seed = seed if split == "train" else seed + 10_000
    if source:               # another reasoning-gym dataset, at its own default config and prompt
        return reasoning_gym_tasks(source, 1024, seed)
    return reasoning_gym_tasks(DATASET, 1024, seed, prompt=None if ON_GPU else few_shot_prompt, **CONFIG)


class AgentRunner(EnvRunner):
    env_cls = ReasoningGymEnv
