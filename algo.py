# algo.py — the RL math of tracerl, as pure tensor functions.
#
# Owns: the algorithm config and its validation; reward shaping by reply length (DAPO's soft overlong punishment,
# ProRL's stop-properly penalty); advantage estimators (REINFORCE, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO, GSPO,
# on-policy distillation, and GAE over a critic's values with observation gaps transparent); Schulman's KL estimators
# k1/k2/k3; the PPO-clip (with dual clip) and GSPO-token surrogates; PPO's clipped value loss (the critic's, critic.py);
# loss aggregation over GLOBAL denominators; DAPO dynamic filtering.
# Never does: touch a model, a tokenizer, a file, a process group or an engine; compute importance-sampling weights.
# Invariant kept: 2 (policy version). The train/infer correction weights come in as `is_weights`, computed in
# invariants.py; this module only multiplies them in, detached, so they can never carry gradient.
# Tensor convention: per-token arrays are [B, T], aligned to tokens, `loss_mask` float 0/1, position 0 never trainable.
# Names (invariants.py's glossary): a row is a segment; a rollout is all the segments of one episode, `rollout_index`
# [B] maps rows to rollouts; `prox_logprobs` are the proximal policy pi_prox's, `logprobs` the live policy pi's.
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from invariants import MAX_LOG_RATIO, per_rollout

# ---- config + validation ----

GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "grpo", "dr_grpo", "gspo")  # need >= 2 samples per prompt
TOKEN_ESTIMATORS = ("on_policy_distill", "gae")  # a per-token advantage: from a teacher, or from a critic's values
ESTIMATORS = ("reinforce",) + GROUP_ESTIMATORS + TOKEN_ESTIMATORS
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "prompt_mean_token_mean")
GROUP_AGGREGATIONS = ("prompt_mean_token_mean",)  # weigh a token by its group's kept tokens: a micro-batch and a
                                                  # rank hold whole groups, not only whole rollouts (actor, runtime)
STD_EPS = 1e-6  # added to a std before dividing (GRPO, REINFORCE++-baseline)
WHITEN_EPS = 1e-8  # added to a variance before its inverse square root (GAE's whitening, verl's masked_whiten)


@dataclass
class AlgoConfig:
    estimator: str = "grpo"  # one of ESTIMATORS
    clip_low: float = 0.2  # ratio lower bound is 1 - clip_low (GSPO paper uses 3e-4)
    clip_high: float = 0.28  # ratio upper bound is 1 + clip_high (DAPO clip-higher; GSPO paper uses 4e-4)
    dual_clip: float = 0.0  # dual-clip PPO: a token with A < 0 loses at most -dual_clip * A (0 = off; verl: 3.0)
    loss_agg: str = "token_mean"  # one of LOSS_AGGREGATIONS
    kl_coef: float = 0.0  # beta of the KL to the reference model; for on_policy_distill: distillation strength
    kl_estimator: str = "k3"  # k1 | k2 | k3 (as a loss use k2 for reverse-KL gradients, k3 gives forward-KL ones)
    kl_in_reward: bool = False  # KL enters as a per-token reward (only `reinforce` reads per-token rewards)
    filter_zero_variance: bool = False  # DAPO dynamic filtering: drop groups whose rollouts all share one reward
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last N tokens of rollout.max_tokens (0 = off)
    overlong_penalty: float = 1.0  # what that punishment takes from the reward of a reply of rollout.max_tokens
    stop_penalty: float = 1.0  # ProRL stop-properly: a truncated reply's reward x this (1 = off; < 0: replaces it)
    score_centering: int = 0  # k in 1..20 (0 = off): ratio-free REINFORCE, score centered on the sampler's top-k
    gae_gamma: float = 1.0  # gae: discount per sampled token, in [0, 1] (observation tokens between turns do not count)
    gae_lambda: float = 1.0  # gae: GAE's lambda in [0, 1] (1: Monte-Carlo return minus V; 0: one-step TD error)
    gae_whiten: bool = True  # gae: whiten the advantages over the step's sampled tokens (the returns stay raw)


