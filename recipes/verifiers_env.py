# recipes/verifiers_env.py — GRPO on a verifiers environment, run as it is: a SingleTurnEnv over arithmetic word
# problems, its rubric the reward.
#
# The whole recipe: the environment (built in-process from an offline dataset, as a verifiers environment module's
# `load_environment` builds it), the defaults and the agent. agents/envs.py's VerifiersAgent runs each rollout
# through the environment's own `run_rollout`, its client on the rollout's loopback session; the rubric's
# `correct_answer` is the reward and its 0-weight `boxed` metric is logged as agent/boxed.
# Defaults: SmolLM2-135M-Instruct on a CPU (the math recipe's problems: it gets about a third right at the
# start, so every group has signal); Qwen3-0.6B with CUDA.
import verifiers as vf
from datasets import Dataset

import data
import models
from agents import ChatAgentRunner
from agents.envs import VerifiersAgent, verifiers_tasks
from agents.graders import grade

ON_GPU = models.gpu_defaults()
DEFAULTS = {
    "run.model": "Qwen/Qwen3-0.6B" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 24,
    "rollout.prompts_per_step": 16 if ON_GPU else 8,
    "rollout.temperature": 0.7,
    "rollout.max_tokens": 256 if ON_GPU else 40,
    "rollout.max_length": 1024 if ON_GPU else 256,
    "train.minibatches": 2,
    "actor.lr": 1e-6 if ON_GPU else 3e-5,
}


def _problems(seed: int) -> Dataset:
    """data.arithmetic_tasks as verifiers' question/answer rows (the question holds its \\boxed{} instruction)."""
    return Dataset.from_list([{"question": t.messages[0]["content"], "answer": t.label}
                              for t in data.arithmetic_tasks(512, seed=seed, max_operand=5)])


def load_environment(seed: int = 0) -> vf.Environment:
    parser = vf.Parser()                  # the reply's text, as it is

    def correct_answer(completion, answer) -> float:
        return grade(parser.parse_answer(completion) or "", answer)

    def boxed(completion) -> float:
        return float(vf.extract_boxed_answer(parser.parse_answer(completion) or "", strict=True) != "")

    rubric = vf.Rubric(funcs=[correct_answer, boxed], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(dataset=_problems(seed), eval_dataset=_problems(seed + 10_000), parser=parser,
                            rubric=rubric, env_id="arithmetic")


def tasks(split: str, seed: int) -> list[data.Task]:
    return verifiers_tasks(load_environment(seed), split)


class ArithmeticAgent(VerifiersAgent):
    environment = load_environment()      # its rollout loop and rubric; the rows come from tasks()


class AgentRunner(ChatAgentRunner):
    agent_cls = ArithmeticAgent
