# Tests of algo.py: each estimator's expected gradient on exactly enumerated bandits, the PPO/GSPO surrogates,
# KL estimator values and gradients, global-denominator aggregation, dynamic filtering and config refusals.
# Everything is float64 on CPU and exact (enumeration over all outcomes), so tolerances are ~1e-10, not statistical.
import itertools
import math

import pytest
import torch

import algo
import invariants
from algo import AlgoConfig



@pytest.fixture(autouse=True)
def float64_default():
    """Exact enumeration wants float64; restored afterwards so other test files keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)

K_ARMS = 3
ARM_REWARDS = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
THETA_PROX = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)


# ---- helpers ----


def exact_policy_gradient(theta: torch.Tensor, arm_rewards: torch.Tensor) -> torch.Tensor:
    """grad J for J = sum_a pi_a R_a with a softmax policy: sum_a pi_a R_a (e_a - pi)."""
    pi = torch.softmax(theta, 0)
    return sum(pi[a] * arm_rewards[a] * (torch.eye(len(pi))[a] - pi) for a in range(len(pi)))


def expected_bandit_loss(theta, theta_prox, estimator: str, group_size: int, arm_rewards=ARM_REWARDS, **cfg_kw):
    """Expected surrogate loss of one group of `group_size` pulls from pi_prox, by enumerating all K^G outcomes.
    Each pull is a 2-token row (position 0 context, position 1 the arm); each outcome is its own group."""
    outcomes = list(itertools.product(range(len(arm_rewards)), repeat=group_size))
    arms = torch.tensor(outcomes).reshape(-1)  # [O * G]
    prox_logp = torch.log_softmax(theta_prox, 0)
    weight = prox_logp[arms].reshape(len(outcomes), group_size).sum(-1).exp().repeat_interleave(group_size)
    rows = len(arms)
    logprobs = torch.stack([torch.zeros(rows), torch.log_softmax(theta, 0)[arms]], dim=1)
    prox_logprobs = torch.stack([torch.zeros(rows), prox_logp[arms]], dim=1)
    loss_mask = torch.tensor([[0.0, 1.0]]).repeat(rows, 1)
    group_ids = [f"o{i // group_size}" for i in range(rows)]
    rollout_ids = [f"o{i // group_size}-{i % group_size}" for i in range(rows)]
    adv = algo.rollout_advantages(arm_rewards[arms].tolist(), group_ids, rollout_ids, estimator)
    advantages = torch.tensor(adv)[:, None] * loss_mask
    cfg = AlgoConfig(estimator=estimator, **cfg_kw)
    token_loss, _ = algo.policy_loss(logprobs, prox_logprobs, advantages, loss_mask, cfg)
    weighted = token_loss * weight[:, None]
    return (weighted * algo.loss_weights(loss_mask, "token_mean", global_tokens=group_size, global_rollouts=1)).sum()


def grad_of(fn, theta: torch.Tensor) -> torch.Tensor:
    theta = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(theta), theta)
    return grad


def central_differences(fn, theta: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    grad = torch.zeros_like(theta)
    for i in range(theta.numel()):
        step = torch.zeros_like(theta)
        step.view(-1)[i] = h
        grad.view(-1)[i] = (fn(theta + step) - fn(theta - step)) / (2 * h)
    return grad


def random_sequence_batch(seed: int = 0, batch: int = 6, length: int = 7, vocab: int = 5):
    """Random logits parameter [B, T, V], sampled ids, right-padded loss mask with varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen)
    input_ids = torch.randint(0, vocab, (batch, length), generator=gen)
    lengths = torch.tensor([2, 7, 4, 6, 3, 5])[:batch]
    loss_mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    loss_mask[:, 0] = 0.0  # position 0 is never trainable
    return logits, input_ids, loss_mask, gen


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, input_ids[..., None]).squeeze(-1)


# ---- advantages ----


def test_reinforce_advantage_is_the_reward():
    adv = algo.rollout_advantages([1.0, 0.0, 0.5], ["g", "g", "h"], ["a", "b", "c"], "reinforce")
    assert adv == [1.0, 0.0, 0.5]


def test_rloo_advantage_is_group_size_over_group_size_minus_one_times_centered_reward():
    rewards = [1.0, 0.0, 0.5, 0.25]
    adv = torch.tensor(algo.rollout_advantages(rewards, ["g"] * 4, list("abcd"), "rloo"))
    r = torch.tensor(rewards)
    leave_one_out = torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
    torch.testing.assert_close(adv, leave_one_out, rtol=0, atol=1e-15)
    torch.testing.assert_close(adv, 4 / 3 * (r - r.mean()), rtol=0, atol=1e-15)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo", "gspo"])
