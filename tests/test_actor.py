# Claims of actor.py: its recompute is the engine's behavior logprob (the forward itself, by hand:
# tests/test_recompute.py), one train_step is the GLOBAL token-mean step however the batch is split (micro-batches,
# FSDP2 ranks) and whichever way its proximal logprobs come, the on-policy corrected step is the plain step, the
# export is complete and exact, checkpoints resume bitwise and half-written ones are refused, and MoE routes are
# replayed with the router still learning.
import concurrent.futures
import math
import os
import socket
import types

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import actor
import algo
import engines
import invariants
import models
import rollout
from engines import r3
from trainer import recompute

TEMPERATURE = 0.7
SAMPLING = invariants.Sampling(TEMPERATURE)     # how the hand-made batches' tokens were "sampled"


# ---- fixtures and builders ----

def make_batch(lengths: list[int], prompt_len: int, vocab: int, seed: int = 0, version: int = 0,
               advantages: list[float] | None = None) -> invariants.TrainBatch:
    """Right-padded rows of random ids; tokens from `prompt_len` on are 'sampled' at weight `version`."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        trainable = [t >= prompt_len for t in range(n)]
        rows.append(invariants.Segment(f"r{i}", f"g{i // 2}", 0, ids, trainable, [0.0] * n,
                                       [version if tr else -1 for tr in trainable],
                                       [SAMPLING if tr else invariants.UNSAMPLED for tr in trainable]))
    if advantages is None:
        advantages = [(-1.0) ** i * (0.5 + 0.25 * i) for i in range(len(lengths))]
    return invariants.build_batch(rows, advantages, pad_id=0)


def rows_from(generations) -> list[invariants.Segment]:
    """One single-turn rollout per engine generation, recorded through the ledger as a runner would."""
    rows = []
    for i, gen in enumerate(generations):
        ledger = invariants.TokenLedger(f"r{i}", "g")
        ledger.extend_or_seal(gen.prompt_ids)
        ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling)
        rows += ledger.rows()
    return rows


def on_policy(batch: invariants.TrainBatch, policy: actor.Actor) -> torch.Tensor:
    """Recompute pi_prox and make it the behavior logprob too (what an exact engine would have reported)."""
    prox = policy.recompute_logprobs(batch)
    batch.behavior_logprobs = prox * batch.loss_mask
    return prox


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest entry-wise difference of two tensor dicts (compared on the CPU, whichever device holds them)."""
    assert a.keys() == b.keys()
    return max((a[k].detach().double().cpu() - b[k].detach().double().cpu()).abs().max().item() for k in a)


# ---- the recompute against the engine (the forward itself, by hand: tests/test_recompute.py) ----

def test_recompute_matches_the_engines_behavior_logprobs(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=2), total_steps=1)
    engine = rollout.EmbeddedEngine(models.load_model(qwen3_dir))
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11]]
    generations = engine.generate(prompts, engines.SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=3))
    batch = invariants.build_batch(rows_from(generations), [1.0, -1.0], pad_id=0)
    recomputed = policy.recompute_logprobs(batch)
    diff = ((recomputed - batch.behavior_logprobs) * batch.loss_mask).abs().max().item()
    assert diff < 1e-4, f"trainer and engine disagree on behavior logprobs by {diff} nats"


# ---- train_step: the global token-mean step ----

@pytest.mark.parametrize("loss_agg", algo.LOSS_AGGREGATIONS)
def test_micro_batch_split_changes_nothing_global_token_mean(qwen3_dir, loss_agg):
    lengths, prompt_len = [14, 6, 10, 5], 3  # unequal trainable counts: per-micro-batch means would differ
    algo_cfg = algo.AlgoConfig(estimator="reinforce", loss_agg=loss_agg)
    results = []
    for micro_batch_size in (4, 1):
        policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=micro_batch_size,
                                                          max_grad_norm=1e9),
                             total_steps=1)
        batch = make_batch(lengths, prompt_len, policy.model.config.vocab_size)
        prox = on_policy(batch, policy)
        metrics = policy.train_step(batch, prox, algo_cfg, invariants.CorrectionConfig(), 0, token_budget=16).metrics
        results.append((grads(policy.model), metrics))
    (whole, m_whole), (split, m_split) = results
    scale = max(g.abs().max().item() for g in whole.values())
    assert max_abs_diff(whole, split) <= 1e-6 * max(scale, 1.0)
    assert math.isclose(m_whole["actor/loss"], m_split["actor/loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(m_whole["actor/grad_norm"], m_split["actor/grad_norm"], rel_tol=1e-5)

    # negative control: normalising each micro-batch by its OWN token count (then averaging) is another gradient
    model = models.load_model(qwen3_dir)
    batch = make_batch(lengths, prompt_len, model.config.vocab_size)
    for b in range(len(lengths)):
        rows = slice(b, b + 1)
        logprobs = recompute.sequence_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows], TEMPERATURE)
        mask = batch.loss_mask[rows]
        loss = -(batch.advantages[rows] * logprobs * mask).sum() / mask.sum() / len(lengths)
        loss.backward()
    if loss_agg == "token_mean":
        assert max_abs_diff(whole, grads(model)) > 1e-3 * scale


def test_a_token_the_is_mask_rejects_leaves_the_loss_and_its_denominator(qwen3_dir):
    """Rejection is removal: the masked step equals the plain step on the batch without that token."""
    algo_cfg = algo.AlgoConfig(estimator="reinforce")
    masked = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", max_grad_norm=1e9), total_steps=1)
    batch = make_batch([12, 8, 10], prompt_len=3, vocab=masked.model.config.vocab_size)
    prox = on_policy(batch, masked)
    batch.behavior_logprobs[1, 5] -= math.log(10.0)           # rho = 10 on one token: outside the band [0.5, 5]
    icepop = invariants.CorrectionConfig(level="token", mode="mask", low=0.5, high=5.0)
    report = masked.train_step(batch, prox, algo_cfg, icepop, 0)
    assert report.metrics["actor/kept_tokens"] == batch.loss_mask.sum().item() - 1
    assert not report.mask[1, 5] and report.loss_contribution[1, 5] == 0.0

    plain = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", max_grad_norm=1e9), total_steps=1)
    without = make_batch([12, 8, 10], prompt_len=3, vocab=plain.model.config.vocab_size)
    without.loss_mask[1, 5] = 0.0
    plain.train_step(without, on_policy(without, plain), algo_cfg, invariants.CorrectionConfig(), 0)
    assert max_abs_diff(grads(masked.model), grads(plain.model)) <= 1e-7