def validate_algo(cfg: AlgoConfig, n_samples_per_prompt: int, max_tokens: int | None = None) -> None:
    """Refuse configurations that would train silently wrong. Raises ValueError naming the fix. max_tokens: the
    run's reply cap (rollout.max_tokens), the length the soft overlong punishment counts back from."""
    for name, known in (("estimator", ESTIMATORS), ("kl_estimator", KL_ESTIMATORS), ("loss_agg", LOSS_AGGREGATIONS)):
        if getattr(cfg, name) not in known:
            raise ValueError(f"unknown {name} {getattr(cfg, name)!r}; expected one of {known}")
    if not (0.0 < cfg.clip_low < 1.0) or not (cfg.clip_high > 0.0):
        raise ValueError(f"clip bounds must satisfy 0 < clip_low < 1 and clip_high > 0, got clip_low={cfg.clip_low}, "
                         f"clip_high={cfg.clip_high}; the ratio is clipped to [1 - clip_low, 1 + clip_high]")
    if cfg.kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {cfg.kl_coef}; a negative coefficient rewards drifting away")
    if not (cfg.dual_clip == 0.0 or 1.0 < cfg.dual_clip < math.inf):
        raise ValueError(f"dual_clip must be 0 (off) or a finite bound > 1, got {cfg.dual_clip}; at <= 1 it would "
                         f"cap tokens whose ratio is 1, on-policy ones included (verl's default is 3.0)")
    if cfg.dual_clip and cfg.estimator == "gspo":
        raise ValueError("dual_clip bounds a token's PPO ratio, but GSPO's ratio is its rollout's geometric mean "
                         "(one value per rollout, clipped at 3e-4-scale bounds); set dual_clip=0 with gspo")
    _validate_shaping(cfg, max_tokens)
    if cfg.kl_in_reward and cfg.estimator == "on_policy_distill":
        raise ValueError("on_policy_distill already uses the teacher's per-token KL as its advantage; "
                         "set kl_in_reward=False")
    if cfg.kl_in_reward and cfg.estimator != "reinforce":
        raise ValueError(f"kl_in_reward=True with estimator {cfg.estimator!r} would be silently ignored: only "
                         f"'reinforce' reads per-token rewards; set kl_in_reward=False to add the KL as a loss term "
                         f"instead")
    if cfg.kl_in_reward and cfg.kl_coef == 0.0:
        raise ValueError("kl_in_reward=True with kl_coef=0 adds nothing; set kl_coef > 0 or kl_in_reward=False")
    if cfg.estimator == "on_policy_distill" and cfg.kl_coef <= 0.0:
        raise ValueError("on_policy_distill needs a teacher: kl_coef is the distillation strength and kl_coef > 0 "
                         "loads the teacher in the reference slot; set kl_coef (1.0 is the usual choice)")
    _validate_gae(cfg)
    needs_group = cfg.estimator in GROUP_ESTIMATORS or cfg.filter_zero_variance
    if needs_group and n_samples_per_prompt < 2:
        what = f"estimator {cfg.estimator!r}" if cfg.estimator in GROUP_ESTIMATORS else "filter_zero_variance"
        raise ValueError(f"{what} compares samples of one prompt but n_samples_per_prompt={n_samples_per_prompt}; "
                         f"use n_samples_per_prompt >= 2 or estimator 'reinforce'")


def _validate_gae(cfg: AlgoConfig) -> None:
    for name in ("gae_gamma", "gae_lambda"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}; 1 is the usual choice for an LLM's sparse "
                             f"final reward (a discount below 1 shrinks it toward the first tokens)")
    defaults = AlgoConfig()
    changed = [name for name in ("gae_gamma", "gae_lambda", "gae_whiten") if getattr(cfg, name) != getattr(defaults,
                                                                                                       name)]
    if changed and cfg.estimator != "gae":
        raise ValueError(f"{', '.join(changed)} set, but estimator {cfg.estimator!r} never reads them: only 'gae' "
                         f"does; use estimator gae, or leave them at their defaults")