def test_group_advantages_sum_to_zero_per_group(estimator):
    rewards = [1.0, 0.0, 0.5, 3.0, -1.0, 2.0, 2.5]
    groups = ["g", "g", "g", "h", "h", "h", "h"]
    adv = algo.rollout_advantages(rewards, groups, list("abcdefg"), estimator)
    assert abs(sum(adv[:3])) < 1e-12 and abs(sum(adv[3:])) < 1e-12
    assert any(abs(a) > 0.1 for a in adv)


def test_grpo_divides_by_the_unbiased_group_std():
    adv = algo.rollout_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4, list("abcd"), "grpo")
    scaled_half = 0.5 / (torch.tensor([1.0, 0.0, 0.0, 1.0]).std(correction=1).item() + 1e-6)
    assert adv == pytest.approx([scaled_half, -scaled_half, -scaled_half, scaled_half], abs=1e-15)


def test_singleton_groups_give_rloo_the_reward_and_grpo_zero():
    assert algo.rollout_advantages([0.7], ["g"], ["a"], "rloo") == [0.7]
    assert algo.rollout_advantages([0.7], ["g"], ["a"], "grpo") == [0.0]
    assert algo.rollout_advantages([0.7], ["g"], ["a"], "dr_grpo") == [0.0]


def test_reinforce_baseline_is_dr_grpo_scaled_by_one_batch_wide_std():
    rewards = [1.0, 0.0, 0.5, 3.0, -1.0, 2.0, 2.5]
    groups = ["g", "g", "g", "h", "h", "h", "h"]
    centered = torch.tensor(algo.rollout_advantages(rewards, groups, list("abcdefg"), "dr_grpo"))
    adv = torch.tensor(algo.rollout_advantages(rewards, groups, list("abcdefg"), "reinforce_baseline"))
    torch.testing.assert_close(adv, centered / (centered.std(correction=1) + 1e-6), rtol=0, atol=1e-14)


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo", "grpo", "dr_grpo", "gspo"])
def test_segments_of_one_rollout_count_once_in_the_group_baseline(estimator):
    rewards, groups = [1.0, 0.0, 0.0], ["g", "g", "g"]
    unsplit = algo.rollout_advantages(rewards, groups, ["a", "b", "c"], estimator)
    # rollout "a" is split into 3 segments (rows); every row carries a's reward and must get a's advantage
    split_rows = ["a", "a", "a", "b", "c"]
    split = algo.rollout_advantages([1.0, 1.0, 1.0, 0.0, 0.0], ["g"] * 5, split_rows, estimator)
    assert split == pytest.approx([unsplit[0]] * 3 + unsplit[1:], abs=1e-15)
    # trap armed: counting each segment as its own rollout changes the baseline
    as_rollouts = algo.rollout_advantages([1.0, 1.0, 1.0, 0.0, 0.0], ["g"] * 5, list("vwxyz"), estimator)
    assert as_rollouts != pytest.approx(split, abs=1e-3)


def test_rows_of_one_rollout_with_different_rewards_are_refused():
    with pytest.raises(ValueError, match="rows of rollout 'a' disagree"):
        algo.rollout_advantages([1.0, 0.0, 0.5], ["g", "g", "g"], ["a", "a", "b"], "grpo")
    with pytest.raises(ValueError, match="equally long"):
        algo.rollout_advantages([1.0, 0.0], ["g"], ["a", "b"], "grpo")


def test_rollout_advantages_refuses_on_policy_distill():
    with pytest.raises(ValueError, match="call distill_advantages"):
        algo.rollout_advantages([1.0], ["g"], ["a"], "on_policy_distill")


# ---- expected gradients on the K-armed bandit (exact enumeration of group outcomes) ----


@pytest.mark.parametrize("estimator,scale", [("reinforce", 1.0), ("rloo", 1.0), ("dr_grpo", 2 / 3)])
def test_expected_gradient_of_unbiased_estimators_is_the_exact_policy_gradient(estimator, scale):
    # rloo is unbiased; dr_grpo's baseline includes the sample itself, shrinking the gradient by (G-1)/G
    grad = grad_of(lambda th: expected_bandit_loss(th, THETA_PROX, estimator, group_size=3), THETA_PROX)
    torch.testing.assert_close(grad, -scale * exact_policy_gradient(THETA_PROX, ARM_REWARDS), rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_grpo_with_two_samples_follows_the_pairwise_win_rate(estimator):
    # G=2: A_1 = sign(R_1 - R_2) / sqrt(2), so the expected gradient is -(1/sqrt 2) sum_a pi_a W_a (e_a - pi)
    # with the win rate W_a = sum_b pi_b sign(R_a - R_b): GRPO on two samples is REINFORCE on a rank reward
    grad = grad_of(lambda th: expected_bandit_loss(th, THETA_PROX, estimator, group_size=2), THETA_PROX)
    pi = torch.softmax(THETA_PROX, 0)
    win_rate = torch.stack([(pi * torch.sign(ARM_REWARDS[a] - ARM_REWARDS)).sum() for a in range(K_ARMS)])
    expected = -exact_policy_gradient(THETA_PROX, win_rate) / math.sqrt(2)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5)  # 1e-5: the 1e-6 std epsilon


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gspo"])
def test_autograd_of_expected_clipped_surrogate_matches_finite_differences_away_from_theta_prox(estimator):
    theta = THETA_PROX + torch.tensor([0.25, -0.15, 0.05])  # far enough that some ratios are clipped
    pi_ratio = torch.softmax(theta, 0) / torch.softmax(THETA_PROX, 0)
    assert ((pi_ratio < 0.8) | (pi_ratio > 1.28)).any() and ((pi_ratio > 0.8) & (pi_ratio < 1.28)).any()

    def loss(th):
        return expected_bandit_loss(th, THETA_PROX, estimator, group_size=3)

    torch.testing.assert_close(grad_of(loss, theta), central_differences(loss, theta), rtol=0, atol=1e-9)


