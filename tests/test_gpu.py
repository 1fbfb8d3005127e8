# GPU claims, checked on a CUDA machine (the CPU suite covers the same logic with gloo): the actor on a GPU
# recomputes the CPU engine's behavior logprobs (text rows, and a VLM's rows with their images), an MoE on vLLM
# keeps R3 across a weight update (the drain: one version and vLLM's routes for every position of each request),
# FSDP2 over NCCL on two GPUs takes the same optimizer step as one GPU on the whole batch, vLLM serves a LoRA adapter
# the trainer recomputes, and an actor that fails to start stops the vLLM engine that train.py started beside it.
import contextlib
import copy
import dataclasses
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import actor
import algo
import data
import invariants
import models
from engines import r3
from trainer import recompute
from conftest import import_vllm
from engines import SamplingParams
from rollout import EmbeddedEngine
from test_actor import FSDP_CONFIG, FSDP_LENGTHS, FSDP_PROMPT, free_port, grads, make_batch, max_abs_diff, \
    on_policy, rows_from, select_rows
from test_vlm import check_fsdp_vlm_step, mixed_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEMPERATURE = 0.7
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_actor_on_gpu_recomputes_the_cpu_engine_logprobs():
    path = models.tiny_model_dir("qwen3")
    gens = EmbeddedEngine(models.load_model(path)).generate(
        [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]], SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=0))
    batch = invariants.build_batch(rows_from(gens), [1.0] * len(gens), pad_id=0)
    policy = actor.Actor(path, actor.ActorConfig(precision="fp32"), total_steps=1)
    assert next(policy.model.parameters()).is_cuda
    gap = (policy.recompute_logprobs(batch) - batch.behavior_logprobs)[batch.loss_mask.bool()].abs()
    print(f"GPU actor vs CPU engine: max |logprob diff| {gap.max().item():.2e}")
    assert gap.max() <= 1e-4


def test_actor_on_gpu_recomputes_the_cpu_engine_logprobs_with_images():
    vl_dir, tok = models.tiny_model_dir("qwen2_5_vl"), models.bpe_tokenizer()
    # sampled on CPU under 16-, 6- and 1-token images, and a text row
    _, _, batch = mixed_batch(models.load_model(vl_dir), tok, models.load_image_processor(vl_dir),
                              tok.convert_tokens_to_ids(data.IMAGE_PAD))
    policy = actor.Actor(vl_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    assert next(policy.model.parameters()).is_cuda
    gap = (policy.recompute_logprobs(batch) - batch.behavior_logprobs)[batch.loss_mask.bool()].abs()
    print(f"GPU actor vs CPU engine, Qwen2.5-VL rows with images: max |logprob diff| {gap.max().item():.2e}")
    assert gap.max() <= 1e-4


def test_the_embedded_engine_samples_on_the_gpu_and_the_actor_recomputes_it():
    """Inputs, caches and sampling on the model's device; a seeded request draws the same ids alone and in a
    mixed batch; the actor on the same GPU recomputes every token at its own sampling; MoE routes come back."""
    for kind in ("qwen3", "qwen3_moe"):
        path = models.tiny_model_dir(kind)
        engine = EmbeddedEngine(models.load_model(path).cuda(), seed=0)
        seeded = SamplingParams(temperature=0.8, max_tokens=12, seed=3, stop_token_ids=(9999,))
        alone = engine.generate([[5, 6, 7]], seeded)[0]
        mixed = engine.generate([[5, 6, 7], [9, 10], [11, 12, 13, 14]],
                                [seeded, SamplingParams(max_tokens=12), SamplingParams(temperature=0.5, top_k=5,
                                                                                       max_tokens=12)])
        assert mixed[0].token_ids == alone.token_ids
        policy = actor.Actor(path, actor.ActorConfig(precision="fp32"), total_steps=1)
        rows = []
        for i, gen in enumerate(mixed):              # recorded as a runner records them, routes included
            ledger = invariants.TokenLedger(f"r{i}", "g")
            ledger.extend_or_seal(gen.prompt_ids)
            ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling)
            if gen.routes is not None:
                ledger.absorb_routes(gen.routes)
            rows += ledger.rows()
        batch = invariants.build_batch(rows, [1.0] * 3, pad_id=0)
        assert (batch.routes is not None) == (kind == "qwen3_moe")
        gap = (policy.recompute_logprobs(batch) - batch.behavior_logprobs)[batch.loss_mask.bool()].abs().max()
        print(f"{kind} engine on GPU vs actor on GPU: max |logprob diff| {gap.item():.2e}")
        assert gap <= 1e-4


