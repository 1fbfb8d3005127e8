# agents/envs.py — environments from other libraries, taken as they are: verifiers, reasoning-gym, skyrl-gym.
#
# Owns three adapters, one per library, each a thin translation into tracerl's agent contract (agents/__init__.py):
#   - verifiers: an `Environment` runs its own rollout against an AsyncOpenAI client pointed at the rollout's
#     loopback session (`VerifiersAgent`, a ChatAgent), and its rubric's score is the reward; `verifiers_tasks`
#     turns its dataset rows into tasks.
#   - reasoning-gym: a procedural dataset is a task set (`reasoning_gym_tasks`), each task graded by the scorer of
#     the dataset that made it (`ReasoningGymEnv`, an Env).
#   - skyrl-gym: a text env (BaseTextEnv: `init(prompt)`, a dict-returning `step(action)`) runs as an Env
#     (`SkyRLEnv`).
# Keeps invariant 1 as every agent does: the libraries see decoded text, never the token record; what the
# loopback session or the EnvRunner sampled is what trains. An adapter never rewrites an action: a skyrl env that
# would replace the model's reply (postprocessed_action) fails its rollout instead, since training on text the
# model did not sample would break token identity.
# Never: scores anything itself (each library's own scorer or rubric is the reward), or makes a library's error
# pass: an environment that raises, or a verifiers rollout that ends in an error, fails only its own rollout
# (counted by the runner); a verifiers environment whose rubric needs the whole group is refused up front.
# Each library is imported where its adapter is first used: all three are optional (requirements-agents.txt),
# and verifiers alone takes seconds to import.
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

import data
from agents import ChatAgent, ChatContext, Env, Result, info_numbers, user_turns


# ---- verifiers: an Environment's own rollout, against the session's endpoint ----------------------------

@dataclass
class VerifiersTask(data.Task):
    row: dict = field(default_factory=dict)    # the dataset row as the environment's rollout() takes it (prompt,
                                               # answer, info, example_id, ...)


def verifiers_tasks(environment, split: str) -> list[VerifiersTask]:
    """A verifiers Environment's dataset ("train") or eval dataset (any other split; verifiers itself falls back
    to the dataset when there is none) as tasks. Refuses an environment whose rubric scores a whole group or
    hands out advantages: tracerl runs each rollout of a group in its own session and computes the advantages."""
    if environment.requires_group_rollouts or environment.provides_advantages:
        raise ValueError(f"{type(environment).__name__}'s rubric scores rollouts as a group (group reward functions "
                         f"or advantages); tracerl scores each rollout alone and computes advantages itself: give "
                         f"the rubric per-rollout reward functions (Rubric(funcs=[f]) with f(completion, answer))")
    rows = environment.get_dataset() if split == "train" else environment.get_eval_dataset()
    name = environment.env_id or type(environment).__name__
    return [VerifiersTask(f"{name}-{split}-{row['example_id']}", list(row["prompt"]), str(row.get("answer", "")),
                          row=dict(row)) for row in rows]


class VerifiersAgent(ChatAgent):
    """One rollout of a verifiers Environment: its `run_rollout` (its own turn loop, tools and rubric) with an
    AsyncOpenAI client on the rollout's session; the rubric's reward is the reward, its metrics go to `info`.
    Subclass with `environment = <a verifiers Environment>` and run it through a ChatAgentRunner on tasks from
    `verifiers_tasks`. The rollout's sampling (temperature, top_p, max_tokens) overrides the environment's
    `sampling_args`, as verifiers' own trainer-facing `generate` does."""

    environment: Any = None

    async def run(self, ctx: ChatContext) -> Result:
        import verifiers as vf
        if not isinstance(ctx.task, VerifiersTask):
            raise TypeError(f"VerifiersAgent runs tasks made by agents.envs.verifiers_tasks, got "
                            f"{type(ctx.task).__name__}")
        sampling = {**self.environment.sampling_args, **ctx.sampling_params}
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
            output = await self.environment.run_rollout(ctx.task.row, vf.OpenAIChatCompletionsClient(client),
                                                        ctx.model_name, sampling)
        error = output.get("error")
        if error is not None:                 # verifiers scores it 0 and goes on; a broken episode is no sample
            detail = error.get("error_chain_repr", error) if isinstance(error, dict) else error
            raise RuntimeError(f"the verifiers rollout ended in an error: {detail}")
        return Result(reward=float(output["reward"]), truncated=bool(output.get("is_truncated")),
                      info=info_numbers(output.get("metrics")))


