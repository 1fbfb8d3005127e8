# bench/shared_prefix.py — the trainer's phases with a shared prompt computed once, against the same phases without.
#
# The math recipe's train batch without the rollout around it: 8 arithmetic prompts (about 75 tokens each, rendered
# with the chat template as the recipe does) x 4 rows, replies of 10..40 random ids, SmolLM2-135M-Instruct in fp32
# on the actor's defaults, split into the two minibatches train.py makes. One round times what train.py times per
# RL step: the recompute of the second minibatch (time/recompute_s), then the first minibatch's step on its own
# forward and the second's on the recomputed logprobs (time/train_s). Rounds alternate the two modes (the shared
# forward, and recompute.shared_prefixes replaced by a function returning None: the unshared forward), so a machine
# shared with other work slows both alike; reported as JSON: the median wall and CPU seconds (all threads: a busy
# machine distorts them less) of each phase per mode and of its fastest round, and the ratios unshared / shared.
#
#   python bench/shared_prefix.py [--rounds 3] [--out shared_prefix.json]
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import actor  # noqa: E402
import algo  # noqa: E402
import data  # noqa: E402
import invariants  # noqa: E402
import models  # noqa: E402
from trainer import recompute  # noqa: E402


PHASES = ("recompute_s", "train_s", "recompute_cpu_s", "train_cpu_s")


def math_batch(tokenizer, vocab: int, prompts: int, samples: int, max_tokens: int) -> invariants.TrainBatch:
    g = torch.Generator().manual_seed(0)
    rows, advantages = [], []
    for p, task in enumerate(data.arithmetic_tasks(prompts, seed=0, max_operand=5)):
        prompt = data.render_prompt_ids(tokenizer, task.messages)
        for s in range(samples):
            reply = torch.randint(0, vocab, (int(torch.randint(10, max_tokens + 1, (1,), generator=g)),),
                                  generator=g).tolist()
            n = len(prompt) + len(reply)
            trainable = [t >= len(prompt) for t in range(n)]
            rows.append(invariants.Segment(f"r{p}-{s}", f"g{p}", 0, prompt + reply, trainable, [0.0] * n,
                                           [0 if t else -1 for t in trainable],
                                           [invariants.Sampling(0.7) if t else invariants.UNSAMPLED for t in trainable]))
            advantages.append((-1.0) ** s)
    return invariants.build_batch(rows, advantages, pad_id=tokenizer.pad_token_id or 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (after one warm-up each)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    path = models.smollm2_path()
    policy = actor.Actor(path, actor.ActorConfig(lr=3e-5), total_steps=4 * (args.rounds + 1))
    batch = math_batch(models.load_tokenizer(path), policy.model.config.vocab_size, args.prompts, args.samples,
                       args.max_tokens)
    half = len(batch.rollout_ids) // 2
    first, second = (invariants.select_rows(batch, list(r)) for r in (range(half), range(half, 2 * half)))
    shared = recompute.shared_prefixes
    times = {"shared": [], "unshared": []}
    for round_ in range(args.rounds + 1):
        for mode in (("shared", "unshared") if round_ % 2 else ("unshared", "shared")):
            recompute.shared_prefixes = shared if mode == "shared" else (lambda *a: None)
            t0, c0 = time.perf_counter(), time.process_time()
            old = policy.recompute_logprobs(second)
            t1, c1 = time.perf_counter(), time.process_time()
            report = policy.train_step(first, None, algo.AlgoConfig(), invariants.CorrectionConfig(), policy.version)
            policy.train_step(second, old, algo.AlgoConfig(), invariants.CorrectionConfig(), policy.version - 1)
            t2, c2 = time.perf_counter(), time.process_time()
            saved = report.metrics["actor/prefix_tokens_saved"]
            print(f"round {round_} {mode}: recompute {t1 - t0:.2f} s, train {t2 - t1:.2f} s, "
                  f"prefix tokens saved {saved:.0f}", file=sys.stderr, flush=True)
            if round_:                                  # the first round pays one-off costs (allocator, oneDNN)
                times[mode].append({"recompute_s": t1 - t0, "train_s": t2 - t1, "recompute_cpu_s": c1 - c0,
                                    "train_cpu_s": c2 - c1, "prefix_tokens_saved": saved})
    recompute.shared_prefixes = shared
    median = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in times.items()}
    fastest = {mode: {k: min(r[k] for r in runs) for k in runs[0]} for mode, runs in times.items()}
    summary = {"shape": f"{args.prompts} prompts x {args.samples} rows, replies <= {args.max_tokens} tokens, "
                        f"prompt {batch.loss_mask.argmax(-1).float().mean():.0f} tokens, fp32",
               "threads": torch.get_num_threads(), "median": median, "fastest": fastest, "rounds": times,
               # medians, and the fastest rounds' (the least disturbed by other work on the machine)
               "ratio_unshared_over_shared": {k: median["unshared"][k] / median["shared"][k] for k in PHASES},
               "ratio_fastest_unshared_over_shared": {k: fastest["unshared"][k] / fastest["shared"][k] for k in PHASES}}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
