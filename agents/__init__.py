# agents — the agent contract: an agent is an ordinary Python program.
#
# Owns: `Env` (Gymnasium-aligned reset/step), `GymEnv` (drives a gymnasium-style env, with its (obs, info) and
# 5-tuple returns, as an Env), `Result` (what a step returns), `Rollout` (what an episode
# hands the trainer), `EnvRunner` (drives Env episodes through the engine and the token ledger), the
# ChatAgent form (`ChatAgent`, `ChatContext`, `ChatAgentRunner`: the agent talks to a stock OpenAI or
# Anthropic SDK at a per-rollout loopback session, which closes when the rollout ends however it ends; the agent
# gets that session's URL and key, never the server's admin key, which opens sessions), `load_agent_runner` (a
# recipe names one module that exports `AgentRunner`; reward is ordinary code) and `info_numbers` (the real numbers
# of an env's info: the ones logged). Adapters for other libraries' environments (verifiers, reasoning-gym,
# skyrl-gym) are agents/envs.py.
#
# Keeps invariant 1: the runner never re-tokenizes an action. Sampled ids go from the engine straight
# into the rollout's `TokenLedger`; the action text handed to `step()` is a decoding for the env's eyes
# only. Observations are tokenized once and appended as context (never trainable). Images (a task's, or an
# observation's) are processed once into `ImageInput`s, their single pad ids expanded to the images' tokens,
# and the same objects go to the engine and into the ledger (hence to the trainer).
# Never: computes advantages or touches weights. A failing or hanging env loses only its own rollout:
# the failure is counted and logged, and the group goes on.
#
# One package, two folders: the OpenAI Agents SDK (PyPI `openai-agents`) also installs a top-level package named
# `agents`, and only one package of a name can be imported in a process. So this package is also the SDK's: when
# the SDK is installed, its folder joins this package's `__path__` (after ours) and its `__init__` runs once, as
# the submodule `agents._openai_agents`, whose public names (its `__all__`: Agent, Runner, function_tool, ...) are
# bound here. A recipe's `from agents import Agent, Runner` and `from agents import ChatAgent, Result` both work,
# and so do the SDK's own submodules (`agents.models.openai_chatcompletions`, `agents.function_schema`, which
# verifiers' ToolEnv imports), each imported once under its own name. The one submodule both packages have is
# `sandbox` (ours: the python tool's jail; the SDK's: its sandbox agents): `agents.sandbox` stays ours and is also
# the SDK's sandbox package (its folder is the module's `__path__`, its public names bound in it). Any other name
# both define is an ImportError at import, never a silent shadowing (`_refuse_clashes`, `_take_names`). The SDK's
# sandbox agents lose one thing: their default instructions file, read from the package folder, is not found
# (they run without it). Why this way: `__path__` is Python's own means for a package spanning folders, so there
# is no import hook to read; renaming ours breaks `agents.sandbox`, which the recipes and tests import; running
# recipes in a process where the SDK's package comes first loses tracerl's names there. The cost: importing `agents`
# imports the SDK too (about 1 s on a 2-core CPU).
from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import importlib.util
import logging
import math
import numbers
import os
import pkgutil
import secrets
import sys
import uuid
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import data
import invariants
from engines import Generation, SamplingParams, validate_sampling
from router import Router
from session import SIDE_LINE_RULES, Budget, context_length

log = logging.getLogger("tracerl.agents")


# ---- the contract an agent author writes against ----------------------------------------------------

@dataclass
class Result:
    """What `Env.step` returns (Gymnasium's step tuple, named)."""
    reward: float                              # this turn's reward; an episode's reward is the sum over turns
    observation: str = ""                      # text appended as context before the next turn; the env
                                               # writes its own chat glue (e.g. "\n<|im_start|>user\n...")
                                               # and one data.IMAGE_PLACEHOLDER per image of `images`, and
                                               # wraps text it did not write (a tool's output) in data.plain()
                                               # so that a "<|im_start|>" in it stays characters
    terminated: bool = True                    # the episode reached an end state
    truncated: bool = False                    # the episode was cut short (turn or length budget)
    info: dict[str, float] = field(default_factory=dict)   # numeric extras, logged per step (info_numbers)
    score: float | None = None                 # the metric to report (accuracy); defaults to reward
    images: list | None = None                 # images shown with the observation, in placeholder order
                                               # (PIL images or data: URLs; a VLM only)
    sampling_params: dict[str, Any] | None = None  # per-turn overrides of SamplingParams for later turns


