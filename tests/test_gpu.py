# GPU claims, checked on a CUDA machine (the CPU suite covers the same logic with gloo): the actor on a GPU
# recomputes the CPU engine's behavior logprobs (text rows, and a VLM's rows with their images), and FSDP2
# over NCCL on two GPUs takes the same optimizer step as one GPU on the whole batch.
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import actor
import algo
import data
import invariants
import models
from rollout import EmbeddedEngine, SamplingParams
from test_actor import FSDP_CONFIG, FSDP_LENGTHS, FSDP_PROMPT, free_port, grads, make_batch, max_abs_diff, \
    on_policy, rows_from, select_rows
from test_vlm import TEMPERATURE as VLM_TEMPERATURE
from test_vlm import check_fsdp_vlm_step, mixed_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEMPERATURE = 0.7


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
