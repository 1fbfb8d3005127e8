# bench/gpu.py — tracerl's GPU figures, side by side with a plain baseline on the same GPU, in one run.
#
# actor: one optimizer step of actor.Actor.train_step (bf16 compute over fp32 master weights, the output
#   projection chunked so [rows, T, vocab] logits never exist, activation checkpointing per decoder layer or
#   not) against a plain transformers bf16 loop (the whole model in bf16, gradient checkpointing, fused AdamW,
#   the model's own cross-entropy over full logits) on a Qwen3-0.6B shape, 8 rows x 2048 tokens. Reported:
#   tokens/s, the ratio to the baseline, peak memory, and model-FLOPs utilisation against the H200's bf16 dense
#   peak (6 x parameters x tokens, plus causal attention, per second, over 790 TFLOP/s).
#
#   python bench/gpu.py [--parts actor] [--out gpu-summary.json] [--steps 5]
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

import actor  # noqa: E402
import algo  # noqa: E402
import invariants  # noqa: E402

PEAK_BF16_FLOPS = 790e12      # H200 dense bf16, as measured on the lent machine
ROWS, LENGTH = 8, 2048


def qwen3_06b_shape() -> Qwen3Config:
    """Qwen3-0.6B's architecture (random weights: no hub here)."""
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def train_flops_per_token(config: Qwen3Config) -> float:
    """6 x parameters (the tied embedding counted once, as the output projection) + causal attention's
    QK^T and AV: 6 x layers x heads x head_dim x length (fwd 2 matmuls x 2 FLOPs x length/2, x3 for bwd)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    params = layers * per_layer + config.vocab_size * h
    attention = 6 * layers * q * LENGTH
    return 6 * params + attention


def timed(step, steps: int) -> tuple[float, float]:
    """(seconds per step, peak GiB) over `steps` steps after two warm-up steps."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30


def random_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))


def baseline_step_fn(config: Qwen3Config):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = random_ids(config.vocab_size).cuda()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, model


def actor_step_fn(model_dir: str, cfg: actor.ActorConfig, vocab: int):
    policy = actor.Actor(model_dir, cfg, total_steps=10**6)
    ids = random_ids(vocab).tolist()
    sampled = invariants.Sampling(1.0)
    rows = [invariants.Segment(f"r{b}", f"g{b // 2}", 0, row, [False] + [True] * (LENGTH - 1), [0.0] * LENGTH,
                               [-1] + [0] * (LENGTH - 1), [invariants.UNSAMPLED] + [sampled] * (LENGTH - 1))
            for b, row in enumerate(ids)]
    batch = invariants.build_batch(rows, [(-1.0) ** b for b in range(ROWS)], pad_id=0)
    old = policy.recompute_logprobs(batch)
    batch.behavior_logprobs = old * batch.loss_mask          # on-policy: the correction is an exact no-op
    algo_cfg, correction = algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig()

    def step():
        policy.version = 0                                    # every step trains the same on-policy batch
        policy.train_step(batch, old, algo_cfg, correction, trainer_version=0)
    return step, policy


def bench_actor(steps: int) -> dict:
    config = qwen3_06b_shape()
    flops = train_flops_per_token(config) * ROWS * LENGTH
    results = {"shape": "Qwen3-0.6B", "rows": ROWS, "length": LENGTH}

    def record(name: str, make):
        try:
            step, owner = make()
            seconds, peak = timed(step, steps)
            results[name] = {"tokens_per_s": ROWS * LENGTH / seconds, "step_s": seconds, "peak_gib": peak,
                             "mfu": flops / seconds / PEAK_BF16_FLOPS}
            del step, owner
        except torch.OutOfMemoryError as error:
            results[name] = {"error": f"out of memory: {str(error)[:200]}"}
        torch.cuda.empty_cache()
        print(name, json.dumps(results[name]), flush=True)

    record("baseline_transformers_bf16", lambda: baseline_step_fn(config))
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        bf16 = dict(precision="bf16", micro_batch_size=ROWS)
        variants = {"tracerl_bf16_checkpointed": actor.ActorConfig(**bf16, activation_checkpointing=True),
                    "tracerl_bf16": actor.ActorConfig(**bf16),
                    "tracerl_bf16_compiled_checkpointed": actor.ActorConfig(**bf16, activation_checkpointing=True,
                                                                              compile=True),
                    "tracerl_bf16_compiled": actor.ActorConfig(**bf16, compile=True),
                    "tracerl_bf16_compiled_micro4": actor.ActorConfig(**{**bf16, "micro_batch_size": 4},
                                                                        compile=True),
                    "tracerl_fp32_micro2": actor.ActorConfig(precision="fp32", micro_batch_size=2)}
        for name, cfg in variants.items():
            record(name, lambda cfg=cfg: actor_step_fn(folder, cfg, config.vocab_size))
    base = results["baseline_transformers_bf16"].get("tokens_per_s")
    for name, value in results.items():
        if isinstance(value, dict) and "tokens_per_s" in value and base:
            value["ratio_to_baseline"] = value["tokens_per_s"] / base
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="tracerl's GPU benchmarks; writes a JSON summary")
    parser.add_argument("--parts", nargs="+", default=["actor"], choices=["actor"])
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant")
    parser.add_argument("--out", default="gpu-summary.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "actor" in args.parts:
        summary["actor"] = bench_actor(args.steps)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
