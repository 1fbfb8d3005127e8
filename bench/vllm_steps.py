# bench/vllm_steps.py — does the vLLM engine's generation slow down from step to step of a sync RL run?
#
# Drives vllm_engine.VLLMEngine through router.Router the way train.py's sync loop does, for --steps steps of:
#   generate one batch (--prompts x --samples rows; new prompts every step, all sharing one prefix as chat-templated
#   prompts do, each prompt repeated --samples times as a GRPO group is; with --recipe NAME the recipe's own agent
#   runner makes the rollouts from its tasks, exactly train.py's rollout: chat template, env threads, grading)
#   -> sleep (a GPU engine: weights to host, KV cache dropped)
#   -> "train": perturb a copy of the weights on the device; with --actor (and --recipe) train.py's own step instead:
#      actor.Actor trained on the rollouts' rows by train.train_on_rows, so the GPU holds the actor's memory (optimizer,
#      activations) while the engine sleeps, exactly as in a run
#   -> wake_up -> update_weights (CUDA IPC on a GPU, a state dict on vLLM's CPU build) at the next version.
# As in train.py, the weights are pushed once before step 1.
# Each step opens with a probe, one request of a fixed prompt that the previous step also sent: after an update its
# prompt must be computed afresh (KV written by the old weights must never be reused), so its cached tokens are 0.
#
# Recorded per step (steps[] in the JSON): tokens/s over the engine's busy time (gen_s: requests in flight, from
# router.Router.stats) and over the rollout's wall time (rollout_s: train.py's perf/tokens_per_s); output lengths and
# stops; the probe's and the batch's prompt tokens served from vLLM's prefix cache; CPU use of this process and of
# vLLM's engine processes during the rollout (cores busy); Python's garbage collector during it (collections,
# seconds); what the engine and the router still hold after the step (requests in flight, vLLM request states, tasks
# on the engine's loop, sessions, threads, objects the collector tracks); host memory of this process and of vLLM's
# processes; GPU memory, and where nvidia-smi answers the SM clock, power and utilisation sampled during the rollout;
# the seconds of sleep, train, wake and update. The summary compares the last steps' tokens/s with the first
# steps' (step 1 excluded: it runs right after start-up) and fits every counter's change per step.
#
#   python bench/vllm_steps.py --tiny [--steps 6] [--recipe math [--actor]]   (vLLM's CPU build, a tiny random Qwen3)
#   python bench/vllm_steps.py --model DIR --prompts 32 --samples 8 --max-tokens 512 --steps 20
#                              [--recipe math [--actor]] [--no-sleep] [--no-update] [--out vllm-steps.json]
import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402

import actor  # noqa: E402
import config  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
from engines.vllm_engine import VLLMEngine  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from router import Router  # noqa: E402

PREFIX, TAIL = 48, 32          # prompt tokens shared by every prompt (a chat template's), and each prompt's own
PROBE_TAIL = 224               # the probe's own: with the prefix, two of the CPU build's 128-token KV blocks


class GCWatch:
    """Seconds Python's collector spent, and collections per generation, between start() and stop()."""

    def __init__(self):
        self.seconds, self._t, self._counts = 0.0, None, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self._t = None

    def start(self) -> None:
        self.seconds, self._counts = 0.0, [s["collections"] for s in gc.get_stats()]

    def stop(self) -> dict[str, float]:
        counts = [s["collections"] - c for s, c in zip(gc.get_stats(), self._counts)]
        return {"gc_s": self.seconds, **{f"gc_gen{g}": float(n) for g, n in enumerate(counts)}}


