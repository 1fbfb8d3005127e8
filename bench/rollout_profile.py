# bench/rollout_profile.py — where a rollout's time goes between raw vLLM and train.py's rollout phase.
#
# The same batch (the math recipe's prompts for one RL step, rendered as train.py renders them, each --samples
# times), the same model and the same reply lengths (a stop id that is never sampled: every reply runs to
# --max-tokens), timed layer by layer, each the best of --repeats after a warm-up:
#   raw_llm       one vllm.LLM.generate call over every prompt (what TRL's colocated engine does)
#   raw_asyncllm  vLLM's AsyncLLM alone on VLLMEngine's loop, final outputs only (the engine vLLM gives an async server)
#   engine        VLLMEngine.generate: our request records, versions, logprob unpacking
#   router        router.Router.generate: engine choice, stats
#   runner        the recipe's AgentRunner.run: env threads, chat rendering, the token ledger, grading (train.py's
#                 rollout phase, as its sync loop calls it)
#   sleep_wake    VLLMEngine.sleep + wake_up, which a GPU run pays once a step beside the rollout
# and the runner's own Python once more under cProfile (the functions with the most time of their own).
# Each layer's cost is its time less the one below it; the JSON says each layer's tokens/s and its ratio to raw_llm.
#
#   python bench/rollout_profile.py --tiny                                  (vLLM's CPU build, a tiny Qwen3)
#   python bench/rollout_profile.py --model DIR --prompts 32 --samples 8 --max-tokens 256 --out profile.json
import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402
from agents import load_recipe  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from router import Router  # noqa: E402
from vllm_engine import VLLMEngine  # noqa: E402


def best_seconds(run, repeats: int) -> float:
    run(warm_up=True)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(warm_up=False)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 on vLLM's CPU build")
    parser.add_argument("--model", default="", help="a model folder (e.g. bench/shapes.py's)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-memory", type=float, default=0.3, help="train.py's --rollout.engine_memory")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import vllm
    from vllm.sampling_params import RequestOutputKind
    gpu = torch.cuda.is_available()
    folder = models.tiny_model_dir("qwen3", head_dim=32) if args.tiny else args.model
    tokenizer = models.load_tokenizer(folder)
    vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    never = vocab - 1                      # a stop id that ends nothing: every reply runs to max_tokens
    recipe = load_recipe("math")
    tasks = recipe.tasks("train", 0)[:args.prompts]
    group_tasks = [t for t in tasks for _ in range(args.samples)]
    group_ids = [f"g{i}" for i in range(len(tasks)) for _ in range(args.samples)]
    prompt_ids = [data.render_prompt_ids(tokenizer, t.messages) for t in group_tasks]
    tokens = len(prompt_ids) * args.max_tokens
    kwargs = dict(dtype="bfloat16" if gpu else "float32", gpu_memory_utilization=args.engine_memory,
                  max_model_len=max(len(p) for p in prompt_ids) + args.max_tokens + 8, enforce_eager=not gpu)
    result = {"model": folder, "rows": len(prompt_ids), "max_tokens": args.max_tokens, "tokens": tokens,
              "device": torch.cuda.get_device_name() if gpu else "cpu", "seconds": {}}
    seconds = result["seconds"]

    # raw vLLM, as TRL calls it
    llm = vllm.LLM(folder, seed=0, logprobs_mode="processed_logprobs", **kwargs)
    raw = vllm.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, logprobs=0,
                              stop_token_ids=[never], detokenize=False)
    prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    seconds["raw_llm"] = best_seconds(lambda warm_up, llm=llm: llm.generate(prompts[:8] if warm_up else prompts, raw,
                                                                            use_tqdm=False), args.repeats)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()

    # tracerl's engine, layer by layer
    engine = VLLMEngine(folder, transfer="ipc" if gpu else "rpc", sleep_mode=gpu, **kwargs)
    try:
        final_only = raw.clone()
        final_only.output_kind = RequestOutputKind.FINAL_ONLY

        async def async_batch(batch):
            async def one(p):
                async for _ in engine._llm.generate(p, final_only, request_id=os.urandom(8).hex()):
                    pass
            await asyncio.gather(*(one(p) for p in batch))
        seconds["raw_asyncllm"] = best_seconds(lambda warm_up: engine._call(async_batch(
            prompts[:8] if warm_up else prompts)), args.repeats)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, stop_token_ids=(never,))
        seconds["engine"] = best_seconds(lambda warm_up: engine.generate(
            prompt_ids[:8] if warm_up else prompt_ids, params), args.repeats)
        router = Router([engine])
        seconds["router"] = best_seconds(lambda warm_up: router.generate(
            prompt_ids[:8] if warm_up else prompt_ids, params), args.repeats)
        runner = recipe.AgentRunner(router, tokenizer, max_length=kwargs["max_model_len"])
        seconds["runner"] = best_seconds(lambda warm_up: runner.run(
            group_tasks[:8] if warm_up else group_tasks, group_ids[:8] if warm_up else group_ids, params),
            args.repeats)
        # the runner's own Python, function by function (this thread only: vLLM's loop thread is not in it)
        profile = cProfile.Profile()
        profile.runcall(runner.run, group_tasks, group_ids, params)
        for order in ("tottime", "cumulative"):
            listing = io.StringIO()
            pstats.Stats(profile, stream=listing).sort_stats(order).print_stats(20)
            result[f"runner_profile_by_{order}"] = listing.getvalue().splitlines()[-22:]
        if gpu:
            def cycle(warm_up: bool) -> None:
                engine.sleep()
                engine.wake_up()
            seconds["sleep_wake"] = best_seconds(cycle, args.repeats)
    finally:
        engine.shutdown()
    layers = ["raw_llm", "raw_asyncllm", "engine", "router", "runner"]
    result["tokens_per_s"] = {name: tokens / seconds[name] for name in layers}
    result["ratio_to_raw_llm"] = {name: seconds["raw_llm"] / seconds[name] for name in layers}
    result["layer_cost_s"] = {name: seconds[name] - seconds[below] for below, name in zip(layers, layers[1:])}
    if "sleep_wake" in seconds:
        result["rollout_phase_with_sleep_wake_ratio"] = seconds["raw_llm"] / (seconds["runner"] +
                                                                             seconds["sleep_wake"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
