# bench/gpu.py — tracerl's GPU figures, side by side with a plain baseline on the same GPU, in one run.
#
# actor: one optimizer step of actor.Actor.train_step (bf16 compute over fp32 master weights, the output
#   projection chunked so [rows, T, vocab] logits never exist, activation checkpointing per decoder layer or
#   not) against a plain transformers bf16 loop (the whole model in bf16, gradient checkpointing, fused AdamW,
#   the model's own cross-entropy over full logits) on a Qwen3-0.6B shape, 8 rows x 2048 tokens. Reported:
#   tokens/s, the ratio to the baseline, peak memory, and model-FLOPs utilisation against the H200's bf16 dense
#   peak (6 x parameters x tokens, plus causal attention, per second, over 790 TFLOP/s).
#
# refit: a weight update of the same shape from the actor to the embedded engine on the same GPU: seconds and
#   bytes per update, the engine's outputs before and after, the versions of a request that straddles one.
#
# vllm_speed: vllm_engine.VLLMEngine (AsyncLLM, per-token streaming, versions, processed logprobs) against raw
#   `vllm.LLM.generate` on the same model and batch (SmolLM2-135M, 512 prompts x 256 new tokens, logprobs on); also
#   through router.Router as train.py calls it, not streamed and streamed (per-step outputs); and vLLM's AsyncLLM
#   driven alone, which VLLMEngine wraps (what of the gap is AsyncLLM's own).
#
# vllm_parity: vLLM's bf16 behavior logprobs against the actor's recompute of the same tokens (bf16 autocast as the
#   actor trains, and exact fp32): mean and max |diff| and the k3 estimate of KL(mu || pi).
#
# vllm_refit: the Qwen3-0.6B shape's weight update from the actor to a vLLM engine on the same GPU through vLLM's
#   weight-transfer API (CUDA IPC): seconds and bytes, outputs before and after, a straddling request's versions,
#   and what re-prefilling a kept request does to its logprobs (against continuing on its old KV cache).
#
# vllm_r3: routed experts from vLLM on a tiny Qwen3-MoE replayed by the actor: how often the actor's own routing
#   picks the engine's expert set, and the logprob gap with and without replay.
#
#   python bench/gpu.py [--parts actor refit vllm_speed vllm_parity vllm_refit vllm_r3] [--model DIR]
#                       [--out gpu-summary.json] [--steps 5]
import argparse
import asyncio
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
import engines  # noqa: E402
import invariants  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
from engines import r3  # noqa: E402
from router import Router  # noqa: E402
from trainer import recompute  # noqa: E402

PEAK_BF16_FLOPS = 790e12      # H200 dense bf16, as measured on the lent machine
ROWS, LENGTH = 8, 2048


def qwen3_06b_shape() -> Qwen3Config:
    """Qwen3-0.6B's architecture (random weights: no hub here)."""
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645, pad_token_id=151643)


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
        # the defaults (bf16, each decoder layer compiled, micro-batches sized from free memory) against the eager
        # step and the memory-saving settings
        variants = {"tracerl_defaults": actor.ActorConfig(),
                    "tracerl_bf16_eager": actor.ActorConfig(**bf16, compile="false"),
                    "tracerl_bf16_compiled_checkpointed": actor.ActorConfig(**bf16, activation_checkpointing=True,
                                                                              compile="true"),
                    "tracerl_fp32_micro2": actor.ActorConfig(precision="fp32", micro_batch_size=2, compile="false")}
        for name, cfg in variants.items():
            record(name, lambda cfg=cfg: actor_step_fn(folder, cfg, config.vocab_size))
        default_chunk = recompute.LOGPROB_CHUNK
        recompute.LOGPROB_CHUNK = 4 * default_chunk       # the output projection in larger pieces: fewer launches
        record("tracerl_defaults_chunk4x", lambda: actor_step_fn(folder, actor.ActorConfig(), config.vocab_size))
        recompute.LOGPROB_CHUNK = default_chunk
    base = results["baseline_transformers_bf16"].get("tokens_per_s")
    for value in results.values():
        if isinstance(value, dict) and "tokens_per_s" in value and base:
            value["ratio_to_baseline"] = value["tokens_per_s"] / base
    return results


def perturb(policy) -> None:
    """Stands in for an optimizer step: every weight moves."""
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.02 * torch.randn_like(p))


