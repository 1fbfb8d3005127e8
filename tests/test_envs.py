# Environments from other libraries, run as they are through agents/envs.py, on a real EmbeddedEngine over tiny
# Qwen3s and the BPE tokenizer: a verifiers Environment's own rollout over real loopback HTTP (its rubric the
# reward, its ToolEnv calling its tool), reasoning-gym task sets graded by their own scorers, skyrl-gym text envs
# through init / dict step. Every rollout's sampled tokens are trainable exactly once (check_sampled_once); every
# adapter's failures (a constructor, reset or step that raises, output of the wrong shape, a rewritten reply, an
# environment that ends in an error) fail only their own rollout, counted, and the run goes on.
import asyncio
import logging

import numpy as np
import pytest

import data
import models
from agents import ChatAgentRunner, EnvRunner
from agents.envs import ReasoningGymEnv, SkyRLEnv, VerifiersAgent, reasoning_gym_tasks, verifiers_tasks
from engines import SamplingParams
from invariants import check_sampled_once
from rollout import EmbeddedEngine

# the libraries are test dependencies (requirements-agents.txt, installed by ./launch.sh): missing is a failure,
# here at collection (the adapters import reasoning_gym and skyrl_gym inside a rollout, where an ImportError would
# be one more counted rollout failure)
import reasoning_gym  # noqa: E402, F401
import skyrl_gym  # noqa: E402, F401
import verifiers as vf  # noqa: E402
from datasets import Dataset  # noqa: E402  (verifiers' datasets are Hugging Face datasets)


@pytest.fixture(scope="module")
def tokenizer():
    return models.bpe_tokenizer()


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(models.tiny_model("qwen3", seed=0))


def chat_runner(agent_cls, engine, tokenizer, **kwargs) -> ChatAgentRunner:
    """What a recipe does: `class AgentRunner(ChatAgentRunner): agent_cls = MyAgent`."""
    return type("Runner", (ChatAgentRunner,), {"agent_cls": agent_cls})(engine, tokenizer, **kwargs)


def env_runner(env_cls, engine, tokenizer, **kwargs) -> EnvRunner:
    return type("Runner", (EnvRunner,), {"env_cls": env_cls})(engine, tokenizer, **kwargs)


def run_and_close(runner, tasks, sampling) -> list:
    try:
        return runner.run(tasks, [f"g{i // 2}" for i in range(len(tasks))], sampling)
    finally:
        if hasattr(runner, "server"):
            runner.server.stop()


def questions(n: int) -> Dataset:
    return Dataset.from_list([{"question": f"What is {i} + {i + 2}?", "answer": str(2 * i + 2)} for i in range(n)])


# ---- verifiers: an Environment's own rollout against the session ----

def reply_length(completion) -> float:
    """A reward the test can recompute from the sampled text: the reply's length in characters, / 100."""
    return len(completion[-1].content or "") / 100


def has_digit(completion) -> float:
    return float(any(c.isdigit() for c in completion[-1].content or ""))


def single_turn_env(**kwargs):
    rubric = vf.Rubric(funcs=[reply_length, has_digit], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=questions(4), system_prompt="Answer with a number.", rubric=rubric, **kwargs)


def test_a_verifiers_environment_runs_unchanged_and_its_rubric_is_the_reward(engine, tokenizer):
    class Agent(VerifiersAgent):
        environment = single_turn_env(sampling_args={"temperature": 0.3, "max_tokens": 2})

    tasks = verifiers_tasks(Agent.environment, "train")
    assert [t.label for t in tasks] == ["2", "4", "6", "8"] and tasks[0].messages[0]["role"] == "system"
    rollouts = run_and_close(chat_runner(Agent, engine, tokenizer), tasks, SamplingParams(0.8, max_tokens=6, seed=0))
    assert len(rollouts) == 4
    for r in rollouts:
        check_sampled_once(r.rows, r.generations)
        (gen,) = r.generations                    # one turn, one row: the rubric scored exactly what was sampled
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)       # no stop strings: the reply as sent
        assert r.reward == pytest.approx(len(text) / 100) and len(r.rows) == 1
        assert set(r.info) == {"reply_length", "has_digit", "num_turns"} and r.info["num_turns"] == 1.0
        # the run's sampling overrides the environment's sampling_args, as verifiers' own generate() does
        assert gen.sampling.temperature == 0.8
    assert max(len(r.generations[0].token_ids) for r in rollouts) > 2


