# config.py — the training job's configuration: what `python train.py --section.key value` sets, and what it refuses.
#
# Owns: the job's own sections (RunConfig, RolloutConfig, TrainConfig, EvalConfig: --run.*, --rollout.*, --train.*,
# --eval.*), the table of every section (`config_sections`; the others live in the module they configure: ActorConfig
# in actor.py, AlgoConfig in algo.py, CriticConfig in critic.py, CorrectionConfig in invariants.py, RuntimeConfig in
# runtime.py), the command
# line (`parse_config`: a flag for every field, its --help text the field's comment; field defaults < the recipe's
# DEFAULTS < flags), the rules across sections (`validate_config`, each section's own rules called from there), and
# the run's context once the model is known (`resolve_context`).
# Never does: load weights, start an engine or a process, or write a file; a bad flag or combination is refused
# here, before train.py loads anything (resolve_context reads only the model's config).
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
from dataclasses import dataclass

import transformers

import actor
import algo
import critic
import invariants
import models
import runtime
from agents import load_recipe, sandbox
from engines import MAX_TOP_LOGPROBS, SamplingParams, validate_sampling
from trainer import centering

# ---- the job's own sections; the other sections live in the module each configures -----------------------------

@dataclass
class RunConfig:
    recipe: str = "math"        # recipes/<name>.py or a recipe file's path: its DEFAULTS, tasks and AgentRunner
    steps: int = 30             # RL steps (rollout batch -> optimizer step(s) -> weight push)
    model: str = "smollm2"      # a model folder or a packaged name (models.resolve_model)
    ref_model: str = ""         # frozen reference for KL (teacher for on_policy_distill); "" = initial policy
    data: str = ""              # the recipe's data source (geo3k: "synthetic", a hub name or a local copy); "" = its default
    out: str = ""               # run folder; "" = runs/<recipe>-<timestamp>
    seed: int = 0
    threads: int = 0            # torch CPU threads; 0 = all cores
    sandbox_accept: str = ""    # sandbox protections the run may go without, by name (agents/sandbox.py); "" = none
    wandb: str = ""             # also log to this Weights & Biases project ("" = off; WANDB_MODE=offline needs no account)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8   # prompt groups per RL step
    samples_per_prompt: int = 4 # rollouts per prompt (the group of GRPO/RLOO)
    temperature: float = 1.0    # the run's sampling; an agent may send its own per request (each token's is recorded)
    top_p: float = 1.0          # nucleus mass (1 = off); the trainer recomputes logprobs over the same nucleus
    top_k: int = -1             # most likely tokens kept (-1 = off)
    max_tokens: int = 64        # new tokens per turn
    ignore_eos: bool = False    # the model's eos ids end no reply: every turn runs to max_tokens (fixed-length benches)
    max_turns: int = 1
    max_length: int = 0         # prompt + all turns, in tokens; 0 = the model's position limit (never more)
    step_timeout_s: float = 60.0  # an env reset/step slower than this fails its rollout
    engine: str = "auto"        # embedded | vllm | auto (vLLM where it is installed and a GPU is present)
    engine_memory: float = 0.3  # vLLM on a GPU: the share of GPU memory for its weights and KV cache (the actor
                                # shares the GPU; the engine sleeps while the actor trains)


@dataclass
class TrainConfig:
    minibatches: int = 1        # optimizer steps per rollout batch (>1 makes the PPO clip matter)
    save_every: int = 0         # checkpoint every N steps (0 = only at the end)
    # full by default: unless save_every is set it is the run's only checkpoint, and only a full one can be continued
    # (--train.resume, with more --steps); weights drops the optimizer state (Qwen3-4B: 16.1 GB in 17 s against 49.8 GB
    # in 104 s on an H100 host, docs/runs.md). Periodic checkpoints are always full: resuming is what they are for
    final_checkpoint: str = "full"  # one of FINAL_CHECKPOINTS: resumable; the policy as a model folder; nothing
    resume: str = ""            # a checkpoint folder to continue exactly from (its step, weights, optimizer, RNGs)
    trace_rows: int = 4         # rows per step written to OUT/traces