def _validate_shaping(cfg: AlgoConfig, max_tokens: int | None) -> None:
    shaping = cfg.overlong_buffer != 0 or cfg.stop_penalty != 1.0
    if shaping and cfg.estimator == "on_policy_distill":
        raise ValueError("overlong_buffer and stop_penalty shape the reward, which on_policy_distill never reads "
                         "(its advantage is the teacher's per-token KL); set overlong_buffer=0 and stop_penalty=1")
    if cfg.overlong_buffer < 0 or (cfg.overlong_buffer and not 0.0 < cfg.overlong_penalty < math.inf):
        raise ValueError(f"overlong_buffer must be >= 0 (0 = off) and, when on, overlong_penalty a finite value > 0; "
                         f"got {cfg.overlong_buffer} and {cfg.overlong_penalty}")
    if cfg.overlong_buffer and max_tokens is not None and cfg.overlong_buffer > max_tokens:
        raise ValueError(f"overlong_buffer ({cfg.overlong_buffer}) is longer than rollout.max_tokens ({max_tokens}): "
                         f"even an empty reply would be punished; use a buffer of at most max_tokens (DAPO: 4096 of "
                         f"20480)")
    if not (cfg.stop_penalty <= 1.0 and math.isfinite(cfg.stop_penalty)):
        raise ValueError(f"stop_penalty must be in [0, 1] (a factor on a truncated reply's reward; 1 = off) or "
                         f"negative (the reward it gets instead), got {cfg.stop_penalty}; above 1 it would reward "
                         f"running out of tokens")


def kl_loss_coef(cfg: AlgoConfig) -> float:
    """Coefficient of the KL-to-reference LOSS term: 0 when KL is a reward, or when the reference is a teacher."""
    if cfg.kl_in_reward or cfg.estimator == "on_policy_distill":
        return 0.0
    return cfg.kl_coef


# ---- reward shaping by reply length (before the advantages) ----
# Both read the rollout's replies (engines.Generation) against the run's cap rollout.max_tokens: the soft overlong
# punishment takes the longest reply's penalty, the stop-properly penalty fires when any reply ran out of tokens
# (finish_reason "length": agents.Rollout.max_tokens_turns > 0). They apply in that order (OpenRLHF's), so a
# truncated reply's reward is the overlong-shaped one, scaled.


