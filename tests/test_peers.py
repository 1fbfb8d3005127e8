# Oracles from the peers' own code: algo.py's dual-clip PPO against verl 0.9.1's vanilla policy loss, its DAPO
# overlong punishment against verl's DAPO reward manager, its ProRL stop-properly penalty against OpenRLHF 0.11.2's,
# and invariants.py's binary_kl / tv rollout gate (FlashREINFORCE) against OpenRLHF's PolicyLoss, each called as
# the peer ships it (requirements-peers.txt). Each oracle is armed: its batch holds what the option changes, and a
# near miss (the option off, a shifted buffer, a truncation ignored) disagrees with the peer. The one place we part
# from a peer on purpose is its negative control: OpenRLHF's fp32 binary KL of two all but equal logprobs comes out
# below 0 and its [0, delta] band rejects the rollout; ours clamps at 0 and keeps it.
import importlib
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

import algo
import invariants
from conftest import import_peer


@pytest.fixture(scope="module")
def verl_core():
    return import_peer("verl.trainer.ppo.core_algos")


@pytest.fixture(scope="module")
def openrlhf_loss():
    """openrlhf.models.loss as the package ships it, loaded from its folder: openrlhf.models' __init__ imports its
    Actor, which needs flash-attn (a CUDA build); the loss module itself imports torch and its utils (deepspeed)."""
    openrlhf = import_peer("openrlhf")
    if "openrlhf.models" not in sys.modules:
        package = types.ModuleType("openrlhf.models")
        package.__path__ = [os.path.join(os.path.dirname(openrlhf.__file__), "models")]
        sys.modules["openrlhf.models"] = package
    return importlib.import_module("openrlhf.models.loss")


def ppo_batch(seed: int = 0, rows: int = 6, width: int = 9):
    """float64 [rows, width]: proximal logprobs, live ones up to 2 nats away (so ratios reach past 3 and below 1/3),
    advantages of both signs, a right-padded mask of unequal lengths, position 0 never trainable."""
    gen = torch.Generator().manual_seed(seed)
    prox = torch.log(torch.rand(rows, width, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    live = prox + (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 4 - 2)
    lengths = torch.tensor([9, 4, 7, 9, 3, 6])[:rows]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    mask[:, 0] = 0.0
    advantages = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width) * mask
    return prox, live, advantages, mask


def our_ppo_loss(live, prox, advantages, mask, dual_clip: float, loss_agg: str, is_weights=None):
    """The step loss as actor.train_step builds it, and its gradient per token."""
    live = live.clone().requires_grad_(True)
    cfg = algo.AlgoConfig(estimator="grpo", clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, loss_agg=loss_agg)
    token_loss, metrics = algo.policy_loss(live, prox, advantages, mask, cfg, is_weights=is_weights)
    weights = algo.loss_weights(mask, loss_agg, float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    loss = (token_loss * weights).sum()
    loss.backward()
    return loss.detach(), live.grad, metrics


# ---- dual-clip PPO: verl's compute_policy_loss_vanilla (clip_ratio_c, default 3.0) ----

@pytest.mark.parametrize("loss_agg, verl_agg", [("token_mean", "token-mean"),
                                                ("seq_mean_token_mean", "seq-mean-token-mean")])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "is_weighted"])
def test_dual_clip_ppo_equals_verls_vanilla_policy_loss(verl_core, loss_agg, verl_agg, weighted):
    from omegaconf import OmegaConf
    prox, live, advantages, mask = ppo_batch()
    is_weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5 \
        if weighted else None
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "global_batch_info": {"dp_size": 1, "batch_num_tokens": int(mask.sum()),
                                                     "global_batch_size": int((mask.sum(-1) > 0).sum())}})
    theirs_live = live.clone().requires_grad_(True)
    theirs, metrics = verl_core.compute_policy_loss_vanilla(prox, theirs_live, advantages, mask, verl_agg, config,
                                                            rollout_is_weights=is_weights)
    theirs.backward()
    ours, grad, our_metrics = our_ppo_loss(live, prox, advantages, mask, 3.0, loss_agg, is_weights)

    assert metrics["actor/pg_clipfrac_lower"] > 0.05, "armed: tokens with A < 0 past the dual clip"
    # verl adds 1e-8 to the token count a mean divides by (its rollouts', its metrics'): agreement to ~1e-9
    assert abs(ours.item() - theirs.item()) <= 1e-8
    assert (grad - theirs_live.grad).abs().max() <= 1e-8
    assert our_metrics["dual_clip_frac"] == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-8)
    # negative control: without the dual clip the same batch is another loss and gradient
    off, off_grad, _ = our_ppo_loss(live, prox, advantages, mask, 0.0, loss_agg, is_weights)
    assert abs(off.item() - theirs.item()) > 1e-3 and (off_grad - theirs_live.grad).abs().max() > 1e-3