def _routes_of(model, gen) -> torch.Tensor:
    """transformers' routes for gen's forwarded positions, each an expert set (sorted) [P + n - 1, L, k]."""
    with r3.capture_routes(model) as captured, torch.no_grad():
        model(input_ids=torch.tensor([gen.prompt_ids + gen.token_ids[:-1]], device="cuda"))
    return captured[-1].sort(-1).values.cpu()


def _replay_gap(model, gen) -> float:
    """max |behavior - trainer| over gen's tokens, the trainer replaying gen's routes."""
    ids = torch.tensor([gen.prompt_ids + gen.token_ids], device="cuda")
    replay = torch.full((1, ids.shape[1], *gen.routes.shape[1:]), -1, dtype=torch.long)
    replay[0, :len(gen.routes)] = torch.from_numpy(gen.routes).long()
    with torch.no_grad():
        lp = recompute.sequence_logprobs(model, ids, torch.ones_like(ids), 1.0, routes=replay.cuda())[0].float().cpu()
    return (torch.tensor(gen.behavior_logprobs) - lp[len(gen.prompt_ids):]).abs().max().item()


def _push_during_a_request(engine, old, new):
    """A 64-token request; after its 16th token the runtime's push (pause, update to `new`, resume) and, while
    paused, a 16-token request. A random model may sample the stop id early, so the request must still run when the
    push comes: up to three seeds are tried. Returns (long, late, {version: its weights})."""
    stop = (engine.vocab_size - 1,)
    for seed in (7, 17, 27):
        version = engine.version + 1
        engine.update_weights(old.state_dict(), version)
        heard, count, long, late = threading.Event(), [0], [], []

        def listen(index, token_id):
            count[0] += 1
            if count[0] == 16:
                heard.set()

        def run_long():
            try:
                long.extend(engine.generate([list(range(3, 27))], SamplingParams(
                    temperature=1.0, max_tokens=64, seed=seed, stop_token_ids=stop), listen))
            finally:
                heard.set()
        worker = threading.Thread(target=run_long)
        worker.start()
        assert heard.wait(120)
        engine.pause()
        at_pause = count[0]
        late_worker = threading.Thread(target=lambda: late.extend(engine.generate(
            [list(range(40, 64))], SamplingParams(temperature=1.0, max_tokens=16, seed=8, stop_token_ids=stop))))
        late_worker.start()
        engine.update_weights(new.state_dict(), version + 1)
        engine.resume()
        worker.join(300)
        late_worker.join(300)
        if len(long[0].token_ids) > at_pause:      # it was still sampling when the push came
            return long[0], late[0], {version: old, version + 1: new}
    raise AssertionError("every seed's request sampled its stop id before the push; try other seeds")