@dataclass
class EvalConfig:
    every: int = 0              # evaluate the held-out split before training and every N steps (0 = never)
    split: str = "test"         # the recipe's held-out split
    prompts: int = 32           # held-out prompts per evaluation (the split's first N)
    samples: int = 1            # samples per prompt: pass@1 is their mean, pass@k (k = samples) any of them right
    temperature: float = 1.0    # evaluation sampling, separate from the rollout's
    top_k: int = 1              # 1 = greedy (the default); -1 = sample from the whole distribution


def config_sections() -> dict[str, type]:
    """section name -> dataclass type: the job's own four here, the others in the module each configures."""
    return {"run": RunConfig, "rollout": RolloutConfig, "train": TrainConfig, "actor": actor.ActorConfig,
            "algo": algo.AlgoConfig, "critic": critic.CriticConfig, "correction": invariants.CorrectionConfig,
            "eval": EvalConfig, "runtime": runtime.RuntimeConfig}


ENGINES = ("auto", "embedded", "vllm")
FINAL_CHECKPOINTS = ("full", "weights", "none")     # checkpoints/final: train.save_checkpoint
SHORT_FLAGS = ("recipe", "steps", "model", "out", "seed")   # --steps N == --run.steps N


# ---- command line ---------------------------------------------------------------------------------------

