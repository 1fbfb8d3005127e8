# recipes/math_retry.py — PPO with a critic (GAE) on arithmetic with a second chance: a wrong first answer is told
# so and may try again, so an episode is two turns with the env's reply between them.
#
# The whole recipe: the defaults it changes, and the agent. Tasks are recipes/math.py's. A right first answer earns
# 1, a right retry RETRY_REWARD: the reward arrives at the episode's end, and what the first turn's tokens deserve
# is the question per-token credit answers (the critic's V at each token; the feedback between the turns is an
# observation, transparent to GAE: algo.py). `--algo.estimator grpo` runs the same episodes with GRPO's one
# advantage per rollout, for a comparison (docs/critic.md).
from agents import Env, EnvRunner, Result, user_turns
from agents.graders import extract_final_answer, grade
from recipes.math import tasks  # noqa: F401  (read from this module: config.py, train.py)

RETRY_REWARD = 0.5
FEEDBACK = "That is not right. Think again and give the final answer."

DEFAULTS = {
    "run.model": "smollm2",
    "run.steps": 24,
    "rollout.temperature": 0.7,
    "rollout.max_tokens": 40,
    "rollout.max_turns": 2,           # an answer and one retry
    "rollout.max_length": 384,
    "actor.lr": 3e-5,
    "algo.estimator": "gae",
}


class RetryEnv(Env):
    def reset(self, task):
        self.label, self.turn = task.label, 0
        return task.messages

    def step(self, action_text: str) -> Result:
        self.turn += 1
        right = grade(action_text, self.label)
        answered = float(extract_final_answer(action_text) is not None)
        if right or self.turn >= 2:
            reward = right * (1.0 if self.turn == 1 else RETRY_REWARD)
            return Result(reward=reward, score=right, info={"answered": answered, "retried": float(self.turn > 1)})
        return Result(reward=0.0, observation=user_turns([FEEDBACK]), terminated=False,
                      info={"answered": answered, "retried": 1.0})


class AgentRunner(EnvRunner):
    env_cls = RetryEnv
