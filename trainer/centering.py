# trainer/centering.py — score centering: off-policy REINFORCE without an importance ratio, from the sampler's top-k.
#
# Owns: the score-centered surrogate (centered_policy_loss), the coefficients of its top-k head
# (head_coefficients), and the rules a run with it must keep (validate_centering).
# Never does: touch a model, an engine or a ledger. The top-k ids and their behavior logprobs come in from the
# TrainBatch (invariants.py records them per sampled token, invariant 2: the distribution that drew the token, not
# a later one), the live policy's logprobs of the same ids from recompute.forward_logprobs(candidates=...).
#
# The math (Marek & Ryabinin, "Score Centering Stabilizes Off-policy Reinforcement Learning", arXiv 2609.20807).
# At one prefix, q is the sampler's distribution, p = pi the live policy's, s_v = grad log p_v the score of token v,
# a ~ q the sampled token and A its (detached) advantage. The plain REINFORCE term A s_a on tokens drawn from q has
# expectation E_q[A] mu + Cov_q(A, s) with mu = sum_v q_v s_v: whenever q != p, mu != 0 and the first term drags p
# towards q in proportion to the prefix's mean advantage (group centering does not make E_q[A | prefix] zero).
# Score centering subtracts mu: the per-token estimate is A (s_a - mu), whose expectation is exactly Cov_q(A, s).
# The sampler reports q only on its top-k head H (the k most likely ids, logprobs over the full vocabulary). The
# tail is modeled as p's tail rescaled to q's tail mass ("proportional tail"): q_v = alpha p_v off H with
# alpha = (1 - Q_H) / (1 - P_H), Q_H and P_H the head masses of q and p. Since sum_v p_v s_v = 0 the tail's share of
# mu moves onto the head:  mu = sum_{v in H} (q_v - alpha p_v) s_v,  which needs the k head logprobs only. Both
# tail masses are floored at TAIL_EPS (the paper's numerical guard), so a head covering all of a truncated
# distribution (top_k <= k) gives alpha = 1 and the exact centering sum_H (q_v - p_v) s_v.
# Precision: far off-policy (the live tail 1 - P_H small where the sampler's is not) alpha reaches 1e5 and more, each
# c_v ~ -alpha p_v, and sum_H c_v s_v cancels from that size to order 1; from an fp32 head log-softmax (and its
# backward) the gradient is then off by ~4e-3 relative at alpha 1e5. So the head comes in fp64
# (recompute.forward_logprobs normalises it in fp64 over the fp32 logits) and the coefficients and the head term are
# computed in fp64: 2e-8 relative at alpha 1e5 (tests/test_centering.py).
# The loss whose gradient is minus that estimate:  loss_t = -A log p_a + A sum_{v in H} sg(q_v - alpha p_v) log p_v.
# With p = q it is the plain REINFORCE loss in expectation (mu = 0), and its per-token value differs from it only
# by the head term. The paper also composes the centering with a per-token IS weight f(p/q) applied to the sampled
# token AND every head candidate; tracerl's IS weights are pi_prox/mu of the sampled token only, so the composition
# is refused (validate_centering) rather than applied to the sampled token alone, which would center the wrong score.
import math

import torch
from torch import Tensor

from invariants import MAX_LOG_RATIO

TAIL_EPS = 1e-6   # floor on the tail masses 1 - Q_H and 1 - P_H (the paper's guard against 0 / 0)


def head_coefficients(live_head_logprobs: Tensor, behavior_head_logprobs: Tensor) -> Tensor:
    """[..., k] detached c_v = q_v - alpha p_v of the head H: the weight of log p_v in the centering term.
    live_head_logprobs: log p at the head ids (full-vocabulary logprobs of the live policy, -inf where its processed
    distribution excludes the id); behavior_head_logprobs: log q at the same ids as the sampler reported them, -inf
    on an empty slot (fewer than k reported, context, padding). An empty slot gets c = 0."""
    with torch.no_grad():
        log_q = behavior_head_logprobs.double()
        slot = torch.isfinite(log_q)
        log_p = torch.where(slot, live_head_logprobs.detach().double(), -math.inf)
        q, p = log_q.exp(), log_p.exp()
        # 1 - mass from the head's logsumexp: exact where the head holds nearly all the mass
        q_tail = -torch.expm1(torch.logsumexp(log_q, -1).clamp(max=0.0))
        p_tail = -torch.expm1(torch.logsumexp(log_p, -1).clamp(max=0.0))
        alpha = q_tail.clamp_min(TAIL_EPS) / p_tail.clamp_min(TAIL_EPS)
        return torch.where(slot, q - alpha.unsqueeze(-1) * p, 0.0)