def timed_refits(policy, engine, prompt: list[int], seeded: engines.SamplingParams) -> dict:
    """The engine's seeded reply; every weight moved; three timed updates (the actor's export on its own device,
    then the engine's load); the reply again, which must differ."""
    before = engine.generate([prompt], seeded)[0]
    perturb(policy)
    seconds = []
    for version in (1, 2, 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        state = policy.export_weights(policy.device)
        engine.update_weights(state, version)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    after = engine.generate([prompt], seeded)[0]
    shift = max(abs(x - y) for x, y in zip(before.behavior_logprobs, after.behavior_logprobs))
    return {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "update_s": seconds,
            "tokens_changed": before.token_ids != after.token_ids, "max_logprob_shift": shift,
            "outputs_changed": before.token_ids != after.token_ids or shift > 1e-3}


def bench_refit() -> dict:
    """A weight update of the Qwen3-0.6B shape with the actor and the embedded engine on one GPU: the actor's
    export copied on the device and loaded by the engine (seconds per update, bytes moved); the engine's seeded
    reply before and after (its logprobs must change); and a request that straddles an update, loaded by a listener when
    its 8th token is drawn: its tokens' versions must read [v] * 8 + [v + 1] * (n - 8)."""
    config = qwen3_06b_shape()
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        policy = actor.Actor(folder, actor.ActorConfig(precision="bf16"), total_steps=10**6)
        engine = rollout.EmbeddedEngine(models.load_model(folder).to(policy.device), seed=0)
    prompt, seeded = list(range(100, 164)), engines.SamplingParams(max_tokens=24, seed=0,
                                                                   stop_token_ids=(config.vocab_size - 1,))
    results = {"shape": "Qwen3-0.6B", **timed_refits(policy, engine, prompt, seeded)}
    state = policy.export_weights(policy.device)
    drawn = []

    def update_at_the_8th_token(index: int, token_id: int) -> None:   # runs on the decoding thread
        drawn.append(token_id)
        if len(drawn) == 8:
            engine.update_weights(state, 4)
    straddling = engine.generate([prompt], seeded, on_token=update_at_the_8th_token)[0]
    return {**results, "straddling_versions": straddling.policy_versions,
            "straddling_ok": straddling.policy_versions == [3] * 8 + [4] * (len(straddling.token_ids) - 8)}


# ---- the vLLM engine ---------------------------------------------------------------------------------------------

def smollm2_shape_dir(folder: str) -> str:
    """SmolLM2-135M's architecture (bench/shapes.py) with random weights and SmolLM2's ids, no tokenizer."""
    from shapes import SHAPES
    config_class, fields = SHAPES["smollm2-135m"]
    config = config_class(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, **fields)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n, length), generator=g).tolist()


def bench_vllm_speed(model_dir: str, n_prompts: int = 512, new_tokens: int = 256, repeats: int = 2,
                     engine_kwargs: dict | None = None) -> dict:
    """Tokens/s of raw vllm.LLM.generate and of VLLMEngine.generate on the same prompts and sampling (temperature
    1, every token's logprob, no early stop), each the best of `repeats` after a warm-up; engines one at a time."""
    import gc

    import vllm

    from engines import vllm_engine
    kwargs = {"dtype": "bfloat16", "gpu_memory_utilization": 0.5, "max_model_len": 1024, **(engine_kwargs or {})}
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    prompts = random_prompts(n_prompts, 64, vocab)
    never = vocab - 1                                 # a stop id that ends nothing: every request runs to the end
    results = {"prompts": n_prompts, "new_tokens": new_tokens}

    def best(run) -> float:
        run(prompts[:8])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(prompts)
            times.append(time.perf_counter() - start)
        return n_prompts * new_tokens / min(times)

    llm = vllm.LLM(model_dir, seed=0, logprobs_mode="processed_logprobs", **kwargs)
    raw_params = vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, logprobs=0, ignore_eos=True,
                                     stop_token_ids=[never], detokenize=False)
    # llm bound as the lambda's default, not read from this scope, where it is deleted below to free the engine
    results["raw_vllm_tokens_per_s"] = best(lambda ps, llm=llm: llm.generate(
        [vllm.TokensPrompt(prompt_token_ids=p) for p in ps], raw_params, use_tqdm=False))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    engine = vllm_engine.VLLMEngine(model_dir, **{"transfer": "rpc", **kwargs})
    # vLLM's AsyncLLM alone, driven on the engine's own loop (final outputs only): what is AsyncLLM's, and what is
    # VLLMEngine's, in the gap to LLM.generate
    from vllm.sampling_params import RequestOutputKind
    async_params = raw_params.clone()
    async_params.output_kind = RequestOutputKind.FINAL_ONLY

    async def async_batch(ps):
        async def one(p):
            async for _ in engine._llm.generate(vllm.TokensPrompt(prompt_token_ids=p), async_params,
                                                request_id=os.urandom(8).hex()):
                pass
        await asyncio.gather(*(one(p) for p in ps))
    results["raw_asyncllm_tokens_per_s"] = best(lambda ps: engine._call(async_batch(ps)))
    params = engines.SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=(never,))
    results["tracerl_vllm_tokens_per_s"] = best(lambda ps: engine.generate(ps, params))
    # as train.py calls it: through the router, without a listener (vLLM returns final outputs only) and with one
    # (per-step outputs, what a streaming loopback reply costs)
    router = Router([engine])
    results["router_tokens_per_s"] = best(lambda ps: router.generate(ps, params))
    results["router_streamed_tokens_per_s"] = best(lambda ps: router.generate(ps, params, on_token=lambda i, t: None))
    engine.shutdown()
    results["ratio"] = results["tracerl_vllm_tokens_per_s"] / results["raw_vllm_tokens_per_s"]
    results["asyncllm_ratio"] = results["raw_asyncllm_tokens_per_s"] / results["raw_vllm_tokens_per_s"]
    results["router_ratio"] = results["router_tokens_per_s"] / results["raw_vllm_tokens_per_s"]
    results["router_streamed_ratio"] = results["router_streamed_tokens_per_s"] / results["raw_vllm_tokens_per_s"]
    return results


