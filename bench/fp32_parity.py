# bench/fp32_parity.py — why vLLM in fp32 on a GPU disagrees with the trainer's fp32 recompute, and which MoE routes
# vLLM reports for a request in flight during a weight update (drained, or kept); each part one run, one JSON summary.
#
# parity: one fp32 model (SmolLM2-135M's architecture with random weights, its final norm scaled so its logits
#   spread like a trained model's; or --model FOLDER, e.g. the smollm2 folder) samples 64 prompts x 128 tokens in
#   vLLM with processed logprobs (the project's mode: after temperature and top-p) and the top 20 of them per
#   position, at T 0.8 with top_p 0.9 and again with top_p 1 (no nucleus: vLLM then skips its top-k/top-p code), under
#   each ENGINE variant; every sampled token is recomputed by recompute.sequence_logprobs under each TRAINER variant.
#   Reported per pair: mean and max |diff| over the sampled tokens. For the project's trainer (sdpa, fp32) also where
#   the gap comes from, from the top 20 at each position with |diff| > 1e-4: one shift shared by all of them (the
#   nucleus' normaliser differs: top-p kept other tokens) or a scatter (the logits differ: matmuls, attention), and
#   how many positions keep a top-20 token on one side and drop it on the other.
#   Engine variants (a fresh engine each; vLLM's engine core is a spawned process, so a setting goes in as an engine
#   argument, an environment variable it inherits, or a function run in its worker through collective_rpc):
#     default         vllm.LLM(dtype=float32, enforce_eager=True): what vLLM 0.26 picks itself. Read from its source:
#                     on Hopper FLASH_ATTN and FLASHINFER take fp16/bf16 only, so fp32 gets TRITON_ATTN, whose
#                     kernel's tl.dot runs fp32 inputs as TF32 unless TRITON_F32_DEFAULT=ieee; the worker sets
#                     torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION="highest"), so cuBLAS
#                     matmuls are full fp32; with 8 or more rows top-k/top-p runs vLLM's Triton pivot-search kernel
#                     (topk_topp_triton.py: at most 18 bisection steps, fast exp), below 8 and on a CPU an exact sort
#     project_engine  vllm_engine.VLLMEngine(dtype=float32, enforce_eager=True): the project's engine, same settings
#     topp_sort       default + the worker's apply_top_k_top_p replaced by vLLM's own sort-based one
#     triton_ieee     default + TRITON_F32_DEFAULT=ieee (fp32 tl.dot in the attention kernel; a fresh Triton cache)
#     flex_attention  default + attention_backend=FLEX_ATTENTION (torch's flex attention, which follows torch's
#                     matmul precision)
#     matmul_tf32     default + VLLM_FLOAT32_MATMUL_PRECISION=high (TF32 cuBLAS matmuls: the size of that effect)
#     cuda_graphs     default with enforce_eager=False (torch.compile and CUDA graphs)
#     fixed           triton_ieee + topp_sort;  fixed_graphs: the same with CUDA graphs
#   Trainer variants: sdpa_fp32 (the project's: models.load_model, torch's default "highest" precision), eager_fp32
#   (eager attention), sdpa_tf32 (torch.set_float32_matmul_precision("high")), fp64 (the model in float64: the
#   reference both sides are measured against).
# r3_update: a tiny Qwen3-MoE in fp32 on vllm_engine.VLLMEngine; a 64-token request is in flight when the runtime's
#   push (pause, update, resume) replaces every router's weights (so routes change), and a 16-token request comes
#   while the engine is paused. Under each update policy: drain (an MoE engine's default: the update waits for the
#   request in flight; the second one starts after it), keep_reprefill (drain_on_update=False: the kept request is
#   re-prefilled by the new weights), keep_old_kv_cache (also reprefill_on_update=False). Reported per request:
#   its versions, whether vLLM reported routes for every forwarded position (on an H200 vLLM 0.26 reported none,
#   or some positions only, for some requests: docs/gpu.md), which routes they are against transformers' under the
#   old and the new weights, and the logprob gap of each version's tokens when the trainer replays the reported
#   routes, a fresh forward's routes at that version, or none (live routes); also how long the update took (a drain waits).
#   Routed-expert capture needs CUDA: with --tiny on a CPU the part runs on the embedded engine instead (which keeps
#   the same policies), to test the part's plumbing.
# --tiny: a 2-layer Qwen3 (head_dim 32, the smallest vLLM's CPU attention takes) on vLLM's CPU build, 8 prompts x 32
#   tokens, the variants a CPU has; it exists to test this script.
#
#   python bench/fp32_parity.py [--parts parity r3_update] [--variants default topp_sort ...] [--model DIR]
#                               [--out fp32-parity.json] [--tiny]
import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# collective_rpc with a function (the worker-side patches below) pickles it; both ends are this process and the
# engine it starts
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import engines  # noqa: E402
import models  # noqa: E402
import rollout  # noqa: E402
from engines import processing  # noqa: E402
from engines import r3  # noqa: E402
from trainer import recompute  # noqa: E402