def _parse_value(text: str, like):
    if isinstance(like, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(like, tuple):
        return tuple(type(x)(v) for x, v in zip(like, text.split(",")))
    return type(like)(text)


def field_help(cls) -> dict[str, str]:
    """A dataclass field's trailing comment is its --help text (one source of truth for both). "one of NAME", where
    NAME is a tuple of the field's module (algo.ESTIMATORS), is printed with the names it holds."""
    module = sys.modules[cls.__module__]

    def names(match: re.Match) -> str:
        choices = getattr(module, match.group(1), None)
        return f"one of {', '.join(choices)}" if isinstance(choices, tuple) else match.group(0)
    found = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            found[match.group(1)] = re.sub(r"one of ([A-Z][A-Z_]+)\b", names, match.group(2)).replace("%", "%%")
    return found


def parse_config(argv: list[str]) -> dict:
    """argv -> {section: dataclass instance}, validated. Precedence: field defaults < recipe DEFAULTS < flags."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", "--run.recipe", dest="recipe", default=RunConfig.recipe)
    recipe_name = pre.parse_known_args(argv)[0].recipe
    recipe = load_recipe(recipe_name)
    sections = config_sections()
    defaults = {name: cls() for name, cls in sections.items()}
    for dotted, value in getattr(recipe, "DEFAULTS", {}).items():
        section, key = dotted.split(".")
        setattr(defaults[section], key, value)
    defaults["run"].recipe = recipe_name

    parser = argparse.ArgumentParser(
        prog="train.py", description=f"tracerl synchronous RL. Defaults shown are recipe {recipe_name!r}'s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for section, instance in defaults.items():
        group = parser.add_argument_group(section)
        helps = field_help(type(instance))
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            names = [f"--{section}.{f.name}"] + ([f"--{f.name}"] if section == "run" and f.name in SHORT_FLAGS else [])
            group.add_argument(*names, dest=f"{section}.{f.name}", default=value, metavar=type(value).__name__.upper(),
                               type=lambda text, like=value: _parse_value(text, like),
                               help=helps.get(f.name, f.name.replace("_", " ")))
    args = vars(parser.parse_args(argv))
    cfg = {name: dataclasses.replace(defaults[name], **{k.split(".")[1]: v for k, v in args.items()
                                                         if k.split(".")[0] == name})
           for name in sections}
    try:
        validate_config(cfg)
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


# ---- the rules across sections, and the context the model sets -------------------------------------------------

def validate_config(cfg: dict) -> None:
    """Every cross-section rule, checked before any model loads."""
    ro, run, tr = cfg["rollout"], cfg["run"], cfg["train"]
    algo.validate_algo(cfg["algo"], ro.samples_per_prompt, max_tokens=ro.max_tokens)
    invariants.validate_correction(cfg["correction"])
    al = cfg["algo"]
    centering.validate_centering(al.score_centering, al.estimator, al.dual_clip, cfg["correction"].level,
                                 MAX_TOP_LOGPROBS)
    actor.validate_actor(cfg["actor"])
    critic.validate_critic(cfg["critic"], cfg["algo"].estimator, run.steps)
    runtime.validate_runtime(cfg["runtime"], cfg["correction"], tr.minibatches)
    validate_sampling(SamplingParams(ro.temperature, ro.top_p, ro.top_k, ro.max_tokens))
    positive = {"run.steps": run.steps, "rollout.prompts_per_step": ro.prompts_per_step,
                "rollout.samples_per_prompt": ro.samples_per_prompt, "rollout.max_turns": ro.max_turns,
                "train.minibatches": tr.minibatches, "rollout.step_timeout_s": ro.step_timeout_s}
    for name, value in positive.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if ro.max_length < 0:
        raise ValueError(f"rollout.max_length must be > 0, or 0 for the model's position limit; got {ro.max_length}")
    if ro.prompts_per_step % tr.minibatches:
        raise ValueError(f"train.minibatches ({tr.minibatches}) must divide rollout.prompts_per_step "
                         f"({ro.prompts_per_step}): minibatches hold whole prompt groups")
    if ro.max_length and ro.max_tokens >= ro.max_length:
        raise ValueError(f"rollout.max_tokens ({ro.max_tokens}) must be below rollout.max_length ({ro.max_length})")
    ev = cfg["eval"]
    validate_sampling(SamplingParams(ev.temperature, 1.0, ev.top_k, ro.max_tokens))
    if ev.every < 0 or ev.prompts < 1 or ev.samples < 1:
        raise ValueError(f"eval.every must be >= 0 and eval.prompts, eval.samples >= 1; got {ev.every}, "
                         f"{ev.prompts}, {ev.samples}")
    if tr.resume and not os.path.isdir(tr.resume):
        raise ValueError(f"train.resume: no checkpoint folder at {tr.resume!r}")
    if ro.engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {ENGINES}, got {ro.engine!r}")
    if tr.final_checkpoint not in FINAL_CHECKPOINTS:
        raise ValueError(f"train.final_checkpoint must be one of {FINAL_CHECKPOINTS}, got {tr.final_checkpoint!r}")
    if tr.final_checkpoint == "weights" and cfg["actor"].lora_rank:
        raise ValueError("train.final_checkpoint weights writes every weight of the policy; under LoRA only the "
                         "adapter trains, and a full checkpoint holds it in PEFT's format (adapter/): use full")
    if not 0 < ro.engine_memory < 1:
        raise ValueError(f"rollout.engine_memory is a share of the GPU's memory, in (0, 1); got {ro.engine_memory}")
    unknown = {n.strip() for n in run.sandbox_accept.split(",") if n.strip()} - set(sandbox.PROTECTIONS)
    if unknown:
        raise ValueError(f"run.sandbox_accept: unknown protections {sorted(unknown)}; known: "
                         f"{', '.join(sandbox.PROTECTIONS)}")


def resolve_context(ro: RolloutConfig, model_path: str) -> RolloutConfig:
    """The rollout config with its context known, once the model is: max_length 0 is the model's position limit, and
    more than the limit is refused (the engine would serve, and the actor train, positions the model was never built
    for). Raises SystemExit naming both numbers."""
    limit = models.position_limit(transformers.AutoConfig.from_pretrained(model_path))
    if ro.max_length > limit:
        raise SystemExit(f"error: rollout.max_length ({ro.max_length}) is above the model's position limit ({limit} "
                         f"positions, prompt and reply); set at most {limit}, or 0 for the limit")
    ro = dataclasses.replace(ro, max_length=ro.max_length or limit)
    if ro.max_tokens >= ro.max_length:
        raise SystemExit(f"error: rollout.max_tokens ({ro.max_tokens}) must be below rollout.max_length "
                         f"({ro.max_length}, the model's position limit)")
    return ro