def test_dual_clip_bounds_a_negative_advantages_loss_and_takes_its_gradient():
    prox, live, advantages, mask = ppo_batch(seed=1)
    live = live.clone().requires_grad_(True)
    cfg = algo.AlgoConfig(estimator="grpo", dual_clip=3.0)
    token_loss, _ = algo.policy_loss(live, prox, advantages, mask, cfg)
    token_loss.sum().backward()
    bound = -3.0 * advantages
    negative = (advantages < 0) & (mask > 0)
    assert (token_loss[negative] <= bound[negative] + 1e-15).all()
    at_bound = negative & (torch.exp(live - prox) > 3.0)          # PPO's min picks the ratio there: unbounded
    assert at_bound.any() and torch.equal(token_loss[at_bound], bound[at_bound])
    assert (live.grad[at_bound] == 0).all()


# ---- DAPO's soft overlong punishment: verl's DAPO reward manager ----

MAX_TOKENS, BUFFER, FACTOR = 16, 6, 0.5
REPLY_TOKENS = [1, 5, 9, 10, 11, 13, 15, 16]                 # below, at the edge of, inside and at the end of the buffer
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 1.0]


class _Detokenizer:
    """What verl's reward manager asks of a tokenizer: text for its score function, which here ignores it."""
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def verl_dapo_rewards(buffer: int) -> list[float]:
    """verl's DAPORewardManager over replies of REPLY_TOKENS tokens scored SCORES (the score rides in as the ground
    truth): the rewards it puts on each reply's last token."""
    dapo = import_peer("verl.workers.reward_manager.dapo")
    from omegaconf import OmegaConf
    from verl import DataProto
    rows, prompt = len(REPLY_TOKENS), 3
    responses = torch.ones(rows, MAX_TOKENS, dtype=torch.long)
    attention = torch.zeros(rows, prompt + MAX_TOKENS, dtype=torch.long)
    for i, n in enumerate(REPLY_TOKENS):
        attention[i, :prompt + n] = 1
    data = DataProto.from_dict(
        tensors={"prompts": torch.ones(rows, prompt, dtype=torch.long), "responses": responses,
                 "attention_mask": attention},
        non_tensors={"reward_model": np.array([{"ground_truth": s} for s in SCORES], dtype=object),
                     "data_source": np.array(["oracle"] * rows, dtype=object)})
    manager = dapo.DAPORewardManager(
        _Detokenizer(), num_examine=0, compute_score=lambda data_source, solution_str, ground_truth, extra_info:
        float(ground_truth), max_resp_len=MAX_TOKENS,
        overlong_buffer_cfg=OmegaConf.create({"enable": True, "len": buffer, "penalty_factor": FACTOR, "log": False}))
    return manager(data).sum(-1).tolist()


def test_overlong_punishment_equals_verls_dapo_reward_manager():
    theirs = verl_dapo_rewards(BUFFER)
    cfg = algo.AlgoConfig(overlong_buffer=BUFFER, overlong_penalty=FACTOR)
    ours = algo.shape_rewards(SCORES, REPLY_TOKENS, [False] * len(SCORES), cfg, MAX_TOKENS)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-6        # verl's reward tensor is float32
    punished = [s != r for s, r in zip(SCORES, theirs)]
    assert punished == [n > MAX_TOKENS - BUFFER for n in REPLY_TOKENS], "armed: replies on both sides of the edge"
    assert theirs[-1] == pytest.approx(SCORES[-1] - FACTOR)
    # negative control: a buffer one token longer punishes the reply at the edge too
    shifted = algo.shape_rewards(SCORES, REPLY_TOKENS, [False] * len(SCORES),
                                 algo.AlgoConfig(overlong_buffer=BUFFER + 1, overlong_penalty=FACTOR), MAX_TOKENS)
    assert max(abs(a - b) for a, b in zip(shifted, theirs)) > 1e-2


