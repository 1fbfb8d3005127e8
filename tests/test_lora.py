# Tests of trainer/lora.py and of LoRA through the actor and both engines: which layers are adapted, the adapted forward
# against W x + alpha/r * B A x written by hand, a train step that moves the adapter alone, the push of the adapter
# alone (engine and trainer agree after it, and a skipped push is caught: invariant 3's trap), R3 under an MoE base,
# vLLM serving the adapter (every token of a request under the adapter it started at: invariant 2), and checkpoints
# that hold the adapter alone, resume exactly and load in PEFT; two FSDP2 ranks take the one-process step.
import json
import os
import threading

import pytest
import torch

import actor
import algo
import engines
import invariants
import models
import rollout
from engines import r3
from trainer import lora
from conftest import import_vllm
from test_actor import make_batch, on_policy, rows_from

TEMPERATURE = 0.8
SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def lora_actor(model_dir: str, **overrides) -> actor.Actor:
    cfg = actor.ActorConfig(**{"precision": "fp32", "lr": 3e-2, "micro_batch_size": 2, "lora_rank": SPEC.rank,
                               "lora_alpha": SPEC.alpha, **overrides})
    return actor.Actor(model_dir, cfg, total_steps=8)


def step(policy: actor.Actor, seed: int) -> dict:
    """One REINFORCE step on a random batch, on-policy."""
    batch = make_batch([10, 7, 9, 8], prompt_len=3, vocab=policy.model.config.vocab_size, seed=seed,
                       version=policy.version)
    return policy.train_step(batch, on_policy(batch, policy), algo.AlgoConfig(estimator="reinforce"),
                             invariants.CorrectionConfig(), policy.version).metrics


# ---- which layers, and the adapted layer by hand ----