TEMPERATURE, TOP_P, TOP_LOGPROBS = 0.8, 0.9, 20
SHARPEN = 6.0      # final-norm scale: random-init logits (std ~0.5) spread to std ~3, as a trained model's
GPU_ONLY = {"triton_ieee", "flex_attention", "matmul_tf32", "cuda_graphs", "fixed", "fixed_graphs"}
# engine variant -> (engine keyword arguments, environment, sort-based top-p in the worker, the project's engine)
ENGINE_VARIANTS = {
    "default": ({}, {}, False, False),
    "project_engine": ({}, {}, False, True),
    "topp_sort": ({}, {}, True, False),
    "triton_ieee": ({}, {"TRITON_F32_DEFAULT": "ieee"}, False, False),
    "flex_attention": ({"attention_backend": "FLEX_ATTENTION"}, {}, False, False),
    "matmul_tf32": ({}, {"VLLM_FLOAT32_MATMUL_PRECISION": "high"}, False, False),
    "cuda_graphs": ({"enforce_eager": False}, {}, False, False),
    "fixed": ({}, {"TRITON_F32_DEFAULT": "ieee"}, True, False),
    "fixed_graphs": ({"enforce_eager": False}, {"TRITON_F32_DEFAULT": "ieee"}, True, False),
}
TRAINER_VARIANTS = ("sdpa_fp32", "eager_fp32", "sdpa_tf32", "fp64")


# ---- the model and prompts ----

def sharpened_smollm2_shape(folder: str) -> str:
    """SmolLM2-135M's architecture (bench/gpu.py's), random weights in fp32, the final norm scaled by SHARPEN."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    models.bpe_tokenizer().save_pretrained(folder)   # vLLM loads a tokenizer; the prompts are ids, never text
    return folder


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n, length), generator=g).tolist()


def vocab_of(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)["vocab_size"]


# ---- functions run inside vLLM's worker (collective_rpc passes the worker first) ----

def worker_sort_based_top_p(worker) -> str:
    """vLLM's own exact top-k/top-p (sort, softmax, cumsum) in place of its Triton pivot-search kernel."""
    from vllm.v1.sample.ops import topk_topp_sampler as ops
    ops.apply_top_k_top_p = lambda logits, k, p: ops.apply_top_k_top_p_pytorch(logits, k, p)
    return "apply_top_k_top_p_pytorch"


def worker_facts(worker) -> dict:
    """What the engine's worker computes with: its attention backends, torch's matmul precision, Triton's fp32
    default."""
    backends = set()
    for groups in getattr(worker.model_runner, "attn_groups", []) or []:
        for group in groups:
            try:
                backends.add(group.backend.get_name())
            except Exception:  # noqa: BLE001 - a fact we could not read stays out of the summary
                pass
    return {"attention_backends": sorted(backends), "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT", "")}


# ---- sampling under one engine variant ----