def test_ppo_clip_gradient_at_theta_old_equals_the_weighted_reinforce_gradient():
    logits, input_ids, loss_mask, gen = random_sequence_batch()
    advantages = torch.randn(loss_mask.shape, generator=gen) * loss_mask
    is_weights = torch.rand(loss_mask.shape, generator=gen) + 0.5
    n_tokens = loss_mask.sum().item()
    prox_logprobs = token_logprobs(logits, input_ids).detach()

    def ppo(lg):
        token_loss, _ = algo.policy_loss(token_logprobs(lg, input_ids), prox_logprobs, advantages, loss_mask,
                                         AlgoConfig(), is_weights)
        return (token_loss * algo.loss_weights(loss_mask, "token_mean", n_tokens, 6)).sum()

    def reinforce(lg):  # -(1/N) sum_t w_t A_t grad log pi(y_t)
        return -(is_weights * advantages * token_logprobs(lg, input_ids) * loss_mask).sum() / n_tokens

    torch.testing.assert_close(grad_of(ppo, logits), grad_of(reinforce, logits), rtol=0, atol=1e-12)
    _, metrics = algo.policy_loss(prox_logprobs, prox_logprobs, advantages, loss_mask, AlgoConfig(), is_weights)
    assert metrics == {"clip_frac": 0.0, "dual_clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}


def test_ppo_clip_uses_separate_low_and_high_bounds():
    prox = torch.zeros(1, 5)
    logprobs = torch.log(torch.tensor([[1.0, 0.7, 0.85, 1.2, 1.4]]))
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
    cfg = AlgoConfig(clip_low=0.2, clip_high=0.28)
    loss_pos, m = algo.policy_loss(logprobs, prox, mask.clone(), mask, cfg)
    torch.testing.assert_close(loss_pos, -torch.tensor([[0.0, 0.7, 0.85, 1.2, 1.28]]), rtol=0, atol=1e-12)
    assert m["clip_frac"] == 0.25
    loss_neg, m = algo.policy_loss(logprobs, prox, -mask, mask, cfg)
    torch.testing.assert_close(loss_neg, torch.tensor([[0.0, 0.8, 0.85, 1.2, 1.4]]), rtol=0, atol=1e-12)
    assert m["clip_frac"] == 0.25


def test_is_weights_carry_no_gradient():
    logits, input_ids, loss_mask, gen = random_sequence_batch()
    logprobs = token_logprobs(logits.requires_grad_(True), input_ids)
    is_weights = (torch.rand(loss_mask.shape, generator=gen) + 0.5).requires_grad_(True)
    # trap armed: a plain product with these weights would send gradient into them
    (is_weights * logprobs.detach()).sum().backward()
    assert is_weights.grad is not None
    is_weights.grad = None
    token_loss, _ = algo.policy_loss(logprobs, logprobs.detach(), loss_mask, loss_mask, AlgoConfig(), is_weights)
    token_loss.sum().backward()
    assert is_weights.grad is None and logits.grad is not None


# ---- GSPO ----


def test_gspo_token_gradient_equals_rollout_level_gspo_gradient_for_rollout_advantages():
    logits, input_ids, loss_mask, gen = random_sequence_batch(seed=1)
    prox_logprobs = (token_logprobs(logits, input_ids) + 0.3 * torch.randn(loss_mask.shape, generator=gen)).detach()
    seq_advantage = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3, 2.0])
    advantages = seq_advantage[:, None] * loss_mask
    cfg = AlgoConfig(estimator="gspo", clip_low=0.1, clip_high=0.1)

    def gspo_token(lg):
        token_loss, _ = algo.policy_loss(token_logprobs(lg, input_ids), prox_logprobs, advantages, loss_mask, cfg)
        return (token_loss * algo.loss_weights(loss_mask, "seq_mean_token_mean", 36.0, 6)).sum()

    def seq_ratio(lg):  # s_i = exp(mean_t log(pi / pi_prox)), differentiable
        log_ratio = (token_logprobs(lg, input_ids) - prox_logprobs) * loss_mask
        return torch.exp(log_ratio.sum(-1) / loss_mask.sum(-1))

    def gspo_sequence(lg):  # -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)
        s = seq_ratio(lg)
        return -torch.minimum(s * seq_advantage, s.clamp(0.9, 1.1) * seq_advantage).mean()

    s = seq_ratio(logits)
    assert ((s < 0.9) | (s > 1.1)).any() and ((s > 0.9) & (s < 1.1)).any()  # both branches exercised
    torch.testing.assert_close(grad_of(gspo_token, logits), grad_of(gspo_sequence, logits), rtol=0, atol=1e-12)


