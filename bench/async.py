# bench/async.py — synchronous (eta = 0) against asynchronous (eta = 1, partial rollout) training through the Ray
# runtime, side by side, in one run; writes a JSON summary.
#
# real: `train.py --runtime.mode ray` twice on this machine with the same recipe, model, seed and steps, eta 0 then
#   eta 1: wall-clock of the steps and its ratio, the engines' idle fraction, the staleness seen, reward per step.
#   On a small CPU the two roles share the same cores, so overlap buys little: the figure is reported as measured.
# simulated: the same orchestration (runtime.RolloutPool, Runtime.push_weights, router.Router, EngineActors in
#   their own processes) with engines and a trainer whose costs are fixed sleeps: an engine spends --token-s per
#   decode step whatever its batch (as a GPU nearly does), honours pause between steps and stamps every token with
#   its weights' version; the trainer spends --sample-s per sample. This is what the scheduler achieves when each
#   role has its own hardware: with equal rollout and train costs the ideal ratio is 2 n / (n + 1) for n steps.
#   The same costs also go through the scale part's simulated clock, whose wall-clock is reported beside the
#   processes' (how much the clock leaves out).
# scale: 8, 64 and 512 engines, too many for this machine, on a simulated clock (one thread, no Ray) that drives the
#   real scheduling code (runtime.RolloutPool, router.Router's weight push, runtime.staleness_metrics) under a stated
#   cost model (ScaleModel: per-engine decode rate by batch, trainer tokens/s, weight push per engine, eta):
#   throughput, the staleness histogram of trained rollouts, engine idle and trainer idle, at eta 0, 1 and 2, with
#   the batch growing with the engines (weak) or fixed (strong), and at 512 engines with one wall after another
#   taken away. docs/scale-out.md reads the figures.
#
#   python bench/async.py [--parts real simulated] [--out async-summary.json] [--model smollm2 --steps 8 ...]
#   python bench/async.py --parts simulated scale --out docs/async-scale.json     (about 9 minutes on 2 cores)
import argparse
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

import runtime  # noqa: E402
from engines import Generation, SamplingParams
from rollout import per_prompt  # noqa: E402
from router import Router  # noqa: E402


# ---- real: train.py through the Ray runtime, eta 0 then eta 1 ------------------------------------------------

def real_run(args, eta: int, out: str) -> dict:
    flags = ["--recipe", args.recipe, "--model", args.model, "--steps", str(args.steps), "--seed", "0",
             "--rollout.prompts_per_step", str(args.prompts), "--rollout.samples_per_prompt", str(args.samples),
             "--rollout.max_tokens", str(args.max_tokens), "--run.threads", "1", "--train.minibatches", "1",
             "--runtime.mode", "ray", "--runtime.eta", str(eta), "--out", out]
    if eta:
        flags += ["--correction.level", "token", "--correction.max_staleness", str(eta)]
    t0 = time.time()
    done = subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"train.py failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {"eta": eta, "process_s": time.time() - t0,
            "steps_s": sum(r["time/step_s"] for r in records),
            "engine_idle_frac": sum(r["runtime/engine_idle_frac"] for r in records) / len(records),
            "staleness_max": max(r["actor/staleness_max"] for r in records),
            "multi_version_rollouts": sum(r["runtime/multi_version_rollouts"] for r in records),
            "reward": [round(r["rollout/reward"], 4) for r in records]}