def sample(variant: str, folder: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """{top_p: [(prompt, token ids, sampled logprobs, top-20 per position {id: logprob})]} at T 0.8 for top_p 0.9 and
    1.0, and the worker's facts."""
    import vllm
    kwargs, env, sort_top_p, project = ENGINE_VARIANTS[variant]
    saved = {key: os.environ.get(key) for key in [*env, "TRITON_CACHE_DIR"]}
    cache = tempfile.mkdtemp(prefix="triton-") if env else None
    os.environ.update(env)
    if cache:                         # kernels built under one TRITON_F32_DEFAULT are never reused under another
        os.environ["TRITON_CACHE_DIR"] = cache
    base = dict(dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
                gpu_memory_utilization=0.3, max_logprobs=TOP_LOGPROBS)
    t0 = time.time()
    try:
        if project:                    # its own engine arguments (processed logprobs, the top 20 at most)
            from engines import vllm_engine
            engine = vllm_engine.VLLMEngine(folder, seed=0, dtype="float32", transfer="rpc", max_model_len=512,
                                            gpu_memory_utilization=0.3, enforce_eager=True)
            rpc = lambda fn: engine._call(engine._llm.collective_rpc(fn))      # noqa: E731
        else:
            llm = vllm.LLM(folder, logprobs_mode="processed_logprobs", **{**base, **kwargs})
            rpc = llm.collective_rpc
        started = time.time() - t0
        facts = rpc(worker_facts)[0]
        if sort_top_p:
            facts["top_k_top_p"] = rpc(worker_sort_based_top_p)[0]
        samples = {}
        for top_p in (TOP_P, 1.0):
            if project:
                params = engines.SamplingParams(temperature=TEMPERATURE, top_p=top_p, max_tokens=max_tokens,
                                                top_logprobs=TOP_LOGPROBS, stop_token_ids=(vocab_of(folder) - 1,))
                gens = engine.generate(prompts, params)
                samples[top_p] = [(g.prompt_ids, g.token_ids, g.behavior_logprobs, [dict(t) for t in g.top_logprobs])
                                  for g in gens]
            else:
                params = vllm.SamplingParams(temperature=TEMPERATURE, top_p=top_p, max_tokens=max_tokens,
                                             logprobs=TOP_LOGPROBS, ignore_eos=True, detokenize=False)
                outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                samples[top_p] = [(list(o.prompt_token_ids), list(c.token_ids),
                                   [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                   [{t: e.logprob for t, e in lp.items()} for lp in c.logprobs])
                                  for o in outs for c in [o.outputs[0]]]
        if project:
            engine.shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
            del llm
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"samples": samples, "facts": {**facts, "engine_start_s": round(started, 1),
                                          "engine_s": round(time.time() - t0, 1)}}


# ---- the trainer's recompute ----

def load_trainer(folder: str, variant: str, device: str):
    """The model as a trainer variant computes with, and the matmul precision to set around it."""
    attn = "eager" if variant == "eager_fp32" else models.ATTN_IMPLEMENTATION
    dtype = torch.float64 if variant == "fp64" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn).to(device).eval()
    return model, ("high" if variant == "sdpa_tf32" else "highest")