def test_gspo_ratio_of_a_sealed_rollout_spans_all_its_rows():
    # rows 0+1 are one rollout sealed in two (its context was rewritten), rows 2..5 one row each
    logits, input_ids, loss_mask, gen = random_sequence_batch(seed=3)
    prox_logprobs = (token_logprobs(logits, input_ids) + 0.3 * torch.randn(loss_mask.shape, generator=gen)).detach()
    index = invariants.rollout_index(["r0", "r0", "r1", "r2", "r3", "r4"])
    seq_advantage = torch.tensor([1.0, 1.0, -0.5, 0.8, -1.2, 0.3])           # a rollout's rows share its advantage
    advantages = seq_advantage[:, None] * loss_mask
    cfg = AlgoConfig(estimator="gspo", clip_low=0.1, clip_high=0.1)
    global_rollouts = 5.0
    weights = algo.loss_weights(loss_mask, "seq_mean_token_mean", loss_mask.sum().item(), global_rollouts,
                                rollout_index=index)

    def gspo_token(lg):
        token_loss, _ = algo.policy_loss(token_logprobs(lg, input_ids), prox_logprobs, advantages, loss_mask, cfg,
                                         rollout_index=index)
        return (token_loss * weights).sum()

    def gspo_sequence(lg):  # the rollout's ratio over the tokens of both its rows, then the mean over rollouts
        log_ratio = (token_logprobs(lg, input_ids) - prox_logprobs) * loss_mask
        s = torch.exp(torch.stack([log_ratio[:2].sum() / loss_mask[:2].sum()] +
                                  [log_ratio[b].sum() / loss_mask[b].sum() for b in range(2, 6)]))
        a = torch.cat([seq_advantage[:1], seq_advantage[2:]])
        return -torch.minimum(s * a, s.clamp(0.9, 1.1) * a).mean()

    torch.testing.assert_close(grad_of(gspo_token, logits), grad_of(gspo_sequence, logits), rtol=0, atol=1e-12)
    # armed: one ratio per ROW (the rows as separate rollouts) is another gradient
    per_row = algo.loss_weights(loss_mask, "seq_mean_token_mean", loss_mask.sum().item(), 6.0)

    def gspo_rows(lg):
        token_loss, _ = algo.policy_loss(token_logprobs(lg, input_ids), prox_logprobs, advantages, loss_mask, cfg)
        return (token_loss * per_row).sum()
    assert (grad_of(gspo_rows, logits) - grad_of(gspo_sequence, logits)).abs().max() > 1e-3


def test_a_rollout_sealed_into_three_rows_weighs_once_in_the_rollout_mean():
    loss_mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0],
                              [0.0, 1.0, 1.0, 0.0]])
    index = invariants.rollout_index(["sealed", "sealed", "sealed", "plain"])
    assert invariants.count_rollouts(loss_mask, index) == 2
    weights = algo.loss_weights(loss_mask, "seq_mean_token_mean", loss_mask.sum().item(), 2.0, rollout_index=index)
    per_rollout = [weights[:3].sum().item(), weights[3].sum().item()]
    assert per_rollout == pytest.approx([0.5, 0.5], abs=1e-7)          # each rollout is half of the loss
    torch.testing.assert_close(weights[:3][loss_mask[:3] > 0], torch.full((6,), 1 / 12))  # its 6 tokens alike
    rows_as_rollouts = algo.loss_weights(loss_mask, "seq_mean_token_mean", loss_mask.sum().item(), 4.0)
    assert rows_as_rollouts[:3].sum().item() == pytest.approx(0.75)    # armed: per row it weighs three times


def test_gspo_ratio_is_one_at_theta_prox():
    logits, input_ids, loss_mask, _ = random_sequence_batch()
    logprobs = token_logprobs(logits, input_ids)
    token_loss, metrics = algo.policy_loss(logprobs, logprobs, loss_mask, loss_mask, AlgoConfig(estimator="gspo"))
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    torch.testing.assert_close(token_loss, -loss_mask, rtol=0, atol=0)