def test_cuda_vllm_moe_update_drains_so_each_request_has_one_version_and_its_routes_replay():
    """vLLM in fp32 serving a tiny Qwen3-MoE; a push that moves every router lands while a request runs. Draining
    (an MoE engine's default): the request in flight and one submitted during the push each have one version and
    vLLM's routes for every forwarded position, a fresh forward's at that version, and the trainer replaying them
    meets vLLM's logprobs. (Under vLLM 0.26's asynchronous scheduling a drained request at times came back with
    routes for only some positions; an MoE engine schedules synchronously, and both must have them all.) With the
    drain forced off the kept request spans both versions (armed); what vLLM reports for it (no routes, or which)
    is printed, and nothing fails."""
    import_vllm()
    from engines.vllm_engine import VLLMEngine
    path = models.tiny_model_dir("qwen3_moe", head_dim=64)
    old = models.load_model(path).cuda()
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in r3.moe_routers(new):
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * router.weight.std().item() * 3)
    engine = VLLMEngine(path, dtype="float32", transfer="rpc", enforce_eager=True, gpu_memory_utilization=0.2,
                        max_model_len=512)
    try:
        assert engine.is_moe and engine.drain_on_update
        long, late, weights = _push_during_a_request(engine, old, new)
        engine.drain_on_update = False
        kept, _, kept_weights = _push_during_a_request(engine, old, new)
    finally:
        engine.shutdown()
    for name, gen in (("in flight", long), ("submitted during the push", late)):
        (version,) = set(gen.policy_versions)
        assert gen.routes is not None, f"drained, request {name}: vLLM reported routes for some positions only"
        assert len(gen.routes) == len(gen.prompt_ids) + len(gen.token_ids) - 1
        agree = (torch.from_numpy(gen.routes).long().sort(-1).values == _routes_of(weights[version], gen)).all(-1)
        gap = _replay_gap(weights[version], gen)
        print(f"drained, request {name}: version {version}, {len(gen.token_ids)} tokens, routes agree with "
              f"transformers' at {agree.float().mean().item():.4f} of (position, layer); replay gap max {gap:.2e}")
        assert agree.float().mean() >= 0.98 and gap <= 2e-3
    versions = sorted(set(kept.policy_versions))
    assert len(versions) == 2                                   # armed: kept across the push, it spans both
    n_old = kept.policy_versions.count(versions[0])
    if kept.routes is None:
        print(f"kept and re-prefilled ({n_old} + {len(kept.token_ids) - n_old} tokens): vLLM reported no routes")
    else:
        cut = len(kept.prompt_ids) + n_old - 1
        reported = torch.from_numpy(kept.routes).long().sort(-1).values
        old_routes, new_routes = (_routes_of(kept_weights[v], kept) for v in versions)
        print(f"kept and re-prefilled ({n_old} + {len(kept.token_ids) - n_old} tokens): vLLM reported routes "
              f"{list(kept.routes.shape)}; before the push they equal the old weights' at "
              f"{(reported[:cut] == old_routes[:cut]).all(-1).float().mean().item():.3f}, the new weights' at "
              f"{(reported[:cut] == new_routes[:cut]).all(-1).float().mean().item():.3f}")