def overlong_penalty(reply_tokens: int, max_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (2503.14476 §3.4, times factor): 0 up to max_tokens - buffer tokens, then
    falling linearly to -factor at max_tokens, and -factor beyond."""
    return -min(max(reply_tokens - (max_tokens - buffer), 0), buffer) / buffer * factor


def shape_rewards(rewards: list[float], reply_tokens: list[int], hit_max_tokens: list[bool], cfg: AlgoConfig,
                  max_tokens: int) -> list[float]:
    """Per row: the rollout's reward, plus overlong_penalty of its longest reply (reply_tokens) when
    cfg.overlong_buffer > 0, then, where a reply hit max_tokens before a stop (ProRL's "stop properly"), times
    cfg.stop_penalty, or replaced by it when it is negative."""
    shaped = []
    for reward, tokens, truncated in zip(rewards, reply_tokens, hit_max_tokens):
        if cfg.overlong_buffer:
            reward += overlong_penalty(tokens, max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        if truncated and cfg.stop_penalty != 1.0:
            reward = cfg.stop_penalty if cfg.stop_penalty < 0 else reward * cfg.stop_penalty
        shaped.append(float(reward))
    return shaped


# ---- advantages (estimators) ----
# Rows are segments; several segments of one rollout share its reward and must count ONCE in a group baseline.


def _rollouts(rewards: list[float], group_ids: list[str], rollout_ids: list[str]) -> dict[str, tuple[str, float]]:
    """rollout_id -> (group_id, reward), first row wins; rows of one rollout must agree on both."""
    if not (len(rewards) == len(group_ids) == len(rollout_ids)):
        raise ValueError(f"rewards, group_ids, rollout_ids must be per row and equally long, got "
                         f"{len(rewards)}, {len(group_ids)}, {len(rollout_ids)}")
    rollouts: dict[str, tuple[str, float]] = {}
    for reward, group_id, rollout_id in zip(rewards, group_ids, rollout_ids):
        seen = rollouts.setdefault(rollout_id, (group_id, float(reward)))
        if seen != (group_id, float(reward)):
            raise ValueError(f"rows of rollout {rollout_id!r} disagree: (group, reward) {seen} vs "
                             f"{(group_id, float(reward))}; every segment of a rollout must carry the rollout's "
                             f"group_id and reward")
    return rollouts


def _group_advantages(rewards: Tensor, estimator: str) -> Tensor:
    """Advantages of the rollouts of ONE group (1-D float64).
    Sources: RLOO 2402.14740, GRPO 2402.03300, Dr.GRPO 2503.20783."""
    n = rewards.numel()
    if estimator == "reinforce":
        return rewards.clone()
    if estimator in ("reinforce_baseline", "dr_grpo"):
        return rewards - rewards.mean()
    if estimator == "rloo":  # R_i - mean of the others = G/(G-1) (R_i - mean); a singleton keeps its reward
        return rewards.clone() if n == 1 else (rewards - rewards.mean()) * n / (n - 1)
    if estimator in ("grpo", "gspo"):  # (R - mean) / (unbiased std + eps); a singleton has no spread -> 0
        if n == 1:
            return torch.zeros_like(rewards)
        return (rewards - rewards.mean()) / (rewards.std(correction=1) + STD_EPS)
    raise ValueError(f"no rollout-level advantage for estimator {estimator!r}; expected one of "
                     f"{ESTIMATORS[:-len(TOKEN_ESTIMATORS)]}")


def rollout_advantages(
    rewards: list[float], group_ids: list[str], rollout_ids: list[str], estimator: str
) -> list[float]:
    """Per-ROW advantages. Rollouts are deduped by rollout_id (each counts once in its group), their advantage
    is computed per group, then scattered back to every row (segment) of the rollout.
    on_policy_distill has no reward advantage: it is refused here, use distill_advantages."""
    if estimator in TOKEN_ESTIMATORS:
        raise ValueError(f"{estimator} advantages are per token; call "
                         f"{'distill_advantages' if estimator == 'on_policy_distill' else 'gae_advantages'}, not "
                         f"rollout_advantages")
    rollouts = _rollouts(rewards, group_ids, rollout_ids)
    members: dict[str, list[str]] = {}
    for rollout_id, (group_id, _) in rollouts.items():
        members.setdefault(group_id, []).append(rollout_id)
    advantage: dict[str, float] = {}
    for ids in members.values():
        group_rewards = torch.tensor([rollouts[i][1] for i in ids], dtype=torch.float64)
        advantage.update(zip(ids, _group_advantages(group_rewards, estimator).tolist()))
    if estimator == "reinforce_baseline":  # REINFORCE++-baseline (2501.03262): divide by the batch std, per rollout
        centered = torch.tensor(list(advantage.values()), dtype=torch.float64)
        std = centered.std(correction=1).item() if centered.numel() > 1 else 0.0
        advantage = {i: a / (std + STD_EPS) for i, a in advantage.items()}
    return [advantage[i] for i in rollout_ids]


def distill_advantages(
    teacher_logprobs: Tensor, prox_logprobs: Tensor, loss_mask: Tensor, kl_coef: float = 1.0
) -> Tensor:
    """On-policy distillation (thinkingmachines.ai/blog/on-policy-distillation): per-token advantage
    kl_coef * (log pi_teacher - log pi_prox) on the sampled token, i.e. minus a k1 reverse-KL estimate, discount 0.
    Returns a detached [B, T] tensor, 0 off the mask. Pass cfg.kl_coef (the distillation strength)."""
    return (kl_coef * (teacher_logprobs - prox_logprobs) * loss_mask).detach()


# ---- GAE: per-token advantages from a critic's values (critic.py) ----
# A row's sampled tokens are the agent's actions; the context tokens between two turns (a tool's output, the
# template) are observations the agent did not choose. They are TRANSPARENT: no TD error, no discount and no value
# there, the next action's V and A carried across them to the previous action, so a multi-turn episode is one chain
# of decisions and the final reward reaches the first turn's tokens. A rollout sealed into several rows (a context
# rewrite: the same episode, its later turns on a new prompt; a compaction, its summary a row between them) is ONE
# chain too: its rows in segment order, end to end (segment_chains), so the last action of a row bootstraps from the
# first action of the next row, and only the last row holds the reward. A chat agent's side line (a sub-agent, a
# title request: session.py; its segments numbered from 0 apart from the main line's) is a chain of its own: its
# tokens are another conversation, never between two of the main line's segments in the episode, so neither line
# bootstraps from the other's values; each line's last action holds the rollout's reward, as a group estimator gives
# every line the rollout's advantage.
# V after the chain's last action is 0 (the episode ends there).


def segment_chains(rollout_ids: Sequence[str], segment_ids: Sequence[int], lines: Sequence[str]) -> list[list[int]]:
    """The rows of each line of each rollout (Segment.line), in segment order: one chain of decisions per line (a
    sealed line's rows are consecutive parts of it). Chains in order of first appearance."""
    chains: dict[tuple[str, str], list[int]] = {}
    for row in sorted(range(len(rollout_ids)), key=lambda b: segment_ids[b]):
        chains.setdefault((rollout_ids[row], lines[row]), []).append(row)
    return [chains[key] for key in dict.fromkeys(zip(rollout_ids, lines))]


def token_rewards(rewards: Tensor, loss_mask: Tensor, chains: list[list[int]] | None = None) -> Tensor:
    """[B, T] per-token rewards: the episode's reward on its LAST sampled token, 0 elsewhere (an outcome reward; an
    intermediate token earns nothing). rewards [B]: per row, its rollout's. Without `chains` each row is an episode;
    with them (segment_chains) only a chain's last row with a sampled token holds it, once per chain (line)."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    last = torch.where(loss_mask > 0, positions, -1).amax(-1)        # [B]; -1 for a row with no sampled token
    holders = [b for b in range(len(last)) if last[b] >= 0] if chains is None else \
        [sampled[-1] for chain in chains if (sampled := [b for b in chain if last[b] >= 0])]
    out = torch.zeros(loss_mask.shape, dtype=torch.float64, device=loss_mask.device)
    rows = torch.tensor(holders, dtype=torch.long, device=loss_mask.device)
    out[rows, last[rows]] = rewards.to(out)[rows]
    return out


def gae_advantages(token_rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lam: float,
                   whiten: bool = True, chains: list[list[int]] | None = None) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 1506.02438) over each episode's sampled tokens, observation
    gaps transparent (see above). Backwards over t, for a sampled token t:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,   then V_next = V_t, A_next = A_t
    and for a context token nothing changes (V_next, A_next carried); V_next = A_next = 0 after the episode's end.
    An episode is a row, or with `chains` (segment_chains) the rows of one line of a rollout end to end. values [B, T]: the
    critic's V of the state before each token (critic.Critic.compute_values). Returns (advantages, returns), float32
    [B, T], 0 off the mask: returns = A + V before any whitening (the critic's target); advantages whitened over
    every sampled token of the batch, (A - mean) / sqrt(var + 1e-8) with the unbiased variance (verl's
    masked_whiten), when `whiten`. Computed in float64."""
    mask = loss_mask.double()
    rewards, values = token_rewards.double(), values.double() * mask
    if chains is None:
        advantages = _gae_backwards(rewards, values, mask, gamma, lam)
    else:     # each chain's rows end to end ([R, K * T]; a shorter chain padded with masked rows), then back
        B, T = mask.shape
        index = torch.full((len(chains), max(map(len, chains))), -1, dtype=torch.long)
        for c, chain in enumerate(chains):
            index[c, :len(chain)] = torch.tensor(chain)
        real = index >= 0
        if sorted(index[real].tolist()) != list(range(B)):
            raise ValueError(f"gae_advantages: chains must hold every one of the {B} rows once, got {chains}")

        def end_to_end(x: Tensor) -> Tensor:
            return torch.where(real[..., None], x[index.clamp(min=0)], 0.0).reshape(len(chains), -1)
        chained = _gae_backwards(end_to_end(rewards), end_to_end(values), end_to_end(mask), gamma, lam)
        advantages = torch.zeros_like(mask)
        advantages[index[real]] = chained.reshape(len(chains), -1, T)[real]
    returns = (advantages + values) * mask
    if whiten:
        advantages = whiten_advantages(advantages, mask)
    return advantages.float(), returns.float()


def _gae_backwards(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """The GAE recursion above over [N, L] episodes, right to left; 0 off the mask."""
    advantages = torch.zeros_like(mask)
    next_value = next_advantage = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
    for t in range(mask.shape[1] - 1, -1, -1):
        sampled = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(sampled, values[:, t], next_value)
        next_advantage = torch.where(sampled, advantage, next_advantage)
        advantages[:, t] = torch.where(sampled, advantage, 0.0)
    return advantages


def whiten_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """(A - mean) * rsqrt(var + WHITEN_EPS) over the sampled tokens (unbiased variance), 0 off the mask; a batch
    of fewer than two sampled tokens has no spread and is returned as it is."""
    n = loss_mask.sum()
    if n < 2:
        return advantages * loss_mask
    mean = (advantages * loss_mask).sum() / n
    var = ((advantages - mean).square() * loss_mask).sum() / (n - 1)
    return (advantages - mean) * torch.rsqrt(var + WHITEN_EPS) * loss_mask


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor,
               clip: float) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss per token [B, T] (0 off the mask), and its metrics:
        0.5 * max((V - R)^2, (old_V + clip(V - old_V, -clip, +clip) - R)^2)
    old_V the values the step's returns were computed with (the critic's before this step), R = A + old_V; the clip
    keeps V from moving further than `clip` from old_V where that would lower the loss (PPO2's cliprange_value;
    0 = no clip: the plain 0.5 (V - R)^2). The caller weighs the tokens (a global token mean, algo.loss_weights)."""
    unclipped = (values - returns).square()
    if clip > 0:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
        token_loss = 0.5 * torch.maximum(unclipped, clipped)
    else:
        clipped = unclipped
        token_loss = 0.5 * unclipped
    with torch.no_grad():
        n = loss_mask.sum().clamp_min(1.0)
        metrics = {"value_clip_frac": ((clipped > unclipped).to(loss_mask.dtype) * loss_mask).sum().div(n).item()}
    return token_loss * loss_mask, metrics


# ---- KL estimators ----


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman, joschu.net/blog/kl-approx.html).
    With log_r = log pi_ref - log pi: k1 = -log_r, k2 = log_r^2 / 2, k3 = exp(log_r) - 1 - log_r.
    Values: E[k1] = E[k3] = KL(pi||ref). As losses (gradient through logprobs only): E grad k1 = 0,
    E grad k2 = grad KL(pi||ref), E grad k3 = grad KL(ref||pi). Returns [B, T]; the caller masks."""
    log_r = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_reward_penalty(
    prox_logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, kl_coef: float, estimator: str
) -> Tensor:
    """KL as a reward, for estimator 'reinforce' (REINFORCE++ 2501.03262, gamma = 1): each token's return gets
    -kl_coef * sum_{s >= t} kl_s over the row's trainable tokens. Add it to the rollout advantage:
    advantages[b, t] = R_b + penalty[b, t]. Detached [B, T], 0 off the mask.
    Limitation: the sum runs within one row, so a later segment's KL does not reach an earlier segment."""
    kl = kl_divergence(prox_logprobs, ref_logprobs, estimator).detach() * loss_mask
    kl_to_go = kl.flip(-1).cumsum(-1).flip(-1)
    return -kl_coef * kl_to_go * loss_mask


# ---- policy surrogates ----


def policy_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: AlgoConfig,
    is_weights: Tensor | None = None,
    rollout_index: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token clipped surrogate loss [B, T] (0 off the mask) and monitoring metrics.
    PPO (Schulman 2017, clip-higher from DAPO): loss = -w * min(r A, clip(r, 1-lo, 1+hi) A), r = pi / pi_prox; with
    dual_clip c, a token with A < 0 loses min(that, -c A), so a huge ratio cannot blow up a negative advantage's loss
    (nor its gradient: a token at -c A has none).
    GSPO-token (2507.18071): r_t = sg[s_i] * pi_t / sg[pi_t], s_i = exp(masked mean_t log(pi_t / pi_prox_t)) over
    every token of the rollout i (all its rows; rollout_index [B] maps rows to rollouts, None = each row its own).
    Every token of a rollout has the value r_t = s_i, so where A is constant within the rollout the clip takes one
    branch for all its tokens, and an unclipped token's gradient is w_t * A_i * s_i * grad log pi_t (a clipped
    one's is 0). That sums to the gradient of sequence-level GSPO (the paper's sequence is our rollout),
    w_i * A_i * grad s_i with grad s_i = s_i * mean_t grad log pi_t, only when all three hold: A is constant within
    a rollout, loss_agg is seq_mean_token_mean (each token weighted by 1 / its rollout's token count), and w is
    constant within a rollout (is_weights None, or correction level off, seq or geo: one weight per rollout).
    Per-token IS weights (correction level token) weight each token's gradient by its own w_t, which
    sequence-level GSPO cannot express; that is GSPO-token with per-token weights, not GSPO. The rows of a rollout
    must all be in this call. w = is_weights from invariants.correction_weights, DETACHED here (None -> 1)."""
    token_log_ratio = ((logprobs - prox_logprobs) * loss_mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_ratio = token_log_ratio
    if cfg.estimator == "gspo":
        tokens = per_rollout(loss_mask.sum(-1), rollout_index).clamp_min(1.0)
        rollout_log_ratio = (per_rollout(token_log_ratio.sum(-1), rollout_index) / tokens).detach().unsqueeze(-1)
        log_ratio = rollout_log_ratio + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped)
    dual_clipped = torch.zeros_like(token_loss, dtype=torch.bool)
    if cfg.dual_clip:  # dual-clip PPO (Ye et al. 1912.09729): for A < 0 the loss is at most -c A, whatever the ratio
        dual_clipped = (advantages < 0) & (token_loss > -cfg.dual_clip * advantages)
        token_loss = torch.where(dual_clipped, -cfg.dual_clip * advantages, token_loss)
    if is_weights is not None:
        token_loss = token_loss * is_weights.detach()
    token_loss = token_loss * loss_mask

    with torch.no_grad():
        n = loss_mask.sum().clamp_min(1.0)
        k3_prox_to_live = torch.expm1(token_log_ratio) - token_log_ratio  # k3 estimate of KL(pi_prox || pi)
        metrics = {
            "clip_frac": ((clipped < unclipped).to(loss_mask.dtype) * loss_mask).sum().div(n).item(),
            "dual_clip_frac": (dual_clipped.to(loss_mask.dtype) * loss_mask).sum().div(n).item(),
            "approx_kl": (k3_prox_to_live * loss_mask).sum().div(n).item(),
            "ratio_mean": (ratio * loss_mask).sum().div(n).item(),
        }
    return token_loss, metrics


# ---- loss aggregation ----
# The loss of an optimizer step is sum_{b,t} token_loss[b,t] * weight[b,t], with weights built from GLOBAL counts of
# the whole step (all micro-batches, all ranks), so summing micro-batch gradients gives the full-batch gradient
# however the batch is split (verl #7321, prime-rl #2562). The seq_mean_* modes count rollouts (all their rows,
# rollout_index), prompt_mean_token_mean counts groups (all their rollouts, group_index), and the mask is the FINAL
# mask of the step: a token or rollout a correction rejected is not counted anywhere (invariants.py, section 2). The
# weight of a token is also its exact share of the loss: the trace reports token_loss * weight as each token's
# contribution.


def loss_weights(
    loss_mask: Tensor, mode: str, global_tokens: float, global_rollouts: float, token_budget: int | None = None,
    rollout_index: Tensor | None = None, group_index: Tensor | None = None, global_groups: float = 0.0,
) -> Tensor:
    """[B, T] weight of each token's loss in the step's scalar loss (0 off the mask): loss_numerators / the
    step's global count loss_denominator picks.
    token_mean: 1 / global_tokens (kept tokens in the step).
    seq_mean_token_mean (GRPO): 1 / (global_rollouts * tokens of its rollout), i.e. the mean over kept rollouts of
      each rollout's token mean, so a rollout sealed into three rows weighs once.
    seq_mean_token_sum_norm (Dr.GRPO, 2503.20783): 1 / (global_rollouts * token_budget), token_budget a constant of
      the run (train.py: the most sampled tokens a rollout can hold), so no rollout's length changes any weight.
    prompt_mean_token_mean (DAPO's token-level loss within a group, 2503.14476 §3.3): 1 / (global_groups * kept
      tokens of its group), i.e. the mean over kept groups of each group's token mean: within a prompt every token
      weighs the same however long its rollout, and every prompt weighs the same however long its rollouts."""
    numerators = loss_numerators(loss_mask, mode, token_budget, rollout_index, group_index)
    return numerators / loss_denominator(mode, global_tokens, global_rollouts, global_groups)


def loss_numerators(loss_mask: Tensor, mode: str, token_budget: int | None = None,
                    rollout_index: Tensor | None = None, group_index: Tensor | None = None) -> Tensor:
    """The part of loss_weights that the rows themselves decide (every row of a rollout must be in the call, and for
    prompt_mean_token_mean every row of a group). A trainer that learns the global counts only after its
    micro-batches ran (actor.train_step) weighs each token by this and divides the summed gradient by
    loss_denominator once: the gradient is linear in the weights."""
    if mode == "token_mean":
        return loss_mask
    if mode == "seq_mean_token_mean":
        return loss_mask / per_rollout(loss_mask.sum(-1), rollout_index).clamp_min(1.0).unsqueeze(-1)
    if mode == "seq_mean_token_sum_norm":
        if token_budget is None:
            raise ValueError("seq_mean_token_sum_norm divides by a constant token budget per rollout; pass "
                             "token_budget (the most sampled tokens a rollout can hold)")
        return loss_mask / _positive("token_budget", token_budget)
    if mode == "prompt_mean_token_mean":
        if group_index is None:
            raise ValueError("prompt_mean_token_mean divides by the kept tokens of each prompt group; pass "
                             "group_index (invariants.rollout_index(batch.group_ids)), with every row of a group")
        return loss_mask / per_rollout(loss_mask.sum(-1), group_index).clamp_min(1.0).unsqueeze(-1)
    raise ValueError(f"unknown loss_agg {mode!r}; expected one of {LOSS_AGGREGATIONS}")


def loss_denominator(mode: str, global_tokens: float, global_rollouts: float, global_groups: float = 0.0) -> float:
    """The global count of the step that loss_weights divides by: kept tokens (token_mean), kept groups
    (prompt_mean_token_mean) or kept rollouts."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {mode!r}; expected one of {LOSS_AGGREGATIONS}")
    if mode == "token_mean":
        return _positive("global_tokens", global_tokens)
    if mode in GROUP_AGGREGATIONS:
        return _positive("global_groups", global_groups)
    return _positive("global_rollouts", global_rollouts)


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (a count over the whole optimizer step), got {value}")
    return value


# ---- dynamic filtering ----


def keep_groups_with_variance(rewards: list[float], group_ids: list[str], rollout_ids: list[str]) -> list[bool]:
    """DAPO dynamic sampling (2503.14476): keep a row iff its group's rollouts (deduped by rollout_id, so a
    rollout split into segments counts once) do not all share one reward; such groups have zero advantage."""
    rollouts = _rollouts(rewards, group_ids, rollout_ids)
    group_rewards: dict[str, set[float]] = {}
    for group_id, reward in rollouts.values():
        group_rewards.setdefault(group_id, set()).add(reward)
    return [len(group_rewards[g]) > 1 for g in group_ids]