# ---- ProRL's stop-properly penalty: OpenRLHF's length_penalty, and the formula ----

def prorl_reference(reward: float, truncated: bool, coef: float) -> float:
    """ProRL's stop-properly penalty as OpenRLHF documents it: a truncated sample's reward times coef in [0, 1], or
    coef itself when coef is negative; a sample that stopped keeps its reward."""
    if not truncated:
        return reward
    return coef if coef < 0 else reward * coef


@pytest.mark.parametrize("coef", [0.0, 0.25, -0.5])
def test_stop_properly_penalty_equals_openrlhfs_and_the_formula(coef):
    length_penalty = import_peer("openrlhf.trainer.ppo_utils.length_penalty")
    truncated = [n == MAX_TOKENS for n in REPLY_TOKENS]          # the reply ran into max_tokens without a stop
    experience = types.SimpleNamespace(rewards=torch.tensor(SCORES, dtype=torch.float64),
                                       response_length=torch.tensor(REPLY_TOKENS),
                                       truncated=torch.tensor(truncated))
    # OpenRLHF's order: its overlong punishment (capped, as DAPO's), then the stop-properly penalty
    length_penalty.apply_overlong_penalty([experience], MAX_TOKENS, BUFFER, FACTOR)
    assert length_penalty.apply_stop_properly_penalty([experience], coef) == sum(truncated) > 0   # armed
    cfg = algo.AlgoConfig(overlong_buffer=BUFFER, overlong_penalty=FACTOR, stop_penalty=coef)
    ours = algo.shape_rewards(SCORES, REPLY_TOKENS, truncated, cfg, MAX_TOKENS)
    assert max(abs(a - b) for a, b in zip(ours, experience.rewards.tolist())) <= 1e-12
    overlong = [s - min(max(n - (MAX_TOKENS - BUFFER), 0), BUFFER) / BUFFER * FACTOR
                for s, n in zip(SCORES, REPLY_TOKENS)]
    assert ours == pytest.approx([prorl_reference(r, t, coef) for r, t in zip(overlong, truncated)], abs=1e-12)
    # negative control: a truncation left unseen keeps the overlong-shaped reward, which OpenRLHF does not
    unseen = algo.shape_rewards(SCORES, REPLY_TOKENS, [False] * len(SCORES), cfg, MAX_TOKENS)
    assert max(abs(a - b) for a, b in zip(unseen, experience.rewards.tolist())) > 0.1


# ---- FlashREINFORCE's divergence gate: OpenRLHF's PolicyLoss (seq level, mask mode, binary_kl / tv) ----

