# bench/vs_trl.py — tracerl against TRL's GRPOTrainer (1.16) on the same task, model and batch, one after the other
# on the same machine: seconds per RL step, where each side's step goes, the reward curve, time to the first step and
# the whole process, and the ratio (TRL's seconds per step / tracerl's: above 1 means tracerl is faster).
#
# The task is the math recipe (recipes/math.py: data.arithmetic_tasks, the grader's verdict as the reward) on
# SmolLM2-135M-Instruct. Both sides get the same prompts in the same order (rendered by the tokenizer's chat template;
# the TRL side checks that its prompt ids equal tracerl's before it trains), prompts x samples per RL step, new tokens,
# temperature, lr (constant), beta 0, seed, and two optimizer steps per rollout batch (tracerl: --train.minibatches 2;
# TRL: micro-batches of 8, gradient accumulation A, steps_per_generation 2A, so a generation batch gives two optimizer
# steps and its logprobs are recomputed once before them, as tracerl's are). TRL keeps its other defaults (loss
# "dapo", clip 0.2, gradient checkpointing on); --trl-set changes any GRPOConfig field. A side whose name ends in
# -nogc is TRL with gradient_checkpointing=False.
#
# The sizes people train (the h200-qwen3-* presets): the math recipe at Qwen3-0.6B, 1.7B, 4B (and 8B) shapes, random
# weights with a borrowed tokenizer (bench/shapes.py; --tokenizer, SmolLM2's), every reply at its full length on both
# sides (--fixed-lengths: tracerl's --rollout.ignore_eos, TRL's min_tokens / min_new_tokens = max_tokens), so both do
# the same work; TRL with gradient checkpointing off and on as two sides. A side that runs out of memory (or time,
# --budget-s) is recorded as failed and the next one runs: the largest size each side fits is read off the presets.
# Per side: its peak GPU memory (the device's, nvidia-smi sampled every 200 ms, every process; and its trainer process's
# own torch.cuda.max_memory_reserved, which on TRL's side holds its colocated vLLM too), and each phase's seconds
# beside its physical lower bound on an H200 (bench/limits.py).
#
# tracerl runs as `python train.py --recipe math ...` (flags only); its seconds per step and phases come from its
# OUT/metrics.jsonl (time/*) and the times its progress lines arrive, its final checkpoint's kind, seconds and bytes
# from its OUT/summary.json. TRL is never a dependency of tracerl: it runs in
# a Python of its own (--trl-python, see docs/vs-trl.md for the set-up) as this same file's `trl-driver` mode, whose
# callback records when each optimizer step ends and whose hooks time generation, weight sync and the recompute.
#
#   python bench/vs_trl.py --preset cpu --trl-python .cache/trl-venv/bin/python [--steps 5] [--tracerl-commit REV]
#   python bench/vs_trl.py --preset h200 --model DIR --trl-python python3 --trl-pythonpath /tmp/trl-site
#   python bench/vs_trl.py ... --sides trl-vllm --out runs/vs_trl-h200    # one side; the summary gathers all in --out
#   python bench/vs_trl.py --preset h200-qwen3-4b --tokenizer SMOLLM2_DIR --trl-python python3 \
#       --trl-pythonpath /tmp/trl-site --caches shared --budget-s 560 --out /tmp/vs-trl-4b
#   python bench/vs_trl.py --preset cpu --shape qwen3-tiny --tokenizer DIR --fixed-lengths --steps 2 \
#       --sides tracerl,trl-transformers-nogc --trl-python .cache/trl-venv/bin/python    (the paths, on a CPU)
#
# Seconds per RL step: the median, over every step after the first, of the time from one step's end to the next's
# (the same clock on both sides). Only this file's standard-library imports load at the top: the TRL side imports it.
import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {   # the README's CPU math run, and the H200 shape of issue 19
    "cpu": dict(prompts=8, samples=4, max_tokens=40, max_length=256, temperature=0.7, lr=3e-5, steps=5, bf16=False,
                engine="embedded", trl_sides=["trl-transformers"]),
    # the vLLM paths of both sides on vLLM's CPU build (a tiny --shape: the code, not the speed)
    "cpu-vllm": dict(prompts=8, samples=4, max_tokens=40, max_length=256, temperature=0.7, lr=3e-5, steps=3, bf16=False,
                     engine="vllm", trl_sides=["trl-vllm"]),
    "h200": dict(prompts=32, samples=8, max_tokens=256, max_length=512, temperature=0.7, lr=3e-5, steps=10, bf16=True,
                 engine="vllm", trl_sides=["trl-vllm", "trl-transformers"]),
    # LoRA at a size full fine-tuning does not fit on one GPU (--lora-rank; bench/shapes.py's qwen3-8b)
    # (an 8B engine's CUDA graphs with LoRA take 15 GiB beside its 14 GiB of weights: both engines get half the card)
    "h200-lora": dict(prompts=16, samples=8, max_tokens=256, max_length=512, temperature=0.7, lr=1e-4, steps=5,
                      bf16=True, engine="vllm", trl_sides=["trl-vllm"], engine_memory=0.5),
}
# the sizes people train: h200's batch, every reply at its full length, TRL without and with gradient checkpointing
PRESETS.update({f"h200-{size}": dict(PRESETS["h200"], steps=3, shape=size, fixed_lengths=True,
                                     trl_sides=["trl-vllm-nogc", "trl-vllm"])
                for size in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")})
TRL_SIDES = ("trl-vllm", "trl-vllm-nogc", "trl-transformers", "trl-transformers-nogc")
MICRO_BATCH = 8          # TRL's rows per forward/backward (its default; tracerl's micro-batches are its own defaults)
MINIBATCHES = 2          # optimizer steps per rollout batch
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
# a side out of device memory: a CUDA allocation that failed, or a vLLM engine that found too little free memory
# to start beside the trainer (a ValueError of its own, not an allocation)
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory|Free memory on device .* is less than desired",
                 re.IGNORECASE)


def compile_caches(out: str, side: str, mode: str, shared_root: str = "") -> dict:
    """The compile caches a side runs with (vLLM's torch.compile and AOT cache, inductor's, Triton's). cold: its own,
    empty at its start: each side pays its own cold start, and the side run second cannot load kernels the first one
    compiled (vLLM's cache key is the model and compilation config, which the two sides may share). shared: one
    folder for every side (`shared_root`, default OUT/shared.caches), kept: a later side (or run) of the same model
    loads what an earlier one compiled, so time to the first step no longer compares, seconds per step still do."""
    if mode == "shared":
        root = shared_root or os.path.join(out, "shared.caches")
    else:
        root = os.path.join(out, f"{side}.caches")
        shutil.rmtree(root, ignore_errors=True)
    return {"VLLM_CACHE_ROOT": os.path.join(root, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton")}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a running process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:]) if len(values) > 1 else float("nan")


def phase_medians(per_step: list[float], phases: list[dict[str, float]], rest: str) -> tuple[dict, list[dict]]:
    """Each phase's median over the steps after the first, and each step's phases; `rest` is what a step spent
    outside its timed phases."""
    rows = [{**p, rest: total - sum(p.values())} for total, p in zip(per_step, phases)]
    return {name: median_after_first([row[name] for row in rows]) for name in rows[0]}, rows


def step_intervals(start: float, ends: list[float]) -> list[float]:
    """Seconds of each RL step, from the previous step's end (the first: from the loop's start) to its own."""
    return [b - a for a, b in zip([start] + ends[:-1], ends)]


# ---- a side's process: its deadline, and what is left of it when it fails ------------------------------------------

class SideFailed(Exception):
    """A side that did not finish; `record` says why (exit status, out of memory, out of time, its log's tail)."""

    def __init__(self, record: dict):
        super().__init__(record["error"])
        self.record = record


class Deadline:
    """Stops a side's process tree (its engines and compile workers too) at `at` (time.time(); None: never), and on
    SIGTERM to this process (the driver's own time cap), so no side outlives the bench holding the GPU."""
    running: list[subprocess.Popen] = []

    def __init__(self, proc: subprocess.Popen, at: float | None):
        self.proc, self.expired = proc, False
        self.timer = threading.Timer(max(at - time.time(), 0), self.expire) if at is not None else None
        if self.timer is not None:
            self.timer.start()
        Deadline.running.append(proc)

    def expire(self) -> None:
        self.expired = True
        stop_tree(self.proc)

    def done(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        Deadline.running.remove(self.proc)

    @staticmethod
    def on_sigterm(signum, frame) -> None:
        for proc in list(Deadline.running):
            stop_tree(proc)
        raise SystemExit(128 + signum)


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to the process and every descendant (collected first: an engine whose parent dies is re-parented),
    SIGKILL to what is still alive 15 s later. From /proc, so it needs nothing outside the standard library."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, i = [proc.pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        end = time.time() + wait
        while time.time() < end and any(alive(pid) for pid in tree):
            proc.poll()             # reaps our own child, which would otherwise stay a zombie
            time.sleep(0.2)
        if not any(alive(pid) for pid in tree):
            return


def failure(side: str, code: int, log_path: str, timed_out: bool, detail: str = "") -> SideFailed:
    with open(log_path, errors="replace") as f:
        log = f.read()
    why = "out of time (--budget-s)" if timed_out else f"exited with {code}"
    return SideFailed({"error": f"{side} {why}{detail}; see {log_path}", "exit_code": code, "timed_out": timed_out,
                       "out_of_memory": bool(OOM.search(log)), "log_tail": log[-3000:].splitlines()[-40:]})


# ---- tracerl side: train.py as a subprocess ------------------------------------------------------------------------

def tracerl_source(commit: str, out: str) -> tuple[str, str]:
    """The tracerl tree to run and its commit: `commit` exported from git (a clean tree, whatever the working tree
    holds now), or the working tree itself, its HEAD marked '+dirty' when tracked files differ from it."""
    if commit:
        folder = os.path.join(out, "tracerl-src")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        full = subprocess.run(["git", "-C", ROOT, "rev-parse", commit], check=True, capture_output=True,
                              text=True).stdout.strip()
        archive = subprocess.run(["git", "-C", ROOT, "archive", full], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        return folder, full
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return ROOT, head + ("+dirty" if dirty else "")


def run_tracerl(cfg: dict, model: str, source: str, out: str, deadline: float | None, cache_dir: str) -> dict:
    run_dir = os.path.join(out, "tracerl")
    argv = [sys.executable, os.path.join(source, "train.py"), "--recipe", "math", "--model", model,
            "--steps", str(cfg["steps"]), "--seed", str(cfg["seed"]), "--out", run_dir,
            "--rollout.prompts_per_step", str(cfg["prompts"]), "--rollout.samples_per_prompt", str(cfg["samples"]),
            "--rollout.max_tokens", str(cfg["max_tokens"]), "--rollout.max_length", str(cfg["max_length"]),
            "--rollout.temperature", str(cfg["temperature"]), "--rollout.engine", cfg["engine"],
            "--actor.lr", str(cfg["lr"]), "--actor.lr_schedule", "constant", "--train.minibatches", str(MINIBATCHES),
            "--algo.kl_coef", "0"]      # everything else (micro-batches, precision, compile) is tracerl's default
    if cfg["fixed_lengths"]:
        argv += ["--rollout.ignore_eos", "true"]
    if cfg["lora_rank"]:
        argv += ["--actor.lora_rank", str(cfg["lora_rank"]), "--actor.lora_alpha", str(2 * cfg["lora_rank"])]
    if cfg["engine_memory"]:
        argv += ["--rollout.engine_memory", str(cfg["engine_memory"])]
    for flag, value in cfg["tracerl_set"].items():
        argv += [f"--{flag}", value]
    print("tracerl:", " ".join(argv[1:]), flush=True)
    load = os.getloadavg()[0]
    t0 = time.time()
    log_path = os.path.join(out, "tracerl.log")
    env = {**os.environ, **OFFLINE, **compile_caches(out, "tracerl", cfg["caches"], cache_dir)}
    proc = subprocess.Popen(argv, cwd=source, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    watch = Deadline(proc, deadline)
    startup, step_ends, step_cpu, phase, mkl_avx512 = {}, [], [], None, False
    os.makedirs(out, exist_ok=True)
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout:         # each line timed as it arrives: train.py flushes every one
                log.write(f"{time.time() - t0:7.2f} {line}")      # the log is the start-up's timeline
                if re.match(r"step\s+\d+/\d+ \|", line):
                    step_ends.append(time.time())
                    step_cpu.append(process_cpu_s(proc.pid))
                    print("  " + line.rstrip(), flush=True)
                elif line.startswith("tracerl: fp32 products on MKL's AVX-512 kernels"):
                    mkl_avx512 = True
                elif found := re.match(r"tracerl: (.+?) \.\.\.(?: ([\d.]+) s)?$", line.strip()):
                    phase = found.group(1)                            # a start-up phase train.py prints
                    if found.group(2):
                        startup[phase], phase = float(found.group(2)), None
                elif phase and (found := re.match(r"([\d.]+) s$", line.strip())):
                    startup[phase], phase = float(found.group(1)), None  # its time, after the engine's log lines
        code = proc.wait()
    finally:
        watch.done()
    wall = time.time() - t0
    if code != 0 or len(step_ends) != cfg["steps"]:
        raise failure("tracerl", code, log_path, watch.expired, f" after {len(step_ends)} of {cfg['steps']} steps")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    loop_start = step_ends[0] - steps[0]["time/step_s"]
    per_step = step_intervals(loop_start, step_ends)
    timed = [{"rollout": s.get("time/rollout_s", 0.0), "recompute": s.get("time/recompute_s", 0.0),
              "train": s.get("time/train_s", 0.0), "weight_push": s.get("time/weight_push_s", 0.0),
              "sleep_wake": s.get("time/engine_sleep_s", 0.0) + s.get("time/engine_wake_s", 0.0)} for s in steps]
    phases, rows = phase_medians(per_step, timed, "other")    # other: the batch's build and checks, logging, traces
    peaks = [s["perf/gpu_peak_reserved_gib"] for s in steps if "perf/gpu_peak_reserved_gib" in s]
    # the run's final checkpoint (train.py's default kind): final_checkpoint, _s and _bytes; its seconds are part of
    # exit_s, which TRL's side (save_strategy "no") does not pay. A tracerl older than OUT/summary.json has none
    final = {}
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as f:
            final = json.load(f)
    return {"s_per_step": median_after_first(per_step), "steps_s": per_step, "phases": phases, "steps_phases": rows,
            **final, "cpu_s_per_step": median_after_first(step_intervals(step_cpu[0], step_cpu)),
            "reward": [s["rollout/reward"] for s in steps],
            "sampled_tokens": [s["rollout/sampled_tokens"] for s in steps],
            "trainer_peak_reserved_gib": max(peaks) if peaks else None,
            "wall_s": wall, "to_first_step_s": step_ends[0] - t0, "startup_s": loop_start - t0,
            "exit_s": t0 + wall - step_ends[-1], "startup_phases": startup, "mkl_avx512_on_amd": mkl_avx512,
            "load_avg_1min": [load, os.getloadavg()[0]]}


# ---- TRL side: this file's trl-driver mode, in TRL's own Python ------------------------------------------------------

def run_trl(side: str, cfg: dict, model: str, prompts: list[dict], trl_python: str, trl_pythonpath: str,
            trl_set: dict, mkl_avx512: bool, out: str, deadline: float | None, cache_dir: str) -> dict:
    os.makedirs(out, exist_ok=True)
    job = {"side": side, "cfg": cfg, "model": model, "prompts": prompts, "trl_set": trl_set, "mkl_avx512": mkl_avx512,
           "output_dir": os.path.join(out, side), "result": os.path.join(out, f"{side}.driver.json")}
    job_path = os.path.join(out, f"{side}.job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    if os.path.exists(job["result"]):
        os.remove(job["result"])
    env = {**os.environ, **OFFLINE, **compile_caches(out, side, cfg["caches"], cache_dir)}
    if trl_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (trl_pythonpath, env.get("PYTHONPATH", "")) if p)
    print(f"{side}: {trl_python} {os.path.relpath(__file__, ROOT)} trl-driver {job_path}", flush=True)
    load = os.getloadavg()[0]
    t0 = time.time()
    log_path = os.path.join(out, f"{side}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([trl_python, os.path.abspath(__file__), "trl-driver", job_path], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        watch = Deadline(proc, deadline)
        try:
            code = proc.wait()
        finally:
            watch.done()
    wall = time.time() - t0
    if code != 0:
        raise failure(side, code, log_path, watch.expired)
    with open(job["result"]) as f:
        d = json.load(f)
    ends = d["optimizer_step_ends"][MINIBATCHES - 1::MINIBATCHES]      # an RL step ends with its last optimizer step
    per_step = step_intervals(d["train_begin"], ends)
    phases, rows = phase_medians(per_step, d["phase_s"], "train")   # train: the loss's forwards, backward, optimizer
    opt = step_intervals(d["train_begin"], d["optimizer_step_ends"])
    for k in range(MINIBATCHES):        # each optimizer step of an RL step: the first one generates
        phases[f"optimizer_step_{k + 1}"] = median_after_first(opt[k::MINIBATCHES])
    cpu = d["optimizer_step_cpu_s"][MINIBATCHES - 1::MINIBATCHES]
    return {"s_per_step": median_after_first(per_step), "steps_s": per_step, "phases": phases, "steps_phases": rows,
            "cpu_s_per_step": median_after_first(step_intervals(cpu[0], cpu)), "reward": d["reward"],
            "sampled_tokens": d["sampled_tokens"], "trainer_peak_reserved_gib": d["peak_reserved_gib"],
            "wall_s": wall, "to_first_step_s": ends[0] - t0, "startup_s": d["train_begin"] - t0,
            "exit_s": t0 + wall - ends[-1], "versions": d["versions"], "grpo_config": d["grpo_config"],
            "mkl_avx512_on_amd": d["mkl_avx512_on_amd"], "load_avg_1min": [load, os.getloadavg()[0]]}


def trl_driver(job_path: str) -> None:
    """TRL's side, run by TRL's own Python: GRPOTrainer on the job's prompts; writes when each optimizer step ended,
    each generation's phases and reward. Imports nothing of tracerl but its grader (agents/graders.py) and
    trainer/cpu_setup.py, by path."""
    with open(job_path) as f:
        job = json.load(f)
    cfg, side = job["cfg"], job["side"]
    import datasets
    import torch
    mkl_avx512 = job["mkl_avx512"] and mkl_avx512_on_amd()     # before the first product, as train.py does it
    import transformers
    import trl
    from trl.extras import profiling

    spec = importlib.util.spec_from_file_location("graders", os.path.join(ROOT, "agents", "graders.py"))
    graders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graders)

    # the prompts exactly as tracerl encodes them, or nothing is measured
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["model"])
    for p in job["prompts"]:
        ids = tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(ids["input_ids"]) != p["tracerl_ids"]:
            raise SystemExit(f"TRL's prompt ids differ from tracerl's for {p['prompt']!r}")

    events = []           # (name, end time, seconds) of every block TRL itself times, plus ours below
    profiling.ProfilingContext._log_metrics = lambda self, seconds: events.append((self.name, time.time(), seconds))
    rewards, sampled = [], []

    def math_reward(completions, label, completion_ids, **_):
        """The math recipe's reward: the grader's verdict on the decoded reply."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [graders.grade(t, answer) for t, answer in zip(texts, label)]
        rewards.append(sum(scores) / len(scores))
        sampled.append(float(sum(len(ids) for ids in completion_ids)))
        return scores

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """Times a generation batch's whole scoring, and inside it the logprob recompute (the forward pass over the
        batch before any optimizer step; the loss's own forwards run later, outside it)."""
        scoring = False

        def _generate_and_score_completions(self, inputs):
            t0, self.scoring = time.time(), True
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.scoring = False
                events.append(("generate_and_score", time.time(), time.time() - t0))

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            t0 = time.time()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                if self.scoring:
                    events.append(("recompute", time.time(), time.time() - t0))

    clock = {"train_begin": None, "optimizer_step_ends": [], "optimizer_step_cpu_s": []}

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["train_begin"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            clock["optimizer_step_ends"].append(time.time())
            clock["optimizer_step_cpu_s"].append(time.process_time())

    batch = cfg["prompts"] * cfg["samples"]
    accumulation = batch // MINIBATCHES // MICRO_BATCH
    use_vllm = side.startswith("trl-vllm")
    settings = dict(output_dir=job["output_dir"], learning_rate=cfg["lr"], lr_scheduler_type="constant", beta=0.0,
                    num_generations=cfg["samples"], per_device_train_batch_size=MICRO_BATCH,
                    gradient_accumulation_steps=accumulation, steps_per_generation=accumulation * MINIBATCHES,
                    max_completion_length=cfg["max_tokens"], temperature=cfg["temperature"],
                    max_steps=cfg["steps"] * MINIBATCHES, seed=cfg["seed"], shuffle_dataset=False, bf16=cfg["bf16"],
                    use_vllm=use_vllm, vllm_mode="colocate", report_to="none", save_strategy="no",
                    disable_tqdm=True)
    if cfg["engine_memory"]:
        settings["vllm_gpu_memory_utilization"] = cfg["engine_memory"]
    if cfg["fixed_lengths"]:     # every reply max_tokens long: eos is masked until then (vLLM's and transformers' own)
        settings["generation_kwargs"] = {"min_tokens" if use_vllm else "min_new_tokens": cfg["max_tokens"]}
    settings.update(job["trl_set"])
    if side.endswith("-nogc"):
        settings["gradient_checkpointing"] = False
    args = trl.GRPOConfig(**settings)
    dataset = datasets.Dataset.from_list([{"prompt": p["prompt"], "label": p["label"]} for p in job["prompts"]])
    peft_config = None
    if cfg["lora_rank"]:     # the same adapter as tracerl's: every linear of the decoder, alpha 2r, no dropout
        import peft
        peft_config = peft.LoraConfig(r=cfg["lora_rank"], lora_alpha=2 * cfg["lora_rank"], lora_dropout=0.0,
                                      target_modules="all-linear")
    trainer = TimedGRPOTrainer(model=job["model"], reward_funcs=math_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[Clock()], peft_config=peft_config)
    trainer.train()

    # each generation's phases, from the blocks that ended inside its RL step
    ends = clock["optimizer_step_ends"][MINIBATCHES - 1::MINIBATCHES]
    if len(ends) != cfg["steps"] or len(rewards) != cfg["steps"]:
        raise SystemExit(f"expected {cfg['steps']} generations of {MINIBATCHES} optimizer steps each; got "
                         f"{len(rewards)} generations and {len(clock['optimizer_step_ends'])} optimizer steps")
    phase_s = []
    for start, end in zip([clock["train_begin"]] + ends[:-1], ends):
        def total(*suffixes: str) -> float:
            return sum(s for name, t, s in events if start < t <= end and name.endswith(suffixes))
        rollout, push, recompute = total(".generate", ".generate_batch"), total(".sync_weights"), total("recompute")
        phase_s.append({"rollout": rollout, "weight_push": push, "recompute": recompute,
                        "scoring_other": total("generate_and_score") - rollout - push - recompute})
    versions = {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "datasets": datasets.__version__}
    if use_vllm:
        import vllm
        versions["vllm"] = vllm.__version__
    # this process's peak: the trainer's and, colocated, its vLLM engine's (weights, KV cache)
    peak = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None
    with open(job["result"], "w") as f:
        json.dump({**clock, "phase_s": phase_s, "reward": rewards, "sampled_tokens": sampled, "versions": versions,
                   "mkl_avx512_on_amd": mkl_avx512, "peak_reserved_gib": peak,
                   "grpo_config": {k: getattr(args, k) for k in sorted(settings) if k != "output_dir"}
                   | {"loss_type": args.loss_type, "epsilon": args.epsilon, "gradient_checkpointing":
                      args.gradient_checkpointing, "scale_rewards": args.scale_rewards,
                      "generation_kwargs": args.generation_kwargs}}, f, indent=1, default=str)


def mkl_avx512_on_amd() -> bool:
    """cpu_setup.mkl_avx512_on_amd in TRL's process, loaded by path as the grader is (trainer/cpu_setup.py imports torch and
    the standard library only); TRACERL_CPU_SETUP=0 turns it off here too, as on tracerl's side."""
    spec = importlib.util.spec_from_file_location("cpu_setup", os.path.join(ROOT, "trainer/cpu_setup.py"))
    cpu_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_setup)
    return cpu_setup.mkl_avx512_on_amd()




# ---- the summary ------------------------------------------------------------------------------------------------

class GpuMemoryWatch:
    """The device's used memory, sampled by nvidia-smi every 200 ms while a side runs (every process on the GPU:
    the engine's and the trainer's alike); stop() returns the peak in MiB (None without nvidia-smi)."""

    def __init__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.proc = None

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        samples = [float(line.split(",")[0]) for line in self.proc.communicate()[0].split() if line.strip()]
        return max(samples, default=None)


def machine() -> dict:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def math_prompts(cfg: dict, model: str) -> list[dict]:
    """The math recipe's train prompts in the order tracerl's loop takes them, with tracerl's prompt ids."""
    sys.path.insert(0, ROOT)
    import data
    import models
    spec = importlib.util.spec_from_file_location("recipe_math", os.path.join(ROOT, "recipes", "math.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    tasks = recipe.tasks("train", cfg["seed"])
    tokenizer = models.load_tokenizer(model)
    picked = [tasks[i % len(tasks)] for i in range(cfg["steps"] * cfg["prompts"])]
    return [{"prompt": t.messages, "label": t.label, "tracerl_ids": data.render_prompt_ids(tokenizer, t.messages)}
            for t in picked]


def shape_folder(shape: str, tokenizer: str, root: str) -> str:
    """bench/shapes.py's random-weight folder of `shape` with `tokenizer`'s tokenizer under `root` (made once), in a
    process of its own: it initialises on the GPU, and its memory is gone before any side starts."""
    folder = os.path.join(root, f"shape-{shape}")
    print(f"a random-weight {shape} in {folder} (the tokenizer of {tokenizer})", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "shapes.py"), shape, folder, "--tokenizer",
                    tokenizer], check=True, stdout=subprocess.DEVNULL)
    return folder


def limits_table(side: str, result: dict, cfg: dict, model: str, prompts: list[dict]) -> dict | None:
    """Each phase's median seconds beside its lower bound on an H200 (bench/limits.py), for the prompts and reply
    lengths the side's steps had; None for a model the bounds do not cover (an MoE)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import limits
    try:
        shape = limits.Shape.of(model)
    except (ValueError, KeyError):
        return None
    P, S = cfg["prompts"], cfg["samples"]
    # pi_prox takes a forward of its own for tracerl's later minibatches only, for all of TRL's rows
    recomputed = (MINIBATCHES - 1) / MINIBATCHES if side == "tracerl" else 1.0
    per_step = [limits.phase_bounds(shape, [len(p["tracerl_ids"]) for p in prompts[k * P:(k + 1) * P]], S,
                                    tokens / (P * S), MINIBATCHES, recomputed)
                for k, tokens in enumerate(result["sampled_tokens"])]
    bounds = {name: median_after_first([b[name] for b in per_step]) for name in per_step[0]}
    if side != "tracerl":
        del bounds["sleep_wake"]        # TRL's colocated engine stays awake (its default)
    if side.startswith("trl-transformers"):
        del bounds["weight_push"]       # transformers' generate samples from the trained weights themselves
    table = limits.beside(result["phases"], bounds)
    table["step"] = limits.beside({"step": result["s_per_step"]}, {"step": sum(bounds.values())})["step"]
    return {"phases": table, "shape": vars(shape), "parameters": shape.params, "constants": limits.CONSTANTS}


def summary(out: str, cfg: dict, model: str, prompts: list[dict]) -> dict:
    """Every side in --out measured with this configuration, the ratios to tracerl, what fit."""
    results = {}
    for side in ("tracerl",) + TRL_SIDES:
        path = os.path.join(out, f"{side}.json")
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            if saved["cfg"] == cfg:
                results[side] = saved["result"]
    expected = cfg["prompts"] * cfg["samples"] * cfg["max_tokens"]
    for side, result in results.items():
        if "s_per_step" in result:
            result["limits"] = limits_table(side, result, cfg, model, prompts)
            result["every_reply_full_length"] = all(t == expected for t in result["sampled_tokens"])
    ratios = {}
    ours = results.get("tracerl", {})
    for side in TRL_SIDES:
        theirs = results.get(side, {})
        if "s_per_step" in ours and "s_per_step" in theirs:
            for name, key in (("s_per_step", "s_per_step"), ("cpu_s_per_step", "cpu_s_per_step"),
                              ("to_first_step", "to_first_step_s")):
                ratios[f"{side}_{name} / tracerl"] = theirs[key] / ours[key]
        for key in ("peak_gpu_memory_mib", "trainer_peak_reserved_gib"):
            if ours.get(key) and theirs.get(key):     # > 1: tracerl's peak is the lower
                ratios[f"{side}_{key} / tracerl"] = theirs[key] / ours[key]
    return {"what": "tracerl vs TRL GRPOTrainer, math recipe, one after the other on one machine; ratio > 1: "
                    "tracerl faster", "config": cfg, "model": model, "machine": machine(),
            "date": datetime.date.today().isoformat(), **results,
            # True: it ran; False: out of GPU memory; None: not known (skipped, out of time, another failure)
            "fits": {side: True if "s_per_step" in r else False if r.get("out_of_memory") else None
                     for side, r in results.items()}, "ratios": ratios}


def main(argv: list[str]) -> None:
    if argv[:1] == ["trl-driver"]:
        return trl_driver(argv[1])
    parser = argparse.ArgumentParser(description="tracerl against TRL's GRPOTrainer on the math recipe, side by side")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per side (0 = the preset's)")
    parser.add_argument("--model", default="", help="a model folder or packaged name (models.resolve_model); default: "
                                                    "the preset's shape, else smollm2")
    parser.add_argument("--shape", default="", help="a bench/shapes.py shape, random weights (default: the preset's)")
    parser.add_argument("--tokenizer", default="", help="the folder whose tokenizer a shape borrows (default: "
                                                        "SmolLM2's, models.smollm2_path)")
    parser.add_argument("--shapes-dir", default="", help="where shape folders are made (default: tracerl's cache)")
    parser.add_argument("--fixed-lengths", action="store_true", help="every reply runs to max_tokens on both sides "
                                                                     "(the h200-qwen3-* presets' default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="both sides train LoRA adapters of this rank "
                                                                 "(alpha 2r) instead of every weight")
    parser.add_argument("--trl-python", default="", help="the Python of TRL's own environment")
    parser.add_argument("--trl-pythonpath", default="", help="prepended to PYTHONPATH for the TRL side only")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=JSON",
                        help="a GRPOConfig field for the TRL side, e.g. gradient_checkpointing=false (repeatable)")
    parser.add_argument("--trl-mkl-avx512", action="store_true",
                        help="TRL's process also takes MKL's AVX-512 kernels on an AMD CPU with AVX-512, as tracerl's "
                             "does (cpu_setup.mkl_avx512_on_amd); by default TRL runs as its users run it")
    parser.add_argument("--tracerl-set", action="append", default=[], metavar="FLAG=VALUE",
                        help="a train.py flag for the tracerl side, e.g. actor.micro_batch_tokens=8192 (repeatable)")
    parser.add_argument("--tracerl-commit", default="", help="run tracerl as of this commit (git archive) instead "
                                                             "of the working tree")
    parser.add_argument("--sides", default="", help=f"comma list of {', '.join(('tracerl',) + TRL_SIDES)} "
                                                    f"(default: tracerl and the preset's TRL runs)")
    parser.add_argument("--caches", choices=("cold", "shared"), default="cold",
                        help="compile caches: each side's own and empty, or one kept for every side of --out")
    parser.add_argument("--cache-dir", default="", help="with --caches shared: the caches' folder (default "
                                                        "OUT/shared.caches)")
    parser.add_argument("--budget-s", type=float, default=0, help="seconds for every side together (0: no limit); a "
                        "side is stopped when they run out, and one that cannot get a minute is skipped")
    parser.add_argument("--summary-only", action="store_true", help="run nothing: the summary of the sides in --out")
    parser.add_argument("--out", default="", help="work folder (default runs/vs_trl-PRESET); a side's result stays "
                                                  "there, so runs of single sides add up to one summary")
    parser.add_argument("--json", default="", help="the summary (default docs/vs-trl-PRESET.json)")
    args = parser.parse_args(argv)
    started = time.time()
    preset = PRESETS[args.preset]
    cfg = {k: preset[k] for k in ("prompts", "samples", "max_tokens", "max_length", "temperature", "lr", "bf16",
                                  "engine")}
    cfg.update(preset=args.preset, steps=args.steps or preset["steps"], seed=args.seed, micro_batch=MICRO_BATCH,
               minibatches=MINIBATCHES, beta=0.0, lora_rank=args.lora_rank,
               engine_memory=preset.get("engine_memory", 0),     # 0: each side's default (both 0.3)
               fixed_lengths=args.fixed_lengths or preset.get("fixed_lengths", False), caches=args.caches,
               tracerl_set=dict(item.partition("=")[::2] for item in args.tracerl_set),
               shape=None if args.model else args.shape or preset.get("shape"))
    sides = args.sides.split(",") if args.sides else ["tracerl"] + preset["trl_sides"]
    unknown = set(sides) - {"tracerl", *TRL_SIDES}
    if unknown or (set(TRL_SIDES) & set(sides) and not args.trl_python and not args.summary_only):
        parser.error(f"unknown sides {sorted(unknown)}" if unknown else "the TRL sides need --trl-python (TRL's own "
                     "environment; docs/vs-trl.md says how to make one)")
    if cfg["prompts"] * cfg["samples"] % (MINIBATCHES * MICRO_BATCH):
        parser.error(f"prompts x samples must be a multiple of {MINIBATCHES * MICRO_BATCH}")
    trl_set = {}
    for item in args.trl_set:
        key, _, value = item.partition("=")
        try:
            trl_set[key] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--trl-set {item!r}: expected KEY=JSON, e.g. gradient_checkpointing=false or "
                         f'lr_scheduler_type=\"linear\"')
    out = os.path.abspath(args.out or os.path.join(ROOT, "runs", f"vs_trl-{args.preset}"))
    os.makedirs(out, exist_ok=True)

    sys.path.insert(0, ROOT)
    import models
    if cfg["shape"]:
        model = shape_folder(cfg["shape"], args.tokenizer or models.smollm2_path(),
                             args.shapes_dir or models.cache_root())
    else:
        model = models.resolve_model(args.model or "smollm2")
    prompts = math_prompts(cfg, model)
    signal.signal(signal.SIGTERM, Deadline.on_sigterm)     # a side's processes never outlive this one
    for side in [] if args.summary_only else sides:        # one after the other: each has the machine to itself
        left = started + args.budget_s - time.time() - 20 if args.budget_s else None   # 20 s kept for the summary
        saved = os.path.join(out, f"{side}.json")
        if left is not None and left < 60:
            print(f"{side}: skipped, {left + 20:.0f} s of --budget-s left", flush=True)
            if os.path.exists(saved):        # an earlier run's result of this side stays
                continue
            result = {"error": f"{side} skipped: {left + 20:.0f} s of --budget-s left", "skipped": True}
        else:
            watch = GpuMemoryWatch()
            deadline = None if left is None else time.time() + left
            try:
                if side == "tracerl":
                    source, commit = tracerl_source(args.tracerl_commit, out)
                    result = {**run_tracerl(cfg, model, source, out, deadline, args.cache_dir), "commit": commit}
                else:
                    result = run_trl(side, cfg, model, prompts, args.trl_python, args.trl_pythonpath, trl_set,
                                     args.trl_mkl_avx512, out, deadline, args.cache_dir)
            except SideFailed as failed:
                result = failed.record
            result["peak_gpu_memory_mib"] = watch.stop()
        result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        with open(saved, "w") as f:
            json.dump({"cfg": cfg, "result": result}, f, indent=1)
        if "s_per_step" in result:
            print(f"{side}: {result['s_per_step']:.2f} s per RL step, reward {result['reward'][0]:.2f} -> "
                  f"{result['reward'][-1]:.2f}, {result['wall_s']:.0f} s in all", flush=True)
        else:
            print(f"{side}: FAILED: {result['error']}", flush=True)

    result = summary(out, cfg, model, prompts)
    path = args.json or os.path.join(ROOT, "docs", f"vs-trl-{args.preset}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"ratios": result["ratios"], "fits": result["fits"]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