def test_the_adapted_modules_are_the_language_models_linears_and_never_a_router_head_or_vision_tower():
    dense = lora.adapted_modules(models.tiny_model("qwen3"))
    assert len(dense) == 2 * 7 and all(name.startswith("model.layers.") for name in dense)
    assert {name.rsplit(".", 1)[1] for name in dense} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}
    moe = models.tiny_model("qwen3_moe")
    moe_names = lora.adapted_modules(moe)
    router_names = {name for name, module in moe.named_modules() if module in set(r3.moe_routers(moe))}
    assert router_names and not router_names & set(moe_names)
    assert {name.rsplit(".", 1)[1] for name in moe_names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    vision = lora.adapted_modules(models.tiny_model("qwen2_5_vl"))
    assert vision and all(".language_model." in name for name in vision)
    assert not any("lm_head" in name or "embed" in name for name in dense + moe_names + vision)


def test_an_adapted_layer_is_w_x_plus_alpha_over_r_b_a_x_and_the_fresh_adapter_changes_nothing(qwen3_dir):
    base = models.load_model(qwen3_dir)
    adapted = lora.add_lora(models.load_model(qwen3_dir), SPEC)
    ids = torch.tensor([[5, 17, 42, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, adapted(input_ids=ids).logits), "B = 0 at the start"
    assert all(p.requires_grad == (lora.ADAPTER_MARK in n) for n, p in adapted.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in adapted.named_parameters() if lora.ADAPTER_MARK in n)

    layer = adapted.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.copy_(torch.randn_like(b))
        x = torch.randn(3, a.shape[1])
        by_hand = x @ layer.base_layer.weight.T + SPEC.alpha / SPEC.rank * (x @ a.T) @ b.T
        assert torch.allclose(layer(x), by_hand, atol=1e-5, rtol=0)
        assert (layer(x) - x @ layer.base_layer.weight.T).abs().max() > 1e-2     # the path is live


# ---- the actor ----

def test_a_lora_step_moves_the_adapter_alone_and_exports_it_alone(qwen3_dir):
    policy = lora_actor(qwen3_dir)
    before = {name: t.clone() for name, t in policy.model.state_dict().items()}
    assert {id(p) for group in policy.optimizer.param_groups for p in group["params"]} == \
        {id(p) for n, p in policy.model.named_parameters() if lora.ADAPTER_MARK in n}
    metrics = step(policy, seed=0)
    assert metrics["actor/skipped"] == 0.0 and policy.version == 1
    after = policy.model.state_dict()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(".lora_B." in name for name in moved), "the first step moves B (A's gradient is 0 at B=0)"
    assert all(torch.equal(before[n], after[n]) for n in before if lora.ADAPTER_MARK not in n), "the base is frozen"
    step(policy, seed=1)
    assert any(".lora_A." in n and not torch.equal(before[n], t) for n, t in policy.model.state_dict().items())

    exported = policy.export_weights()
    assert sorted(exported) == sorted(lora.adapter_keys(policy.model)) and lora.is_adapter_state(exported)
    adapter_bytes = sum(t.numel() * t.element_size() for t in exported.values())
    model_bytes = sum(t.numel() * t.element_size() for t in policy.model.state_dict().values())
    assert adapter_bytes < model_bytes / 5


def test_the_engine_and_the_trainer_agree_after_an_adapter_push_and_a_skipped_push_is_caught(qwen3_dir):
    policy = lora_actor(qwen3_dir)
    for seed in range(3):
        step(policy, seed)
    engine = rollout.EmbeddedEngine(lora.add_lora(models.load_model(qwen3_dir), SPEC))
    prompts, params = [[5, 17, 42], [7, 8, 9, 10, 11]], engines.SamplingParams(temperature=TEMPERATURE,
                                                                                max_tokens=8, seed=3)

    def gap() -> float:
        generations = engine.generate(prompts, params)
        batch = invariants.build_batch(rows_from(generations), [1.0, -1.0], pad_id=0)
        return ((policy.recompute_logprobs(batch) - batch.behavior_logprobs) * batch.loss_mask).abs().max().item()

    stale = gap()          # the trap: the engine still serves the version-0 adapter (the base)
    engine.update_weights(policy.export_weights(), policy.version)
    synced = gap()
    assert synced < 1e-5 < 1e-2 < stale, (synced, stale)
    with pytest.raises(ValueError, match="missing keys"):       # half an adapter is refused, never half applied
        engine.update_weights(dict(list(policy.export_weights().items())[:3]), policy.version + 1)


def test_lora_over_an_moe_base_keeps_routes_replayed_and_the_routers_frozen(moe_dir):
    policy = lora_actor(moe_dir)
    step(policy, seed=0)
    engine = rollout.EmbeddedEngine(lora.add_lora(models.load_model(moe_dir), SPEC))
    engine.update_weights(policy.export_weights(), policy.version)
    generations = engine.generate([[5, 17, 42], [7, 8, 9, 10]], engines.SamplingParams(temperature=TEMPERATURE,
                                                                                        max_tokens=8, seed=1))
    assert all(g.routes is not None for g in generations)
    rows = []
    for i, gen in enumerate(generations):       # as a runner records them, routes included
        ledger = invariants.TokenLedger(f"r{i}", "g")
        ledger.extend_or_seal(gen.prompt_ids)
        ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling, routed=True)
        ledger.absorb_routes(gen.routes)
        rows += ledger.rows()
    batch = invariants.build_batch(rows, [1.0, -1.0], pad_id=0)
    replayed = policy.recompute_logprobs(batch)
    assert ((replayed - batch.behavior_logprobs) * batch.loss_mask).abs().max() < 1e-5
    num_experts = policy.model.config.num_experts
    shifted = invariants.TrainBatch(**{**vars(batch), "routes": torch.where(batch.routes >= 0,
                                                                            (batch.routes + 1) % num_experts, -1)})
    assert ((policy.recompute_logprobs(shifted) - replayed) * batch.loss_mask).abs().max() > 1e-3  # replay is live
    routers = [p for router in r3.moe_routers(policy.model) for p in router.parameters()]
    assert routers and not any(p.requires_grad for p in routers)
    batch.behavior_logprobs = replayed * batch.loss_mask
    metrics = policy.train_step(batch, replayed, algo.AlgoConfig(estimator="reinforce"),
                                invariants.CorrectionConfig(), policy.version).metrics
    assert metrics["actor/skipped"] == 0.0 and metrics["actor/r3_unreplayed_tokens"] == 0.0


# ---- checkpoints ----

def test_a_lora_checkpoint_holds_the_adapter_alone_resumes_exactly_and_loads_in_peft(qwen3_dir, tmp_path):
    straight = lora_actor(qwen3_dir, weight_decay=0.01)
    straight_metrics = [step(straight, seed) for seed in range(4)]

    first = lora_actor(qwen3_dir, weight_decay=0.01)
    for seed in range(2):
        step(first, seed)
    path = str(tmp_path / "ckpt")
    first.save_checkpoint(path)
    saved = torch.load(os.path.join(path, actor.CHECKPOINT_STATE), weights_only=True)
    assert sorted(saved["model"]) == sorted(lora.adapter_keys(first.model))
    assert saved["lora"] == {"rank": SPEC.rank, "alpha": SPEC.alpha}

    resumed = lora_actor(qwen3_dir, weight_decay=0.01)
    resumed.load_checkpoint(path)
    resumed_metrics = [step(resumed, seed) for seed in range(2, 4)]
    assert [m["actor/loss"] for m in resumed_metrics] == [m["actor/loss"] for m in straight_metrics[2:]]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"

    # the PEFT folder: PEFT itself loads it over the base and computes the actor's logits
    from peft import PeftModel
    with open(os.path.join(path, actor.LORA_ADAPTER, "adapter_config.json")) as f:
        assert json.load(f)["r"] == SPEC.rank
    peft_model = PeftModel.from_pretrained(models.load_model(qwen3_dir), os.path.join(path, actor.LORA_ADAPTER))
    ids = torch.tensor([[5, 17, 42, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, first.model(input_ids=ids).logits, atol=1e-6)

    other = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", lora_rank=8), total_steps=8)
    with pytest.raises(ValueError, match="lora_rank"):
        other.load_checkpoint(path)
    full = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=8)
    with pytest.raises(ValueError, match="LoRA"):
        full.load_checkpoint(path)


def test_bad_lora_settings_are_refused():
    with pytest.raises(ValueError, match="lora_rank"):
        actor.validate_actor(actor.ActorConfig(lora_rank=-1))
    with pytest.raises(ValueError, match="lora_alpha"):
        actor.validate_actor(actor.ActorConfig(lora_rank=8, lora_alpha=0.0))
    assert actor.lora_spec(actor.ActorConfig()) is None
    assert actor.lora_spec(actor.ActorConfig(lora_rank=8, lora_alpha=16)) == lora.LoraSpec(8, 16.0)


# ---- vLLM serves the adapter (its CPU build) ----

def test_vllm_serves_the_pushed_adapter_and_each_request_keeps_the_adapter_it_started_under():
    import_vllm()
    from engines.vllm_engine import VLLMEngine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = models.tiny_model_dir("qwen3", head_dim=32)     # vLLM's CPU attention needs head_dim >= 32
    policy = lora_actor(model_dir)
    for seed in range(3):
        step(policy, seed)
    engine = VLLMEngine(model_dir, dtype="float32", transfer="rpc", enforce_eager=True, max_model_len=512,
                        lora_spec=SPEC)
    try:
        prompts = [[5, 17, 42], [7, 8, 9, 10, 11]]
        params = engines.SamplingParams(temperature=TEMPERATURE, max_tokens=8, seed=3)

        def gap(recomputing: actor.Actor, generations) -> float:
            batch = invariants.build_batch(rows_from(generations), [1.0] * len(generations), pad_id=0)
            lp = recomputing.recompute_logprobs(batch)
            return ((lp - batch.behavior_logprobs) * batch.loss_mask).abs().max().item()

        stale = gap(policy, engine.generate(prompts, params))      # the trap: no adapter pushed yet (the base)
        engine.update_weights(policy.export_weights(), policy.version)
        synced = gap(policy, engine.generate(prompts, params))
        assert synced < 1e-4 < 1e-2 < stale, (synced, stale)
        with pytest.raises(ValueError, match="adapter"):
            engine.update_weights(models.load_model(model_dir).state_dict(), policy.version + 1)

        # a push while a long request runs: that request keeps the adapter it started under, every token at its
        # version; a request after the push is sampled by the new adapter; the trainer agrees with each
        old_version, old_adapter = policy.version, policy.export_weights()
        heard, count, kept = threading.Event(), [0], []

        def listen(index, token_id):
            count[0] += 1
            if count[0] == 5:
                heard.set()
        long_params = engines.SamplingParams(temperature=TEMPERATURE, max_tokens=48, seed=5, stop_token_ids=(689,))
        running = threading.Thread(target=lambda: kept.extend(engine.generate([[5, 6, 7]], long_params, listen)))
        running.start()
        assert heard.wait(timeout=120)
        step(policy, seed=9)
        engine.update_weights(policy.export_weights(), policy.version)
        heard_at_push = count[0]
        after = engine.generate(prompts, params)
        running.join(timeout=120)
        assert heard_at_push < len(kept[0].token_ids), "the request was still running when the push ended"
        assert set(kept[0].policy_versions) == {old_version}
        assert {v for g in after for v in g.policy_versions} == {policy.version}
        assert gap(policy, after) < 1e-4
        then = lora_actor(model_dir)
        then.model.load_state_dict(old_adapter, strict=False)
        assert gap(then, kept) < 1e-4 < gap(policy, kept)
        assert list(engine._adapters) == [policy.version], "an adapter is dropped once no request uses it"
    finally:
        engine.shutdown()


# ---- train.py with --actor.lora_rank, in one process and with engines in Ray actors ----

@pytest.mark.parametrize("mode", ["sync", "ray"])
def test_a_lora_run_trains_the_adapter_the_engine_samples_with_and_resumes(mode, tmp_path):
    from test_train import TINY_RUN, metrics_of, run_cli, scored_run
    flags = ["--actor.lora_rank", "4", "--actor.lora_alpha", "8", "--actor.lr", "3e-2", "--runtime.mode", mode,
             *(["--runtime.eta", "0"] if mode == "ray" else [])]
    records, _ = scored_run(tmp_path, *flags)      # two steps of a recipe whose rewards differ within a group
    # the second step samples from an adapter the actor moved: the push reached the engine, or the trainer's
    # recompute would differ from the engine's logprobs by the adapter's whole change
    assert [r["actor/version"] for r in records] == [2, 4]
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records), [r["mismatch/logprob_diff_max"]
                                                                          for r in records]
    final = str(tmp_path / "out" / "checkpoints" / "final")
    adapter = torch.load(os.path.join(final, actor.CHECKPOINT_STATE), weights_only=True)["model"]
    assert adapter and all(lora.ADAPTER_MARK in name for name in adapter)
    assert max(t.abs().max().item() for name, t in adapter.items() if ".lora_B." in name) > 1e-3
    if mode == "ray":
        # the push is the adapter's bytes: fp32 A [r, in] and B [out, r] of 14 linears
        assert records[-1]["runtime/weight_sync_bytes"] == sum(t.numel() * 4 for t in adapter.values())
    recipe = str(tmp_path / "scored.py")
    resumed = str(tmp_path / "resumed")
    done = run_cli(*[f if f != "math" else recipe for f in TINY_RUN], *flags, "--steps", "3", "--out", resumed,
                   "--train.resume", final)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = metrics_of(resumed)
    assert record["step"] == 3 and record["actor/version"] == 6 and record["mismatch/logprob_diff_max"] < 1e-4


# ---- FSDP2: two ranks take the one-process LoRA step ----

LORA_FSDP = dict(precision="fp32", lr=1e-2, micro_batch_size=2, max_grad_norm=1e9, lora_rank=SPEC.rank,
                 lora_alpha=SPEC.alpha)


def _lora_fsdp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from test_actor import FSDP_LENGTHS, FSDP_PROMPT, select_rows
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        policy = actor.Actor(model_dir, actor.ActorConfig(**LORA_FSDP), total_steps=2)
        for step_index in range(2):        # the second step has A's gradients too (B is off zero)
            full = make_batch(FSDP_LENGTHS, FSDP_PROMPT, policy.model.config.vocab_size, seed=step_index,
                              version=policy.version)
            batch = select_rows(full, list(range(rank, len(FSDP_LENGTHS), world_size)))
            policy.train_step(batch, on_policy(batch, policy), algo.AlgoConfig(estimator="reinforce"),
                              invariants.CorrectionConfig(), policy.version)
        grads = {name: p.grad.full_tensor() for name, p in policy.model.named_parameters() if p.grad is not None}
        export = policy.export_weights()
        policy.save_checkpoint(os.path.join(out_dir, "ckpt"))
        if rank == 0:
            torch.save({"grads": grads, "export": export}, os.path.join(out_dir, "fsdp.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU")
def test_fsdp2_two_ranks_take_the_one_process_lora_step_and_their_checkpoint_resumes_in_one(qwen3_dir, tmp_path):
    import torch.multiprocessing as mp
    from test_actor import FSDP_LENGTHS, FSDP_PROMPT, free_port, max_abs_diff
    mp.spawn(_lora_fsdp_worker, args=(2, free_port(), qwen3_dir, str(tmp_path)), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    single = actor.Actor(qwen3_dir, actor.ActorConfig(**LORA_FSDP), total_steps=2)
    for step_index in range(2):
        batch = make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size, seed=step_index,
                           version=single.version)
        single.train_step(batch, on_policy(batch, single), algo.AlgoConfig(estimator="reinforce"),
                          invariants.CorrectionConfig(), single.version)
    grads = {name: p.grad for name, p in single.model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(sharded["grads"]) and all(lora.ADAPTER_MARK in name for name in grads)
    assert max_abs_diff(sharded["grads"], grads) <= 1e-5
    assert any(".lora_A." in name and g.abs().max() > 0 for name, g in grads.items())
    assert max_abs_diff(sharded["export"], single.export_weights()) <= 1e-5
    resumed = actor.Actor(qwen3_dir, actor.ActorConfig(**LORA_FSDP), total_steps=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.version == 2 and max_abs_diff(resumed.export_weights(), sharded["export"]) == 0.0