class Env:
    """One episode of an environment. A fresh instance is made per rollout.

    reset(task) -> the first observation as chat messages (rendered with the model's chat template)
    step(action_text) -> Result
    tool_schemas() -> the functions the model may call (OpenAI schemas, rendered into the prompt by the chat
        template), or None; agents/tools.py's ToolEnv runs the calls
    """

    def reset(self, task) -> list[dict]:
        return task.messages

    def tool_schemas(self) -> list[dict] | None:
        return None

    def step(self, action_text: str) -> Result:
        raise NotImplementedError("an Env must implement step(action_text) -> Result")


def info_numbers(info) -> dict[str, float]:
    """The entries of an env's info that are finite real numbers, as floats: Python and numpy ints, floats and bools
    (a flag's mean over rollouts is a rate), and 0-d arrays or tensors of them; anything else (text, lists, NaN,
    infinities, complex numbers) is not a metric and is left out. None is an empty info; an info that is not a
    mapping is a TypeError (the env's bug, which fails its rollout)."""
    if info is None:
        return {}
    if not hasattr(info, "items"):
        raise TypeError(f"an env's info must be a dict of name -> number, got {type(info).__name__}")
    out = {}
    for key, value in info.items():
        if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
            value = value.item()         # numpy scalars (np.bool_ included), np.array(3.0), torch.tensor(3.0)
        if isinstance(value, numbers.Real) and math.isfinite(value):
            out[str(key)] = float(value)
    return out


class GymEnv(Env):
    """A gymnasium-style env, driven as an Env: reset(seed=None, options={"task": task}) -> (observation, info);
    step(action_text) -> (observation, reward, terminated, truncated, info). Observations are text (the first may
    also be chat messages) and actions are the decoded reply. A later observation becomes a ChatML user turn
    (the chat glue of the models tracerl ships; an Env that needs another template writes its own glue). The
    info's numbers go to the metrics; a "score" in it is the episode's score (accuracy). EnvRunner wraps any
    env_cls that is not an Env in this, so an author hands over a gymnasium.Env as it is."""

    def __init__(self, env):
        if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
            raise TypeError(f"{type(env).__name__} is neither an agents.Env nor a gymnasium-style env with "
                            f"reset() and step()")
        self.env = env

    def reset(self, task) -> list[dict]:
        observation, _ = self.env.reset(options={"task": task})
        return observation if isinstance(observation, list) else [{"role": "user", "content": str(observation)}]

    def step(self, action_text: str) -> Result:
        observation, reward, terminated, truncated, info = self.env.step(action_text)
        info = info_numbers(info)
        score = info.pop("score", None)
        glue = "" if terminated or truncated else user_turns([str(observation)])
        return Result(float(reward), glue, bool(terminated), bool(truncated), info, score)


def user_turns(texts: list[str]) -> str:
    """The ChatML glue after a reply for an observation: one user turn per text (as characters: text stays text),
    then the assistant's opening. The chat format of the models tracerl ships; an env for another template writes
    its own."""
    turns = "".join(f"\n<|im_start|>user\n{data.plain(text)}<|im_end|>" for text in texts)
    return f"{turns}\n<|im_start|>assistant\n"


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
    max_tokens_turns: int = 0                     # turns whose reply hit max_tokens before a stop token
    info: dict[str, float] = field(default_factory=dict)
    generations: list[Generation] = field(default_factory=list)  # the engine's output for every turn, in order:
                                               # train.py checks the rows train each sampled token exactly once
    side_lines: int = 0                        # a ChatAgent's session: conversations beside its main one (sub-agents,
    side_turns: int = 0                        # title requests: session.py) and their turns; their rows
                                               # (labelled, Segment.line) are in `rows` when they train


# ---- the Env runner ----------------------------------------------------------------------------------