def padded(rows: list, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [p + t for p, t, _, _ in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def trainer_logprobs(model, precision: str, rows: list, top_p: float, device: str) -> list[torch.Tensor]:
    """recompute.sequence_logprobs of every sampled token (the project's recompute), one padded forward."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        ids, mask = padded(rows, device)
        lp = recompute.sequence_logprobs(model, ids, mask, TEMPERATURE, top_p=top_p).float().cpu()
    finally:
        torch.set_float32_matmul_precision(before)
    return [lp[b, len(p):len(p) + len(t)] for b, (p, t, _, _) in enumerate(rows)]


@torch.no_grad()
def top20_split(model, rows: list, top_p: float, device: str, threshold: float = 1e-4) -> dict:
    """Where the gap of the tokens with |diff| > threshold comes from: the top-20 processed logprobs vLLM reported at
    that position against the trainer's processed distribution (processing.processed_logprobs of fp32 logits, the
    sampled id kept). A shared shift (scatter below a tenth of the gap) is the nucleus' normaliser; a scatter is the
    logits. Also counted: positions where a top-20 token is kept on one side and dropped on the other."""
    counts = {"tokens": 0, "over_threshold": 0, "shift": 0, "scatter": 0, "nucleus_membership_differs": 0}
    for prompt, tokens, behavior, tops in rows:
        ids = torch.tensor([prompt + tokens], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(tokens) - 1].float()
        keep = torch.tensor(tokens, device=device)
        lp = processing.processed_logprobs(logits, TEMPERATURE, top_p, keep=keep).cpu()
        for t, (token, b, top) in enumerate(zip(tokens, behavior, tops)):
            counts["tokens"] += 1
            ids_top = list(top)
            ours = lp[t, ids_top]
            theirs = torch.tensor([top[i] for i in ids_top])
            kept_here, kept_there = torch.isfinite(ours), torch.isfinite(theirs)
            counts["nucleus_membership_differs"] += int((kept_here != kept_there).any())
            gap = abs(b - float(lp[t, token]))
            if gap <= threshold:
                continue
            counts["over_threshold"] += 1
            both = kept_here & kept_there
            d = (theirs - ours)[both]
            scatter = float((d - d.median()).abs().max()) if len(d) else float("inf")
            counts["shift" if scatter < gap / 10 else "scatter"] += 1
    return counts


def gap(rows: list, recomputed: list[torch.Tensor]) -> dict:
    behavior = torch.cat([torch.tensor(b, dtype=torch.float32) for _, _, b, _ in rows])
    diff = (behavior - torch.cat(recomputed)).abs()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "over_1e-4": float((diff > 1e-4).float().mean()),
            "tokens": int(diff.numel())}


def bench_parity(variants: list[str], model_arg: str, tiny: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cpu = device == "cpu"
    work = tempfile.mkdtemp(prefix="fp32-parity-")
    if tiny:
        folder, n_prompts, max_tokens = models.tiny_model_dir("qwen3", head_dim=32), 8, 32
    else:
        folder = models.resolve_model(model_arg) if model_arg else sharpened_smollm2_shape(work)
        n_prompts, max_tokens = 64, 128
    prompts = random_prompts(n_prompts, 32, vocab_of(folder))
    result = {"model": model_arg or ("tiny-qwen3 (head_dim 32)" if tiny else
                                     f"SmolLM2-135M shape, random fp32 weights, final norm x{SHARPEN}"),
              "device": device, "prompts": n_prompts, "max_tokens": max_tokens, "temperature": TEMPERATURE,
              "top_p": [TOP_P, 1.0], "engines": {}}
    trainers = {}
    for name in TRAINER_VARIANTS:
        if name == "sdpa_tf32" and on_cpu:
            continue
        trainers[name] = load_trainer(folder, name, device)
    for variant in variants:
        if on_cpu and variant in GPU_ONLY:
            result["engines"][variant] = {"skipped": "needs CUDA"}
            continue
        try:
            sampled = sample(variant, folder, prompts, max_tokens)
        except Exception as error:  # noqa: BLE001 - a variant vLLM refuses still leaves the others' figures
            result["engines"][variant] = {"error": f"{type(error).__name__}: {error}"[:1500]}
            print(variant, result["engines"][variant], flush=True)
            continue
        entry = {"facts": sampled["facts"]}
        for top_p, rows in sampled["samples"].items():
            key = f"top_p_{top_p:g}"
            entry[key] = {name: gap(rows, trainer_logprobs(model, precision, rows, top_p, device))
                          for name, (model, precision) in trainers.items()}
            entry[key]["sources_vs_sdpa_fp32"] = top20_split(trainers["sdpa_fp32"][0], rows, top_p, device)
        result["engines"][variant] = entry
        print(variant, json.dumps(entry), flush=True)
    return result


# ---- R3: routes of a request in flight during a weight update ----

def captured_routes(model, ids: list[int], device: str) -> torch.Tensor:
    """transformers' own routes for one sequence: long [positions, layers, k], sorted (an expert set)."""
    with torch.no_grad(), r3.capture_routes(model) as captured:
        model(input_ids=torch.tensor([ids], device=device))
    return captured[0].sort(-1).values.cpu()


def match(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (position, layer) whose expert sets agree."""
    return float((a == b).all(-1).float().mean()) if a.numel() else float("nan")


def replay_gap(model, gen, routes, tokens: slice, device: str) -> dict | None:
    """|behavior - trainer| over gen's tokens `tokens` (indices into its sampled tokens), the trainer (model, T 1)
    replaying `routes` [positions, L, k] (None: its own live routes)."""
    if tokens.start == tokens.stop:
        return None
    ids, mask = padded([(gen.prompt_ids, gen.token_ids, gen.behavior_logprobs, [])], device)
    replay = None
    if routes is not None:
        replay = torch.full((1, ids.shape[1], *routes.shape[1:]), -1, dtype=torch.long)
        replay[0, :len(routes)] = torch.as_tensor(routes).long()
        replay = replay.to(device)
    with torch.no_grad():
        lp = recompute.sequence_logprobs(model, ids, mask, 1.0, routes=replay)[0, len(gen.prompt_ids):].float().cpu()
    diff = (torch.tensor(gen.behavior_logprobs) - lp[:len(gen.token_ids)])[tokens].abs()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(diff.numel())}


def describe(gen, weights: dict, device: str) -> dict:
    """What the engine reported for one request (versions, routes) against transformers under each version's
    weights (`weights`: version -> model): which routes they are, and the trainer-replay logprob gap of the tokens of
    each version replaying the reported routes, the routes a fresh forward at that version gives (what a consistent
    engine reports), and none (live routes, what the trainer does without them)."""
    versions = sorted(set(gen.policy_versions))
    sequence = gen.prompt_ids + gen.token_ids[:-1]          # the forwarded positions
    entry = {"tokens": len(gen.token_ids), "versions": {str(v): gen.policy_versions.count(v) for v in versions},
             "positions_forwarded": len(sequence),
             "routes_shape": None if gen.routes is None else list(gen.routes.shape)}
    entry["routes_for_every_position"] = gen.routes is not None and len(gen.routes) == len(sequence)
    reported = None if gen.routes is None else torch.from_numpy(gen.routes).long().sort(-1).values
    fresh = {v: captured_routes(weights[v], sequence, device) for v in versions}
    first = 0
    for v in versions:               # the tokens of each version are a run: versions only move forward
        n = gen.policy_versions.count(v)
        tokens = slice(first, first + n)
        part = {"tokens": n}
        if reported is not None:      # positions before a token of this run conditioned it
            positions = slice(0, len(gen.prompt_ids) + first + n - 1)
            part["reported_equals_fresh_routes_at_this_version"] = match(reported[positions], fresh[v][positions])
        for name, routes in (("reported", gen.routes), ("fresh_routes", fresh[v]), ("live", None)):
            if name == "reported" and routes is None:
                continue
            part[f"gap_replaying_{name}"] = replay_gap(weights[v], gen, routes, tokens, device)
        entry[f"v{v}"] = part
        first += n
    if len(versions) == 2 and reported is not None:   # which routes the positions before the update got
        cut = len(gen.prompt_ids) + entry["versions"][str(versions[0])] - 1
        old, new = fresh[versions[0]], fresh[versions[1]]
        entry["positions_before_update"] = cut
        entry["old_vs_new_weights_agree_before"] = match(old[:cut], new[:cut])
        entry["reported_equals_old_weights_before"] = match(reported[:cut], old[:cut])
        entry["reported_equals_new_weights_before"] = match(reported[:cut], new[:cut])
        entry["reported_equals_new_weights_after"] = match(reported[cut:], new[cut:])
    return entry


def bench_r3_update(tiny: bool) -> dict:
    """On a GPU, vLLM; with --tiny on a CPU (where vLLM captures no routes) the embedded engine, which keeps the
    same update policies: a check of this part's plumbing, not of vLLM."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not tiny:
        return {"skipped": "vLLM captures routed experts only on CUDA (its capture needs Triton); run on the GPU"}
    device = "cuda" if on_gpu else "cpu"
    folder = models.tiny_model_dir("qwen3_moe", head_dim=64)
    vocab = vocab_of(folder)
    old = models.load_model(folder).to(device)
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():        # every router gets new weights: most positions change experts
        for router in r3.moe_routers(new):
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * router.weight.std().item() * 3)
    if on_gpu:
        from engines import vllm_engine
        engine = vllm_engine.VLLMEngine(folder, dtype="float32", transfer="rpc", enforce_eager=True,
                                        gpu_memory_utilization=0.2, max_model_len=512)
    else:
        engine = rollout.EmbeddedEngine(models.load_model(folder), seed=0)
    prompt, late_prompt = random_prompts(2, 24, vocab, seed=3)
    result = {"model": "tiny Qwen3-MoE (8 experts, top 2, head_dim 64), fp32", "prompt_tokens": len(prompt),
              "engine": "vLLM (VLLMEngine)" if on_gpu else "the embedded engine (a CPU check of this part only)",
              "drain_on_update_default": engine.drain_on_update,
              "how": "a 64-token request; after its 16th token the runtime's push (pause, update every router's "
                     "weights, resume) and, while paused, a 16-token request; per request: versions, routes, and "
                     "the trainer's logprob gap (T 1) replaying them"}
    # policy -> (drain_on_update, reprefill_on_update); the embedded engine always re-prefills what it keeps
    policies = {"drain": (True, True), "keep_reprefill": (False, True)}
    if on_gpu:
        policies["keep_old_kv_cache"] = (False, False)
    try:
        for name, (drain, reprefill) in policies.items():
            engine.drain_on_update = drain
            if on_gpu:
                engine.reprefill_on_update = reprefill
            version = engine.version + 1
            engine.update_weights(old.state_dict(), version)          # start from the old weights
            heard, got, late = threading.Event(), [], []
            count = [0]

            def listen(index: int, token_id: int) -> None:   # on the engine's loop (or decoding thread)
                count[0] += 1
                if count[0] == 16:
                    heard.set()
            params = engines.SamplingParams(temperature=1.0, max_tokens=64, seed=7, stop_token_ids=(vocab - 1,))
            late_params = engines.SamplingParams(temperature=1.0, max_tokens=16, seed=8, stop_token_ids=(vocab - 1,))
            def run_long() -> None:
                try:
                    got.extend(engine.generate([prompt], params, on_token=listen))
                finally:
                    heard.set()           # also if it sampled its stop id first (then nothing spans the push)
            worker = threading.Thread(target=run_long)
            worker.start()
            heard.wait(300)
            engine.pause()
            at_pause = count[0]
            late_worker = threading.Thread(target=lambda: late.extend(engine.generate([late_prompt], late_params)))
            late_worker.start()
            t0 = time.time()
            engine.update_weights(new.state_dict(), version + 1)       # draining: once the request has finished
            update_s = time.time() - t0
            engine.resume()
            worker.join(300)
            late_worker.join(300)
            weights = {version: old, version + 1: new}
            entry = {"tokens_at_pause": at_pause, "update_s": round(update_s, 3),
                     "long": describe(got[0], weights, device), "late": describe(late[0], weights, device)}
            entry["one_version_per_request"] = all(len(e["versions"]) == 1 for e in (entry["long"], entry["late"]))
            entry["routes_for_every_position"] = all(e["routes_for_every_position"]
                                                     for e in (entry["long"], entry["late"]))
            result[name] = entry
            print("r3_update", name, json.dumps(entry), flush=True)
    finally:
        if on_gpu:
            engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="vLLM fp32 vs the trainer's recompute; R3 routes across an update")
    parser.add_argument("--parts", nargs="+", default=["parity", "r3_update"], choices=["parity", "r3_update"])
    parser.add_argument("--variants", nargs="+", default=list(ENGINE_VARIANTS), choices=list(ENGINE_VARIANTS))
    parser.add_argument("--model", default="", help="a model folder or name (default: the sharpened random shape)")
    parser.add_argument("--out", default="fp32-parity.json")
    parser.add_argument("--tiny", action="store_true", help="tiny model, vLLM's CPU build (tests this script)")
    args = parser.parse_args()
    import vllm
    summary = {"torch": torch.__version__, "vllm": vllm.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for part in args.parts:
        t0 = time.time()
        try:
            summary[part] = bench_parity(args.variants, args.model, args.tiny) if part == "parity" else \
                bench_r3_update(args.tiny)
        except Exception as error:  # noqa: BLE001 - one part failing still leaves the other's figures
            summary[part] = {"error": f"{type(error).__name__}: {error}"[:3000]}
        summary[part]["seconds"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