# ---- reasoning-gym: procedural datasets with their own scorers --------------------------------------------

@dataclass
class ReasoningGymTask(data.Task):
    entry: dict = field(default_factory=dict)  # the dataset's item: question, answer, metadata
    dataset: Any = None                        # the reasoning_gym dataset that made it: its score_answer grades


def reasoning_gym_tasks(name: str, size: int, seed: int, prompt: Callable[[str], list[dict]] | None = None,
                        **config) -> list[ReasoningGymTask]:
    """`size` problems of reasoning_gym's dataset `name` (its config fields as keyword arguments), made from
    `seed` (take disjoint seeds for train and held-out). `prompt(question)` gives the chat messages; by default
    reasoning-gym's own system prompt (which asks for the answer in <answer></answer> tags) and the question."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS
    dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    prompt = prompt or (lambda question: [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                                          {"role": "user", "content": question}])
    return [ReasoningGymTask(f"{name}-{seed}-{i}", prompt(entry["question"]), str(entry["answer"]), entry=entry,
                             dataset=dataset) for i, entry in enumerate(dataset)]


class ReasoningGymEnv(Env):
    """One answer, graded by the task's dataset: reasoning-gym's own <answer> extraction and score_answer (a score
    in [0, 1]: partial credit where the dataset gives it) is the reward."""

    def reset(self, task: ReasoningGymTask) -> list[dict]:
        if not isinstance(task, ReasoningGymTask):
            raise TypeError(f"ReasoningGymEnv runs tasks made by agents.envs.reasoning_gym_tasks, got "
                            f"{type(task).__name__}")
        self.task = task
        return task.messages

    def step(self, action_text: str) -> Result:
        from reasoning_gym.utils import extract_answer
        answer = extract_answer(action_text)
        score = float(self.task.dataset.score_answer(answer, self.task.entry))
        return Result(reward=score, score=score, info={"answered": float(answer is not None)})


# ---- skyrl-gym: a text env through its init / dict-returning step ------------------------------------------

class SkyRLEnv(Env):
    """A skyrl-gym text env as an Env. Subclass with `env_id` (an id in skyrl_gym's registry, e.g. "gsm8k") and,
    where the env reads one, `env_config`; `extras(task)` is the per-task dict its constructor takes (default:
    skyrl's reward_spec with the task's label as ground truth). The env is made in reset, on the runner's worker
    thread, so a constructor that raises (or hangs) fails only that rollout. Observations must be user messages
    (skyrl's convention); each becomes a ChatML user turn. `metadata` numbers and, at the end, `get_metrics()`
    numbers go to `info`."""

    env_id: str = ""
    env_config: Any = None

    def extras(self, task) -> dict:
        return {"reward_spec": {"method": "rule", "ground_truth": task.label}}

    def reset(self, task) -> list[dict]:
        import skyrl_gym
        self.env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=self.extras(task))
        prompt, _ = self.env.init(task.messages)
        return prompt

    def step(self, action_text: str) -> Result:
        try:
            result = self._result(self.env.step(action_text), action_text)
        except BaseException:
            self.env.close()
            raise
        if result.terminated:
            result.info.update(info_numbers(self.env.get_metrics()))
            self.env.close()
        return result

    def _result(self, out, action_text: str) -> Result:
        if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
            raise TypeError(f"{type(self.env).__name__}.step must return a dict with observations, reward, done "
                            f"and metadata (BaseTextEnvStepOutput), got {out!r:.120}")
        postprocessed = out.get("postprocessed_action")
        if postprocessed is not None and postprocessed != action_text:
            raise ValueError(f"{type(self.env).__name__} replaced the model's reply (postprocessed_action): tracerl "
                             f"trains on the tokens the model sampled and never on rewritten text; end the reply "
                             f"where the env wants it with stop strings instead (SamplingParams.stop, per turn "
                             f"through Result.sampling_params)")
        observations = list(out["observations"] or [])
        roles = [m.get("role") if isinstance(m, dict) else None for m in observations]
        if any(role != "user" or not isinstance(m.get("content"), str) for role, m in zip(roles, observations)):
            raise ValueError(f"{type(self.env).__name__}'s observations must be user messages "
                             f"{{'role': 'user', 'content': str}}, got roles {roles}")
        done = bool(out["done"])
        glue = "" if done else user_turns([m["content"] for m in observations])
        return Result(float(out["reward"]), glue, terminated=done, info=info_numbers(out.get("metadata")))