def _nccl_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str,
                 cfg: actor.ActorConfig = FSDP_CONFIG) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        policy = actor.Actor(model_dir, cfg, total_steps=1)
        full = make_batch(FSDP_LENGTHS, FSDP_PROMPT, policy.model.config.vocab_size)
        batch = select_rows(full, list(range(rank, len(FSDP_LENGTHS), world_size)))
        policy.train_step(batch, on_policy(batch, policy), algo.AlgoConfig(estimator="reinforce"),
                          invariants.CorrectionConfig(), 0)
        full_grads = {name: p.grad.full_tensor().cpu() for name, p in policy.model.named_parameters()}
        export = policy.export_weights()
        if rank == 0:
            torch.save({"grads": full_grads, "export": export}, os.path.join(out_dir, "nccl.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fsdp2_over_nccl_on_two_gpus_equals_one_gpu(tmp_path):
    path = models.tiny_model_dir("qwen3")
    mp.spawn(_nccl_worker, args=(2, free_port(), path, str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "nccl.pt", weights_only=True)
    single = actor.Actor(path, FSDP_CONFIG, total_steps=1)
    batch = make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size)
    single.train_step(batch, on_policy(batch, single), algo.AlgoConfig(estimator="reinforce"),
                      invariants.CorrectionConfig(), 0)
    single_grads = {k: v.cpu() for k, v in grads(single.model).items()}
    print(f"FSDP2/NCCL vs one GPU: max |grad diff| {max_abs_diff(sharded['grads'], single_grads):.2e}")
    assert max_abs_diff(sharded["grads"], single_grads) <= 1e-5
    assert max_abs_diff(sharded["export"], single.export_weights()) <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_bf16_fsdp2_over_nccl_reduces_fp32_gradients_close_to_the_one_gpu_bf16_step(tmp_path):
    """bf16 compute, fp32 masters and fp32 reduce-scatter (FSDP2's MixedPrecisionPolicy) on two GPUs against one
    GPU's autocast step: the same gradient up to bf16 rounding, and every gradient fp32."""
    path, cfg = models.tiny_model_dir("qwen3"), dataclasses.replace(FSDP_CONFIG, precision="bf16")
    mp.spawn(_nccl_worker, args=(2, free_port(), path, str(tmp_path), cfg), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "nccl.pt", weights_only=True)
    assert all(g.dtype == torch.float32 for g in sharded["grads"].values())
    single = actor.Actor(path, cfg, total_steps=1)
    batch = make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size)
    single.train_step(batch, on_policy(batch, single), algo.AlgoConfig(estimator="reinforce"),
                      invariants.CorrectionConfig(), 0)
    single_grads = {k: v.cpu() for k, v in grads(single.model).items()}
    scale = max(g.abs().max().item() for g in single_grads.values())
    gap = max_abs_diff(sharded["grads"], single_grads)
    print(f"bf16 FSDP2/NCCL vs one GPU bf16: max |grad diff| {gap:.2e} of max |grad| {scale:.2e}")
    assert gap <= 3e-2 * scale


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fsdp2_over_nccl_ranks_with_and_without_images_take_the_one_gpu_step(tmp_path):
    vl_dir, tok = models.tiny_model_dir("qwen2_5_vl"), models.bpe_tokenizer()
    _, _, batch = mixed_batch(models.load_model(vl_dir), tok, models.load_image_processor(vl_dir),
                              tok.convert_tokens_to_ids(data.IMAGE_PAD))
    check_fsdp_vlm_step(vl_dir, batch, tmp_path, "nccl")


def test_an_actor_that_fails_to_start_stops_the_vllm_engine_started_before_it(tmp_path):
    """On one GPU train.py starts the vLLM engine in a thread, then builds the actor. When the actor then fails (a
    resume folder that holds no checkpoint), the run exits with the actor's error, not the engine's, and no process
    it started outlives it. Armed: the engine's process is seen running while the actor fails."""
    import_vllm()
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    run = subprocess.Popen([sys.executable, "train.py", "--recipe", "math", "--rollout.engine", "vllm",
                            "--model", models.tiny_model_dir("qwen3", head_dim=64), "--train.resume", str(empty),
                            "--run.out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    started, names, deadline = {}, set(), time.time() + 600
    while run.poll() is None and time.time() < deadline:    # every process the run starts, while it runs
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(run.pid).children(recursive=True):
                started.setdefault(child.pid, child)
                with contextlib.suppress(psutil.Error):
                    names.add(child.name() + " " + " ".join(child.cmdline()))   # vLLM renames its engine core
        time.sleep(0.2)
    output = run.communicate(timeout=60)[0]
    assert run.returncode != 0 and "FileNotFoundError" in output and "not a complete actor checkpoint" in output
    assert any("EngineCore" in name for name in names), (names, output[-3000:])   # an engine was running
    time.sleep(2)
    left = [p for p in started.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, (left, output[-3000:])


@pytest.mark.parametrize("dtype", ["bfloat16"])      # vLLM's GPU LoRA kernels take fp16 and bf16 weights only
def test_cuda_vllm_serves_the_lora_adapter_the_trainer_recomputes(dtype):
    """vLLM on the GPU serving LoRA adapters unmerged (its punica kernels), pushed from an actor that trains them:
    after a push the trainer's recompute meets vLLM's logprobs within bf16's precision, far closer than to the base
    the engine served before the push (armed); every request has one version."""
    import_vllm()
    from test_lora import SPEC, lora_actor, step
    from engines.vllm_engine import VLLMEngine
    path = models.tiny_model_dir("qwen3", head_dim=64)
    policy = lora_actor(path, compile="false", precision="fp32" if dtype == "float32" else "bf16")
    for seed in range(3):
        step(policy, seed)
    engine = VLLMEngine(path, dtype=dtype, transfer="ipc", enforce_eager=True, gpu_memory_utilization=0.2,
                        max_model_len=512, lora_spec=SPEC)
    try:
        prompts = [list(range(3, 20)), list(range(30, 41)), [5, 17, 42]]
        params = SamplingParams(temperature=TEMPERATURE, max_tokens=32, seed=3)

        def gaps() -> tuple[float, float]:
            generations = engine.generate(prompts, params)
            assert {v for g in generations for v in g.policy_versions} == {engine.version}
            batch = invariants.build_batch(rows_from(generations), [1.0] * len(prompts), pad_id=0)
            diff = ((policy.recompute_logprobs(batch) - batch.behavior_logprobs) * batch.loss_mask).abs()
            return diff.sum().item() / batch.loss_mask.sum().item(), diff.max().item()

        stale_mean, _ = gaps()
        engine.update_weights(policy.export_weights(policy.device), policy.version)
        mean, worst = gaps()
        print(f"vLLM {dtype} LoRA: trainer gap mean {mean:.2e} max {worst:.2e} nats; before the push {stale_mean:.2e}")
        assert stale_mean > 20 * mean
        assert (mean, worst) < ((1e-5, 1e-4) if dtype == "float32" else (2e-2, 0.5))
    finally:
        engine.shutdown()
