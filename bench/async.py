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
#
#   python bench/async.py [--parts real simulated] [--out async-summary.json] [--model smollm2 --steps 8 ...]
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

import runtime  # noqa: E402
from rollout import Generation, SamplingParams, params_per_prompt  # noqa: E402
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
        n = max(p.max_tokens for p in params_per_prompt(params, len(prompts)))
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
        staleness, idle = [], []
        for step in range(args.sim_steps):
            rollouts, _ = pool.take()
            staleness.append(max(step - min(g.policy_versions) for r in rollouts for g in r.generations))
            time.sleep(args.sample_s * len(rollouts))            # the trainer's cost
            rt.push_weights(router, state, step + 1)
            pool.trained_step(step + 1)
            idle.append(rt.engine_metrics()["runtime/engine_idle_frac"])
        wall = time.monotonic() - t0
    finally:
        runtime.stop(rt)
    return {"eta": eta, "wall_s": wall, "engine_idle_frac": sum(idle) / len(idle), "staleness_max": max(staleness),
            "staleness_hist": {s: staleness.count(s) for s in sorted(set(staleness))}}


def simulated(args) -> dict:
    rollout_s = args.sim_tokens * args.token_s
    train_s = args.sample_s * args.prompts * args.samples
    sync, asyn = simulated_run(args, 0), simulated_run(args, 1)
    n = args.sim_steps
    return {"steps": n, "rollout_s_per_step": rollout_s, "train_s_per_step": train_s, "engines": args.engines,
            "sync": sync, "async": asyn, "wall_clock_ratio": sync["wall_s"] / asyn["wall_s"],
            "ideal_ratio": n * (rollout_s + train_s) / (rollout_s + n * max(rollout_s, train_s))}


def main() -> None:
    parser = argparse.ArgumentParser(description="eta 0 against eta 1 through the Ray runtime; writes a JSON summary")
    parser.add_argument("--parts", nargs="+", default=["real", "simulated"], choices=["real", "simulated"])
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
    args = parser.parse_args()
    summary = {}
    for part in args.parts:
        summary[part] = real(args) if part == "real" else simulated(args)
        print(part, json.dumps(summary[part]), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
