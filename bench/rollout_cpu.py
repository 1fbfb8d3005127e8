# bench/rollout_cpu.py — the embedded engine's rollout at the math recipe's shape, on its own.
#
# The math recipe's rollout without the trainer around it: 8 distinct arithmetic prompts (about 75 tokens each,
# rendered with the chat template as the recipe does) x 4 samples x <= 40 tokens at T 0.7, SmolLM2-135M-Instruct
# in fp32, one generate call per "step" as the EnvRunner makes it. Reported as JSON: seconds per step (the first
# call is a warm-up and is not counted), sampled tokens per second, and a digest of the sampled ids and
# logprobs under a fixed engine seed (two builds of the engine that sample the same tokens print the same digest).
# With --vs REV the same measurement runs in turn on this tree and on git revision REV (exported to a temporary
# folder), --rounds times each, A B A B ..., and the summary adds the ratio of seconds per step pair by pair (the
# machine's speed drifts; a pair shares its drift).
#
#   python bench/rollout_cpu.py [--steps 3] [--threads 0] [--vs REV --rounds 3] [--out rollout.json]
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="timed generate calls (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--vs", default=None, help="also measure git revision VS, in turn with this tree")
    parser.add_argument("--rounds", type=int, default=3, help="with --vs: runs of each side")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    if args.vs:
        return side_by_side(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = models.smollm2_path()
    tokenizer = models.load_tokenizer(path)
    engine = EmbeddedEngine(models.load_model(path), seed=0, tokenizer=tokenizer)
    tasks = data.arithmetic_tasks(args.prompts * (args.steps + 1), seed=0, max_operand=5)
    sampling = SamplingParams(temperature=0.7, max_tokens=args.max_tokens)
    seconds, tokens, digest = [], [], hashlib.sha256()
    for step in range(args.steps + 1):
        picked = tasks[step * args.prompts:(step + 1) * args.prompts]
        prompts = [data.render_prompt_ids(tokenizer, t.messages) for t in picked for _ in range(args.samples)]
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        elapsed = time.perf_counter() - t0
        for g in out:
            digest.update(json.dumps([g.token_ids, [round(x, 5) for x in g.behavior_logprobs]]).encode())
        if step:                                   # the first call pays one-off costs (allocator, oneDNN)
            seconds.append(elapsed)
            tokens.append(sum(len(g.token_ids) for g in out))
        print(f"step {step}: {elapsed:.2f} s, {sum(len(g.token_ids) for g in out)} tokens, prompt "
              f"{sum(map(len, prompts)) / len(prompts):.0f} tokens", file=sys.stderr, flush=True)
    summary = {"shape": f"{args.prompts} prompts x {args.samples} samples x <= {args.max_tokens} tokens, fp32",
               "threads": torch.get_num_threads(), "seconds_per_step": statistics.median(seconds),
               "steps": seconds, "tokens_per_s": sum(tokens) / sum(seconds), "digest": digest.hexdigest()[:16]}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


def side_by_side(args) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
             "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", here, "archive", args.vs], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        shutil.copy(os.path.abspath(__file__), os.path.join(old, "bench"))   # REV may predate this script
        for _ in range(args.rounds):
            for side, tree in (("this", here), ("baseline", old)):
                # the summary counts even if the process then dies at exit (an engine before rollout._hand_back
                # could abort there, its decoding thread freeing tensors during shutdown): the exit status is kept
                done = subprocess.run([sys.executable, os.path.join(tree, "bench", "rollout_cpu.py"), *flags],
                                      cwd=tree, capture_output=True, text=True)
                lines = done.stdout.strip().splitlines()
                if not lines:
                    raise SystemExit(f"the {side} run printed no summary (exit {done.returncode}):\n{done.stderr[-2000:]}")
                runs[side].append({**json.loads(lines[-1]), "exit": done.returncode})
                print(side, f"{runs[side][-1]['seconds_per_step']:.2f} s per step", file=sys.stderr, flush=True)
    ratios = [a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(runs["this"], runs["baseline"])]
    summary = {"vs": args.vs, "this_seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs["this"]),
               "baseline_seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs["baseline"]),
               "ratio_median": statistics.median(ratios), "ratios": ratios, "runs": runs}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