def add(a: int, b: int) -> int:
    """Add two integers."""
    ADDED.append((a, b))
    return a + b


ADDED: list[tuple[int, int]] = []
TOOL_PROMPT = "Use the add tool, then give the answer in \\boxed{}."


def correct(parser, completion, answer) -> float:
    return float(f"\\boxed{{{answer}}}" in (parser.parse_answer(completion) or ""))


def tool_env():
    return vf.ToolEnv(tools=[add], max_turns=3, dataset=questions(64), system_prompt=TOOL_PROMPT,
                      rubric=vf.Rubric(funcs=[correct]))


def taught_tool_model(environment) -> str:
    """A tiny Qwen3 taught the episode as the verifiers client renders it: the prompt and the add tool (as the
    client sends it), an add call, its output, the boxed answer."""
    (tool,) = environment.tool_defs
    schema = dict(asyncio.run(vf.OpenAIChatCompletionsClient(None).to_native_tool(tool)))
    tokenizer, examples = models.bpe_tokenizer(), []
    for row in environment.get_dataset():
        i = row["example_id"]
        messages = [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "add", "arguments": {"a": i, "b": i + 2}}}]},
            {"role": "tool", "content": row["answer"]},
            {"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"}]
        examples.append((data.render_prompt_text(tokenizer, messages, tools=[schema], add_generation_prompt=False), []))
    return models.taught_tiny_model_dir("qwen3", examples)


def test_a_verifiers_tool_env_calls_its_tool_over_the_session_and_trains_each_sampled_token_once():
    class Agent(VerifiersAgent):
        environment = tool_env()

    path = taught_tool_model(Agent.environment)
    runner = chat_runner(Agent, EmbeddedEngine(models.load_model(path)), models.load_tokenizer(path), max_turns=3)
    ADDED.clear()
    rollouts = run_and_close(runner, verifiers_tasks(Agent.environment, "train")[:8], SamplingParams(max_tokens=32,
                                                                                                    seed=0))
    assert len(rollouts) == 8 and runner.failures == {}
    assert sum(r.info["add_calls"] for r in rollouts) == sum(r.info["total_tool_calls"] for r in rollouts) \
        == len(ADDED) > 0                                         # the environment ran the tool the model called
    assert max(r.num_turns for r in rollouts) >= 2
    for r in rollouts:
        check_sampled_once(r.rows, r.generations)
        assert len(r.rows) == 1                # verifiers sends the whole conversation back: it extends the record


class FailingEnv(vf.MultiTurnEnv):
    """Two turns; between them, the env fails the way its answer says: a verifiers error (the rollout goes on to
    score 0 with state['error'] set), or any other exception (run_rollout raises)."""

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] == "vf-error":
            raise vf.Error("the environment's sandbox is gone")
        if state["answer"] == "crash":
            raise ValueError("the environment's own bug")
        return [{"role": "user", "content": "Again."}]


def test_a_verifiers_environment_that_errors_or_raises_fails_only_its_own_rollout(engine, tokenizer, caplog):
    rows = Dataset.from_list([{"question": "Hi.", "answer": a} for a in ("ok", "vf-error", "crash", "ok")])

    class Agent(VerifiersAgent):
        environment = FailingEnv(dataset=rows, max_turns=2, rubric=vf.Rubric(funcs=[reply_length]))

    tasks = verifiers_tasks(Agent.environment, "train")
    stray = data.Task("not-a-verifiers-task", [{"role": "user", "content": "Hi."}], "")
    runner = chat_runner(Agent, engine, tokenizer, max_turns=2)
    with caplog.at_level(logging.WARNING, logger="tracerl.agents"):
        rollouts = run_and_close(runner, [*tasks, stray], SamplingParams(max_tokens=4, seed=0))
    assert [r.task_id for r in rollouts] == [tasks[0].task_id, tasks[3].task_id]
    assert all(r.num_turns == 2 for r in rollouts) and runner.failures == {"agent_error": 3}
    assert "the verifiers rollout ended in an error" in caplog.text and "sandbox is gone" in caplog.text
    assert "ValueError: the environment's own bug" in caplog.text
    assert "VerifiersAgent runs tasks made by agents.envs.verifiers_tasks, got Task" in caplog.text