def own_stream(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of the index-th rollout of a run: a seeded run still gives every rollout (so every sample
    of a group) its own random stream, or the group's samples would be identical and its advantages zero."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)


@dataclass
class _Episode:
    task: Any
    ledger: invariants.TokenLedger
    sampling: SamplingParams
    budget: Budget                             # what the whole episode may sample (session.Budget)
    env: Env | None = None                     # made on a worker thread, like every call into agent code
    reward: float = 0.0
    score: float | None = None
    turns: int = 0
    truncated: bool = False
    max_tokens_turns: int = 0
    generations: list[Generation] = field(default_factory=list)
    done: bool = False
    failed: str = ""
    info: dict[str, float] = field(default_factory=dict)
    # its prefix-cache salt (engines/prefix_cache.py's rule): a secret of its own, so no other episode reads its KV
    cache_salt: str = field(default_factory=lambda: f"rollout:{secrets.token_hex(16)}")

    @property
    def sampled(self) -> int:
        return sum(len(gen.token_ids) for gen in self.generations)


def _start(fn, *args) -> Future:
    """Run agent code on a daemon thread: a hung env can be abandoned and never blocks the process exit."""
    future: Future = Future()

    def target():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
    threading.Thread(target=target, daemon=True, name="env-call").start()
    return future


class EnvRunner:
    """Runs a group of Env episodes in lockstep: every turn, all live episodes sample together in one
    batched engine call. Subclass with `env_cls = MyEnv` and export it as `AgentRunner`. A VLM's runner gets
    the model's `image_processor` (models.load_image_processor); without one, an episode that shows an image
    fails (a text model would drop it silently). `max_length`: an episode's context, prompt and every turn (default:
    the most the engine serves, its model's position limit)."""

    env_cls: type[Env] = Env

    def __init__(self, engine, tokenizer, max_turns: int = 1, max_length: int | None = None,
                 step_timeout_s: float = 60.0, image_processor=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_turns, self.step_timeout_s = max_turns, step_timeout_s
        self.max_length = context_length(engine, max_length)
        self.image_processor = image_processor
        self.image_pad_id = tokenizer.convert_tokens_to_ids(data.IMAGE_PAD) if image_processor is not None else None
        self.failures: dict[str, int] = {}     # reason -> count, over the runner's life

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> list[Rollout]:
        """One rollout per (task, group id). Failed episodes are counted and left out of the result."""
        if len(tasks) != len(group_ids):
            raise ValueError(f"got {len(tasks)} tasks but {len(group_ids)} group ids; pass one group id per task")
        budget = Budget.of_run(self.max_turns, sampling.max_tokens, self.max_length)
        episodes = [_Episode(task, invariants.TokenLedger(uuid.uuid4().hex[:12], group_id), own_stream(sampling, i),
                             budget) for i, (task, group_id) in enumerate(zip(tasks, group_ids))]
        # an env's constructor is agent code too: one that raises or hangs fails only its own rollout
        for ep, env in zip(episodes, self._call_all(episodes, "init", [(self._new_env,)] * len(episodes))):
            ep.env = env
        opened = [ep for ep in episodes if not ep.failed]
        for ep, messages in zip(opened, self._call_all(opened, "reset", [(ep.env.reset, ep.task) for ep in opened])):
            if ep.failed:
                continue
            try:
                images = data.prompt_images(messages, ep.task.images)
                prompt = data.render_prompt_ids(self.tokenizer, messages, tools=ep.env.tool_schemas())
                ep.ledger.extend_or_seal(*self._with_images(prompt, images))
            except ValueError as exc:          # images the model cannot see, or parts without their images
                self._fail(ep, "reset_error", f"{type(exc).__name__}: {exc}")
        while live := [ep for ep in episodes if not (ep.done or ep.failed)]:
            self._turn(live)
        return [self._to_rollout(ep) for ep in episodes if not ep.failed]

    def _new_env(self) -> Env:
        env = self.env_cls()
        return env if isinstance(env, Env) else GymEnv(env)      # a gymnasium-style env, as it is

    def _with_images(self, ids: list[int], images: list) -> tuple[list[int], list[invariants.ImageInput]]:
        """Process `images` once and expand each single image pad of `ids` to its image's tokens. Raises
        ValueError for images without an image processor, or pads and images that do not pair up."""
        if self.image_processor is None:
            if images:
                raise ValueError(f"{len(images)} images but the runner has no image processor: the model is "
                                 f"text-only (or the runner was built without image_processor="
                                 f"models.load_image_processor(path)), so the images would be dropped silently")
            return ids, []
        inputs = data.image_inputs(self.image_processor, images)
        return data.expand_image_pads(ids, inputs, self.image_pad_id), inputs

    def _turn(self, live: list[_Episode]) -> None:
        prompts, params, images = [], [], []
        for ep in live:
            room = self.max_length - len(ep.ledger.open_token_ids)
            if room < 1:
                ep.done = ep.truncated = True
                continue
            prompts.append(ep.ledger.open_token_ids)
            # the first turn's prompt is the task as reset rendered it, the same for the group's samples: they share it
            given = ep.turns == 0 and ep.ledger.group_id and not ep.ledger.open_images
            # a turn's max_tokens (an env may raise it for later turns) takes at most what the budget has left
            cut = ep.budget.cut(ep.turns, ep.sampled, ep.sampling.max_tokens)
            params.append(replace(ep.sampling, max_tokens=min(ep.sampling.max_tokens if cut is None else cut.max_tokens,
                                                              room), cache_salt=ep.cache_salt,
                                  given_salt=f"group:{ep.ledger.group_id}" if given else ""))
            images.append(ep.ledger.open_images)
        live = [ep for ep in live if not ep.done]
        if not live:
            return
        stepping, actions = [], []
        # a Router sends every turn of a rollout to the engine that holds its prefix
        sticky = {"session_ids": [ep.ledger.rollout_id for ep in live]} if isinstance(self.engine, Router) else {}
        for ep, gen in zip(live, self.engine.generate(prompts, params, images=images, **sticky)):
            if self.image_pad_id is not None and self.image_pad_id in gen.token_ids:
                # a VLM puts image features on every pad id, so this row could never be forwarded again
                self._fail(ep, "sampled_image_pad", f"the model sampled the image placeholder {data.IMAGE_PAD}")
                continue
            # the top logprobs the run's sampling asks for are kept with each token (score centering)
            ep.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling,
                                     routed=gen.routes is not None, top=gen.top_logprobs,
                                     top_k=ep.sampling.top_logprobs)
            ep.generations.append(gen)
            if gen.routes is not None:
                ep.ledger.absorb_routes(gen.routes)
            ep.turns += 1
            ep.max_tokens_turns += gen.finish_reason == "length"
            stepping.append(ep)
            actions.append((ep.env.step, self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)))
        # every env steps at once (one slow env does not delay the others), all under one deadline
        for ep, result in zip(stepping, self._call_all(stepping, "step", actions)):
            if not ep.failed:
                try:
                    self._apply(ep, result)
                except Exception as exc:      # a malformed Result fails its rollout, never the run
                    self._fail(ep, "result_error", f"{type(exc).__name__}: {exc}")

    def _apply(self, ep: _Episode, result: Result) -> None:
        if not isinstance(result, Result):
            raise TypeError(f"Env.step must return agents.Result, got {type(result).__name__}")
        info = info_numbers(result.info)
        next_sampling = replace(ep.sampling, **(result.sampling_params or {}))
        validate_sampling(next_sampling)
        observation, images = self._with_images(data.encode_text(self.tokenizer, result.observation),
                                                list(result.images or []))
        ep.reward += float(result.reward)
        ep.score = result.score if result.score is not None else ep.reward
        ep.info.update(info)
        out_of_budget = ep.budget.cut(ep.turns, ep.sampled, 1) is not None     # its turns or its tokens are spent
        out_of_room = len(ep.ledger.open_token_ids) + len(observation) >= self.max_length
        ep.done = result.terminated or result.truncated or out_of_budget or out_of_room
        ep.truncated = ep.done and not result.terminated
        if not ep.done:
            ep.sampling = next_sampling
            # the next prompt is the open record plus the observation, its images after the record's own
            ep.ledger.extend_or_seal(ep.ledger.open_token_ids + observation, ep.ledger.open_images + images)

    def _call_all(self, episodes: list[_Episode], what: str, calls: list) -> list:
        """Run agent code for every episode concurrently, each with `step_timeout_s`. An exception or a
        hang fails that rollout only (its result is None)."""
        futures = [_start(*call) for call in calls]
        deadline = time.monotonic() + self.step_timeout_s
        results = []
        for ep, future in zip(episodes, futures):
            try:
                results.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
                continue
            except FutureTimeout:
                if not future.done():           # a real hang (an env's own TimeoutError is an error)
                    self._fail(ep, f"{what}_timeout", f"exceeded {self.step_timeout_s:.0f} s")
                    results.append(None)
                    continue
                exc = future.exception()
            except Exception as error:  # agent code is arbitrary: any error is this rollout's failure
                exc = error
            self._fail(ep, f"{what}_error", f"{type(exc).__name__}: {exc}")
            results.append(None)
        return results

    def _fail(self, ep: _Episode, reason: str, detail: str) -> None:
        log.warning("rollout %s dropped: %s (%s)", ep.ledger.rollout_id, reason, detail)
        ep.failed = reason
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def _to_rollout(self, ep: _Episode) -> Rollout:
        return Rollout(ep.ledger.rollout_id, ep.ledger.group_id, ep.task.task_id, ep.ledger.rows(),
                       ep.reward, ep.score if ep.score is not None else ep.reward, ep.turns, ep.truncated,
                       ep.max_tokens_turns, ep.info, ep.generations)