def trainer_logprobs(model, gens, temperature: float, bf16: bool, routes: bool = False) -> list[torch.Tensor]:
    """The actor's logprobs of every sampled token (one padded forward), in bf16 autocast as the actor trains on
    one GPU, or in fp32; optionally replaying each generation's routed experts."""
    seqs = [g.prompt_ids + g.token_ids for g in gens]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    replay = None
    if routes:
        layers, k = gens[0].routes.shape[1:]
        replay = torch.full((len(seqs), width, layers, k), -1, dtype=torch.long)
    for b, (s, g) in enumerate(zip(seqs, gens)):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
        if routes:
            replay[b, :len(g.routes)] = torch.from_numpy(g.routes).long()
    device = next(model.parameters()).device
    precision = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cuda", enabled=False)
    with torch.no_grad(), precision:
        lp = recompute.sequence_logprobs(model, ids.to(device), mask.to(device), temperature,
                                         routes=None if replay is None else replay.to(device)).float().cpu()
    return [lp[b, len(g.prompt_ids):len(g.prompt_ids) + len(g.token_ids)] for b, g in enumerate(gens)]


def mismatch(gens, recomputed) -> dict:
    behavior = torch.cat([torch.tensor(g.behavior_logprobs) for g in gens])
    prox = torch.cat(recomputed)
    return invariants.mismatch_metrics(prox[None], behavior[None], torch.ones(1, len(prox)))


