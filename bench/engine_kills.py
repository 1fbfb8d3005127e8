# bench/engine_kills.py — one of two engine actors killed at a random moment of a real training run, many runs in a
# row; writes a JSON summary.
#
# Each run is train.main on this machine (--runtime.mode ray, two engine actors, eta 1, a checkpoint after every
# step) in a thread of this process; at a seeded random moment of its training loop one engine actor, picked by
# the same seed, is killed (ray.kill, as an OOM-killed or crashed process would die). A run completes when
# train.main returns with every step logged, no request lost, every rollout of full size, and every trained token
# exact: the loop itself refuses a token that is not sampled once (invariants.check_sampled_once) or not fed to
# the trainer as sampled (check_token_identity), and here each traced token drawn by the trainer's own version
# has its behavior logprob equal to the trainer's recompute. Then the earliest checkpoint that lacks the dead
# engine's sampler stream is resumed for one more step, with both engines up again: it must run and say which
# engine starts a fresh stream. The kill moment is uniform over 90% of the time from the loop's start to its final
# checkpoint in a run with no kill (measured here, the faster of two; after it the loop only draws its plot), so it
# lands in rollouts, training, weight pushes and saves alike.
#
#   python bench/engine_kills.py [--runs 20] [--steps 3] [--seed 0] [--out docs/engine-kills.json]
import argparse
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
for name, value in {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(name, value)

import ray  # noqa: E402
import torch  # noqa: E402

import train  # noqa: E402

EXACT_TOL = 1e-4     # |behavior - trainer recompute| for a token of the trainer's own version (fp32 CPU: ~1e-6)


class Tee(io.TextIOBase):
    """stdout to the terminal and to a buffer (the run's own log, read for what it said about missing streams)."""

    def __init__(self, out):
        self.out, self.buffer = out, io.StringIO()

    def write(self, text: str) -> int:
        self.buffer.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def flags(args, out: str, steps: int) -> list[str]:
    return ["--recipe", "math", "--model", args.model, "--steps", str(steps), "--seed", "0",
            "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2", "--rollout.max_tokens", "16",
            "--run.threads", "1", "--train.minibatches", "1", "--train.save_every", "1", "--runtime.mode", "ray",
            "--runtime.eta", "1", "--runtime.engines", "2", "--runtime.object_store_mb", "100",
            "--correction.level", "token", "--correction.max_staleness", "1", "--out", out]


def run(argv: list[str], kill_after_s: float | None = None, engine: int = 0) -> dict:
    """train.main(argv) in a thread; with `kill_after_s`, kill engine actor `engine` that many seconds after the
    training loop starts. Returns what happened (error, the kill's moment, the run's stdout, when the final checkpoint was written)."""
    loop_started, loop_ended, outcome = threading.Event(), threading.Event(), {"error": None, "kill": None}
    real_loop = train.train_loop

    def timed_loop(*loop_args, **loop_kwargs):
        outcome["loop_t0"], outcome["loop_wall_t0"] = time.monotonic(), time.time()
        loop_started.set()
        try:
            return real_loop(*loop_args, **loop_kwargs)
        finally:
            loop_ended.set()

    def main() -> None:
        try:
            train.main(argv)
        except BaseException as error:       # what a killed engine must never cause
            outcome["error"] = f"{type(error).__name__}: {error}"
        finally:
            loop_started.set()
            loop_ended.set()
    out = argv[argv.index("--out") + 1]
    tee = Tee(sys.stdout)
    train.train_loop = timed_loop
    try:
        with contextlib.redirect_stdout(tee):
            thread = threading.Thread(target=main, name="train-main")
            thread.start()
            if kill_after_s is not None:
                loop_started.wait()
                if not loop_ended.wait(kill_after_s):
                    at_s = time.monotonic() - outcome["loop_t0"]
                    outcome["kill"] = kill_moment(out, int(argv[argv.index("--steps") + 1]), at_s, engine)
                    ray.kill(ray.get_actor(f"tracerl-engine-{engine}"))
            thread.join()
    finally:
        train.train_loop = real_loop
    outcome["stdout"] = tee.buffer.getvalue()
    final = os.path.join(out, "checkpoints", "final")
    if os.path.isdir(final):     # the loop's last act that asks the engines: after it, only the plot is drawn
        outcome["final_saved_s"] = max(os.stat(os.path.join(final, name)).st_mtime
                                       for name in os.listdir(final)) - outcome["loop_wall_t0"]
    return outcome


def kill_moment(out: str, steps: int, at_s: float, engine: int) -> dict:
    """Where the loop stood when the kill came: the steps logged so far, and whether the last one's checkpoint was
    still being written (a checkpoint lands in its folder whole, so a missing folder means not yet saved)."""
    metrics = os.path.join(out, "metrics.jsonl")
    logged = len(open(metrics).readlines()) if os.path.exists(metrics) else 0
    saving = logged > 0 and not os.path.isdir(os.path.join(out, "checkpoints", f"step_{logged:06d}"))
    if saving:
        return {"engine": engine, "at_s": round(at_s, 3), "step": logged, "phase": "checkpoint"}
    if logged == steps:
        written = os.path.isdir(os.path.join(out, "checkpoints", "final"))
        return {"engine": engine, "at_s": round(at_s, 3), "step": logged,
                "phase": "after the final checkpoint" if written else "final checkpoint"}
    return {"engine": engine, "at_s": round(at_s, 3), "step": logged + 1, "phase": "rollout / train / weight push"}


def exactness(out: str) -> float:
    """Max |behavior - trainer logprob| over traced trained tokens sampled by the trainer's own version."""
    worst = 0.0
    for name in sorted(os.listdir(os.path.join(out, "traces"))):
        for line in open(os.path.join(out, "traces", name)):
            row = json.loads(line)
            for v, why, b, t in zip(row["policy_version"], row["mask_reason"], row["behavior_logprob"],
                                    row["trainer_logprob"]):
                if why != "context" and v == row["trainer_version"]:
                    worst = max(worst, abs(b - t))
    return worst


def missing_streams(out: str) -> dict[str, dict]:
    """checkpoint folder -> {engine: why} for each checkpoint written without some engine's sampler stream, in
    the order they were written (by step; "final" last)."""
    folder, found = os.path.join(out, "checkpoints"), []
    for name in os.listdir(folder):
        state = torch.load(os.path.join(folder, name, "run_state.pt"), weights_only=True)
        if state.get("engine_sampler_missing"):
            found.append((state["step"], name == "final", name,
                          {str(e): why for e, why in state["engine_sampler_missing"].items()}))
    return {name: lacking for _, _, name, lacking in sorted(found)}


def killed_run(args, index: int, rng: random.Random, window_s: float, tmp: str) -> dict:
    """One run with a kill; a draw that came after the loop had already ended (this run was faster than the
    calibration) is drawn again, and counted."""
    for redraws in range(10):
        engine, delay = rng.randrange(2), rng.uniform(0.0, window_s)
        out = os.path.join(tmp, f"run{index:02d}-{redraws}")
        outcome = run(flags(args, out, args.steps), delay, engine)
        if outcome["kill"] is not None or outcome["error"] is not None:
            break
    record = {"run": index, "kill": outcome["kill"], "redraws": redraws, "error": outcome["error"]}
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] \
        if os.path.exists(os.path.join(out, "metrics.jsonl")) else []
    if outcome["error"] is None and records:
        last, other = records[-1], 1 - engine
        record.update({
            "steps_logged": [r["step"] for r in records],
            "engines_live_last_step": int(last["perf/engines_live"]),
            "failed_on_killed_engine": int(last[f"perf/engine{engine}/failed_total"]),
            "retried_on_other_engine": int(last[f"perf/engine{other}/retried_total"]),
            "requests_lost": int(last["perf/requests_lost_total"]),     # the last step's, logged before its saves
            "rollouts_per_step": sorted({int(r["rollout/count"]) for r in records}),
            "max_logprob_gap_same_version": exactness(out),
            "checkpoints_lacking_streams": missing_streams(out)})
        lacking = record["checkpoints_lacking_streams"]
        if lacking:        # resume the earliest such checkpoint for one more step, both engines up again
            name = next(iter(lacking))
            state = torch.load(os.path.join(out, "checkpoints", name, "run_state.pt"), weights_only=True)
            resumed = run(flags(args, out + "-resumed", state["step"] + 1) +
                          ["--train.resume", os.path.join(out, "checkpoints", name)])
            said = [line for line in resumed["stdout"].splitlines() if line.startswith("resume: ")]
            record["resume"] = {"from": name, "error": resumed["error"], "said": said}
    record["completed"] = (outcome["error"] is None and outcome["kill"] is not None and
                           record.get("steps_logged") == list(range(1, args.steps + 1)) and
                           record["requests_lost"] == 0 and record["rollouts_per_step"] == [4] and
                           record["max_logprob_gap_same_version"] <= EXACT_TOL and
                           ("resume" not in record or (record["resume"]["error"] is None and any(
                               f"engine {engine} starts a fresh sampler stream" in line
                               for line in record["resume"]["said"]))))
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "engine-kills.json"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        saved = []
        for i in range(2):       # the first warms this process up (imports, caches); the window is the faster
            calibration = run(flags(args, os.path.join(tmp, f"no-kill{i}"), args.steps))
            if calibration["error"] is not None:
                raise SystemExit(f"the run without a kill failed: {calibration['error']}")
            saved.append(calibration["final_saved_s"])
        window = 0.9 * min(saved)
        runs = []
        for i in range(args.runs):
            runs.append(killed_run(args, i, rng, window, tmp))
            print(f"engine_kills: run {i + 1}/{args.runs}: kill {runs[-1]['kill']}, completed "
                  f"{runs[-1]['completed']}", file=sys.stderr, flush=True)
    # the path that used to end the run: a save was the first to find the engine dead
    save_found_it = [any(why.startswith("sampler_state failed") for lacking in r.get("checkpoints_lacking_streams",
                                                                                   {}).values()
                         for why in lacking.values()) for r in runs]
    summary = {"command": "python bench/engine_kills.py " + " ".join(sys.argv[1:]),
               "model": args.model, "steps": args.steps, "engines": 2, "eta": 1, "seed": args.seed,
               "completed": sum(r["completed"] for r in runs), "runs": len(runs),
               "runs_where_a_save_found_the_engine_dead": sum(save_found_it),
               "kill_window_s": round(window, 3), "final_saved_s_without_kill": [round(t, 3) for t in saved],
               "wall_s": round(time.time() - t0, 1), "per_run": runs}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"engine_kills: {summary['completed']} of {summary['runs']} runs completed; summary in {args.out}")


if __name__ == "__main__":
    main()
