# bench/lora_push.py — what a LoRA push costs against a full push, on the vLLM engine train.py builds.
#
# A model of a given shape (random weights) is served by vllm_engine.VLLMEngine twice, one engine after the other:
# as a full model taking every weight (CUDA IPC on a GPU, collective_rpc on a CPU: train.py's full push), and serving
# a LoRA adapter of rank R over the same base, taking the adapter alone (lora.adapter_state: train.py's push under
# --actor.lora_rank). Each push is timed --pushes times (the first of each apart: it opens vLLM's transfer, or loads
# the first adapter), with one generation batch after each kind of push (tokens/s: vLLM's LoRA kernels add the
# low-rank path to every adapted layer, so decoding under an adapter costs more than under merged weights).
#
#   python bench/lora_push.py --tiny                                        (vLLM's CPU build, a tiny Qwen3)
#   python bench/lora_push.py --model DIR --rank 16 --out lora-push.json     (one GPU; DIR: bench/shapes.py qwen3-8b)
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

import models  # noqa: E402
from engines.vllm_engine import VLLMEngine  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from trainer import lora  # noqa: E402


def timed_pushes(engine: VLLMEngine, state: dict, pushes: int) -> dict:
    times = []
    for _ in range(pushes):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.update_weights(state, engine.version + 1)
        times.append(time.perf_counter() - t0)
    later = times[1:] or times
    return {"first_s": times[0], "median_s": statistics.median(later), "min_s": min(later),
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def generation(engine: VLLMEngine, vocab: int, prompts: int, new_tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(3, vocab - 1, (prompts, 64), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0, stop_token_ids=(vocab - 1,))
    t0 = time.perf_counter()
    generations = engine.generate(batch, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(gen.token_ids) for gen in generations)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on vLLM's CPU build")
    parser.add_argument("--model", default="", help="a model folder (bf16 on a GPU), e.g. one of bench/shapes.py's")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    dtype, transfer = ("bfloat16", "ipc") if gpu else ("float32", "rpc")
    device = "cuda" if gpu else "cpu"
    spec = lora.LoraSpec(args.rank, 2.0 * args.rank)
    if not args.tiny and not args.model:
        parser.error("give --model DIR, or --tiny")
    result = {"model": "tiny" if args.tiny else args.model, "rank": args.rank, "dtype": dtype,
              "device": torch.cuda.get_device_name() if gpu else "cpu"}
    engine_kwargs = dict(dtype=dtype, transfer=transfer, enforce_eager=not gpu, gpu_memory_utilization=0.4,
                         max_model_len=1024)
    path = models.tiny_model_dir("qwen3", head_dim=32) if args.tiny else args.model
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    # the full push: every weight of the base, on the device, as Actor.export_weights hands it
    base = models.load_model(path, dtype=getattr(torch, dtype)).to(device)
    full_state = {name: t for name, t in base.state_dict().items() if name != models.tied_output_key(base)}
    engine = VLLMEngine(path, **engine_kwargs)
    try:
        result["full"] = timed_pushes(engine, full_state, args.pushes)
        result["full"]["generation"] = generation(engine, vocab, args.prompts, args.new_tokens)
    finally:
        engine.shutdown()
    del full_state
    # the adapter: PEFT's layers over the same base, B moved off zero so the adapter is live
    lora.add_lora(base, spec)
    with torch.no_grad():
        for name, parameter in base.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0.0, 1e-3)
    adapter = {name: t.detach() for name, t in lora.adapter_state(base).items()}
    del base
    if gpu:
        torch.cuda.empty_cache()
    engine = VLLMEngine(path, lora_spec=spec, **engine_kwargs)
    try:
        result["adapter"] = timed_pushes(engine, adapter, args.pushes)
        result["adapter"]["generation"] = generation(engine, vocab, args.prompts, args.new_tokens)
    finally:
        engine.shutdown()
    result["push_time_ratio_full_over_adapter"] = result["full"]["median_s"] / result["adapter"]["median_s"]
    result["bytes_ratio_full_over_adapter"] = result["full"]["bytes"] / result["adapter"]["bytes"]
    result["decode_tokens_per_s_ratio_adapter_over_full"] = (result["adapter"]["generation"]["tokens_per_s"]
                                                             / result["full"]["generation"]["tokens_per_s"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