class GPUWatch:
    """SM clock, power and utilisation sampled by nvidia-smi once a second between start() and stop() (means); a
    generation that leaves the GPU idle part of the time is bound by the CPU."""

    QUERY = "clocks.sm,power.draw,utilization.gpu,temperature.gpu"

    def __init__(self, device_index: int):
        self.device_index, self.samples, self._stop = device_index, [], threading.Event()
        self._thread = None

    def start(self) -> None:
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            line = subprocess.run(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                   "-i", str(self.device_index)], capture_output=True, text=True).stdout
            try:
                self.samples.append([float(x) for x in line.strip().split(",")])
            except ValueError:
                pass

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        if not self.samples:
            return {}
        means = [sum(col) / len(col) for col in zip(*self.samples)]
        return dict(zip(("sm_clock_mhz", "gpu_power_w", "gpu_util_pct", "gpu_temp_c"), means))


def prompts_of_step(step: int, n: int, vocab: int, banned: set[int], tail: int = TAIL) -> list[list[int]]:
    """n prompts of PREFIX shared ids + `tail` ids of their own (new every step; step -1 is the probe's)."""
    def ids(rng, k):
        out = []
        while len(out) < k:
            t = rng.randrange(vocab)
            if t not in banned:
                out.append(t)
        return out
    prefix = ids(random.Random(0), PREFIX)
    rng = random.Random(1000 + step)
    return [prefix + ids(rng, tail) for _ in range(n)]


def processes() -> list[psutil.Process]:
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by its children (vLLM's engine processes)."""
    own, children = 0.0, 0.0
    for i, proc in enumerate(processes()):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        if i == 0:
            own = t.user + t.system
        else:
            children += t.user + t.system
    return own, children


def host_mb() -> tuple[float, float]:
    """RSS of this process and of its children, MB."""
    own, children = 0.0, 0.0
    for i, proc in enumerate(processes()):
        try:
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        own, children = (rss, children) if i == 0 else (own, children + rss)
    return own, children


def gpu_memory() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_used_gb": (total - free) / 2**30, "gpu_trainer_allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "gpu_trainer_reserved_gb": torch.cuda.memory_reserved() / 2**30}