def gate_batch():
    """float64: behavior logprobs mu, proximal pi_prox at a per-rollout drift (rollouts 0 and 3 far, the rest near),
    live logprobs a little off pi_prox, advantages, mask; four rollouts of one row each."""
    gen = torch.Generator().manual_seed(3)
    rows, width = 4, 8
    behavior = torch.log(torch.rand(rows, width, generator=gen, dtype=torch.float64) * 0.8 + 0.1)
    drift = torch.tensor([[1.5], [0.05], [0.1], [0.8]], dtype=torch.float64)
    prox = (behavior + drift * torch.randn(rows, width, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    live = prox + 0.2 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    mask = (torch.arange(width)[None, :] < torch.tensor([[8], [6], [7], [5]])).double()
    mask[:, 0] = 0.0
    advantages = torch.tensor([[1.0], [-0.5], [0.7], [-1.2]], dtype=torch.float64) * mask
    return behavior, prox, live, advantages, mask


def our_gated_loss(behavior, prox, live, advantages, mask, gating: str, delta: float):
    """invariants.apply_correction (the divergence gate, then per-token IS on the survivors) and algo.py's step loss
    over what it kept, as actor.train_step runs them; the loss, its gradient per token and the correction."""
    cfg = invariants.CorrectionConfig(level="token", mode="trunc", high=1e6, gating=gating, gate_divergence=delta)
    versions = torch.where(mask > 0, 0, -1)
    correction = invariants.apply_correction(prox, behavior, mask, versions, 0, cfg)
    live = live.clone().requires_grad_(True)
    token_loss, _ = algo.policy_loss(live, prox, advantages, correction.mask, algo.AlgoConfig(
        estimator="grpo", clip_low=0.2, clip_high=0.28), is_weights=correction.is_weights)
    kept = float(correction.mask.sum())
    loss = (token_loss * algo.loss_weights(correction.mask, "token_mean", kept, 1.0)).sum()
    loss.backward()
    return loss.detach(), live.grad, correction


@pytest.mark.parametrize("gating, delta", [("binary_kl", 0.02), ("tv", 0.1)])
def test_divergence_gate_equals_openrlhfs_policy_loss(openrlhf_loss, gating, delta):
    behavior, prox, live, advantages, mask = gate_batch()
    ours, grad, correction = our_gated_loss(behavior, prox, live, advantages, mask, gating, delta)
    theirs_live = live.clone().requires_grad_(True)
    policy = openrlhf_loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level="seq",
                                      is_correction_mode="mask", is_correction_gating=gating,
                                      is_correction_threshold=[0.0, delta])
    # OpenRLHF keeps a rejected sequence's tokens in its token count; ours leaves the denominator with it
    # (invariants.py, the rejection rule): given our kept count, the losses must be equal
    theirs, _, _, _, filtered = policy(theirs_live, prox, advantages, mask, rollout_log_probs=behavior,
                                       batch_num_tokens=float(correction.mask.sum()))
    theirs.backward()
    assert 0 < correction.gate_counts["drop_divergence"] < 4, "armed: rollouts on both sides of the bound"
    assert correction.gate_counts["drop_divergence"] / 4 == pytest.approx(filtered.item(), abs=1e-12)
    assert abs(ours.item() - theirs.item()) <= 1e-12 * max(1.0, abs(theirs.item()))
    assert (grad - theirs_live.grad).abs().max() <= 1e-12
    # negative control: the ratio gate at its default keeps every rollout, which is another step
    loose = invariants.apply_correction(prox, behavior, mask, torch.where(mask > 0, 0, -1), 0,
                                        invariants.CorrectionConfig(level="token", mode="trunc", high=1e6))
    assert loose.keep.all() and not torch.equal(loose.mask, correction.mask)


def test_openrlhf_rejects_all_but_identical_policies_in_fp32_and_we_keep_them(openrlhf_loss):
    """The fp32 binary KL of behavior logprob -1.0 and proximal -0.99999 is about -4.5e-8: OpenRLHF's band [0, delta]
    drops the rollout; ours clamps the divergence at 0 (and computes it in float64) and keeps it."""
    behavior = torch.tensor([[0.0, -1.0, -1.0]])
    prox = torch.tensor([[0.0, -0.99999, -0.99999]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    advantages = torch.tensor([[0.0, 1.0, 1.0]])
    p, q = behavior[0, 1].exp(), prox[0, 1].exp()
    assert (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()).item() < -4e-8     # the trap: below zero
    policy = openrlhf_loss.PolicyLoss(is_correction_level="seq", is_correction_mode="mask",
                                      is_correction_gating="binary_kl", is_correction_threshold=[0.0, 1e-3])
    loss, _, _, _, filtered = policy(prox, prox, advantages, mask, rollout_log_probs=behavior)
    assert filtered.item() == 1.0 and loss.item() == 0.0                          # OpenRLHF: rejected, no update
    cfg = invariants.CorrectionConfig(level="token", mode="trunc", high=1e6, gating="binary_kl", gate_divergence=1e-3)
    correction = invariants.apply_correction(prox, behavior, mask, torch.tensor([[-1, 0, 0]]), 0, cfg)
    assert correction.keep.all() and torch.equal(correction.mask, mask)         # ours: kept
    d = invariants.token_divergence(behavior, prox, "binary_kl")[0, 1].item()
    assert 0.0 <= d < 1e-9 and math.isfinite(d)