def real(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sync, asyn = (real_run(args, eta, os.path.join(tmp, f"eta{eta}")) for eta in (0, 1))
    return {"model": args.model, "steps": args.steps, "batch": f"{args.prompts} x {args.samples}",
            "sync": sync, "async": asyn, "wall_clock_ratio": sync["steps_s"] / asyn["steps_s"]}


# ---- simulated: fixed costs, separate processes, the same scheduler ------------------------------------------

class SimulatedEngine:
    """The engine interface with a fixed cost per decode step for any batch; pause holds every request between
    steps; each token carries the version of the weights in place when its step began."""

    def __init__(self, token_s: float):
        self.token_s, self.version = token_s, 0
        self._running = threading.Event()
        self._running.set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def update_weights(self, state: dict, version: int) -> None:
        self.version = version

    def check_images(self, prompt, images) -> None:
        pass

    def sampler_state(self):
        return None

    def generate(self, prompts, params, on_token=None, images=None) -> list[Generation]:
        n = max(p.max_tokens for p in per_prompt(len(prompts), params)[0])
        versions = []
        for _ in range(n):
            self._running.wait()
            versions.append(self.version)
            time.sleep(self.token_s)
            for i in range(len(prompts)):
                if on_token is not None:
                    on_token(i, 1)
        return [Generation(list(p), [1] * n, [0.0] * n, list(versions), None, "length") for p in prompts]


class SimulatedRunner:
    """One engine call per group; the rollout's reward is its group's index parity (no group is filtered)."""

    def __init__(self, engine, max_tokens: int):
        self.engine, self.max_tokens, self.failures = engine, max_tokens, {}

    def run(self, tasks, group_ids, sampling):
        gens = self.engine.generate([[1, 2, 3]] * len(tasks), SamplingParams(max_tokens=self.max_tokens))
        return [SimpleNamespace(group_id=g, rollout_id=f"{g}-{i}", reward=float(i % 2), generations=[gen])
                for i, (g, gen) in enumerate(zip(group_ids, gens))]


def simulated_run(args, eta: int) -> dict:
    cfg = runtime.RuntimeConfig(mode="ray", eta=eta, engines=args.engines, object_store_mb=100)
    rt = runtime.start(cfg, SimulatedEngine, lambda i: (args.token_s,), version=0)
    try:
        router = Router(rt.proxies)
        runner = SimulatedRunner(router, args.sim_tokens)
        state = {"w": torch.zeros(args.sim_weights)}
        rt.engine_metrics()
        t0 = time.monotonic()
        pool = runtime.RolloutPool(runner, list(range(1000)), SamplingParams(), args.prompts, args.samples, eta,
                                   False, args.sim_steps)
        staleness, idle, push = [], [], []
        for step in range(args.sim_steps):
            rollouts, _ = pool.take()
            staleness.append(max(step - min(g.policy_versions) for r in rollouts for g in r.generations))
            time.sleep(args.sample_s * len(rollouts))            # the trainer's cost
            push.append(rt.push_weights(router, state, step + 1)["runtime/weight_sync_s"])
            pool.trained_step(step + 1)
            idle.append(rt.engine_metrics()["runtime/engine_idle_frac"])
        wall = time.monotonic() - t0
    finally:
        runtime.stop(rt)
    return {"eta": eta, "wall_s": wall, "engine_idle_frac": sum(idle) / len(idle), "staleness_max": max(staleness),
            "staleness_hist": {s: staleness.count(s) for s in sorted(set(staleness))},
            "push_s": sum(push) / len(push)}


def simulated(args) -> dict:
    rollout_s = args.sim_tokens * args.token_s
    train_s = args.sample_s * args.prompts * args.samples
    sync, asyn = simulated_run(args, 0), simulated_run(args, 1)
    n = args.sim_steps
    # the scale part's simulated clock on the same costs (its push: each engine's measured one): how far its wall
    # clock is from the processes' tells what the simulation leaves out (Ray's and the threads' own overheads)
    for run in (sync, asyn):
        model = ScaleModel(samples=args.samples, prompt_tokens=0, median_tokens=args.sim_tokens, sigma=0.0,
                           max_tokens=args.sim_tokens, step_base_s=args.token_s, step_per_seq_s=0.0,
                           max_seqs=2**30, prefill_tokens_per_s=math.inf,
                           train_tokens_per_s=args.sim_tokens / args.sample_s, train_fixed_s=0.0, weight_bytes=0.0,
                           push_latency_s=run["push_s"] / args.engines)
        clock = ScaleSim(model, args.engines, args.prompts, run["eta"], n).simulate(warmup=0)
        run["simulated_clock_wall_s"] = clock["step_s"] * n
    return {"steps": n, "rollout_s_per_step": rollout_s, "train_s_per_step": train_s, "engines": args.engines,
            "sync": sync, "async": asyn, "wall_clock_ratio": sync["wall_s"] / asyn["wall_s"],
            "ideal_ratio": n * (rollout_s + train_s) / (rollout_s + n * max(rollout_s, train_s))}


# ---- scale: 8, 64 and 512 engines on a simulated clock, through the real pool and the real control plane ---------
# The engines and the trainer are costs on one simulated clock (a discrete-event simulation, one thread), but the
# scheduling is tracerl's own code: runtime.RolloutPool admits, books and hands out the groups (its capacity rule,
# eta, admission order; each of its group threads becomes an event that runs the pool's own `_run` when the group's
# last sample finishes, and its `take` raises where it would wait, so the trainer waits until the next booking),
# router.Router pushes the weights (pause every engine, load one after another, resume every engine: each engine
# has its own weight channel, so a push costs engines x per-engine time, with every engine paused throughout) and
# runtime.staleness_metrics makes the histogram. Requests are placed as the router places them (the engine with the
# fewest outstanding tokens, then fewest sessions, then the lowest index; a call's tokens stay reserved until its
# engine has answered all of its rows). The loop is train.py's: take, train, push, trained_step.

@dataclass
class ScaleModel:
    """The simulation's costs. Defaults: a Qwen3-0.6B-shape policy, vLLM engines of one H200 each, and the trainer
    as tracerl runs it across nodes today: --runtime.trainer_ranks 8 (one 8-GPU FSDP2 group) whose full weights
    come to the driver's host memory, from where each engine's weight channel (gloo, since the tensors are on a
    CPU) sends them, one engine after another. Anchored where tracerl has measured this shape on an H200."""
    samples: int = 8                     # samples per prompt group
    prompt_tokens: int = 256             # per rollout (one turn); its prefill is not timed
    median_tokens: float = 350.0         # response length ~ lognormal(log median, sigma), capped at max_tokens
    sigma: float = 0.7                   #   (mean ~430 tokens, ~6% of replies reach the cap)
    max_tokens: int = 1024
    step_base_s: float = 0.006           # an engine's decode step: base + per_seq * sequences decoding; at 256,
    step_per_seq_s: float = 3.0e-5       #   13.7 ms = 18.7K tokens/s (measured: 19.0K, vLLM, 0.6B shape, one H200)
    max_seqs: int = 256                  # sequences an engine decodes at once (vLLM's max_num_seqs); others queue
    prefill_tokens_per_s: float = 3.0e5  # an engine re-prefills every kept request after each weight update (its
                                         #   KV cache is the old weights'): 1.2 GFLOP/token at ~35% of 990 TFLOP/s
    train_tokens_per_s: float = 2.2e5    # the trainer: 8 ranks x 36.2K tokens/s (the actor's defaults, 0.6B shape,
                                         #   one H200) x 3/4 for the recompute's forward, scaling perfectly
    train_fixed_s: float = 1.5           # per step: optimizer step, the full weights gathered to the driver
    weight_bytes: float = 1.2e9          # the policy in bf16
    link_bytes_per_s: float = 2.0e9      # one engine's weight channel: gloo over TCP from the driver's host memory
    push_latency_s: float = 0.01         # per engine per push: its channel's round trips, the load into vLLM
    push: str = "serial"                 # serial: router.update_weights, one engine's channel after another (as
                                         #   built); broadcast: one collective to all engines (not built), a
                                         #   pipelined tree: one transfer plus a latency per level, loads in parallel

    def step_s(self, seqs: int) -> float:
        return self.step_base_s + self.step_per_seq_s * seqs

    def push_s(self, engines: int) -> float:
        """One weight update's time for `engines` engines; SimEngine.update_weights spends a 1/engines share."""
        transfer = self.weight_bytes / self.link_bytes_per_s
        if self.push == "serial":
            return engines * (self.push_latency_s + transfer)
        return transfer + math.ceil(math.log2(engines + 1)) * self.push_latency_s


class WouldBlock(Exception):
    """RolloutPool.take would wait: the trainer waits for the next booking."""


class SimCondition:
    """The pool's condition variable on one thread: nothing to lock, nobody to notify, and waiting is WouldBlock."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def notify_all(self) -> None:
        pass

    def wait(self) -> None:
        raise WouldBlock


@dataclass
class SimRequest:
    index: int                   # position in its runner call
    length: int                  # response tokens
    call: int = -1               # the runner call it belongs to
    engine: int = -1
    start_p: float = 0.0         # the engine's progress when this request began decoding
    versions: list = field(default_factory=list)   # [first token's version, last token's version]


class SimEngine:
    """One engine on the simulated clock: continuous batching (every decoding sequence gains a token per decode
    step, whose time grows with their number), at most max_seqs at once, and the control calls the router makes.
    `progress` counts decode steps since the engine started; a request ends when it has gained `length` of them."""

    def __init__(self, index: int, sim: "ScaleSim"):
        self.index, self.sim, self.m = index, sim, sim.model
        self.version, self.paused = 0, False
        self.progress, self.last_t, self.stall_until = 0.0, 0.0, 0.0
        self.decoding: list[tuple[float, int, SimRequest]] = []     # heap of (progress at its end, id, request)
        self.waiting: deque = deque()
        self.epoch = 0                   # bumps whenever the next end moves; an event of an older epoch is void
        self.time = {"decode": 0.0, "prefill": 0.0, "paused": 0.0, "idle": 0.0}

    def _advance(self) -> None:
        """Book the time since last_t (decoding, re-prefilling, paused, idle) and move progress on."""
        now, t = self.sim.now, self.last_t
        if now <= t:
            return
        if not self.decoding:
            self.time["idle"] += now - t
        elif self.paused:
            self.time["paused"] += now - t
        else:
            stalled = min(max(self.stall_until - t, 0.0), now - t)
            self.time["prefill"] += stalled
            self.time["decode"] += now - t - stalled
            self.progress += (now - t - stalled) / self.m.step_s(len(self.decoding))
        self.last_t = now

    def _schedule(self) -> None:
        self.epoch += 1
        if self.decoding and not self.paused:
            ends = max(self.sim.now, self.stall_until) + max(self.decoding[0][0] - self.progress, 0.0) * \
                self.m.step_s(len(self.decoding))
            self.sim.at(ends, self._ended, self.epoch)

    def _begin(self, req: SimRequest) -> None:
        req.start_p = self.progress
        req.versions = [self.version]
        heapq.heappush(self.decoding, (self.progress + req.length, id(req), req))

    def add(self, req: SimRequest) -> None:
        self._advance()
        if len(self.decoding) < self.m.max_seqs:
            self._begin(req)
        else:
            self.waiting.append(req)
        self._schedule()

    def _ended(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._advance()
        ended = []
        while self.decoding and self.decoding[0][0] <= self.progress + 1e-6:
            ended.append(heapq.heappop(self.decoding)[2])
            ended[-1].versions.append(self.version)
        while self.waiting and len(self.decoding) < self.m.max_seqs:
            self._begin(self.waiting.popleft())
        self._schedule()
        for req in ended:                # after this engine's own books are closed: a booking may place new work
            self.sim.request_done(req)

    # the control plane, as router.Router calls it
    def pause(self) -> None:
        self._advance()
        self.paused = True
        self._schedule()

    def update_weights(self, state, version: int) -> None:
        self.sim.now += self.m.push_s(len(self.sim.engines)) / len(self.sim.engines)    # the router: one by one
        self.version = version

    def resume(self) -> None:
        self._advance()
        self.paused = False
        kept = sum(self.m.prompt_tokens + self.progress - r.start_p for _, _, r in self.decoding)
        self.stall_until = self.sim.now + kept / self.m.prefill_tokens_per_s
        self._schedule()


class ScaleSim:
    """One run: `engines` simulated engines, B groups of `samples` per step, eta, `steps` policy steps."""

    def __init__(self, model: ScaleModel, engines: int, groups: int, eta: int, steps: int, seed: int = 0):
        self.model, self.B, self.eta, self.steps = model, groups, eta, steps
        self.now, self.events, self.seq = 0.0, [], 0
        self.lengths = random.Random(seed)
        self.engines = [SimEngine(i, self) for i in range(engines)]
        self.router = Router(self.engines)          # the control plane only
        # the router's placement state: outstanding (reserved) tokens and sessions per engine, as a lazy heap
        self.outstanding, self.held = [0] * engines, [0] * engines
        self.free = [(0, 0, e) for e in range(engines)]
        self.parts: list = []                       # pool group threads started and not yet placed
        self.remaining: dict[int, list] = {}        # runner call -> [requests left, its requests, target, args]
        self.calls: dict[tuple[int, int], list] = {}   # (runner call, engine) -> [rows left, tokens reserved]
        self.done_part = None
        self.pool_cpu_s = 0.0                       # real seconds spent in the pool's own code
        self.threads_peak = 0                       # the driver's threads this would take: a group thread per
                                                    # runner call, a router thread per engine the call reaches

    # -- the clock --
    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    # -- the runner's calls, placed as the router places them --
    def thread(self, target, args, daemon=True, name=""):
        sim = self

        class PartThread:        # RolloutPool's group thread: its target runs when the call's last sample ends
            def start(self) -> None:
                sim.parts.append((target, args))
        return PartThread()

    def _place_parts(self) -> None:
        parts, self.parts = self.parts, []
        for target, args in parts:
            part, call = args[0], self.seq
            self.seq += 1
            reqs = [SimRequest(i, self._length()) for i in range(len(part) * self.model.samples)]
            self.remaining[call] = [len(reqs), reqs, target, args]
            for req in reqs:
                e = self._pick()
                req.engine, req.call = e, call
                key = (call, e)
                self.calls.setdefault(key, [0, 0])
                self.calls[key][0] += 1
                self.calls[key][1] += self.model.max_tokens
                self.outstanding[e] += self.model.max_tokens
                self.held[e] += 1                    # every rollout is a new sticky session
                heapq.heappush(self.free, (self.outstanding[e], self.held[e], e))
            for req in reqs:
                self.engines[req.engine].add(req)
        self.threads_peak = max(self.threads_peak, len(self.remaining) + len(self.calls))

    def _pick(self) -> int:
        while True:
            load, held, e = self.free[0]
            if (load, held) == (self.outstanding[e], self.held[e]):
                return e
            heapq.heappop(self.free)

    def _length(self) -> int:
        m = self.model
        return max(1, min(m.max_tokens, round(self.lengths.lognormvariate(math.log(m.median_tokens), m.sigma))))

    def request_done(self, req: SimRequest) -> None:
        key = (req.call, req.engine)
        self.calls[key][0] -= 1
        if self.calls[key][0] == 0:                  # the engine answered the call's rows: reservation released
            self.outstanding[req.engine] -= self.calls.pop(key)[1]
            heapq.heappush(self.free, (self.outstanding[req.engine], self.held[req.engine], req.engine))
        entry = self.remaining[req.call]
        entry[0] -= 1
        if entry[0] == 0:                            # the runner call returns: the pool books its groups
            del self.remaining[req.call]
            self.done_part = entry[1]
            t0 = time.perf_counter()
            entry[2](*entry[3])
            self.pool_cpu_s += time.perf_counter() - t0
            self._place_parts()
            self._try_take()

    def run(self, tasks, group_ids, sampling):
        """The runner the pool calls from the group's thread: the finished call's rollouts, one per request (its
        time is the runner's, not the pool's)."""
        t0, m = time.perf_counter(), self.model
        rollouts = [SimpleNamespace(group_id=g, rollout_id=f"{g}-{r.index}", reward=float(r.index % 2),
                                    tokens=m.prompt_tokens + r.length, sampled=r.length,
                                    generations=[SimpleNamespace(policy_versions=r.versions)])
                    for g, r in zip(group_ids, self.done_part)]
        self.pool_cpu_s -= time.perf_counter() - t0
        return rollouts

    # -- the trainer: train.py's loop (take, train, push, trained_step) --
    def _try_take(self) -> None:
        if self.training or self.step >= self.steps:
            return
        t0 = time.perf_counter()
        try:
            rollouts, _ = self.pool.take()
        except WouldBlock:
            return
        finally:
            self.pool_cpu_s += time.perf_counter() - t0
        self.books["trainer_wait"] += self.now - self.waiting_since
        self.training = True
        for key, n in runtime.staleness_metrics(rollouts, self.step, self.eta).items():
            self.hist[key] = self.hist.get(key, 0) + int(n)
        self.books["rollouts"] += len(rollouts)
        self.books["tokens"] += sum(r.sampled for r in rollouts)
        train_s = self.model.train_fixed_s + sum(r.tokens for r in rollouts) / self.model.train_tokens_per_s
        self.books["trainer_train"] += train_s
        self.at(self.now + train_s, self._trained)

    def _trained(self) -> None:
        self.step += 1
        t0 = self.now
        self.router.update_weights({}, self.step)      # pause all, load one by one, resume all
        self.books["trainer_push"] += self.now - t0
        c0 = time.perf_counter()
        self.pool.trained_step(self.step)
        self.pool_cpu_s += time.perf_counter() - c0
        self.training, self.waiting_since = False, self.now
        if self.step == self.warmup:
            self.start = self.snapshot()
        self._place_parts()
        self._try_take()

    def snapshot(self) -> dict:
        for engine in self.engines:
            engine._advance()
        books = dict(self.books, now=self.now, hist=dict(self.hist))
        for kind in ("decode", "prefill", "paused", "idle"):
            books[f"engine_{kind}"] = sum(e.time[kind] for e in self.engines)
        return books

    def simulate(self, warmup: int) -> dict:
        """Run `steps` policy steps; figures over the steps after the first `warmup` (the pipeline filled)."""
        self.step, self.warmup, self.training, self.waiting_since = 0, warmup, False, 0.0
        self.books = dict.fromkeys(("trainer_wait", "trainer_train", "trainer_push", "rollouts", "tokens"), 0.0)
        self.hist: dict[str, int] = {}
        saved, runtime.threading = runtime.threading, SimpleNamespace(Thread=self.thread, Condition=SimCondition)
        try:                       # the pool's group threads and its condition, for as long as the pool runs
            t0 = time.perf_counter()
            self.pool = runtime.RolloutPool(self, [None], SamplingParams(), self.B, self.model.samples, self.eta,
                                            False, self.steps)
            self.pool_cpu_s += time.perf_counter() - t0
            self.start = self.snapshot()
            self._place_parts()
            self._try_take()
            while self.events and self.step < self.steps:
                t, _, fn, args = heapq.heappop(self.events)
                self.now = max(self.now, t)
                fn(*args)
        finally:
            runtime.threading = saved
        if self.step < self.steps:
            raise RuntimeError(f"the simulation stopped at step {self.step} of {self.steps} with nothing scheduled")
        return self.summary(self.start, self.snapshot())

    def summary(self, a: dict, b: dict) -> dict:
        wall = b["now"] - a["now"]
        steps = self.steps - self.warmup
        engine_s = wall * len(self.engines)
        hist = {k.removeprefix("runtime/staleness_"): b["hist"].get(k, 0) - a["hist"].get(k, 0)
                for k in b["hist"] if k.startswith("runtime/staleness_")}
        return {
            "engines": len(self.engines), "eta": self.eta, "groups_per_step": self.B,
            "rollouts_per_step": self.B * self.model.samples, "steps_measured": steps,
            "step_s": wall / steps,
            "rollouts_per_s": (b["rollouts"] - a["rollouts"]) / wall,
            "tokens_per_s": (b["tokens"] - a["tokens"]) / wall,
            "tokens_per_s_per_engine": (b["tokens"] - a["tokens"]) / wall / len(self.engines),
            # the runtime's engine idle: no request in flight; the rest of an engine's time is split by what it did
            "engine_idle_frac": (b["engine_idle"] - a["engine_idle"]) / engine_s,
            "engine_time_frac": {k: (b[f"engine_{k}"] - a[f"engine_{k}"]) / engine_s
                                 for k in ("decode", "prefill", "paused", "idle")},
            "trainer_idle_frac": (b["trainer_wait"] - a["trainer_wait"]) / wall,
            "trainer_time_frac": {"train": (b["trainer_train"] - a["trainer_train"]) / wall,
                                  "push": (b["trainer_push"] - a["trainer_push"]) / wall,
                                  "wait": (b["trainer_wait"] - a["trainer_wait"]) / wall},
            "push_s": (b["trainer_push"] - a["trainer_push"]) / steps,
            "staleness_hist": hist,
            "multi_version_rollouts": b["hist"].get("runtime/multi_version_rollouts", 0)
                                      - a["hist"].get("runtime/multi_version_rollouts", 0),
            "pool_cpu_s_per_step": self.pool_cpu_s / self.steps,
            "driver_threads_peak": self.threads_peak,
        }


def scale_run(model: ScaleModel, regime: str, engines: int, groups: int, eta: int, args) -> dict:
    t0 = time.perf_counter()
    r = ScaleSim(model, engines, groups, eta, args.scale_steps).simulate(args.scale_warmup)
    r.update(regime=regime, sim_wall_s=time.perf_counter() - t0)
    print(f"scale {regime:22s} engines {engines:4d} eta {eta}: {r['step_s']:7.2f} s/step {r['tokens_per_s']:9.0f} "
          f"tok/s  engine idle {r['engine_idle_frac']:.2f} decoding {r['engine_time_frac']['decode']:.2f}  trainer "
          f"idle {r['trainer_idle_frac']:.2f} push {r['push_s']:6.1f} s  (simulated in {r['sim_wall_s']:.0f} s)",
          flush=True)
    return r


def scale(args) -> dict:
    """weak: the batch grows with the engines (--groups-per-engine groups of each per step), at every engine count
    and eta; strong: a fixed batch (--groups per step); walls: the largest engine count at eta 1 with the walls the
    first runs hit taken away one after another (costs that tracerl does not have today), then the fixed batch
    without them."""
    base = ScaleModel()
    top = max(args.scale_engines)
    walls = [("weak: NCCL-speed channels", replace(base, link_bytes_per_s=25e9, push_latency_s=0.005)),
             ("weak: + one broadcast", replace(base, link_bytes_per_s=25e9, push_latency_s=0.005, push="broadcast")),
             ("weak: + 8x the trainer", replace(base, link_bytes_per_s=25e9, push_latency_s=0.005, push="broadcast",
                                                train_tokens_per_s=8 * base.train_tokens_per_s))]
    runs = [scale_run(base, "weak", n, n * args.groups_per_engine, eta, args)
            for n in args.scale_engines for eta in args.scale_etas]
    for n in args.scale_engines:             # a strong run whose batch a weak run had is that run
        for eta in args.scale_etas:
            same = [r for r in runs if r["engines"] == n and r["eta"] == eta and r["groups_per_step"] == args.groups]
            runs.append(dict(same[0], regime="strong") if same else scale_run(base, "strong", n, args.groups, eta, args))
    runs += [scale_run(model, name, top, top * args.groups_per_engine, 1, args) for name, model in walls]
    # the fixed batch without those walls: what eta's cap on the groups in flight leaves each engine to decode
    runs += [scale_run(walls[-1][1], "strong: " + walls[-1][0].removeprefix("weak: "), n, args.groups, eta, args)
             for n in args.scale_engines[1:] for eta in args.scale_etas]
    return {"model": asdict(base), "walls": {name: asdict(model) for name, model in walls},
            "push_s_per_engine": base.push_s(1), "decode_tokens_per_s_at_max_seqs": base.max_seqs / base.step_s(base.max_seqs),
            "steps": args.scale_steps, "warmup_steps": args.scale_warmup, "groups_per_engine": args.groups_per_engine,
            "strong_groups": args.groups, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description="eta 0 against eta 1 through the Ray runtime; writes a JSON summary")
    parser.add_argument("--parts", nargs="+", default=["real", "simulated"], choices=["real", "simulated", "scale"])
    parser.add_argument("--out", default="async-summary.json")
    parser.add_argument("--recipe", default="math")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=8, help="real: RL steps per run")
    parser.add_argument("--prompts", type=int, default=4, help="prompt groups per step (both parts)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (both parts)")
    parser.add_argument("--max-tokens", type=int, default=32, help="real: new tokens per rollout")
    parser.add_argument("--engines", type=int, default=1, help="simulated: engine actors")
    parser.add_argument("--sim-steps", type=int, default=20)
    parser.add_argument("--sim-tokens", type=int, default=50, help="simulated: tokens per rollout")
    parser.add_argument("--token-s", type=float, default=0.02, help="simulated: seconds per decode step")
    parser.add_argument("--sample-s", type=float, default=1 / 16, help="simulated: trainer seconds per sample")
    parser.add_argument("--sim-weights", type=int, default=1_000_000, help="simulated: fp32 values per weight push")
    parser.add_argument("--scale-engines", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--scale-etas", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scale-steps", type=int, default=6, help="scale: policy steps per simulation")
    parser.add_argument("--scale-warmup", type=int, default=2, help="scale: first steps left out of the figures")
    parser.add_argument("--groups-per-engine", type=int, default=8, help="scale, weak: groups per step per engine")
    parser.add_argument("--groups", type=int, default=512, help="scale, strong: groups per step")
    args = parser.parse_args()
    summary = {}
    for part in args.parts:
        summary[part] = {"real": real, "simulated": simulated, "scale": scale}[part](args)
        print(part, json.dumps(summary[part]), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