# ---- the ChatAgent form: the agent owns the loop and talks to a stock SDK ----------------------------

@dataclass
class ChatContext:
    """What a ChatAgent gets: a per-rollout endpoint for a stock SDK, and the task.
    OpenAI:    AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    Anthropic: AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)"""
    base_url: str                      # http://127.0.0.1:PORT/s/<session>/v1
    session_url: str                   # http://127.0.0.1:PORT/s/<session>
    api_key: str                       # this rollout's key; every other session refuses it
    model_name: str                    # pass as `model=`; the server serves exactly one policy
    messages: list[dict]               # the task's prompt as chat messages, images as data-URL image_url parts
    prompt: str                        # the last user message's text
    label: str                         # the ground truth the agent's reward is computed against
    images: list | None                # the task's images (VLM recipes), as given (PIL images or data URLs)
    sampling_params: dict[str, Any]    # this rollout's sampling; the server applies it to requests that omit it
    max_turns: int = 1                 # the turn budget (--rollout.max_turns): model calls this rollout may make,
                                       # on every line (session.Budget; a call past it gets a reply cut with no token)
    task: Any = None                   # the task itself (a recipe's Task subclass carries what its agent needs)
    max_length: int = 0                # the session's context, prompt and reply, in tokens: what a harness is told
                                       # to compact its conversation within (the recipes of Codex and Claude Code)