def bench_vllm_parity(model_dir: str, tokenizer=None, engine_kwargs: dict | None = None) -> dict:
    """64 prompts x 128 tokens sampled by vLLM in bf16 at temperature 1, recomputed by the actor's model."""
    from engines import vllm_engine
    kwargs = {"dtype": "bfloat16", "gpu_memory_utilization": 0.3, "max_model_len": 1024, **(engine_kwargs or {})}
    engine = vllm_engine.VLLMEngine(model_dir, **{"transfer": "rpc", **kwargs})
    if tokenizer is not None:       # real weights: real questions, so the distribution is a trained model's
        questions = [f"What is {a} plus {b}? Think step by step." for a in range(8) for b in range(8)]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for q in questions]
    else:
        prompts = random_prompts(64, 32, json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"])
    gens = engine.generate(prompts, engines.SamplingParams(temperature=1.0, max_tokens=128))
    engine.shutdown()
    model = models.load_model(model_dir).cuda()
    return {"tokens": sum(len(g.token_ids) for g in gens),
            "actor_bf16": mismatch(gens, trainer_logprobs(model, gens, 1.0, bf16=True)),
            "actor_fp32": mismatch(gens, trainer_logprobs(model, gens, 1.0, bf16=False))}


def bench_vllm_refit() -> dict:
    """The 0.6B shape: actor (bf16 compute, fp32 master weights) and a vLLM engine on one GPU, CUDA IPC."""
    import threading

    from engines import vllm_engine
    config = qwen3_06b_shape()
    results: dict = {"shape": "Qwen3-0.6B"}
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        policy = actor.Actor(folder, actor.ActorConfig(precision="bf16"), total_steps=10**6)
        engine = vllm_engine.VLLMEngine(folder, dtype="bfloat16", transfer="ipc", gpu_memory_utilization=0.3,
                                        max_model_len=1024)
        prompt = list(range(100, 164))
        seeded = engines.SamplingParams(max_tokens=24, seed=0, stop_token_ids=(config.vocab_size - 1,))
        results.update(timed_refits(policy, engine, prompt, seeded))
        # a request kept across an update, with and without the re-prefill
        for reprefill in (True, False):
            engine.reprefill_on_update = reprefill
            heard, got = threading.Event(), []
            long = engines.SamplingParams(max_tokens=400, seed=1, stop_token_ids=(config.vocab_size - 1,))
            worker = threading.Thread(target=lambda: got.extend(engine.generate(
                [prompt], long, on_token=lambda index, token_id: heard.set())))
            worker.start()
            heard.wait(60)
            time.sleep(0.05)                        # let a few tokens through at the old version
            perturb(policy)
            version = engine.version + 1
            engine.update_weights(policy.export_weights(policy.device), version)
            worker.join(120)
            gen = got[0]
            n1 = gen.policy_versions.count(version - 1)
            new_lp = trainer_logprobs(policy.model, [gen], 1.0, bf16=True)[0]
            gap = (torch.tensor(gen.behavior_logprobs[n1:]) - new_lp[n1:]).abs()
            results["reprefill" if reprefill else "old_kv_cache"] = {
                "versions_ok": gen.policy_versions == [version - 1] * n1 + [version] * (len(gen.token_ids) - n1),
                "n_old": n1, "n_new": len(gen.token_ids) - n1,
                "after_update_vs_new_weights_mean": float(gap.mean()), "max": float(gap.max())}
        engine.shutdown()
    return results


def bench_vllm_r3() -> dict:
    """A tiny Qwen3-MoE (8 experts, top 2; head_dim 64 for the GPU attention kernels) sampled by vLLM with routed
    experts returned; how often the actor's own routing picks the engine's expert set, how often it does under
    replay (every position, or R3 is broken), and the actor's recompute with and without replaying the routes."""
    from engines import vllm_engine
    folder = models.tiny_model_dir("qwen3_moe", head_dim=64)
    prompts = random_prompts(16, 24, json.load(open(os.path.join(folder, "config.json")))["vocab_size"])
    engine = vllm_engine.VLLMEngine(folder, dtype="bfloat16", transfer="rpc", gpu_memory_utilization=0.2,
                                    max_model_len=512)
    gens = engine.generate(prompts, engines.SamplingParams(temperature=1.0, max_tokens=32))
    engine.shutdown()
    routed = [g for g in gens if g.routes is not None]
    result = {"generations": len(gens), "with_routes": len(routed)}
    if not routed:
        return result
    model = models.load_model(folder).cuda()
    same = replayed_same = total = 0
    for g in routed:
        ids = torch.tensor([g.prompt_ids + g.token_ids[:-1]], device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), \
                r3.capture_routes(model) as captured:
            model(input_ids=ids)
        own = captured[0].sort(-1).values.cpu()
        engine_routes = torch.from_numpy(g.routes).long().sort(-1).values
        same += int((own == engine_routes).all(-1).sum())
        total += own.shape[0] * own.shape[1]
        # under replay, the experts the actor's routers select are the engine's, position by position
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), \
                r3.replay_routes(model, torch.from_numpy(g.routes).long()[None].cuda()), \
                r3.capture_routes(model) as captured:
            model(input_ids=ids)
        replayed_same += int((captured[0].sort(-1).values.cpu() == engine_routes).all(-1).sum())
    return {**result, "routes_shape": list(routed[0].routes.shape), "positions_x_layers": total,
            "actor_picks_engine_experts": same / total, "replay_reproduces_engine_experts": replayed_same / total,
            "with_replay": mismatch(routed, trainer_logprobs(model, routed, 1.0, bf16=True, routes=True)),
            "without_replay": mismatch(routed, trainer_logprobs(model, routed, 1.0, bf16=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description="tracerl's GPU benchmarks; writes a JSON summary")
    parts = ["actor", "refit", "vllm_speed", "vllm_parity", "vllm_refit", "vllm_r3"]
    parser.add_argument("--parts", nargs="+", default=parts, choices=parts)
    parser.add_argument("--model", default="", help="real SmolLM2 weights for vllm_parity (default: random)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant")
    parser.add_argument("--out", default="gpu-summary.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "actor" in args.parts:
        summary["actor"] = bench_actor(args.steps)
    if "refit" in args.parts:
        summary["refit"] = bench_refit()
    with tempfile.TemporaryDirectory() as folder:
        smol = args.model or smollm2_shape_dir(folder)
        vllm_parts = {"vllm_speed": lambda: bench_vllm_speed(smol),
                      "vllm_parity": lambda: bench_vllm_parity(smol, models.load_tokenizer(smol) if args.model else None),
                      "vllm_refit": bench_vllm_refit, "vllm_r3": bench_vllm_r3}
        for name, part in vllm_parts.items():
            if name in args.parts:
                try:                # one part failing still leaves the others' figures
                    summary[name] = part()
                except Exception as error:  # noqa: BLE001
                    summary[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
                print(name, json.dumps(summary[name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