def slope(values: list[float]) -> float:
    """Least-squares change per step."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def summarize(records: list[dict], args, path: str, on_gpu: bool, start_s: float) -> dict:
    """The run's JSON summary so far: written after every step, so a run cut short keeps the steps it made."""
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    k = max(1, min(5, len(speeds) // 2))
    counters = [name for name, v in records[0].items() if name != "step" and isinstance(v, (int, float))]
    summary = {
        "model": path, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "vllm": __import__("vllm").__version__, "torch": torch.__version__,
        "config": {k_: v for k_, v in vars(args).items() if k_ != "out"}, "engine_start_s": start_s,
        # the engine's tokens/s over its last k steps against its first k after step 1: 1.0 is no decline
        "last_over_first": (sum(speeds[-k:]) / k) / (sum(speeds[:k]) / k),
        "tokens_per_s_slope_pct_per_step": 100 * slope(speeds) / (sum(speeds) / len(speeds)),
        "change_per_step": {name: slope([r.get(name, 0.0) for r in records[1:]]) for name in counters},
        "stale_prefix_hits": None if args.no_update else sum(r["probe_cached_tokens"] for r in records),
        "steps": records,
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description="generation speed of the vLLM engine over the steps of a sync run")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 on vLLM's CPU build")
    parser.add_argument("--model", default="", help="a checkpoint folder (e.g. the Qwen3-0.6B shape, random)")
    parser.add_argument("--recipe", default="", help="rollouts by this recipe's agent runner (e.g. math)")
    parser.add_argument("--actor", action="store_true", help="train with train.py's actor step (needs --recipe)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--noise", type=float, default=1e-4, help="std of the per-step weight perturbation")
    parser.add_argument("--no-sleep", action="store_true", help="keep a GPU engine awake between steps")
    parser.add_argument("--no-update", action="store_true", help="never push weights (isolates the update)")
    parser.add_argument("--engine-memory", type=float, default=0.3, help="train.py's --rollout.engine_memory")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default="vllm-steps.json")
    args = parser.parse_args()
    if args.tiny == bool(args.model):
        parser.error("pass exactly one of --tiny (CPU build) or --model DIR")
    if args.actor and not args.recipe:
        parser.error("--actor trains on a recipe's rollouts: pass --recipe too (e.g. --recipe math)")

    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = models.tiny_model_dir("qwen3", head_dim=32) if args.tiny else args.model
    max_length = max(PREFIX + PROBE_TAIL, (256 if args.recipe else PREFIX + TAIL) + args.max_tokens) + 16
    cfg, policy, trainer, work = None, None, None, tempfile.mkdtemp(prefix="vllm-steps-")
    if args.actor:            # as train.py builds it: the recipe's defaults, this batch's shape; before the engine
        cfg = config.parse_config(["--recipe", args.recipe, "--model", path, "--steps", str(args.steps),
                                   "--rollout.prompts_per_step", str(args.prompts),
                                   "--rollout.samples_per_prompt", str(args.samples),
                                   "--rollout.max_tokens", str(args.max_tokens), "--rollout.max_length",
                                   str(max_length), "--rollout.temperature", str(args.temperature)])
        policy = actor.Actor(path, cfg["actor"], total_steps=args.steps * cfg["train"].minibatches)
        os.makedirs(os.path.join(work, "traces"))
    else:
        trainer = models.load_model(path).to(device)      # fp32 master weights, as the actor keeps them
    t0 = time.time()
    engine = VLLMEngine(path, version=0, seed=0, dtype="bfloat16" if on_gpu else "float32",
                        transfer="ipc" if on_gpu else "rpc", sleep_mode=on_gpu, max_model_len=max_length,
                        gpu_memory_utilization=args.engine_memory, enforce_eager=not on_gpu)
    router = Router([engine])
    start_s = time.time() - t0

    def weights() -> tuple[dict[str, torch.Tensor], int]:
        if policy is not None:
            return policy.export_weights(policy.device), policy.version
        return {k: v.detach().clone() for k, v in trainer.state_dict().items()}, router.version + 1

    if not args.no_update:
        router.update_weights(*weights())          # train.py's push before step 1
    tokenizer = models.load_tokenizer(path)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    banned = set(engine.eos_ids)
    sleeps = on_gpu and not args.no_sleep
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    runner, tasks = None, []
    if args.recipe:           # train.py's rollout: the recipe's runner over its tasks, groups of --samples
        recipe = train.load_recipe(args.recipe)
        runner = recipe.AgentRunner(router, tokenizer, max_length=max_length)
        tasks = recipe.tasks("train", 0)
    print(f"vllm_steps: {path} on {device}, engine up in {start_s:.0f} s; {args.prompts} x {args.samples} rows x "
          f"<= {args.max_tokens} tokens, {args.steps} steps, rollouts by {args.recipe or 'token-id prompts'}, sleep "
          f"{sleeps}, update {not args.no_update}, trained by {'the actor' if args.actor else 'noise'}", flush=True)

    probe = prompts_of_step(-1, 1, vocab, banned, PROBE_TAIL)
    gc_watch = GCWatch()
    gpu_watch = GPUWatch(torch.cuda.current_device()) if on_gpu and shutil.which("nvidia-smi") else None
    records = []
    for step in range(args.steps):
        before = engine.counters()
        router.generate(probe, SamplingParams(top_k=1, max_tokens=1))
        probe_cached = engine.counters()["cached_prompt_tokens"] - before["cached_prompt_tokens"]

        before, busy, cpu = engine.counters(), router.stats()[0].busy_s, cpu_seconds()
        gc_watch.start()
        if gpu_watch:
            gpu_watch.start()
        t = time.perf_counter()
        rollouts = []
        if runner is None:
            prompts = [p for p in prompts_of_step(step, args.prompts, vocab, banned) for _ in range(args.samples)]
            gens = router.generate(prompts, params, session_ids=[f"s{step}-r{i}" for i in range(len(prompts))])
        else:
            picked = [tasks[(step * args.prompts + i) % len(tasks)] for i in range(args.prompts)]
            rollouts = runner.run([task for task in picked for _ in range(args.samples)],
                                  [f"s{step}-g{i}" for i in range(args.prompts) for _ in range(args.samples)], params)
            gens = [g for r in rollouts for g in r.generations]
        rollout_s = time.perf_counter() - t
        record = {"step": step + 1, "rollout_s": rollout_s, "gen_s": router.stats()[0].busy_s - busy,
                  **gc_watch.stop(), **(gpu_watch.stop() if gpu_watch else {})}
        cpu_after, after = cpu_seconds(), engine.counters()
        lengths = [len(g.token_ids) for g in gens]
        record.update({
            "tokens": sum(lengths), "tokens_per_s": sum(lengths) / record["gen_s"],
            "rollout_tokens_per_s": sum(lengths) / rollout_s,
            "len_mean": sum(lengths) / len(lengths), "len_min": min(lengths), "len_max": max(lengths),
            "stopped": sum(g.finish_reason == "stop" for g in gens),
            "probe_cached_tokens": probe_cached,
            "batch_cached_share": (after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
            / max(after["prompt_tokens"] - before["prompt_tokens"], 1),
            "trainer_cores": (cpu_after[0] - cpu[0]) / rollout_s, "engine_cores": (cpu_after[1] - cpu[1]) / rollout_s,
        })
        del gens

        t = time.perf_counter()
        if sleeps:
            engine.sleep()
        record["sleep_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if policy is not None:
            train.train_on_rows(cfg, policy, None, tokenizer, [(r, row) for r in rollouts for row in r.rows], work,
                                step)
        else:
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p), alpha=args.noise)
        del rollouts
        record["train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if sleeps:
            engine.wake_up()
        record["wake_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if not args.no_update:
            router.update_weights(*weights())
        record["update_s"] = time.perf_counter() - t

        rss, engine_rss = host_mb()
        held, stats = engine.counters(), router.stats()[0]
        record.update({k: float(held[k]) for k in ("active_requests", "vllm_request_states", "loop_tasks")})
        record.update({
            "router_in_flight": float(stats.in_flight), "router_outstanding_tokens": float(stats.outstanding_tokens),
            "router_sessions": float(len(router._sessions)), "threads": float(threading.active_count()),
            "gc_objects": float(len(gc.get_objects())), "rss_mb": rss, "engine_rss_mb": engine_rss, **gpu_memory()})
        records.append(record)
        summarize(records, args, path, on_gpu, start_s)
        print(f"step {step + 1:3d}: {record['tokens_per_s']:8.0f} tok/s engine, {record['rollout_tokens_per_s']:8.0f} "
              f"rollout ({record['tokens']} tokens, {record['gen_s']:.2f}/{rollout_s:.2f} s, len "
              f"{record['len_mean']:.0f}) | probe cached {probe_cached} | cores {record['trainer_cores']:.2f}+"
              f"{record['engine_cores']:.2f} | gc {record['gc_s']:.2f} s | live {record['active_requests']:.0f}/"
              f"{record['vllm_request_states']:.0f} tasks {record['loop_tasks']:.0f} threads {record['threads']:.0f} |"
              f" rss {rss:.0f}+{engine_rss:.0f} MB | sleep/train/wake/update {record['sleep_s']:.2f}/"
              f"{record['train_s']:.2f}/{record['wake_s']:.2f}/{record['update_s']:.2f} s", flush=True)

    engine.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    summary = summarize(records, args, path, on_gpu, start_s)
    print(f"engine tokens/s, last steps over first steps (step 1 excluded): {summary['last_over_first']:.3f}; "
          f"slope {summary['tokens_per_s_slope_pct_per_step']:+.2f}% per step; prompt tokens of old weights reused "
          f"after an update: {summary['stale_prefix_hits']}; summary {args.out}", flush=True)


if __name__ == "__main__":
    main()