class ChatAgent:
    """One rollout: talk to ctx.base_url with any OpenAI- or Anthropic-compatible client, return a Result.
    A fresh instance is made per rollout. Only the tokens the engine sampled are trained on, whatever the
    agent does with the text (loopback.py keeps them)."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError("a ChatAgent must implement `async def run(self, ctx) -> Result`")


class ChatAgentRunner:
    """Runs a group of ChatAgents concurrently, each against its own loopback session; concurrent requests
    of all sessions share batched engine calls. Subclass with `agent_cls = MyAgent` and export it as
    `AgentRunner`. An agent that raises, returns no Result, or outlives `step_timeout_s * max_turns`
    loses only its own rollout. Each rollout's session is closed when it ends, however it ends (the run cancelled
    included), so no agent code samples the policy past its rollout."""

    agent_cls: type[ChatAgent] = ChatAgent
    template: str | None = None        # None = the model's own chat template
    # Side lines (session.py): a harness's other conversations on the rollout's session, each with its own record.
    # Those that train with the rollout's reward, after the main line's rows (ChatSession.record): "feeding" (the
    # default), a side line whose last reply is in what the main line is given later (a sub-agent's result, a summary:
    # work the outcome depends on, as the main line's is), not one the main line is never given (a title: an action that
    # does not shape the reward has zero expected policy gradient against the group's baseline, only variance);
    # "all"; "none", the main line alone. Every side line is still recorded, traced and counted (docs/agents.md).
    train_side_lines: str = "feeding"

    def __init__(self, engine, tokenizer, max_turns: int = 1, max_length: int | None = None,
                 step_timeout_s: float = 60.0, image_processor=None):
        import loopback
        if self.train_side_lines not in SIDE_LINE_RULES:
            raise ValueError(f"train_side_lines must be one of {SIDE_LINE_RULES}, got {self.train_side_lines!r}")
        self.max_turns, self.timeout_s = max_turns, step_timeout_s * max_turns
        self.failures: dict[str, int] = {}
        # the sessions turn the images an agent sends into ImageInputs with the model's image processor; their
        # turns share the engine's batch (the engine admits concurrent callers between decode steps). Each session's
        # context is max_length (default: the most the engine serves, its model's position limit)
        self.server = loopback.LoopbackServer(engine, tokenizer, template=self.template, max_length=max_length,
                                              image_processor=image_processor)
        self.max_length = self.server.max_length
        self.server.start()

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> list[Rollout]:
        if len(tasks) != len(group_ids):
            raise ValueError(f"got {len(tasks)} tasks but {len(group_ids)} group ids; pass one group id per task")
        done = asyncio.run(self._run_all(tasks, group_ids, sampling))
        return [r for r in done if r is not None]

    async def _run_all(self, tasks, group_ids, sampling) -> list[Rollout | None]:
        done = await asyncio.gather(*(self._one(t, g, own_stream(sampling, i))
                                      for i, (t, g) in enumerate(zip(tasks, group_ids))))
        # An agent that never closed its SDK client leaves it to the garbage collector, whose close needs this
        # event loop: collect now, while the loop runs, and let those closes finish (after asyncio.run returns
        # they would only log 'Event loop is closed').
        gc.collect()
        await asyncio.sleep(0.01)
        return done

    def _context(self, info, task, sampling: SamplingParams) -> ChatContext:
        users = [m["content"] for m in task.messages if m["role"] == "user"]
        prompt = "" if not users else users[-1] if isinstance(users[-1], str) else \
            "".join(part.get("text", "") for part in users[-1] if part.get("type") == "text")
        return ChatContext(info.base_url, info.session_url, info.api_key, self.server.model_name,
                           data.sdk_messages(task.messages, task.images), prompt, task.label, task.images,
                           {"temperature": sampling.temperature, "top_p": sampling.top_p,
                            "max_tokens": sampling.max_tokens}, self.max_turns, task, self.max_length)

    async def _one(self, task, group_id: str, sampling: SamplingParams) -> Rollout | None:
        info = self.server.create_session(uuid.uuid4().hex[:12], group_id, sampling, self.max_length,
                                          None if task.images else task.messages,
                                          Budget.of_run(self.max_turns, sampling.max_tokens, self.max_length))
        try:
            failure, detail, result = await self._agent(info, task, sampling)
        finally:     # returned, raised, timed out, or the run cancelled: the session goes with its rollout
            session = self.server.close_session(info.session_id)
        if not failure and session.image_pad_turns:   # a pad no image fills: the row could never be forwarded
            failure, detail = "sampled_image_pad", f"{data.IMAGE_PAD} sampled in {session.image_pad_turns} turns"
        if failure:
            log.warning("rollout %s dropped: %s (%s)", session.ledger.rollout_id, failure, detail)
            self.failures[failure] = self.failures.get(failure, 0) + 1
            return None
        rows, generations = session.record(self.train_side_lines)
        score = result.score if result.score is not None else float(result.reward)
        # a rollout whose budget cut a reply short or refused a request is truncated, whatever the agent says
        return Rollout(session.rollout_id, group_id, task.task_id, rows, float(result.reward), score,
                       session.turns, bool(result.truncated) or session.budget_cuts > 0, session.max_tokens_turns,
                       result.info, generations, len(session.side_lines), sum(line.turns for line in session.side_lines))

    async def _agent(self, info, task, sampling: SamplingParams) -> tuple[str, str, Result | None]:
        """One agent run against its session: ("", "", its Result with the info reduced to its numbers), or (the
        reason its failure is counted under, what happened, None)."""
        try:
            ctx = self._context(info, task, sampling)
        except ValueError as exc:           # image parts and task images that do not pair up
            return "task_error", f"{type(exc).__name__}: {exc}", None
        try:
            result = await asyncio.wait_for(self.agent_cls().run(ctx), timeout=self.timeout_s)
            if not isinstance(result, Result):
                raise TypeError(f"ChatAgent.run must return agents.Result, got {type(result).__name__}")
            return "", "", replace(result, info=info_numbers(result.info))
        except asyncio.TimeoutError:
            return "agent_timeout", f"exceeded {self.timeout_s:.0f} s", None
        except Exception as exc:  # agent code is arbitrary: any error is this rollout's failure, counted under its
            # `reason` where it names one (agents.process.ProcessFailure), else as agent_error
            return getattr(exc, "reason", "agent_error"), f"{type(exc).__name__}: {exc}", None


# ---- loading a recipe, and a recipe's agent ----------------------------------------------------------

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def load_recipe(name: str):
    """recipes/<name>.py, or any recipe file given by its path (a fork's own recipe needs no copy in recipes/).
    Here, below both train.py and runtime.py (whose runner actors load the recipe too), so neither imports the
    other for it."""
    path = name if name.endswith(".py") else os.path.join(RECIPES, f"{name}.py")
    if not os.path.exists(path):
        known = sorted(f[:-3] for f in os.listdir(RECIPES) if f.endswith(".py") and not f.startswith("_"))
        raise SystemExit(f"error: unknown recipe {name!r}; known recipes: {', '.join(known)}")
    spec = importlib.util.spec_from_file_location(f"recipe_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_agent_runner(path: str) -> type:
    """Import the Python file at `path` and return its `AgentRunner` class."""
    spec = importlib.util.spec_from_file_location(f"agent_{uuid.uuid4().hex[:8]}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import an agent from {path!r}: expected a path to a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        del sys.modules[spec.name]
        raise ValueError(f"{path} does not export AgentRunner; add e.g. "
                         f"`class AgentRunner(EnvRunner): env_cls = MyEnv`")
    return runner


# ---- the OpenAI Agents SDK: the other package named `agents` (header) ----------------------------------

def _sdk_folder() -> str | None:
    """The folder of the `agents` package that openai-agents installed, or None when it is not installed."""
    try:
        folder = str(importlib.metadata.distribution("openai-agents").locate_file("agents"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return folder if os.path.isfile(os.path.join(folder, "__init__.py")) else None


def _refuse_clashes(ours: dict, our_folder: str | None, their_folder: str, shared: set[str]) -> None:
    """An SDK submodule is found through `__path__` after ours and, once imported, is bound as an attribute of
    its package: one named like a module of ours would be shadowed by it, and one named like a global of ours
    would overwrite it. Either is refused (`shared` names the one submodule both packages are meant to share)."""
    theirs = {m.name for m in pkgutil.iter_modules([their_folder])}
    mine = set(ours) | ({m.name for m in pkgutil.iter_modules([our_folder])} if our_folder else set())
    clash = sorted((theirs & mine) - shared)
    if clash:
        raise ImportError(f"{ours['__name__']} and the OpenAI Agents SDK ({their_folder}) both define {clash}; "
                          f"rename tracerl's, or install the openai-agents version requirements-agents.txt pins")


def _run_init(name: str, init_file: str):
    """Execute a package's __init__.py as the plain module `name`, a child of the package it belongs to, so its
    relative imports (`from .agent import Agent`) resolve in that package: every SDK module is imported once,
    under its own name (agents.agent, agents.run, ...)."""
    spec = importlib.util.spec_from_file_location(name, init_file, submodule_search_locations=None)  # not a package
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _take_names(ours: dict, sdk, mine: set[str]) -> None:
    """Bind the SDK module's public names (its `__all__`) in `ours`, as its own __init__ binds them in its package
    (`apply_diff`, the submodule, becomes `apply_diff`, the function); one of `mine` (tracerl's names) bound to
    something else is an ImportError, never overwritten."""
    for name in sdk.__all__:
        value = getattr(sdk, name)
        if name in mine and ours[name] is not value:
            raise ImportError(f"{ours['__name__']}.{name} is tracerl's and also the OpenAI Agents SDK's; rename "
                              f"tracerl's, or install the openai-agents version requirements-agents.txt pins")
        ours[name] = value


_SDK = _sdk_folder()
if _SDK is not None:
    from agents import sandbox
    _SDK_SANDBOX = os.path.join(_SDK, "sandbox")
    _refuse_clashes(globals(), os.path.dirname(__file__), _SDK, shared={"sandbox"})
    _refuse_clashes(vars(sandbox), None, _SDK_SANDBOX, shared=set())
    _MINE, _MINE_IN_SANDBOX = set(globals()), set(vars(sandbox))
    __path__.append(_SDK)
    sandbox.__path__ = sandbox.__spec__.submodule_search_locations = [_SDK_SANDBOX]   # now a package as well
    # in the SDK's own order: its sandbox package first (the SDK's __init__ imports it first)
    _take_names(vars(sandbox), _run_init("agents.sandbox._openai_agents", os.path.join(_SDK_SANDBOX, "__init__.py")),
                _MINE_IN_SANDBOX)
    _take_names(globals(), _run_init("agents._openai_agents", os.path.join(_SDK, "__init__.py")), _MINE)