# ---- KL estimators ----

Q_LOGITS = torch.tensor([0.5, -0.3, 0.2, 1.0], dtype=torch.float64)
P_LOGITS = torch.tensor([-0.2, 0.4, 0.1, 0.3], dtype=torch.float64)


def categorical_kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    return (log_a.exp() * (log_a - log_b)).sum()


def test_k1_and_k3_are_unbiased_for_reverse_kl_and_k2_is_not():
    log_q, log_p = torch.log_softmax(Q_LOGITS, 0), torch.log_softmax(P_LOGITS, 0)
    kl = categorical_kl(log_q, log_p)
    for estimator in ("k1", "k3"):
        expected = (log_q.exp() * algo.kl_divergence(log_q, log_p, estimator)).sum()
        torch.testing.assert_close(expected, kl, rtol=0, atol=1e-15)
    k2 = (log_q.exp() * algo.kl_divergence(log_q, log_p, "k2")).sum()
    assert abs(k2 - kl) > 1e-3
    assert (algo.kl_divergence(log_q, log_p, "k3") >= 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_gradients_as_losses(estimator):
    # on-policy samples x ~ q: the sampling weights q_x are constants; autodiff only through log q(x)
    log_p = torch.log_softmax(P_LOGITS, 0)

    def expected_loss(theta):
        log_q = torch.log_softmax(theta, 0)
        return (log_q.exp().detach() * algo.kl_divergence(log_q, log_p, estimator)).sum()

    target = {
        "k1": lambda th: 0.0 * th.sum(),  # E grad k1 = 0
        "k2": lambda th: categorical_kl(torch.log_softmax(th, 0), log_p),  # reverse KL(q || p)
        "k3": lambda th: categorical_kl(log_p, torch.log_softmax(th, 0)),  # forward KL(p || q)
    }[estimator]
    torch.testing.assert_close(grad_of(expected_loss, Q_LOGITS), grad_of(target, Q_LOGITS), rtol=0, atol=1e-14)


def test_kl_in_reward_with_reinforce_gives_the_exact_gradient_of_the_kl_regularised_return():
    # two-step sequence bandit, tabular policy: theta1 [K] for y1, theta2 [K, K] for y2 given y1
    k, beta = 3, 0.4
    gen = torch.Generator().manual_seed(3)
    theta_prox = torch.randn(k + k * k, generator=gen)
    ref = torch.randn(k + k * k, generator=gen)
    seq_reward = torch.randn(k, k, generator=gen)

    def step_logprobs(theta):  # log pi(y1) [K] and log pi(y2 | y1) [K, K]
        return torch.log_softmax(theta[:k], 0), torch.log_softmax(theta[k:].reshape(k, k), 1)

    def exact_objective(theta):  # J = E[R] - beta KL(pi || ref) over whole sequences
        (l1, l2), (r1, r2) = step_logprobs(theta), step_logprobs(ref)
        log_seq, log_ref = l1[:, None] + l2, r1[:, None] + r2
        return (log_seq.exp() * (seq_reward - beta * (log_seq - log_ref))).sum()

    ys = list(itertools.product(range(k), repeat=2))
    y1, y2 = torch.tensor([y[0] for y in ys]), torch.tensor([y[1] for y in ys])
    mask = torch.tensor([[0.0, 1.0, 1.0]]).repeat(len(ys), 1)

    def rows(theta):  # [B, 3] token logprobs, position 0 is the prompt
        l1, l2 = step_logprobs(theta)
        return torch.stack([torch.zeros(len(ys)), l1[y1], l2[y1, y2]], 1)

    prox, ref_rows = rows(theta_prox), rows(ref)
    prob = prox.sum(-1).exp()
    rewards = algo.rollout_advantages(seq_reward[y1, y2].tolist(), [f"s{i}" for i in range(len(ys))],
                                      [f"r{i}" for i in range(len(ys))], "reinforce")
    penalty = algo.kl_reward_penalty(prox, ref_rows, mask, beta, "k1")
    cfg = AlgoConfig(estimator="reinforce", kl_coef=beta, kl_in_reward=True)

    def expected_loss(theta, advantages):
        token_loss, _ = algo.policy_loss(rows(theta), prox, advantages, mask, cfg)
        return (prob[:, None] * token_loss).sum()

    advantages = torch.tensor(rewards)[:, None] * mask + penalty
    exact = -grad_of(exact_objective, theta_prox)
    torch.testing.assert_close(grad_of(lambda th: expected_loss(th, advantages), theta_prox), exact, rtol=0, atol=1e-12)
    # trap armed: a per-token penalty (no sum over later tokens) misses the effect of y1 on the KL of y2
    per_token = torch.tensor(rewards)[:, None] * mask - beta * algo.kl_divergence(prox, ref_rows, "k1") * mask
    assert (grad_of(lambda th: expected_loss(th, per_token), theta_prox) - exact).abs().max() > 1e-3


def test_on_policy_distill_expected_gradient_is_the_reverse_kl_gradient_to_the_teacher():
    strength = 0.7
    log_teacher = torch.log_softmax(P_LOGITS, 0)
    arms = torch.arange(4)
    mask = torch.tensor([[0.0, 1.0]]).repeat(4, 1)
    prox = torch.stack([torch.zeros(4), torch.log_softmax(Q_LOGITS, 0)], 1)
    teacher = torch.stack([torch.zeros(4), log_teacher[arms]], 1)
    advantages = algo.distill_advantages(teacher, prox, mask, kl_coef=strength)
    cfg = AlgoConfig(estimator="on_policy_distill", kl_coef=strength)

    def expected_loss(theta):
        logprobs = torch.stack([torch.zeros(4), torch.log_softmax(theta, 0)], 1)
        token_loss, _ = algo.policy_loss(logprobs, prox, advantages, mask, cfg)
        return (prox[:, 1].exp()[:, None] * token_loss).sum()

    reverse_kl = lambda th: strength * categorical_kl(torch.log_softmax(th, 0), log_teacher)  # noqa: E731
    torch.testing.assert_close(grad_of(expected_loss, Q_LOGITS), grad_of(reverse_kl, Q_LOGITS), rtol=0, atol=1e-14)
    assert advantages[:, 0].abs().sum() == 0 and not advantages.requires_grad


def test_kl_loss_term_is_off_when_kl_is_a_reward_or_the_reference_is_a_teacher():
    assert algo.kl_loss_coef(AlgoConfig(kl_coef=0.1)) == 0.1
    assert algo.kl_loss_coef(AlgoConfig(estimator="reinforce", kl_coef=0.1, kl_in_reward=True)) == 0.0
    assert algo.kl_loss_coef(AlgoConfig(estimator="on_policy_distill", kl_coef=1.0)) == 0.0


# ---- loss aggregation ----


GROUPS = invariants.rollout_index(["p", "p", "q", "r", "r", "r"])   # random_sequence_batch's rows as 3 prompts


@pytest.mark.parametrize("mode", algo.LOSS_AGGREGATIONS)
def test_global_aggregation_gradient_is_unchanged_by_micro_batch_split(mode):
    logits, input_ids, loss_mask, gen = random_sequence_batch(seed=2)
    prox_logprobs = (token_logprobs(logits, input_ids) + 0.1 * torch.randn(loss_mask.shape, generator=gen)).detach()
    advantages = torch.randn(loss_mask.shape, generator=gen) * loss_mask
    global_tokens, global_rollouts, max_len = loss_mask.sum().item(), float(len(loss_mask)), loss_mask.shape[1]
    splits = [slice(0, 2), slice(2, 3), slice(3, 6)]  # micro-batches (or ranks) with different token counts, each
                                                      # holding whole groups, as actor.py and runtime.py deal them

    step_weights = algo.loss_weights(loss_mask, mode, global_tokens, global_rollouts, max_len, group_index=GROUPS,
                                     global_groups=3.0)                                          # once per step

    def loss(lg, rows, weights):
        token_loss, _ = algo.policy_loss(token_logprobs(lg[rows], input_ids[rows]), prox_logprobs[rows],
                                         advantages[rows], loss_mask[rows], AlgoConfig())
        return (token_loss * weights).sum()

    full = grad_of(lambda lg: loss(lg, slice(0, 6), step_weights), logits)
    # the micro-batch way (actor.py's own forward): each split's numerators, the step's denominator at the end
    summed = sum(grad_of(lambda lg: loss(lg, rows, algo.loss_numerators(
        loss_mask[rows], mode, max_len, group_index=invariants.rollout_index(GROUPS[rows].tolist()))), logits)
        for rows in splits) / algo.loss_denominator(mode, global_tokens, global_rollouts, 3.0)
    accumulated = sum(grad_of(lambda lg: loss(lg, rows, step_weights[rows]), logits) for rows in splits)
    torch.testing.assert_close(accumulated, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(summed, full, rtol=0, atol=1e-12)
    if mode == "token_mean":  # trap armed: a per-micro-batch token mean (averaged over micro-batches) is wrong
        local = sum(grad_of(lambda lg: loss(lg, rows, algo.loss_weights(loss_mask[rows], mode,
                                                                        loss_mask[rows].sum().item(), 1.0)), logits)
                    for rows in splits)
        assert (local / len(splits) - full).abs().max() > 1e-4
    if mode == "prompt_mean_token_mean":  # trap armed: a micro-batch that splits a group miscounts its tokens
        torn = [slice(0, 1), slice(1, 3), slice(3, 6)]
        split_group = sum(grad_of(lambda lg: loss(lg, rows, algo.loss_numerators(
            loss_mask[rows], mode, group_index=invariants.rollout_index(GROUPS[rows].tolist()))), logits)
            for rows in torn) / 3.0
        assert (split_group - full).abs().max() > 1e-4


def test_prompt_mean_token_mean_is_the_mean_over_prompts_of_each_prompts_token_mean():
    """Reference from the definition (DAPO's token-level loss, per prompt group, then a mean over prompts), written
    with loops; rows of one rollout sealed in two count in their group once, as one rollout's tokens."""
    gen = torch.Generator().manual_seed(4)
    loss_mask = (torch.rand(6, 7, generator=gen) > 0.3).double()
    loss_mask[:, 0] = 0.0
    loss_mask[4] = 0.0                                # a row with no kept token: its group still counts once
    token_loss = torch.randn(6, 7, generator=gen)
    groups = ["p", "p", "p", "q", "r", "r"]           # rows 0 and 1: one rollout sealed in two
    index = invariants.rollout_index(groups)
    kept_groups = float(invariants.count_rollouts(loss_mask, index))
    ours = (token_loss * algo.loss_weights(loss_mask, "prompt_mean_token_mean", loss_mask.sum().item(), 5.0,
                                           group_index=index, global_groups=kept_groups)).sum()
    prompt_means = []
    for g in dict.fromkeys(groups):
        tokens = [token_loss[b, t] for b in range(6) for t in range(7) if groups[b] == g and loss_mask[b, t]]
        if tokens:
            prompt_means.append(sum(tokens) / len(tokens))
    assert kept_groups == 3 and abs(ours - sum(prompt_means) / len(prompt_means)) <= 1e-12
    # negative control: the rollout mean (GRPO's) weighs rollouts, not prompts, and is another number here
    rollouts = invariants.rollout_index(["a", "a", "b", "c", "d", "e"])
    grpo = (token_loss * algo.loss_weights(loss_mask, "seq_mean_token_mean", loss_mask.sum().item(),
                                           float(invariants.count_rollouts(loss_mask, rollouts)),
                                           rollout_index=rollouts)).sum()
    assert abs(grpo - ours) > 1e-3
    with pytest.raises(ValueError, match="pass group_index"):
        algo.loss_weights(loss_mask, "prompt_mean_token_mean", 1.0, 1.0, global_groups=1.0)


def test_dr_grpo_aggregation_weights_every_token_equally_regardless_of_length():
    loss_mask = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    token_loss = torch.ones(2, 4, requires_grad=True)
    (token_loss * algo.loss_weights(loss_mask, "seq_mean_token_sum_norm", 4.0, 2.0, token_budget=4)).sum().backward()
    torch.testing.assert_close(token_loss.grad, loss_mask / 8, rtol=0, atol=0)
    token_loss.grad = None  # contrast: the GRPO per-rollout mean up-weights the short rollout's token
    (token_loss * algo.loss_weights(loss_mask, "seq_mean_token_mean", 4.0, 2.0)).sum().backward()
    torch.testing.assert_close(token_loss.grad[:, 1], torch.tensor([0.5, 1 / 6]), rtol=0, atol=1e-15)


def test_aggregation_refuses_a_non_positive_global_count():
    with pytest.raises(ValueError, match="global_tokens must be > 0"):
        algo.loss_weights(torch.zeros(1, 2), "token_mean", 0.0, 1.0)
    with pytest.raises(ValueError, match="pass token_budget"):   # Dr.GRPO's constant is the run's, never guessed
        algo.loss_weights(torch.ones(1, 2), "seq_mean_token_sum_norm", 2.0, 1.0)


# ---- config validation ----


@pytest.mark.parametrize("kwargs,n_samples,match", [
    (dict(estimator="ppo_magic"), 4, "unknown estimator 'ppo_magic'"),
    (dict(kl_estimator="k4"), 4, "unknown kl_estimator 'k4'"),
    (dict(loss_agg="seq_sum"), 4, "unknown loss_agg 'seq_sum'"),
    (dict(clip_low=0.0), 4, "clip bounds must satisfy"),
    (dict(clip_high=-0.1), 4, "clip bounds must satisfy"),
    (dict(clip_low=1.0), 4, "clip bounds must satisfy"),
    (dict(kl_coef=-0.01), 4, "kl_coef must be >= 0"),
    (dict(estimator="grpo", kl_coef=0.1, kl_in_reward=True), 4, "would be silently ignored"),
    (dict(estimator="rloo", kl_coef=0.1, kl_in_reward=True), 4, "would be silently ignored"),
    (dict(estimator="on_policy_distill", kl_coef=1.0, kl_in_reward=True), 4, "already uses the teacher"),
    (dict(estimator="reinforce", kl_coef=0.0, kl_in_reward=True), 4, "adds nothing"),
    (dict(estimator="on_policy_distill"), 1, "needs a teacher"),
    (dict(estimator="grpo"), 1, "estimator 'grpo' compares samples of one prompt"),
    (dict(estimator="reinforce_baseline"), 1, "compares samples of one prompt"),
    (dict(estimator="reinforce", filter_zero_variance=True), 1, "filter_zero_variance compares samples"),
    (dict(dual_clip=1.0), 4, "dual_clip must be 0"),
    (dict(dual_clip=math.inf), 4, "dual_clip must be 0"),
    (dict(estimator="gspo", dual_clip=3.0), 4, "GSPO's ratio is its rollout's geometric mean"),
    (dict(estimator="on_policy_distill", kl_coef=1.0, overlong_buffer=8), 1, "on_policy_distill never reads"),
    (dict(estimator="on_policy_distill", kl_coef=1.0, stop_penalty=0.0), 1, "on_policy_distill never reads"),
    (dict(overlong_buffer=-1), 4, "overlong_buffer must be >= 0"),
    (dict(overlong_buffer=8, overlong_penalty=0.0), 4, "overlong_penalty a finite value > 0"),
    (dict(stop_penalty=1.5), 4, "would reward running out of tokens"),
    (dict(stop_penalty=math.nan), 4, "stop_penalty must be in"),
])
def test_validate_algo_refuses_silently_wrong_configs(kwargs, n_samples, match):
    with pytest.raises(ValueError, match=match):
        algo.validate_algo(AlgoConfig(**kwargs), n_samples)


@pytest.mark.parametrize("kwargs,n_samples", [
    (dict(), 4),
    (dict(estimator="reinforce", kl_coef=0.05, kl_in_reward=True, kl_estimator="k1"), 1),
    (dict(estimator="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq_mean_token_mean"), 8),
    (dict(estimator="on_policy_distill", kl_coef=1.0), 1),
    (dict(estimator="dr_grpo", loss_agg="seq_mean_token_sum_norm", filter_zero_variance=True), 2),
    (dict(dual_clip=3.0, loss_agg="prompt_mean_token_mean", overlong_buffer=16, stop_penalty=0.0), 4),
])
def test_validate_algo_accepts_sound_configs(kwargs, n_samples):
    algo.validate_algo(AlgoConfig(**kwargs), n_samples)


def test_an_overlong_buffer_longer_than_the_reply_cap_is_refused_and_one_within_accepted():
    with pytest.raises(ValueError, match=r"longer than rollout.max_tokens \(64\): even an empty reply"):
        algo.validate_algo(AlgoConfig(overlong_buffer=65), 4, max_tokens=64)
    algo.validate_algo(AlgoConfig(overlong_buffer=64, overlong_penalty=0.5, stop_penalty=-0.5), 4, max_tokens=64)


# ---- reward shaping ----


def dapo_length_reward(length: int, max_length: int, cache: int) -> float:
    """DAPO (2503.14476) Soft Overlong Punishment, as the paper writes it: 0 while |y| <= L_max - L_cache,
    ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond."""
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return ((max_length - cache) - length) / cache
    return -1.0


def test_the_overlong_punishment_is_dapos_piecewise_length_reward_times_the_factor():
    lengths = list(range(0, 70))
    rewards = [(-1.0) ** n for n in lengths]
    cfg = AlgoConfig(overlong_buffer=16, overlong_penalty=0.5)
    shaped = algo.shape_rewards(rewards, lengths, [False] * len(lengths), cfg, max_tokens=64)
    expected = [r + 0.5 * dapo_length_reward(n, 64, 16) for r, n in zip(rewards, lengths)]
    assert max(abs(a - b) for a, b in zip(shaped, expected)) <= 1e-15
    assert sum(a != r for a, r in zip(shaped, rewards)) == 69 - 48, "armed: replies past the edge only"
    assert algo.shape_rewards(rewards, lengths, [True] * len(lengths), AlgoConfig(), 64) == rewards  # defaults: off


# ---- dynamic filtering ----


def test_dynamic_filtering_drops_zero_variance_groups_and_dedupes_segments():
    # group g: rollout a (3 segments, reward 1) and b (reward 1) -> all equal, dropped
    # group h: rollout c (2 segments, reward 1) and d (reward 0) -> kept, every segment of c kept
    rewards = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    groups = ["g", "g", "g", "g", "h", "h", "h"]
    rollouts = ["a", "a", "a", "b", "c", "c", "d"]
    assert algo.keep_groups_with_variance(rewards, groups, rollouts) == [False] * 4 + [True] * 3
    with pytest.raises(ValueError, match="rows of rollout 'c' disagree"):
        algo.keep_groups_with_variance([1.0, 0.0, 0.0], ["h"] * 3, ["c", "c", "d"])