def centered_policy_loss(logprobs: Tensor, head_logprobs: Tensor, behavior_head_logprobs: Tensor,
                         prox_logprobs: Tensor, advantages: Tensor,
                         loss_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Per-token score-centered REINFORCE loss [B, T] (0 off the mask) and monitoring metrics.
    loss = -A log pi(a) + A sum_{v in H} sg(q_v - alpha pi_v) log pi(v)  (arXiv 2609.20807, proportional tail).
    logprobs [B, T]: log pi of the sampled tokens, with gradient; head_logprobs [B, T, k]: log pi of the recorded
    head ids, with gradient; behavior_head_logprobs [B, T, k]: the sampler's logprobs of those ids (TrainBatch);
    prox_logprobs [B, T] only feeds the metrics (there is no ratio in this loss). The metrics carry the keys of
    algo.policy_loss's: nothing is clipped, approx_kl and ratio_mean monitor pi against pi_prox as there."""
    coefficients = head_coefficients(head_logprobs, behavior_head_logprobs)
    # an id the live processed distribution excludes has no score; its coefficient is kept, its log p read as 0
    head = torch.where(torch.isfinite(head_logprobs), head_logprobs, 0.0)
    # in the head's precision (fp64 from recompute.forward_logprobs): c_v ~ -alpha p_v, and sum_v c_v s_v cancels
    # from alpha to order 1; the term's own value, as the sampled token's, in the logprobs' precision
    centering = (coefficients.to(head.dtype) * head).sum(-1).to(logprobs.dtype)
    token_loss = advantages * (centering - logprobs) * loss_mask

    with torch.no_grad():
        n = loss_mask.sum().clamp_min(1.0)
        log_ratio = ((logprobs - prox_logprobs) * loss_mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        metrics = {
            "clip_frac": 0.0,
            "dual_clip_frac": 0.0,
            "approx_kl": ((torch.expm1(log_ratio) - log_ratio) * loss_mask).sum().div(n).item(),
            "ratio_mean": (log_ratio.exp() * loss_mask).sum().div(n).item(),
        }
    return token_loss, metrics


def batch_heads(batch, k: int) -> Tensor:
    """The batch's recorded top-k ids (invariants.TrainBatch.top_ids, [B, T, k]); refuses a batch whose rows did not
    record k of them, which would center on nothing and train plain ratio-free REINFORCE without saying so."""
    if batch.top_ids is None or batch.top_ids.shape[-1] != k:
        got = "none" if batch.top_ids is None else f"{batch.top_ids.shape[-1]} per token"
        raise ValueError(f"algo.score_centering={k} needs the sampler's top {k} logprobs of every sampled token in the "
                         f"batch, but its rows record {got}; sample with SamplingParams.top_logprobs={k} (train.py "
                         f"does for a run with score centering)")
    return batch.top_ids


def validate_centering(k: int, estimator: str, dual_clip: float, correction_level: str, max_k: int) -> None:
    """Refuse a score-centering run that would train silently wrong (ValueError naming the fix). k: algo.score_centering
    (0 = off); max_k: the most top logprobs an engine reports per token (engines.MAX_TOP_LOGPROBS)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_k:
        raise ValueError(f"algo.score_centering is the number of the sampler's top logprobs recorded per token, an int "
                         f"in [1, {max_k}] (the most an engine reports), or 0 for off; got {k!r}")
    if not k:
        return
    if estimator == "gspo":
        raise ValueError("algo.score_centering replaces the policy surrogate by ratio-free REINFORCE, so GSPO's "
                         "rollout-level ratio would be ignored; use estimator grpo (or another group estimator)")
    if dual_clip:
        raise ValueError("algo.score_centering has no ratio for dual_clip to bound; set algo.dual_clip=0")
    if correction_level != "off":
        raise ValueError(f"algo.score_centering with correction.level {correction_level!r}: the paper composes an IS "
                         f"weight by applying it to the sampled token and to every head candidate alike, and "
                         f"tracerl's weights cover the sampled token only, which would center the wrong score; set "
                         f"correction.level off (the staleness gate and the rollout gates still apply)")