def test_a_verifiers_rubric_that_scores_the_whole_group_is_refused_with_what_to_do_instead():
    def rank_in_group(completions, answers) -> list[float]:
        return [0.0] * len(completions)

    env = vf.SingleTurnEnv(dataset=questions(2), rubric=vf.Rubric(funcs=[rank_in_group]))
    with pytest.raises(ValueError, match=r"scores rollouts as a group.*per-rollout reward functions"):
        verifiers_tasks(env, "train")
    verifiers_tasks(single_turn_env(), "train")             # the same env with a per-rollout rubric is taken


# ---- reasoning-gym: procedural task sets with their own scorers ----

ARITHMETIC = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",))


def test_reasoning_gym_tasks_are_the_datasets_problems_and_its_scorer_grades_them():
    tasks = reasoning_gym_tasks("basic_arithmetic", 8, seed=3, **ARITHMETIC)
    again, other = (reasoning_gym_tasks("basic_arithmetic", 8, seed=s, **ARITHMETIC) for s in (3, 4))
    assert [t.messages for t in tasks] == [t.messages for t in again] != [t.messages for t in other]
    assert all(t.label == t.entry["answer"] and t.messages[-1]["content"] == t.entry["question"] for t in tasks)
    env = ReasoningGymEnv()
    env.reset(tasks[0])
    right = env.step(f"It is <answer>{tasks[0].label}</answer>")
    wrong = env.step(f"<answer>{int(tasks[0].label) + 1}</answer>")
    untagged = env.step(tasks[0].label)                      # reasoning-gym's extraction needs its tags
    assert (right.reward, wrong.reward, untagged.reward) == (1.0, 0.0, 0.0)
    assert (right.info, untagged.info) == ({"answered": 1.0}, {"answered": 0.0})


def test_reasoning_gym_rollouts_are_scored_by_the_dataset_on_what_was_sampled(engine, tokenizer):
    from reasoning_gym.utils import extract_answer
    tasks = reasoning_gym_tasks("basic_arithmetic", 4, seed=0, **ARITHMETIC)
    stray = data.Task("not-a-reasoning-gym-task", [{"role": "user", "content": "Hi."}], "")
    runner = env_runner(ReasoningGymEnv, engine, tokenizer)
    rollouts = run_and_close(runner, [*tasks, stray], SamplingParams(max_tokens=8, seed=0))
    assert len(rollouts) == 4 and runner.failures == {"reset_error": 1}
    for r, task in zip(rollouts, tasks):
        check_sampled_once(r.rows, r.generations)
        text = tokenizer.decode(r.generations[0].token_ids, skip_special_tokens=True)
        assert r.reward == r.score == task.dataset.score_answer(extract_answer(text), task.entry)


# ---- skyrl-gym: text envs through init / dict step ----

FINAL_ASK = "Now provide only the final numeric answer in the exact format: '#### ANSWER'."   # gsm8k_multi_turn's


class GSM8k(SkyRLEnv):
    env_id = "gsm8k"


class GSM8kTwoTurns(SkyRLEnv):
    env_id = "gsm8k_multi_turn"

    def extras(self, task) -> dict:
        return {**super().extras(task), "max_turns": 2}


def gsm8k_tasks(*labels: str) -> list[data.Task]:
    return [data.Task(f"gsm8k-{i}-{label}", [{"role": "user", "content": "How many? End with '#### N'."}], label)
            for i, label in enumerate(labels)]