def test_on_policy_corrected_update_equals_plain_update(qwen3_dir):
    cfg = actor.ActorConfig(precision="fp32", lr=1e-3, weight_decay=0.01)
    correction = invariants.CorrectionConfig(max_staleness=0, level="geo", mode="mask", low=0.99, high=1.01,
                                             seq_gate="geo", gate_low=0.99, gate_high=1.01, veto=1e-4)
    algo_cfg = algo.AlgoConfig(estimator="reinforce")
    policy = actor.Actor(qwen3_dir, cfg, total_steps=1)
    batch = make_batch([12, 8, 10], prompt_len=3, vocab=policy.model.config.vocab_size, version=0)
    prox = on_policy(batch, policy)
    metrics = policy.train_step(batch, prox, algo_cfg, correction, trainer_version=policy.version).metrics
    assert metrics["gate/kept"] == 3 and metrics["actor/logprob_diff_max"] == 0.0

    # the plain REINFORCE/PPO step at ratio 1, written out: -sum(A * log pi * m) / N, clip, AdamW (on the
    # actor's device: the same kernels, so only the correction machinery could make a difference)
    device = policy.device
    plain = models.load_model(qwen3_dir).to(device)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    logprobs = recompute.sequence_logprobs(plain, batch.input_ids.to(device), batch.attention_mask.to(device),
                                           TEMPERATURE).cpu()
    loss = -(batch.advantages * logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.max_grad_norm)
    plain_grads = grads(plain)
    optimizer.step()
    assert max_abs_diff(grads(policy.model), plain_grads) <= 1e-6
    assert max_abs_diff(dict(policy.model.named_parameters()), dict(plain.named_parameters())) <= 1e-6
    assert policy.version == 1

    # negative control: the same step with a behavior policy that drifted is NOT the plain step
    drifted = actor.Actor(qwen3_dir, cfg, total_steps=1)
    batch.behavior_logprobs = (prox - 0.3 * torch.rand_like(prox)) * batch.loss_mask
    loose = invariants.CorrectionConfig(max_staleness=0, level="token", mode="trunc", high=2.0)
    drifted.train_step(batch, prox, algo_cfg, loose, trainer_version=0)
    assert max_abs_diff(grads(drifted.model), plain_grads) > 1e-4


@pytest.mark.parametrize("loss_agg", algo.LOSS_AGGREGATIONS)
def test_the_first_step_takes_its_proximal_logprobs_from_its_own_forward(qwen3_dir, loss_agg):
    """prox_logprobs=None (the proximal policy is the current weights) gives the step a recompute gives: the same
    proximal logprobs, gates, IS rejections, metrics and gradient, also split into micro-batches whose global
    denominators are known only after the last one ran."""
    algo_cfg = algo.AlgoConfig(estimator="reinforce", loss_agg=loss_agg)
    icepop = invariants.CorrectionConfig(level="token", mode="mask", low=0.5, high=5.0)
    reports = []
    for prox_given, micro_batch_size in ((True, 0), (False, 0), (False, 1)):
        policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=micro_batch_size,
                                                          max_grad_norm=1e9), total_steps=1)
        batch = make_batch([14, 6, 10, 5], prompt_len=3, vocab=policy.model.config.vocab_size)
        prox = on_policy(batch, policy)
        batch.behavior_logprobs[1, 4] -= math.log(10.0)     # the trap: rho = 10 on one token, outside [0.5, 5]
        report = policy.train_step(batch, prox if prox_given else None, algo_cfg, icepop, 0, token_budget=16)
        reports.append((report, grads(policy.model), prox))
    (given, given_grads, prox), *own_forward = reports
    assert given.metrics["actor/kept_tokens"] == batch.loss_mask.sum().item() - 1     # the trap is armed
    scale = max(g.abs().max().item() for g in given_grads.values())
    for report, own_grads, _ in own_forward:
        assert not report.mask[1, 4] and torch.equal(report.mask, given.mask)
        trainable = batch.loss_mask.bool()
        assert (report.prox_logprobs - prox)[trainable].abs().max() <= 1e-6
        assert max_abs_diff(own_grads, given_grads) <= 1e-6 * max(scale, 1.0)
        for key, value in given.metrics.items():
            assert report.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert report.metrics["actor/ratio_mean"] == 1.0 and report.metrics["actor/clip_frac"] == 0.0


def test_the_own_forward_refuses_a_trainer_version_that_is_not_the_current_one(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=2)
    batch = make_batch([8, 6], prompt_len=3, vocab=policy.model.config.vocab_size)
    on_policy(batch, policy)
    policy.train_step(batch, None, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(1), 0)
    with pytest.raises(ValueError, match="proximal policy is the current weights"):
        policy.train_step(batch, None, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(1), 0)


def test_only_the_wanted_positions_reach_the_output_projection(qwen3_dir, monkeypatch):
    """Prompt tokens never reach the head: the logprobs of the wanted tokens are those of the full pass, 0.0 at
    the rest, and the head sees exactly as many positions as there are wanted tokens."""
    model = models.load_model(qwen3_dir)
    batch = make_batch([12, 8, 10], prompt_len=5, vocab=model.config.vocab_size)
    seen = []
    chunked = recompute._chunked_head_logprobs
    monkeypatch.setattr(recompute, "_chunked_head_logprobs", lambda hidden, *a, **k: seen.append(len(hidden)) or
                        chunked(hidden, *a, **k))
    with torch.no_grad():
        full = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, TEMPERATURE)
        wanted = recompute.wanted_positions(batch.loss_mask, batch.runs)
        part = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, TEMPERATURE, positions=wanted)
    assert seen == [int(batch.attention_mask[:, 1:].sum()), int(batch.loss_mask.sum())]
    assert (part - full)[wanted].abs().max() <= 1e-6 and (part[~wanted] == 0).all()


