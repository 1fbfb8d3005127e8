# agents — the agent contract: an agent is an ordinary Python program.
#
# Owns: `Env` (Gymnasium-aligned reset/step), `Result` (what a step returns), `Rollout` (what an episode
# hands the trainer), `EnvRunner` (drives Env episodes through the engine and the token ledger) and
# `load_agent_runner` (a recipe names one module that exports `AgentRunner`; reward is ordinary code).
#
# Keeps invariant 1: the runner never re-tokenizes an action. Sampled ids go from the engine straight
# into the rollout's `TokenLedger`; the action text handed to `step()` is a decoding for the env's eyes
# only. Observations are tokenized once and appended as context (never trainable).
# Never: computes advantages or touches weights. A failing or hanging env loses only its own rollout:
# the failure is counted and logged, and the group goes on.
from __future__ import annotations

import importlib.util
import logging
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor, TimeoutError as StepTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import invariants
from rollout import SamplingParams

log = logging.getLogger("tracerl.agents")


# ---- the contract an agent author writes against ----------------------------------------------------

@dataclass
class Result:
    """What `Env.step` returns (Gymnasium's step tuple, named)."""
    reward: float                              # this turn's reward; an episode's reward is the sum over turns
    observation: str = ""                      # text appended as context before the next turn; the env
                                               # writes its own chat glue (e.g. "\n<|im_start|>user\n...")
    terminated: bool = True                    # the episode reached an end state
    truncated: bool = False                    # the episode was cut short (turn or length budget)
    info: dict[str, float] = field(default_factory=dict)   # numeric extras, logged per step
    score: float | None = None                 # the metric to report (accuracy); defaults to reward
    images: list | None = None                 # images shown with the observation (VLM recipes)
    sampling_params: dict[str, Any] | None = None  # per-turn overrides of SamplingParams for later turns


class Env:
    """One episode of an environment. A fresh instance is made per rollout.

    reset(task) -> the first observation as chat messages (rendered with the model's chat template)
    step(action_text) -> Result
    """

    def reset(self, task) -> list[dict]:
        return task.messages

    def step(self, action_text: str) -> Result:
        raise NotImplementedError("an Env must implement step(action_text) -> Result")


@dataclass
class Rollout:
    """One finished episode: its training rows (segments) and its outcome."""
    rollout_id: str
    group_id: str
    task_id: str
    rows: list[invariants.Segment]             # the ledger's segments with sampled tokens
    reward: float
    score: float
    num_turns: int
    truncated: bool
    info: dict[str, float] = field(default_factory=dict)


# ---- the Env runner ----------------------------------------------------------------------------------

@dataclass
class _Episode:
    env: Env
    task: Any
    ledger: invariants.TokenLedger
    sampling: SamplingParams
    reward: float = 0.0
    score: float | None = None
    turns: int = 0
    truncated: bool = False
    done: bool = False
    failed: str = ""
    info: dict[str, float] = field(default_factory=dict)


class EnvRunner:
    """Runs a group of Env episodes in lockstep: every turn, all live episodes sample together in one
    batched engine call. Subclass with `env_cls = MyEnv` and export it as `AgentRunner`."""

    env_cls: type[Env] = Env

    def __init__(self, engine, tokenizer, max_turns: int = 1, max_length: int = 1024,
                 step_timeout_s: float = 60.0):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_turns, self.max_length, self.step_timeout_s = max_turns, max_length, step_timeout_s
        self.failures: dict[str, int] = {}     # reason -> count, over the runner's life
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="env-step")

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> list[Rollout]:
        """One rollout per (task, group id). Failed episodes are counted and left out of the result."""
        import data   # the chat template lives with the data; imported here so agents/ stays light
        episodes = []
        for task, group_id in zip(tasks, group_ids):
            ep = _Episode(self.env_cls(), task, invariants.TokenLedger(uuid.uuid4().hex[:12], group_id), sampling)
            messages = self._call(ep, "reset", ep.env.reset, task)
            if not ep.failed:
                ep.ledger.extend_or_seal(data.render_prompt_ids(self.tokenizer, messages))
            episodes.append(ep)
        while live := [ep for ep in episodes if not (ep.done or ep.failed)]:
            self._turn(live)
        return [self._to_rollout(ep) for ep in episodes if not ep.failed]

    def _turn(self, live: list[_Episode]) -> None:
        prompts, params = [], []
        for ep in live:
            room = self.max_length - len(ep.ledger.open_token_ids)
            if room < 1:
                ep.done = ep.truncated = True
                continue
            prompts.append(ep.ledger.open_token_ids)
            params.append(replace(ep.sampling, max_tokens=min(ep.sampling.max_tokens, room)))
        live = [ep for ep in live if not ep.done]
        if not live:
            return
        for ep, gen in zip(live, self.engine.generate(prompts, params)):
            ep.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions)
            if gen.routes is not None:
                ep.ledger.absorb_routes(gen.routes)
            ep.turns += 1
            action_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            result = self._call(ep, "step", ep.env.step, action_text)
            if ep.failed:
                continue
            ep.reward += float(result.reward)
            ep.score = result.score if result.score is not None else ep.reward
            ep.info.update({k: float(v) for k, v in result.info.items()})
            out_of_turns = ep.turns >= self.max_turns
            ep.truncated = result.truncated or (out_of_turns and not result.terminated)
            ep.done = result.terminated or result.truncated or out_of_turns
            if not ep.done:
                if result.sampling_params:
                    ep.sampling = replace(ep.sampling, **result.sampling_params)
                ep.ledger.append_context(self.tokenizer.encode(result.observation, add_special_tokens=False))

    def _call(self, ep: _Episode, what: str, fn, arg):
        """Run agent code with a time limit; an exception or a hang fails this rollout only."""
        try:
            return self._pool.submit(fn, arg).result(timeout=self.step_timeout_s)
        except StepTimeout:
            reason = f"{what}_timeout"
            log.warning("env %s exceeded %.0f s (rollout %s dropped)", what, self.step_timeout_s,
                        ep.ledger.rollout_id)
            # the hung thread cannot be killed; give later calls a fresh pool so they never queue behind it
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="env-step")
        except Exception as exc:  # agent code is arbitrary: any error is this rollout's failure
            reason = f"{what}_error"
            log.warning("env %s raised %s: %s (rollout %s dropped)", what, type(exc).__name__, exc,
                        ep.ledger.rollout_id)
        ep.failed = reason
        self.failures[reason] = self.failures.get(reason, 0) + 1
        return None

    def _to_rollout(self, ep: _Episode) -> Rollout:
        return Rollout(ep.ledger.rollout_id, ep.ledger.group_id, ep.task.task_id, ep.ledger.rows(),
                       ep.reward, ep.score if ep.score is not None else ep.reward, ep.turns, ep.truncated,
                       ep.info)


# ---- loading a recipe's agent ------------------------------------------------------------------------

def load_agent_runner(path: str) -> type:
    """Import the Python file at `path` and return its `AgentRunner` class."""
    spec = importlib.util.spec_from_file_location(f"agent_{uuid.uuid4().hex[:8]}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import an agent from {path!r}: expected a path to a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise ValueError(f"{path} does not export AgentRunner; add e.g. `class AgentRunner(EnvRunner): env_cls = MyEnv`")
    return runner