def test_a_skyrl_text_env_is_an_env_its_reward_turns_and_metrics_as_skyrl_gives_them():
    env = GSM8k()
    assert env.reset(gsm8k_tasks("7")[0]) == gsm8k_tasks("7")[0].messages
    assert env.step("So #### 7").reward == 1.0 and env.step("So #### 8").reward == 0.0
    two = GSM8kTwoTurns()
    two.reset(gsm8k_tasks("7")[0])
    first = two.step("I think 8.")
    assert not first.terminated and first.reward == 0.0
    # skyrl's observation message, as a ChatML user turn (its text marked plain: text stays text)
    assert first.observation == f"\n<|im_start|>user\n{data.plain(FINAL_ASK)}<|im_end|>\n<|im_start|>assistant\n"
    last = two.step("#### 7")
    assert last.terminated and last.reward == 1.0 and last.info == {"steps": 2.0}   # get_metrics() at the end


def test_skyrl_multi_turn_rollouts_through_the_engine_train_each_sampled_token_once(engine, tokenizer):
    runner = env_runner(GSM8kTwoTurns, engine, tokenizer, max_turns=4)
    rollouts = run_and_close(runner, gsm8k_tasks("7", "9"), SamplingParams(max_tokens=6, seed=0))
    assert len(rollouts) == 2
    for r in rollouts:                        # a random model never answers: both of the env's turns are used
        check_sampled_once(r.rows, r.generations)
        assert r.num_turns == 2 and len(r.rows) == 1 and r.info == {"steps": 2.0}
        context = tokenizer.decode([t for t, keep in zip(r.rows[0].token_ids, r.rows[0].trainable) if not keep])
        assert FINAL_ASK in context                                             # the observation, as context


class BrokenSkyRL(SkyRLEnv):
    """gsm8k_multi_turn, broken the way the task's label says."""
    env_id = "gsm8k_multi_turn"

    def extras(self, task) -> dict:
        if task.label == "no-max-turns":      # the env's constructor reads extras["extra_info"]: a KeyError
            return super().extras(task)
        return {**super().extras(task), "max_turns": 2}

    def reset(self, task):
        prompt = super().reset(task)
        kind, step = task.label, self.env.step
        if kind == "raises":
            self.env.step = lambda action: 1 / 0
        elif kind == "tuple":
            self.env.step = lambda action: ([], 0.0, True, {})
        elif kind == "rewrites":
            self.env.step = lambda action: {**step(action), "postprocessed_action": action[:1]}
        elif kind == "assistant":
            self.env.step = lambda action: {**step(action), "observations": [{"role": "assistant", "content": "x"}]}
        elif kind == "metadata-list":
            self.env.step = lambda action: {**step(action), "metadata": ["not", "a", "dict"]}
        elif kind == "numpy-metadata":     # not broken: numpy numbers are logged, text is left out
            self.env.step = lambda action: {**step(action), "metadata": {"n": np.int64(2), "note": "x"}}
        return prompt


def test_a_skyrl_env_that_raises_returns_the_wrong_shape_or_rewrites_the_reply_fails_only_its_rollout(
        engine, tokenizer, caplog):
    runner = env_runner(BrokenSkyRL, engine, tokenizer, max_turns=2)
    kinds = ("7", "no-max-turns", "raises", "tuple", "rewrites", "assistant", "metadata-list", "numpy-metadata")
    with caplog.at_level(logging.WARNING, logger="tracerl.agents"):
        rollouts = run_and_close(runner, gsm8k_tasks(*kinds), SamplingParams(max_tokens=4, seed=0))
    assert [r.task_id for r in rollouts] == ["gsm8k-0-7", "gsm8k-7-numpy-metadata"]
    assert all(r.num_turns == 2 for r in rollouts) and rollouts[1].info == {"n": 2.0, "steps": 2.0}
    assert runner.failures == {"reset_error": 1, "step_error": 5}
    for said in ("KeyError: 'extra_info'", "ZeroDivisionError", "must return a dict with observations",
                 "replaced the model's reply (postprocessed_action)", "observations must be user messages",
                 "info must be a dict of name -> number, got list"):
        assert said in caplog.text