def test_version_gate_drops_stale_rollouts_from_the_denominator(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    batch = make_batch([10, 10, 10], prompt_len=3, vocab=policy.model.config.vocab_size, version=1)
    batch.policy_versions[0] = torch.where(batch.loss_mask[0] > 0, 0, -1)  # row 0 was sampled one version earlier
    prox = on_policy(batch, policy)
    metrics = policy.train_step(batch, prox, algo.AlgoConfig(estimator="reinforce"),
                                invariants.CorrectionConfig(max_staleness=0), trainer_version=1).metrics
    assert metrics["gate/drop_stale"] == 1 and metrics["actor/kept_rollouts"] == 2
    assert metrics["actor/kept_tokens"] == batch.loss_mask[1:].sum().item()
    assert metrics["actor/staleness_max"] == 1


def test_kl_loss_term_requires_reference_logprobs(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    batch = make_batch([8, 8], prompt_len=3, vocab=policy.model.config.vocab_size)
    prox = on_policy(batch, policy)
    algo_cfg = algo.AlgoConfig(estimator="reinforce", kl_coef=0.1, kl_estimator="k2")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy.train_step(batch, prox, algo_cfg, invariants.CorrectionConfig(), 0)
    metrics = policy.train_step(batch, prox, algo_cfg, invariants.CorrectionConfig(), 0,
                                ref_logprobs=prox).metrics
    assert metrics["actor/kl_ref"] == 0.0  # the reference is the policy itself before the step


def test_left_padded_batch_is_refused(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    batch = make_batch([8, 5], prompt_len=2, vocab=policy.model.config.vocab_size)
    batch.attention_mask[1] = batch.attention_mask[1].flip(0)
    with pytest.raises(ValueError, match="RIGHT-padded"):
        policy.recompute_logprobs(batch)


def test_lr_schedule_warms_up_then_decays_to_min_ratio():
    cfg = actor.ActorConfig(precision="fp32", lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    factors = [actor.lr_factor(step, cfg, total_steps=10) for step in range(11)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert math.isclose(factors[10], 0.1)
    with pytest.raises(ValueError, match="lr_schedule"):
        actor.validate_actor(actor.ActorConfig(precision="fp32", lr_schedule="linear"))


# ---- export_weights ----

def test_export_weights_is_every_entry_but_the_tied_lm_head(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", lr=1e-3), total_steps=1)
    batch = make_batch([9, 7], prompt_len=2, vocab=policy.model.config.vocab_size)
    policy.train_step(batch, on_policy(batch, policy), algo.AlgoConfig(estimator="reinforce"),
                      invariants.CorrectionConfig(), 0)
    norm = policy.model.model.norm
    norm.weight.data = norm.weight.data.to(torch.bfloat16)  # a mixed-dtype model: the export keeps each dtype

    weights = policy.export_weights()
    state = policy.model.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}
    assert all(weights[k].dtype == state[k].dtype and weights[k].device.type == "cpu" for k in weights)
    assert weights["model.norm.weight"].dtype == torch.bfloat16
    norm.weight.data = norm.weight.data.float()

    # the real consumer takes it (only a tied lm_head may be absent) and then computes the same logits
    engine_model = models.load_model(qwen3_dir)
    ids = batch.input_ids[:1]
    exact = 0.0 if policy.device.type == "cpu" else 1e-4       # an actor on a GPU runs other kernels

    def logit_gap() -> float:
        trained = policy.model(input_ids=ids.to(policy.device)).logits.cpu()
        return (engine_model(input_ids=ids).logits - trained).abs().max().item()
    with torch.no_grad():
        assert logit_gap() > 1e-3
        rollout.EmbeddedEngine(engine_model).update_weights(policy.export_weights(), version=1)
        assert logit_gap() <= exact


def test_export_weights_keeps_an_untied_lm_head(moe_dir):
    policy = actor.Actor(moe_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    assert models.tied_output_key(policy.model) is None
    assert set(policy.export_weights()) == set(policy.model.state_dict())


# ---- checkpoints ----

def run_steps(policy: actor.Actor, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        batch = make_batch([10, 7, 9], prompt_len=3, vocab=policy.model.config.vocab_size, seed=policy.version,
                           version=policy.version)
        out.append(policy.train_step(batch, on_policy(batch, policy), algo.AlgoConfig(estimator="reinforce"),
                                     invariants.CorrectionConfig(), policy.version).metrics)
    return out


def test_checkpoint_resume_is_bitwise_exact(qwen3_dir, tmp_path):
    cfg = actor.ActorConfig(precision="fp32", lr=1e-3, weight_decay=0.01, lr_schedule="cosine", warmup_steps=1,
                            micro_batch_size=2)
    straight = actor.Actor(qwen3_dir, cfg, total_steps=4)
    straight_metrics = run_steps(straight, 4)

    first = actor.Actor(qwen3_dir, cfg, total_steps=4)
    run_steps(first, 2)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(str(tmp_path / "ckpt.tmp")), "the temporary folder is renamed into place"
    resumed = actor.Actor(qwen3_dir, cfg, total_steps=4, seed=123)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.version == 2
    resumed_metrics = run_steps(resumed, 2)

    assert resumed.version == straight.version == 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    assert [m["actor/lr"] for m in straight_metrics[2:]] == [m["actor/lr"] for m in resumed_metrics]
    assert [m["actor/loss"] for m in straight_metrics[2:]] == [m["actor/loss"] for m in resumed_metrics]


def test_checkpoint_without_marker_is_refused(qwen3_dir, tmp_path):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    path = str(tmp_path / "ckpt")
    policy.save_checkpoint(path)
    policy.load_checkpoint(path)  # complete: loads
    os.remove(os.path.join(path, actor.CHECKPOINT_MARKER))  # as if the save had died before its last write
    with pytest.raises(FileNotFoundError, match=actor.CHECKPOINT_MARKER):
        policy.load_checkpoint(path)


# ---- FSDP2: two ranks on CPU/gloo == one process on the whole batch ----

FSDP_LENGTHS, FSDP_PROMPT = [12, 6, 9, 11, 5], 3  # 5 rows: rank 0 gets 3, rank 1 gets 2 -> uneven micro-batches
# no clipping in effect: clipping would rescale a mean-reduced (half-size) gradient back to the same norm
FSDP_CONFIG = actor.ActorConfig(precision="fp32", lr=1e-3, micro_batch_size=2, max_grad_norm=1e9)


def _fsdp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str, prox_given: bool,
                 loss_agg: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        policy = actor.Actor(model_dir, FSDP_CONFIG, total_steps=1)
        full = make_batch(FSDP_LENGTHS, FSDP_PROMPT, policy.model.config.vocab_size)
        # this rank's rows: every other rollout, or (a loss over prompt groups) every other group, as runtime deals
        whole = loss_agg in algo.GROUP_AGGREGATIONS
        rows = [b for b in range(len(FSDP_LENGTHS)) if (b // 2 if whole else b) % world_size == rank]
        batch = select_rows(full, rows)
        prox = on_policy(batch, policy)
        metrics = policy.train_step(batch, prox if prox_given else None,
                                    algo.AlgoConfig(estimator="reinforce", loss_agg=loss_agg),
                                    invariants.CorrectionConfig(), 0).metrics
        full_grads = {name: p.grad.full_tensor() for name, p in policy.model.named_parameters()}
        export = policy.export_weights()
        policy.save_checkpoint(os.path.join(out_dir, "fsdp_ckpt"))
        if rank == 0:
            torch.save({"grads": full_grads, "export": export, "metrics": metrics}, os.path.join(out_dir, "fsdp.pt"))
    finally:
        dist.destroy_process_group()


def select_rows(batch: invariants.TrainBatch, rows: list[int]) -> invariants.TrainBatch:
    """The given rows of a batch, right padding trimmed to their longest row."""
    width = int(batch.attention_mask[rows].sum(-1).max())
    fields = {name: value[rows, :width] if isinstance(value, torch.Tensor) else [value[i] for i in rows]
              for name, value in vars(batch).items() if value is not None}
    return invariants.TrainBatch(**{**fields, "routes": None})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU; tests/test_gpu.py runs this over NCCL")
@pytest.mark.parametrize("prox_given, loss_agg", [(True, "token_mean"), (False, "token_mean"),
                                                 (False, "prompt_mean_token_mean")],
                         ids=["recomputed", "own_forward", "own_forward_prompt_mean"])
def test_fsdp2_two_ranks_equal_one_process_on_the_whole_batch(qwen3_dir, tmp_path, prox_given, loss_agg):
    mp.spawn(_fsdp_worker, args=(2, free_port(), qwen3_dir, str(tmp_path), prox_given, loss_agg), nprocs=2,
             join=True)
    sharded = torch.load(tmp_path / "fsdp.pt", weights_only=True)

    single = actor.Actor(qwen3_dir, FSDP_CONFIG, total_steps=1)
    batch = make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size)
    metrics = single.train_step(batch, on_policy(batch, single), algo.AlgoConfig(estimator="reinforce",
                                                                                  loss_agg=loss_agg),
                                invariants.CorrectionConfig(), 0).metrics

    assert max_abs_diff(sharded["grads"], grads(single.model)) <= 1e-5, "rank gradients must SUM to the global"
    export = single.export_weights()
    assert sharded["export"].keys() == export.keys(), "the FSDP2 export has every entry, tied lm_head skipped"
    assert all(sharded["export"][k].shape == export[k].shape for k in export), "full, unsharded tensors"
    # AdamW's first step moves a weight by lr * g / (|g| + eps): at a gradient entry near eps (the group mean's batch
    # has one at -1.9e-8, -2.4e-8 summed over the ranks) fp32 round-off in g moves the weight by a share of lr
    assert max_abs_diff(sharded["export"], export) <= (1e-5 if loss_agg == "token_mean" else FSDP_CONFIG.lr / 10)
    for key in ("actor/loss", "actor/grad_norm", "actor/kept_tokens", "actor/kept_rollouts"):
        assert math.isclose(sharded["metrics"][key], metrics[key], rel_tol=1e-5), key

    # the sharded checkpoint is a full one: a single process resumes from it
    resumed = actor.Actor(qwen3_dir, FSDP_CONFIG, total_steps=1)
    resumed.load_checkpoint(str(tmp_path / "fsdp_ckpt"))
    assert resumed.version == 1
    assert max_abs_diff(resumed.export_weights(), sharded["export"]) == 0.0


# ---- MoE: routes replayed, router still learning ----

def test_moe_train_step_replays_routes_and_router_gets_gradients(moe_dir):
    policy = actor.Actor(moe_dir, actor.ActorConfig(precision="fp32", micro_batch_size=2), total_steps=1)
    batch = make_batch([10, 7, 9], prompt_len=3, vocab=policy.model.config.vocab_size)
    with torch.no_grad(), r3.capture_routes(policy.model) as captured:  # the engine's expert choice
        policy.model(input_ids=batch.input_ids.to(policy.device), attention_mask=batch.attention_mask.to(policy.device))
    routes = captured[-1].cpu().reshape(*batch.input_ids.shape, *captured[-1].shape[1:])
    batch.routes = torch.where(batch.attention_mask[..., None, None] > 0, routes, -1)

    # replay is wired in: the captured routes reproduce the live forward, other routes change the logprobs
    live = policy.recompute_logprobs(invariants.TrainBatch(**{**vars(batch), "routes": None}))
    replayed = policy.recompute_logprobs(batch)
    assert (replayed - live).abs().max() <= 1e-5
    num_experts = policy.model.config.num_experts
    shifted = invariants.TrainBatch(**{**vars(batch), "routes": torch.where(batch.routes >= 0,
                                                                            (batch.routes + 1) % num_experts, -1)})
    assert (policy.recompute_logprobs(shifted) - live).abs().max() > 1e-3

    batch.behavior_logprobs = replayed * batch.loss_mask
    metrics = policy.train_step(batch, replayed, algo.AlgoConfig(estimator="reinforce"),
                                invariants.CorrectionConfig(level="token"), 0).metrics
    assert metrics["actor/skipped"] == 0.0 and policy.version == 1
    assert metrics["actor/r3_unreplayed_tokens"] == 0.0       # every trained token's position has its routes
    # a batch whose engine reported no routes at all (vLLM, for a request kept across a weight update): every
    # trained token is counted as trained on live routes
    unrouted = invariants.TrainBatch(**{**vars(batch), "routes": None})
    report = policy.train_step(unrouted, None, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(
        level="token", max_staleness=1), policy.version)
    assert report.metrics["actor/r3_unreplayed_tokens"] == float(batch.loss_mask.sum()) > 0
    # a row whose routes were lost at one position of one layer: its next token trains on the live router's choice
    holed = batch.routes.clone()
    holed[1, 4, 0] = -1
    hole = invariants.TrainBatch(**{**vars(batch), "routes": holed})
    assert batch.loss_mask[1, 5] == 1
    report = policy.train_step(hole, policy.recompute_logprobs(hole), algo.AlgoConfig(estimator="reinforce"),
                               invariants.CorrectionConfig(level="token", max_staleness=2), policy.version)
    assert report.metrics["actor/skipped"] == 0.0 and report.metrics["actor/r3_unreplayed_tokens"] == 1.0
    routers = r3.moe_routers(policy.model)
    assert len(routers) == policy.model.config.num_hidden_layers
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# ---- GPU-speed knobs, proven on the CPU: chunked output projection, bf16, activation checkpointing, tokens ----

def test_the_chunked_output_projection_changes_no_logprob_and_no_gradient(qwen3_dir, monkeypatch):
    """The [positions, vocab] logits are made LOGPROB_CHUNK positions at a time (and recomputed in backward past
    KEPT_LOGITS); chunks of 3 positions, each recomputed, must give what one chunk of everything, kept, gives."""
    results = []
    for chunk, kept in ((10**6, 10**12), (3, 0)):
        monkeypatch.setattr(recompute, "LOGPROB_CHUNK", chunk)
        monkeypatch.setattr(recompute, "KEPT_LOGITS", kept)
        policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", max_grad_norm=1e9), total_steps=1)
        batch = make_batch([12, 6, 9], prompt_len=3, vocab=policy.model.config.vocab_size)
        prox = on_policy(batch, policy)
        report = policy.train_step(batch, prox, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(),
                                   0)
        results.append((prox, grads(policy.model), report.metrics["actor/entropy"]))
    (old_one, grads_one, entropy_one), (old_chunked, grads_chunked, entropy_chunked) = results
    assert (old_one - old_chunked).abs().max() <= 1e-6
    scale = max(g.abs().max().item() for g in grads_one.values())
    assert max_abs_diff(grads_one, grads_chunked) <= 1e-5 * scale         # fp32 summation order only
    assert entropy_one == pytest.approx(entropy_chunked, rel=1e-6)


def test_activation_checkpointing_and_a_token_cap_change_no_gradient(moe_dir):
    """Recomputing each decoder layer in backward, with MoE routes replayed through the recompute, and
    micro-batches capped by padded tokens give the plain step's gradients; the export keeps its keys."""
    results = []
    for cfg in (actor.ActorConfig(precision="fp32", max_grad_norm=1e9),
                actor.ActorConfig(precision="fp32", max_grad_norm=1e9, activation_checkpointing=True,
                                  micro_batch_tokens=12)):
        policy = actor.Actor(moe_dir, cfg, total_steps=1)
        engine = rollout.EmbeddedEngine(models.load_model(moe_dir))
        gens = engine.generate([[5, 6, 7], [8, 9]], engines.SamplingParams(temperature=TEMPERATURE, max_tokens=5,
                                                                              seed=0))
        batch = invariants.build_batch(rows_from(gens), [1.0, -0.5], pad_id=0)      # rows of 8 and 7 tokens
        assert [rows.tolist() for rows in policy._micro_batches(batch)] == \
            ([[0, 1]] if not cfg.micro_batch_tokens else [[0], [1]])                  # 2 x 8 > 12
        policy.train_step(batch, policy.recompute_logprobs(batch), algo.AlgoConfig(estimator="reinforce"),
                          invariants.CorrectionConfig(), 0)
        unwrapped = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads(policy.model).items()}
        results.append((unwrapped, set(policy.export_weights())))
    (plain, keys), (checkpointed, checkpointed_keys) = results
    assert checkpointed_keys == keys                           # the wrapper does not rename what the engine loads
    assert max_abs_diff(plain, checkpointed) <= 1e-5 * max(g.abs().max().item() for g in plain.values())


def test_bf16_compute_keeps_fp32_masters_and_stays_close_to_fp32(qwen3_dir):
    exact = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    fast = actor.Actor(qwen3_dir, actor.ActorConfig(precision="bf16"), total_steps=1)
    auto = actor.Actor(qwen3_dir, actor.ActorConfig(), total_steps=1)
    assert auto.precision == ("bf16" if torch.cuda.is_available() else "fp32")   # a CPU gets the exact mode
    batch = make_batch([12, 6, 9], prompt_len=3, vocab=fast.model.config.vocab_size)
    reference, prox = exact.recompute_logprobs(batch), fast.recompute_logprobs(batch)
    trainable = batch.loss_mask.bool()
    gap = (prox - reference)[trainable].abs()
    assert 0 < gap.max() < 0.1                 # bf16 products: close to fp32, and visibly not the exact mode
    batch.behavior_logprobs = reference * batch.loss_mask
    report = fast.train_step(batch, prox, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(), 0)
    assert report.metrics["actor/bf16"] == 1.0 and report.metrics["actor/skipped"] == 0.0
    assert all(p.dtype == torch.float32 for p in fast.model.parameters())
    assert all(v.dtype == torch.float32 for state in fast.optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.is_floating_point())
    assert all(w.dtype == torch.float32 for w in fast.export_weights().values())


def grpo_batch(prompts: int, samples: int, vocab: int, seed: int = 0, version: int = 0) -> invariants.TrainBatch:
    """A GRPO step's batch: `samples` rows per prompt, each its prompt's ids and a reply of its own length, sampled
    at weight `version`."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in range(prompts):
        prompt = torch.randint(0, vocab, (6 + 5 * p,), generator=g).tolist()
        for s in range(samples):
            reply = int(torch.randint(16, 40, (1,), generator=g))
            ids = prompt + torch.randint(0, vocab, (reply,), generator=g).tolist()
            trainable = [t >= len(prompt) for t in range(len(ids))]
            rows.append(invariants.Segment(f"p{p}s{s}", f"g{p}", 0, ids, trainable, [0.0] * len(ids),
                                           [version if tr else -1 for tr in trainable],
                                           [SAMPLING if tr else invariants.UNSAMPLED for tr in trainable]))
    return invariants.build_batch(rows, [(-1.0) ** i * 0.5 for i in range(len(rows))], pad_id=0)


def test_the_compiled_actor_compiles_before_its_first_step_and_takes_the_eager_step(qwen3_dir, monkeypatch):
    """--actor.compile (a GPU's default): warm_up, in a thread of its own while the engine starts (as train.py runs
    it), compiles what the first steps would, so steps of new shapes compile nothing: also an RL step as
    train.train_on_rows takes it (groups of rows sharing a prompt, replies of unlike lengths, T 0.7, two minibatches:
    the later one's recompute, a step on the first one's own forward, a step on the recomputed logprobs) with
    micro-batches whose head spans several chunks past KEPT_LOGITS, as a real step's thousands of tokens do, and a
    micro-batch past the positions inductor compiles apart (actor.BIG_MICRO_BATCH; its trap armed too). It
    leaves the weights, the gradients, the optimizer and the global RNG as they were; the compiled step, its output
    projection fused (_untruncated_head), is the eager step."""
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    cfg = dict(precision="fp32", max_grad_norm=1e9)
    algo_cfg, correction = algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig()
    step = lambda policy, batch: policy.train_step(batch, None, algo_cfg, correction, policy.version)  # noqa: E731
    vocab = models.load_model(qwen3_dir).config.vocab_size
    # a real step's head at this tiny shape: a micro-batch (8 rows here) holds more wanted positions than a chunk
    monkeypatch.setattr(recompute, "LOGPROB_CHUNK", 160)
    monkeypatch.setattr(recompute, "KEPT_LOGITS", 160 * vocab)
    first, second = make_batch([12, 6, 9], 3, vocab), make_batch([7, 15, 4, 11], 3, vocab, seed=1)

    torch._dynamo.reset()
    cold = actor.Actor(qwen3_dir, actor.ActorConfig(compile="true", **cfg), total_steps=2)
    before = graphs()
    step(cold, first)
    assert graphs() > before                     # the trap is armed: without the warm-up, the first step compiles

    torch._dynamo.reset()
    warm = actor.Actor(qwen3_dir, actor.ActorConfig(compile="true", **cfg), total_steps=4)
    weights, rng = {k: v.clone() for k, v in warm.model.state_dict().items()}, torch.get_rng_state()
    concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="warm-up").submit(warm.warm_up).result()
    assert all(torch.equal(weights[k], v) for k, v in warm.model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and all(p.grad is None for p in warm.model.parameters())
    assert not warm.optimizer.state and warm.version == 0
    compiled = graphs()
    compiled_logprobs = warm.recompute_logprobs(first)
    step(warm, first)
    warm_grads = grads(warm.model)
    step(warm, second)
    rl = grpo_batch(prompts=4, samples=4, vocab=vocab, seed=2, version=warm.version)
    early, later = list(range(8)), list(range(8, 16))      # train.minibatch_indices: whole groups, two minibatches
    assert all(rl.loss_mask[rows].sum() > recompute.LOGPROB_CHUNK for rows in (early, later))
    version, prox = warm.version, warm.recompute_logprobs(invariants.select_rows(rl, later))
    warm.train_step(invariants.select_rows(rl, early), None, algo_cfg, correction, version)
    report = warm.train_step(invariants.select_rows(rl, later), prox, algo_cfg, correction, version)
    assert report.metrics["actor/skipped"] == 0.0
    # 4170 positions, past 4096, and 4161 wanted ones: a last head chunk of one position, which dynamo specializes
    big = make_batch([1400, 1390, 1380], 3, vocab, seed=3, version=warm.version)
    step(warm, big)
    assert graphs() == compiled                  # steps of other rows and lengths than the warm-up's: no compile

    # the big warm-up batch's trap: without it, a micro-batch past inductor's 4096 positions compiles again
    torch._dynamo.reset()
    monkeypatch.setattr(actor, "BIG_MICRO_BATCH", (0, 0))
    small = actor.Actor(qwen3_dir, actor.ActorConfig(compile="true", **cfg), total_steps=2)
    small.warm_up()
    compiled = graphs()
    step(small, make_batch([1400, 1390, 1380], 3, vocab, seed=3))
    assert graphs() > compiled

    eager = actor.Actor(qwen3_dir, actor.ActorConfig(compile="false", **cfg), total_steps=2)
    assert (eager.recompute_logprobs(first) - compiled_logprobs).abs().max() <= 1e-5
    step(eager, first)
    eager_grads = grads(eager.model)
    assert max_abs_diff(eager_grads, warm_grads) <= 1e-4 * max(g.abs().max().item() for g in eager_grads.values())


# ---- the processing of bias, penalties and min_p: the same in the loss forward, differentiated correctly ----

PROCESSED = invariants.Sampling(TEMPERATURE, min_p=0.02, logit_bias=((3, 2.0), (11, -math.inf), (40, -1.5)),
                                repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.3, generation_start=4)


def processed_row(vocab: int, n: int = 16, seed: int = 0) -> invariants.Segment:
    """A 4-token prompt and n - 4 'sampled' tokens at PROCESSED, with repeats (so every penalty has work)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 24, (n,), generator=g).tolist()            # ids below 24 repeat within 16 tokens
    ids = [t if t != 11 else 12 for t in ids]                          # the banned id is never sampled
    trainable = [t >= 4 for t in range(n)]
    return invariants.Segment("r0", "g0", 0, ids, trainable, [0.0] * n, [0 if tr else -1 for tr in trainable],
                              [PROCESSED if tr else invariants.UNSAMPLED for tr in trainable])


def test_the_loss_forward_applies_the_recomputes_processing_on_policy_ratio_one(qwen3_dir):
    """On-policy (behavior = recompute) a step over bias, penalties and min_p sees ratio 1 and KL 0 exactly: the
    loss forward processed the logits as the recompute did. Trap: the same step without the batch's runs."""
    ratios = []
    for keep_runs in (True, False):
        policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
        batch = invariants.build_batch([processed_row(policy.model.config.vocab_size)], [1.0], pad_id=0)
        assert len(batch.runs[0]) == 1 and (batch.min_p[0, 4:] == 0.02).all()
        prox = on_policy(batch, policy)
        if not keep_runs:
            batch.runs = [[]]
        metrics = policy.train_step(batch, prox, algo.AlgoConfig(estimator="reinforce"),
                                    invariants.CorrectionConfig(), 0).metrics
        ratios.append((metrics["actor/ratio_mean"], metrics["actor/approx_kl"]))
    (ratio, kl), (stripped_ratio, stripped_kl) = ratios
    assert abs(ratio - 1) < 1e-6 and abs(kl) < 1e-9
    assert abs(stripped_ratio - 1) > 0.05 and stripped_kl > 1e-3


def test_the_gradient_through_penalised_biased_logits_equals_a_hand_written_reference(qwen3_dir, monkeypatch):
    """d(sum_t w_t log p_t)/d(weights) from the loss forward (chunks of 5 positions, so the run is split across
    chunks and recomputed in backward) equals autograd through a reference written out element by element from
    the formulas: bias, then the repetition factor by the biased logit's sign, then frequency and presence counts
    of the generation so far, then the temperature and min_p (which never drops the sampled token)."""
    monkeypatch.setattr(recompute, "LOGPROB_CHUNK", 5)
    model = models.load_model(qwen3_dir)
    vocab = model.config.vocab_size
    row = processed_row(vocab)
    batch = invariants.build_batch([row], [1.0], pad_id=0)
    weights = torch.linspace(-1.0, 2.0, len(row.token_ids)) * batch.loss_mask[0]    # the sampled tokens' only
    got = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperature,
                                      min_p=batch.min_p, runs=batch.runs)
    (got[0] * weights).sum().backward()
    ours = grads(model)
    model.zero_grad()
    (recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperature)[0] * weights).sum() \
        .backward()
    unprocessed = grads(model)                          # the trap: the gradient of the plain distribution
    model.zero_grad()

    s, ids, start = PROCESSED, row.token_ids, PROCESSED.generation_start
    logits = model(input_ids=batch.input_ids).logits[0]
    bias = dict(s.logit_bias)
    total, by_hand = 0.0, []
    for t in range(start, len(ids)):
        seen, output = set(ids[:t]), ids[start:t]
        z = []
        for v in range(vocab):
            x = logits[t - 1, v] + bias.get(v, 0.0)
            if v in seen:
                x = x / s.repetition_penalty if x.item() > 0 else x * s.repetition_penalty
            z.append(x - s.frequency_penalty * output.count(v) - s.presence_penalty * (v in output))
        scaled = torch.stack(z) / s.temperature
        p = torch.softmax(scaled, -1).detach()
        kept = p >= s.min_p * p.max()
        kept[ids[t]] = True
        logprob = torch.log_softmax(scaled.masked_fill(~kept, -math.inf), -1)[ids[t]]
        total = total + weights[t] * logprob
        by_hand.append(logprob.item())
    total.backward()
    reference = grads(model)
    assert max(abs(a - b) for a, b in zip(got[0, start:].tolist(), by_hand)) < 1e-5
    assert max_abs_diff(ours, reference) <= 1e-5 * max(g.abs().max().item() for g in reference.values())
    assert max_abs_diff(unprocessed, reference) > 1e-2 * max(g.abs().max().item() for g in reference.values())


# ---- shared prefixes: a group's prompt computed once, the same step as the unshared forward ----

def shared_prompt_rows(vocab: int, seed: int = 0) -> tuple[list[invariants.Segment], dict[str, int]]:
    """Rows as a GRPO batch holds them, plus the cases that must not share: group A (3 rows of one prompt, replies
    of 5, 9, 3 tokens, each at its own top_p/top_k/min_p), a row of A's prompt with 3 more context tokens before
    its reply (it diverges later), a row whose prompt differs from A's by ONE id in the middle, group B (2 rows), a
    row whose prompt differs from B's in its last id only, and group C (2 rows of bias, penalties and min_p: adjusted
    runs over a shared 4-token prompt). Returns the rows and the index of each named case."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def row(name: str, group: str, context: list[int], reply: list[int], sampling) -> invariants.Segment:
        n = len(context) + len(reply)
        trainable = [t >= len(context) for t in range(n)]
        return invariants.Segment(name, group, 0, context + reply, trainable, [0.0] * n,
                                  [0 if tr else -1 for tr in trainable],
                                  [sampling if tr else invariants.UNSAMPLED for tr in trainable])

    prompt_a, prompt_b = ids(12), ids(8)
    one_off = list(prompt_a)
    one_off[5] = (one_off[5] + 1) % vocab
    last_off = prompt_b[:-1] + [(prompt_b[-1] + 1) % vocab]
    rows = [row("a0", "A", prompt_a, ids(5), invariants.Sampling(TEMPERATURE, top_p=0.9)),
            row("a1", "A", prompt_a, ids(9), invariants.Sampling(1.0, top_k=20)),
            row("a2", "A", prompt_a, ids(3), invariants.Sampling(0.8, min_p=0.05)),
            row("later", "A", prompt_a + ids(3), ids(4), SAMPLING),
            row("one_off", "A", one_off, ids(5), SAMPLING),
            row("b0", "B", prompt_b, ids(6), SAMPLING), row("b1", "B", prompt_b, ids(4), SAMPLING),
            row("last_off", "B", last_off, ids(5), SAMPLING)]
    for k in range(2):
        processed = processed_row(vocab, seed=seed + k)
        processed.token_ids[:4] = rows[0].token_ids[:4] if k else processed.token_ids[:4]
        rows.append(invariants.Segment(f"c{k}", "C", 0, processed.token_ids, processed.trainable,
                                       processed.behavior_logprobs, processed.policy_versions, processed.sampling))
    rows[-1].token_ids[:4] = rows[-2].token_ids[:4]
    return rows, {r.rollout_id: i for i, r in enumerate(rows)}


def tiny_llama() -> torch.nn.Module:
    """A random 2-layer Llama at the tiny models' shape: an architecture beside the Qwen ones."""
    from transformers import LlamaConfig, LlamaForCausalLM
    qwen = models.tiny_model("qwen3").config
    config = LlamaConfig(vocab_size=qwen.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         eos_token_id=qwen.eos_token_id, pad_token_id=qwen.pad_token_id, bos_token_id=None)
    config._attn_implementation = models.ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    tiny_llama().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("prox_given", [True, False], ids=["recomputed", "own_forward"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_train_step_over_shared_prompts_equals_the_unshared_step(qwen3_dir, llama_dir, monkeypatch, kind,
                                                                   prox_given):
    model_dir = qwen3_dir if kind == "qwen3" else llama_dir
    results = []
    for share in (False, True):
        with monkeypatch.context() as patch:
            if not share:
                patch.setattr(recompute, "shared_prefixes", lambda *args: None)
            policy = actor.Actor(model_dir, actor.ActorConfig(precision="fp32", lr=1e-3, micro_batch_size=4),
                                 total_steps=1)
            rows, _ = shared_prompt_rows(policy.model.config.vocab_size)
            advantages = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(len(rows))]
            batch = invariants.build_batch(rows, advantages, pad_id=0)
            prox = policy.recompute_logprobs(batch)
            noise = 0.05 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(2))
            batch.behavior_logprobs = (prox + noise) * batch.loss_mask       # off-policy: IS weights are not 1
            report = policy.train_step(batch, prox if prox_given else None, algo.AlgoConfig(),
                                       invariants.CorrectionConfig(), 0)
            results.append((prox, report, grads(policy.model), policy.export_weights()))
    (old_plain, plain, plain_grads, plain_weights), (old_shared, shared, shared_grads, shared_weights) = results
    assert plain.metrics["actor/prefix_tokens_saved"] == 0 and shared.metrics["actor/prefix_tokens_saved"] > 0
    assert (old_plain - old_shared).abs().max() <= 1e-5
    assert (plain.prox_logprobs - shared.prox_logprobs).abs().max() <= 1e-5
    for key in ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean"):
        assert math.isclose(plain.metrics[key], shared.metrics[key], rel_tol=1e-5, abs_tol=1e-7), key
    scale = max(g.abs().max().item() for g in plain_grads.values())
    assert max_abs_diff(plain_grads, shared_grads) <= 1e-5 * scale
    assert max_abs_diff(plain_weights, shared_weights) <= 1e-5


def test_micro_batches_keep_a_prompts_rollouts_together(qwen3_dir):
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=4), total_steps=1)
    rows, at = shared_prompt_rows(policy.model.config.vocab_size)
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=0)
    micro = [set(m.tolist()) for m in policy._micro_batches(batch)]
    for group in (["a0", "a1", "a2"], ["b0", "b1", "last_off"], ["c0", "c1"]):
        assert sum({at[n] for n in group} <= m for m in micro) == 1, group
    lengths = batch.attention_mask.sum(-1)
    longest = [max(lengths[b] for b in m) for m in micro]
    assert longest == sorted(longest, reverse=True), "longest first across the prompts"


# the tiny Qwen3's activations a token at the actor's estimate (16 hidden-sized and 8 intermediate-sized values a
# layer): 2 layers x (16 x 64 + 8 x 128) values x 4 bytes in fp32, worked by hand from its config
TINY_QWEN3_SHAPE, TINY_QWEN3_TOKEN_BYTES = (2, 64, 128), 16_384


@pytest.mark.parametrize("available, tokens", [
    (2**30, 39_321),        # 0.6 x 1 GiB / 16 KiB a token = 39,321.6, inside the range: rounded down
    (10 * 2**20, 2_048),    # 0.6 x 10 MiB / 16 KiB = 384: raised to the range's floor
    (8 * 2**30, 65_536),    # 0.6 x 8 GiB / 16 KiB = 314,572.8: cut to the range's ceiling
])
def test_auto_micro_batch_tokens_are_a_share_of_the_ram_available_worked_by_hand(qwen3_dir, monkeypatch, available,
                                                                                 tokens):
    """Auto on a CPU: MEMORY_SHARE (0.6) of the RAM available over the activations of a token (16 KiB for the tiny
    Qwen3 in fp32), kept in [2048, 65536], and no row cap. The RAM reading is the one input a test cannot pick, so it
    is set here (psutil's); each expected cap is worked by hand from it."""
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    text = policy.model.config.get_text_config()
    assert (text.num_hidden_layers, text.hidden_size, text.intermediate_size) == TINY_QWEN3_SHAPE
    monkeypatch.setattr(actor.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    assert policy._micro_batch_limits() == (0, tokens)


def test_auto_micro_batches_on_a_cpu_follow_the_ram_available_not_a_row_count(qwen3_dir):
    """Auto on a CPU, at the machine's own RAM: no row cap, a padded-token cap inside the range (a 16-row minibatch is
    one micro-batch, not two of 8); an explicit cap still splits."""
    policy = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    rows, tokens = policy._micro_batch_limits()
    low, high = actor.MICRO_BATCH_TOKENS_RANGE
    assert rows == 0 and low <= tokens <= high
    batch = make_batch([12] * 16, 4, policy.model.config.vocab_size)
    assert [m.tolist() for m in policy._micro_batches(batch)] == [list(range(16))]
    capped = actor.Actor(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_tokens=8 * 12), total_steps=1)
    assert [len(m) for m in capped._micro_batches(batch)] == [8, 8]


# ---- long rows: a coding harness's context trains within memory ----

LONG_ROWS, LONG_PROMPT = [49_152, 20_000, 18_000], 16_000   # one row alone, then two of unlike length padded together


def _long_rows_worker(_rank: int, model_dir: str, out_file: str) -> None:
    """One train step over LONG_ROWS in a process of its own: the growth of its peak RSS over the RSS before it (the
    kernel's high-water mark, reset just before the step, so nothing the process did earlier counts), and row 2's
    logprobs in the padded micro-batch beside the same row alone."""
    torch.set_num_threads(1)
    policy = actor.Actor(model_dir, actor.ActorConfig(precision="fp32", micro_batch_tokens=65536, max_grad_norm=1e9),
                         total_steps=1)
    batch = make_batch(LONG_ROWS, LONG_PROMPT, policy.model.config.vocab_size)
    micro = [m.tolist() for m in policy._micro_batches(batch)]
    before = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:     # "5": the peak RSS (VmHWM) starts again from the RSS now
        f.write("5")
    report = policy.train_step(batch, None, algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(), 0)
    with open("/proc/self/status") as f:
        peak = 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))   # kB
    alone = select_rows(batch, [2])
    with torch.no_grad():
        expected = recompute.sequence_logprobs(models.load_model(model_dir), alone.input_ids, alone.attention_mask,
                                               TEMPERATURE, positions=alone.loss_mask > 0)
    width = alone.input_ids.shape[1]
    torch.save({"micro": micro, "growth": peak - before, "metrics": report.metrics,
                "diff": float((report.prox_logprobs[2, :width] - expected[0]).abs().max())}, out_file)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's memory; tests/test_gpu.py trains on the GPU")
def test_a_harness_long_row_trains_within_memory_on_the_cpu(qwen3_dir, tmp_path):
    """49,152 tokens (a coding harness's context) train in one micro-batch, and two long rows of unlike length in
    another, in memory linear in the tokens: the output projection runs in chunks (LOGPROB_CHUNK) and attention gets
    no [B, 1, T, T] mask (right padding under causal attention needs none; the pair's would be 3.2 GB in fp32)."""
    mp.spawn(_long_rows_worker, args=(qwen3_dir, str(tmp_path / "long.pt")), nprocs=1, join=True)
    result = torch.load(tmp_path / "long.pt", weights_only=False)
    assert result["micro"] == [[0], [1, 2]]                 # the token cap: the longest alone, the pair together
    assert result["growth"] < 2 * TINY_QWEN3_TOKEN_BYTES * LONG_ROWS[0], result["growth"] / 2**30   # ~0.8 GiB measured
    metrics = result["metrics"]
    trainable = sum(n - LONG_PROMPT for n in LONG_ROWS)
    assert metrics["actor/kept_tokens"] == trainable and metrics["actor/version"] == 1
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    assert result["diff"] < 1e-5                            # padded beside a longer row = the row alone
