# recipes/distill.py — on-policy distillation: the student samples answers to arithmetic word problems, and every
# sampled token is pushed toward a frozen teacher by its per-token reverse KL, log pi_teacher - log pi_student
# (algo.distill_advantages; Agarwal et al. 2024, "On-Policy Distillation of Language Models"). No reward: the
# env only ends the episode. The number to watch is kl/k3_to_reference, which should fall.
#
# The whole recipe: the teacher, the defaults and the agent. Teacher and student share one tokenizer.
# Defaults: on a CPU, a random 2-layer Qwen3 student and a teacher of the same shape taught to answer the problems
# in the recipe's format (both use the in-process BPE tokenizer); with CUDA, Qwen3-0.6B distilled from
# Qwen3-1.7B.
import data
import models
from agents import Env, EnvRunner, Result
from recipes.math import tasks  # noqa: F401  (the math recipe's problems; train.py reads tasks from this module)

ON_GPU = models.gpu_defaults()
CPU_TEACHER = "tiny-qwen3-teacher"

DEFAULTS = {
    "run.model": "Qwen/Qwen3-0.6B" if ON_GPU else "tiny-qwen3",
    "run.ref_model": "Qwen/Qwen3-1.7B" if ON_GPU else CPU_TEACHER,
    "run.steps": 100 if ON_GPU else 20,
    "rollout.prompts_per_step": 16 if ON_GPU else 8,
    "rollout.max_tokens": 256 if ON_GPU else 16,
    "rollout.max_length": 1024 if ON_GPU else 256,
    "actor.lr": 1e-6 if ON_GPU else 5e-3,      # the tiny student: mean k3 1.76 -> 0.78 (first vs last 5 of 20 steps)
    "algo.estimator": "on_policy_distill",
    "algo.kl_coef": 1.0,                     # the distillation strength: advantage = kl_coef * (log teacher - log student)
}


def taught_teacher() -> str:
    """A tiny Qwen3 taught to answer the math recipe's problems with a boxed number (its own format; the teacher
    needs to be better than the random student, not good)."""
    tokenizer = models.bpe_tokenizer()
    examples = []
    for task in data.arithmetic_tasks(256, seed=777, max_operand=5):
        messages = [*task.messages, {"role": "assistant", "content": f"The answer is \\boxed{{{task.label}}}."}]
        examples.append((data.render_prompt_text(tokenizer, messages, add_generation_prompt=False), []))
    return models.taught_tiny_model_dir("qwen3", examples, steps=150)


models.MODEL_NAMES[CPU_TEACHER] = taught_teacher


class DistillEnv(Env):
    def step(self, action_text: str) -> Result:
        return Result(reward=0.0)            # the teacher's logprobs are the whole signal


class AgentRunner(EnvRunner):
    env_cls = DistillEnv
