# bench/bitwise_probe.py — how far a bf16 trainer forward is from vLLM's sampled logprobs under vLLM's batch-invariant
# mode, and what closes the gap: the first measurement towards a bitwise engine-trainer mode (invariant 3 at
# max |diff| = 0).
#
# vLLM samples with VLLM_BATCH_INVARIANT=1 (its engine process turns on vllm.model_executor.layers.batch_invariant:
# split-k off in cuBLAS on Hopper, Triton kernels for log_softmax / softmax / mean / bmm, its own RMSNorm kernel);
# then this process recomputes every sampled token's logprob with transformers' model in bf16, three ways:
#   default           transformers' kernels as they come (the trainer today, in bf16);
#   batch_invariant   the same, after vLLM's enable_batch_invariant_mode() in this process (the same aten overrides);
#   one_row           batch_invariant, one row at a time (is the trainer's own batch the variance?).
# Each gives max and mean |vLLM - trainer| over every sampled token and the share of tokens that are bitwise equal.
# A GPU-only bench: one JSON summary.
#
#   VLLM_BATCH_INVARIANT=1 python bench/bitwise_probe.py MODEL_DIR --out OUT.json [--prompts 8 --tokens 64]
import argparse
import json
import os
import sys
import time

import torch


def sample(model_dir: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    """vLLM's samples: each prompt's ids, the sampled ids and their logprobs (temperature 1: raw = processed)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    rows = []
    for prompt, out in zip(prompts, outs):
        done = out.outputs[0]
        rows.append({"prompt": prompt, "ids": list(done.token_ids),
                     "logprobs": [lp[t].logprob for t, lp in zip(done.token_ids, done.logprobs)]})
    del llm
    return rows


def recompute(model, rows: list[dict], batched: bool) -> list[torch.Tensor]:
    """Each row's sampled tokens' logprobs from transformers' forward (bf16 logits, log_softmax in fp32, as vLLM)."""
    def forward(batch: list[dict]) -> list[torch.Tensor]:
        width = max(len(r["prompt"]) + len(r["ids"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):                         # right padding: causal attention needs no other mask
            seq = r["prompt"] + r["ids"]
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits.float()
        out = []
        for i, r in enumerate(batch):
            start, n = len(r["prompt"]), len(r["ids"])
            lp = logits[i, start - 1:start - 1 + n].log_softmax(-1)
            out.append(lp.gather(-1, torch.tensor(r["ids"], device=lp.device)[:, None])[:, 0].cpu())
        return out
    if batched:
        return forward(rows)
    return [forward([r])[0] for r in rows]


def compare(rows: list[dict], got: list[torch.Tensor]) -> dict:
    diffs = torch.cat([(torch.tensor(r["logprobs"]) - g.double()).abs() for r, g in zip(rows, got)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "bitwise_equal_share": float((diffs == 0).double().mean()), "tokens": int(diffs.numel())}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise SystemExit("set VLLM_BATCH_INVARIANT=1: the probe measures vLLM's batch-invariant mode")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (16 + 8 * i,), generator=gen).tolist() for i in range(args.prompts)]
    started = time.monotonic()
    rows = sample(args.model, prompts, args.tokens)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    result = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "default": compare(rows, recompute(model, rows, batched=True))}
    from vllm.model_executor.layers import batch_invariant
    batch_invariant.override_envs_for_invariance()
    batch_invariant.enable_batch_invariant_mode()
    result["batch_invariant"] = compare(rows, recompute(model, rows, batched=True))
    result["one_row"] = compare(rows, recompute(model, rows, batched=False))
    result["seconds"] = time.monotonic() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
