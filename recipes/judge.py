# recipes/judge.py — LLM-as-judge: the policy explains a word to a child in one sentence; a frozen judge model scores
# the explanation against the rubric below, and the score (0 to 1) is the reward. GRPO.
#
# The whole recipe: the rubric, the prompts, the judge, the defaults and the agent. The judge is a frozen model
# (never updated, so the reward does not drift with the policy) served by its own embedded engine; the envs of a
# group ask it concurrently and one batching front coalesces their calls. It reads greedily and writes a score.
# Defaults: SmolLM2-135M-Instruct as policy and as judge on a CPU (a judge that small is noisy: expect the reward to
# wander rather than climb); with CUDA, Qwen2.5-0.5B-Instruct judged by Qwen2.5-7B-Instruct.
import random
import re

import torch

import data
import models
from agents import Env, EnvRunner, Result
from engines import SamplingParams
from rollout import EmbeddedEngine

ON_GPU = models.gpu_defaults()
JUDGE_MODEL = "Qwen/Qwen2.5-7B-Instruct" if ON_GPU else "smollm2"

RUBRIC = """Score the explanation from 0 to 10:
- 4 points: it is correct about the word.
- 3 points: a seven-year-old would understand every word of it.
- 2 points: it is one sentence.
- 1 point: it gives an example.
Reply with the score only, as "Score: N"."""

DEFAULTS = {
    "run.model": "Qwen/Qwen2.5-0.5B-Instruct" if ON_GPU else "smollm2",
    "run.steps": 100 if ON_GPU else 10,
    "rollout.prompts_per_step": 16 if ON_GPU else 4,
    "rollout.max_tokens": 128 if ON_GPU else 48,
    "rollout.max_length": 1024 if ON_GPU else 512,
    "actor.lr": 1e-6 if ON_GPU else 2e-5,
}

WORDS = ["gravity", "rain", "a battery", "a volcano", "sleep", "a map", "money", "the moon", "a seed", "an echo",
         "a shadow", "ice", "a magnet", "a rainbow", "a bridge", "a clock", "wind", "a fever", "a fossil", "salt"]


def tasks(split: str, seed: int) -> list[data.Task]:
    """One prompt per word; the held-out split takes the last quarter of the words."""
    words = list(WORDS)
    random.Random(seed).shuffle(words)
    cut = len(words) * 3 // 4
    return [data.Task(f"judge-{word}", [{"role": "user", "content": f"Explain {word} to a child in one sentence."}],
                      word) for word in (words[:cut] if split == "train" else words[cut:])]


class Judge:
    """A frozen model that scores a response: one greedy reply to the rubric, its first 'N' of 0..10 read back."""

    def __init__(self, name: str):
        path = models.resolve_model(name)
        self.tokenizer = models.load_tokenizer(path)
        # on a GPU the frozen judge runs there in bf16 (a 7B judge is 15 GB; in fp32 on the host it would be 30 GB
        # and minutes per score); on a CPU in fp32, like everything else there
        on_gpu = torch.cuda.is_available()
        model = models.load_model(path, torch.bfloat16 if on_gpu else torch.float32).requires_grad_(False)
        model = model.to("cuda" if on_gpu else "cpu")
        self.engine = EmbeddedEngine(model, tokenizer=self.tokenizer)   # concurrent scorers share its batch
        self.sampling = SamplingParams(temperature=1.0, top_k=1, max_tokens=8)   # top_k=1: greedy

    def score(self, word: str, response: str) -> float | None:
        messages = [{"role": "system", "content": RUBRIC},
                    {"role": "user", "content": f"Word: {word}\nExplanation: {response.strip()}"}]
        prompt = data.render_prompt_ids(self.tokenizer, messages)
        reply = self.tokenizer.decode(self.engine.generate([prompt], self.sampling)[0].token_ids,
                                      skip_special_tokens=True)
        found = re.search(r"\b(10|[0-9])\b", reply)
        return int(found.group(1)) / 10 if found else None


class JudgedEnv(Env):
    judge: Judge                                 # set by AgentRunner (one judge for every episode)

    def reset(self, task):
        self.word = task.label
        return task.messages

    def step(self, action_text: str) -> Result:
        score = self.judge.score(self.word, action_text)
        # an unreadable verdict scores 0 and is counted, so a judge that stops answering shows in the metrics
        return Result(reward=score or 0.0, score=score or 0.0, info={"judge_unreadable": float(score is None)})


class AgentRunner(EnvRunner):
    env_cls = JudgedEnv

    def __init__(self, engine, tokenizer, **kwargs):
        super().__init__(engine, tokenizer, **kwargs)
        self.env_cls = type("JudgedEnv", (JudgedEnv,), {"judge": Judge(JUDGE_MODEL)})
