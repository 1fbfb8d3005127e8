# Claims of GAE (algo.gae_advantages, algo.value_loss) and of critic.py: GAE equals verl's
# compute_gae_advantage_return and an independent reference with the observation gaps between turns transparent
# (lambda = 1 gives Monte-Carlo returns; a gap carries V and A across it), a GAE that is not transparent gives another
# answer; a sealed rollout's rows are one chain, a chat agent's side line a chain of its own; the clipped value loss
# equals verl's compute_value_loss; the critic's gradient is the hand-derived and finite-difference one; its values
# replay MoE routes; its checkpoint resumes exactly; the warm-up trains the critic alone (the actor bitwise
# unchanged, no weight push); and the config refuses what would train silently wrong. Two FSDP2 ranks training the
# critic as one process does: tests/test_runtime.py, beside the actor's.
import json
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import actor
import algo
import config
import critic
import data
import engines
import invariants
import models
import rollout
import train
from engines import r3
from conftest import import_peer
from router import Router
from session import ChatSession
from test_actor import free_port, make_batch, max_abs_diff, select_rows

# ---- fixtures and builders ----


@pytest.fixture(scope="module")
def verl_core():
    return import_peer("verl.trainer.ppo.core_algos")


def episode_masks(seed: int = 0, rows: int = 6, width: int = 24, gaps: bool = True) -> tuple[torch.Tensor, ...]:
    """Right-padded multi-turn rows: a prompt, then turns of sampled tokens with observations (context) between
    them when `gaps`; random token values V and one reward per row on its last sampled token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for b in range(rows):
        length = int(torch.randint(width // 2, width + 1, (1,), generator=g))
        t = int(torch.randint(2, 5, (1,), generator=g))     # the prompt
        while t < length:
            turn = int(torch.randint(2, 6, (1,), generator=g))
            mask[b, t:min(t + turn, length)] = 1.0
            t += turn + (int(torch.randint(2, 5, (1,), generator=g)) if gaps else 0)   # an observation
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    rewards = torch.randn(rows, generator=g, dtype=torch.float64)
    return mask, values, rewards


def reference_gae(mask: torch.Tensor, values: torch.Tensor, rewards: torch.Tensor, gamma: float,
                  lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, another way: each row's sampled tokens in order are the episode's actions (the observations
    between turns are not steps of it), GAE runs over that list in plain Python floats, and the answers go back to
    their positions."""
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(mask.shape[0]):
        actions = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        v = [float(values[b, t]) for t in actions] + [0.0]          # V after the last action: 0
        r = [0.0] * (len(actions) - 1) + [float(rewards[b])]
        a = 0.0
        for i in reversed(range(len(actions))):
            a = r[i] + gamma * v[i + 1] - v[i] + gamma * lam * a
            advantages[b, actions[i]], returns[b, actions[i]] = a, a + v[i]
    return advantages, returns


# ---- GAE ----

@pytest.mark.parametrize("gaps", [False, True], ids=["one_turn", "turns_with_observations"])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_equals_verls_compute_gae_advantage_return(verl_core, gaps, gamma, lam):
    mask, values, rewards = episode_masks(gaps=gaps)
    token_rewards = algo.token_rewards(rewards, mask)
    ours, our_returns = algo.gae_advantages(token_rewards, values, mask, gamma, lam, whiten=True)
    theirs, their_returns = verl_core.compute_gae_advantage_return(token_rewards, values, mask.double(),
                                                                   torch.tensor(gamma), torch.tensor(lam))
    on = mask.bool()
    # verl whitens with 1e-8 added to its token counts; our float32 output rounds at ~6e-8 of an advantage
    assert (ours.double() - theirs)[on].abs().max() <= 2e-6
    assert (our_returns.double() - their_returns)[on].abs().max() <= 1e-6
    assert (ours[~on] == 0).all() and (our_returns[~on] == 0).all()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (1.0, 0.0)])
def test_gae_with_observation_gaps_equals_the_reference_over_the_actions_alone(gamma, lam):
    mask, values, rewards = episode_masks(seed=1)
    assert ((mask[:, 1:] - mask[:, :-1]) > 0).sum() > mask.shape[0], "armed: rows with several turns"
    ours, returns = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, gamma, lam, whiten=False)
    want, want_returns = reference_gae(mask, values, rewards, gamma, lam)
    assert (ours.double() - want).abs().max() <= 1e-6
    assert (returns.double() - want_returns).abs().max() <= 1e-6


def test_lambda_one_gives_monte_carlo_returns_and_a_gap_carries_the_next_value():
    mask, values, rewards = episode_masks(seed=2)
    gamma = 0.9
    advantages, returns = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, gamma, 1.0,
                                              whiten=False)
    for b in range(mask.shape[0]):
        actions = mask[b].nonzero().squeeze(-1).tolist()
        for i, t in enumerate(actions):       # the return of a token: R discounted over the ACTIONS still to come
            mc = rewards[b] * gamma ** (len(actions) - 1 - i)
            assert math.isclose(returns[b, t], mc, abs_tol=1e-6)
            assert math.isclose(advantages[b, t], mc - values[b, t], abs_tol=1e-6)
    # lambda = 0: the last token of a turn is bootstrapped by the first token of the next turn, across the gap
    advantages, _ = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, 1.0, 0.0, whiten=False)
    b = 0
    actions = mask[b].nonzero().squeeze(-1).tolist()
    ends = [i for i in range(len(actions) - 1) if actions[i + 1] > actions[i] + 1]
    assert ends, "armed: a turn followed by an observation"
    for i in ends:
        t, next_t = actions[i], actions[i + 1]
        assert math.isclose(advantages[b, t], values[b, next_t] - values[b, t], abs_tol=1e-6)


def test_a_gae_that_steps_through_the_observations_gives_another_answer():
    """Negative control: the trap (the observation tokens counted as steps of the episode, with V = 0 there and
    the discount applied, as a plain recursion over every position does) is armed, and the answer differs."""
    mask, values, rewards = episode_masks(seed=3)
    gamma, lam = 0.99, 0.95
    ours, _ = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, gamma, lam, whiten=False)
    every_position = torch.ones_like(mask)          # the trap: every position a step, V off the mask 0
    trap, _ = algo.gae_advantages(algo.token_rewards(rewards, mask), values * mask, every_position, gamma, lam,
                                  whiten=False)
    assert (ours - trap * mask).abs().max() > 1e-2
    ref, _ = reference_gae(mask, values, rewards, gamma, lam)
    assert (ours.double() - ref).abs().max() <= 1e-6


def test_a_rollout_sealed_into_rows_is_one_episode_chained_in_segment_order():
    """A sealed rollout's rows (given out of order, beside a one-row rollout) are one episode: GAE over them equals
    GAE over their sampled tokens end to end in one row, and the reward is counted once, on the last row. The trap
    (each row its own episode, each ending at V = 0 with the rollout's reward) gives another answer."""
    mask, values, rewards = episode_masks(rows=3, seed=4)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        whole = torch.cat([mask[0], mask[1]])[None], torch.cat([values[0], values[1]])[None], rewards[:1]
        want, want_returns = reference_gae(*whole, gamma, lam)
        # rows: [segment 1 of x, the other rollout y, segment 0 of x]; x's reward on every one of its rows
        rows_mask, rows_values = mask[[1, 2, 0]], values[[1, 2, 0]]
        row_rewards = rewards[[0, 2, 0]]
        chains = algo.segment_chains(["x", "y", "x"], [1, 0, 0], ["main"] * 3)
        assert chains == [[2, 0], [1]]
        token_rewards = algo.token_rewards(row_rewards, rows_mask, chains)
        assert float(token_rewards[2].abs().sum()) == 0.0 and float(token_rewards[0].sum()) == float(rewards[0])
        ours, returns = algo.gae_advantages(token_rewards, rows_values, rows_mask, gamma, lam, whiten=False,
                                            chains=chains)
        assert (torch.cat([ours[2], ours[0]]).double() - want[0]).abs().max() <= 1e-6
        assert (torch.cat([returns[2], returns[0]]).double() - want_returns[0]).abs().max() <= 1e-6
        alone, _ = reference_gae(mask[2:], values[2:], rewards[2:], gamma, lam)
        assert (ours[1].double() - alone[0]).abs().max() <= 1e-6
        # the trap: every row an episode of its own (the same answer only at gamma = lambda = 1, where each of
        # x's tokens gets R - V either way)
        unchained, _ = algo.gae_advantages(algo.token_rewards(row_rewards, rows_mask), rows_values, rows_mask, gamma,
                                           lam, whiten=False)
        assert (unchained[2] - ours[2]).abs().max() > 1e-2 or gamma == lam == 1.0
    with pytest.raises(ValueError, match="every one of the 3 rows once"):
        algo.gae_advantages(token_rewards, rows_values, rows_mask, 1.0, 1.0, chains=[[0], [1]])


def side_line_rollout() -> list[invariants.Segment]:
    """A chat agent's rollout on a real session: its main line (offering tools) sealed by an edited history, then a
    side line (a title request: its own system prompt, no tools), as ChatSession.record gives them to train."""
    session = ChatSession(rollout.EmbeddedEngine(models.tiny_model("qwen3", seed=0)), models.bpe_tokenizer(), "r0",
                          "g0", template=data.CHATML_TEMPLATE, sampling=engines.SamplingParams(max_tokens=4, seed=0))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    task = [{"role": "system", "content": "You look things up."}, {"role": "user", "content": "Find x."}]
    session.turn(task, tools)
    edited = task + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "more"}]
    assert not session.turn(edited, tools).extended                              # the main line seals
    session.turn([{"role": "system", "content": "Name this session."}, {"role": "user", "content": "Find x."}])
    rows, generations = session.record("all")
    invariants.check_sampled_once(rows, generations)
    return rows


def test_a_side_line_is_a_gae_chain_of_its_own_beside_its_rollouts_sealed_main_line():
    """The rows carry their line (Segment.line), and each line of a rollout is one chain in its segment order: with
    gamma 1, lambda 0, reward 1 and V = 0.5 / 0.3 / 0.2 on main 0 / main 1 / the side line, main 0's last action
    bootstraps from main 1's first (A = 0.3 - 0.5), and GAE equals the reference over each line's actions alone. The
    trap (rows ordered by segment number alone: the side line's segment 0 between the main line's) gives -0.3."""
    rows = side_line_rollout()
    assert [(r.line, r.segment_id) for r in rows] == [("main", 0), ("main", 1), ("side-1", 0)]
    batch = invariants.build_batch(rows, [0.0] * 3, pad_id=0)
    mask, rewards = batch.loss_mask, torch.ones(3, dtype=torch.float64)
    chains = algo.segment_chains(batch.rollout_ids, [r.segment_id for r in rows], [r.line for r in rows])
    assert chains == [[0, 1], [2]]
    last_of_main_0 = int(mask[0].nonzero().max())
    values = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)[:, None].expand(mask.shape)
    for order, want in [(chains, -0.2), ([[0, 2, 1]], -0.3)]:              # ours, then the trap
        advantages, _ = algo.gae_advantages(algo.token_rewards(rewards, mask, order), values, mask, 1.0, 0.0,
                                            whiten=False, chains=order)
        assert math.isclose(float(advantages[0, last_of_main_0]), want, abs_tol=1e-6)
    g = torch.Generator().manual_seed(6)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    rewards = torch.randn(1, generator=g, dtype=torch.float64).expand(3)    # the rollout's reward on every row
    for gamma, lam in [(1.0, 0.0), (0.99, 0.95), (0.9, 0.5)]:
        ours, returns = algo.gae_advantages(algo.token_rewards(rewards, mask, chains), values, mask, gamma, lam,
                                            whiten=False, chains=chains)
        main, main_returns = reference_gae(torch.cat([mask[0], mask[1]])[None], torch.cat([values[0], values[1]])[None],
                                           rewards[:1], gamma, lam)
        side, side_returns = reference_gae(mask[2:], values[2:], rewards[2:], gamma, lam)
        assert (torch.cat([ours[0], ours[1], ours[2]]).double() - torch.cat([main[0], side[0]])).abs().max() <= 1e-6
        assert (torch.cat([returns[0], returns[1], returns[2]]).double() -
                torch.cat([main_returns[0], side_returns[0]])).abs().max() <= 1e-6


def test_whitening_is_over_the_sampled_tokens_and_the_returns_stay_raw():
    mask, values, rewards = episode_masks(seed=4)
    raw, returns = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, 1.0, 0.95, whiten=False)
    white, white_returns = algo.gae_advantages(algo.token_rewards(rewards, mask), values, mask, 1.0, 0.95)
    on = mask.bool()
    assert abs(float(white[on].mean())) <= 1e-6 and math.isclose(float(white[on].std()), 1.0, rel_tol=1e-5)
    assert torch.equal(returns, white_returns) and (white[~on] == 0).all()
    assert torch.allclose(white[on], (raw[on] - raw[on].mean()) / raw[on].std(), atol=1e-5)


# ---- the value loss ----

@pytest.mark.parametrize("clip", [0.2, 0.05])
def test_value_loss_equals_verls_compute_value_loss(verl_core, clip):
    mask, old, _ = episode_masks(seed=5)
    g = torch.Generator().manual_seed(5)
    values = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    returns = old + torch.randn(old.shape, generator=g, dtype=torch.float64)
    token_loss, metrics = algo.value_loss(values, old, returns, mask, clip)
    theirs, clipfrac = verl_core.compute_value_loss(values, returns, old, mask, clip, "token-mean")
    ours = token_loss.sum() / mask.sum()
    assert abs(float(ours - theirs)) <= 1e-12
    assert math.isclose(metrics["value_clip_frac"], float(clipfrac), abs_tol=1e-9)
    assert metrics["value_clip_frac"] > 0.05, "armed: the clip binds on some tokens"
    # negative control: without the clip the loss is the plain 0.5 (V - R)^2, which verl's clipped one is not
    plain, _ = algo.value_loss(values, old, returns, mask, 0.0)
    assert float(plain.sum() / mask.sum()) < float(theirs) - 1e-3
    assert torch.allclose(plain, 0.5 * (values - returns).square() * mask)


# ---- the critic ----

def test_values_are_the_value_head_on_the_hidden_state_before_each_token(qwen3_dir):
    value_model = critic.Critic(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=2),
                                critic.CriticConfig(), total_steps=1)
    batch = make_batch([9, 6, 11], 3, value_model.model.config.vocab_size)
    values = value_model.compute_values(batch)
    head = value_model.model.lm_head
    assert isinstance(head, critic.ValueHead) and head.weight.shape == (1, value_model.model.config.hidden_size)
    assert not value_model.model.config.tie_word_embeddings
    with torch.no_grad():
        for b, n in enumerate(batch.attention_mask.sum(-1).tolist()):
            hidden = value_model.model.model(input_ids=batch.input_ids[b:b + 1, :n]).last_hidden_state[0]
            want = hidden @ head.weight[0] + head.bias[0]
            assert torch.allclose(values[b, 1:n], want[:n - 1], atol=1e-5) and values[b, 0] == 0
            assert (values[b, n:] == 0).all()


def test_the_critics_gradient_is_the_hand_derived_and_finite_difference_one(qwen3_dir):
    """In float64: the value head's gradient is sum_t m_t (V_t - R_t) (h_{t-1}, 1) / N (0.5 (V - R)^2, no clip in
    effect), and a backbone weight's matches a central finite difference of the same loss."""
    cfg = critic.CriticConfig(lr=1e-3, max_grad_norm=1e9, value_clip=0.0)
    value_model = critic.Critic(qwen3_dir, actor.ActorConfig(precision="fp32"), cfg, total_steps=1)
    value_model.model.double()
    batch = make_batch([9, 7], 3, value_model.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(batch.input_ids.shape, generator=g, dtype=torch.float64) * batch.loss_mask
    mask = batch.loss_mask.double()

    def loss() -> torch.Tensor:
        values = value_model._values(batch.input_ids, batch.attention_mask, [[], []])
        token_loss, _ = algo.value_loss(values, values.detach(), returns, mask, cfg.value_clip)
        return token_loss.sum() / mask.sum()

    value_model.model.zero_grad()
    loss().backward()
    head = value_model.model.lm_head
    with torch.no_grad():
        values = value_model._values(batch.input_ids, batch.attention_mask, [[], []])
        hidden = value_model.model.model(input_ids=batch.input_ids).last_hidden_state    # [B, T, H]
        error = (values - returns) * mask / mask.sum()                                   # [B, T]
        assert torch.allclose(head.bias.grad, error.sum().reshape(1), atol=1e-12)
        by_hand = (error[:, 1:, None] * hidden[:, :-1]).sum((0, 1))
        assert torch.allclose(head.weight.grad[0], by_hand, atol=1e-12)
        # transformers' RMSNorm computes in fp32 whatever the model's dtype, so a weight before a norm sees fp32
        # round-off (~1e-8 of the loss) and takes a wide step; the final norm's weight scales a fixed fp32 result
        # and is exact in float64
        final_norm = value_model.model.model.norm.weight
        up_proj = value_model.model.model.layers[0].mlp.up_proj.weight
        for weight, index, eps, tol in [(final_norm, (3,), 1e-6, 1e-6), (final_norm, (40,), 1e-6, 1e-6),
                                        (up_proj, (5, 3), 1e-3, 1e-2), (up_proj, (17, 11), 1e-3, 1e-2)]:
            saved = float(weight[index])
            weight[index] = saved + eps
            up = float(loss())
            weight[index] = saved - eps
            down = float(loss())
            weight[index] = saved
            assert abs(float(weight.grad[index])) > 1e-5, "armed: a weight the loss depends on"
            assert math.isclose(weight.grad[index], (up - down) / (2 * eps), rel_tol=tol), (index, eps)


def test_the_critic_learns_the_returns_and_its_clip_holds_it_near_the_old_values(qwen3_dir):
    value_model = critic.Critic(qwen3_dir, actor.ActorConfig(precision="fp32", micro_batch_size=2),
                                critic.CriticConfig(lr=1e-3, value_clip=0.2), total_steps=30)
    batch = make_batch([12, 6, 9, 11, 5], 3, value_model.model.config.vocab_size)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    first = last = None
    for _ in range(15):
        old = value_model.compute_values(batch)
        _, returns = algo.gae_advantages(algo.token_rewards(rewards, batch.loss_mask), old, batch.loss_mask, 1.0,
                                         1.0)
        metrics = value_model.train_step(batch, returns, old)
        first = first or metrics
        last = metrics
    assert last["critic/value_loss"] < first["critic/value_loss"] / 10 and value_model.version == 15
    # one step far from the returns: no value moves more than the clip from its old value where moving helped
    wild = value_model.compute_values(batch)
    targets = wild + 5.0 * batch.loss_mask
    value_model.train_step(batch, targets, wild)
    moved = (value_model.compute_values(batch) - wild)[batch.loss_mask.bool()]
    assert moved.abs().max() < 1.0


def test_the_critics_values_replay_the_recorded_moe_routes():
    moe_dir = models.tiny_model_dir("qwen3_moe")
    value_model = critic.Critic(moe_dir, actor.ActorConfig(precision="fp32", micro_batch_size=2),
                                critic.CriticConfig(lr=1e-3), total_steps=2)
    batch = make_batch([10, 7, 9], 3, value_model.model.config.vocab_size)
    with torch.no_grad(), r3.capture_routes(value_model.model) as captured:
        value_model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    routes = captured[-1].reshape(*batch.input_ids.shape, *captured[-1].shape[1:])
    batch.routes = torch.where(batch.attention_mask[..., None, None] > 0, routes, -1)
    live = value_model.compute_values(invariants.TrainBatch(**{**vars(batch), "routes": None}))
    assert (value_model.compute_values(batch) - live).abs().max() <= 1e-5     # the live choice, replayed
    experts = value_model.model.config.num_experts
    shifted = invariants.TrainBatch(**{**vars(batch), "routes": torch.where(batch.routes >= 0,
                                                                            (batch.routes + 1) % experts, -1)})
    replayed = value_model.compute_values(shifted)
    assert (replayed - live).abs().max() > 1e-3           # other routes: other values (the replay is wired in)
    metrics = value_model.train_step(shifted, replayed + batch.loss_mask, replayed)
    assert metrics["critic/skipped"] == 0.0
    for router in r3.moe_routers(value_model.model):      # gate weights from live logits: the router learns
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_a_critic_checkpoint_resumes_exactly(qwen3_dir, tmp_path):
    cfg, machinery = critic.CriticConfig(lr=1e-3), actor.ActorConfig(precision="fp32", micro_batch_size=2)
    first = critic.Critic(qwen3_dir, machinery, cfg, total_steps=4)
    batch = make_batch([12, 6, 9], 3, first.model.config.vocab_size)
    rewards = torch.tensor([1.0, 0.0, 1.0])

    def step(model) -> None:
        old = model.compute_values(batch)
        _, returns = algo.gae_advantages(algo.token_rewards(rewards, batch.loss_mask), old, batch.loss_mask, 1.0, 1.0)
        model.train_step(batch, returns, old)
    step(first)
    step(first)
    first.save_checkpoint(str(tmp_path / "critic"))
    second = critic.Critic(qwen3_dir, machinery, cfg, total_steps=4, seed=7)
    second.load_checkpoint(str(tmp_path / "critic"))
    assert second.version == 2
    assert max_abs_diff(dict(first.model.state_dict()), dict(second.model.state_dict())) == 0.0
    step(first)
    step(second)             # the optimizer's moments came back too: the next step is the same step
    assert max_abs_diff(dict(first.model.state_dict()), dict(second.model.state_dict())) == 0.0
    fresh = critic.Critic(qwen3_dir, machinery, cfg, total_steps=4)
    assert max_abs_diff(dict(fresh.model.state_dict()), dict(first.model.state_dict())) > 1e-4   # armed


# ---- FSDP2: two critic ranks on CPU/gloo == one process on the whole batch ----

FSDP_LENGTHS, FSDP_PROMPT = [12, 6, 9, 11, 5], 3
FSDP_CRITIC = critic.CriticConfig(lr=1e-3, max_grad_norm=1e9)
FSDP_MACHINERY = actor.ActorConfig(precision="fp32", micro_batch_size=2)
FSDP_REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5])


def _fsdp_worker(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value_model = critic.Critic(model_dir, FSDP_MACHINERY, FSDP_CRITIC, total_steps=1)
        full = make_batch(FSDP_LENGTHS, FSDP_PROMPT, value_model.model.config.vocab_size)
        old_full = torch.load(os.path.join(out_dir, "old.pt"), weights_only=True)
        _, returns = algo.gae_advantages(algo.token_rewards(FSDP_REWARDS, full.loss_mask), old_full, full.loss_mask,
                                         1.0, 1.0)
        rows = [b for b in range(len(FSDP_LENGTHS)) if b % world_size == rank]
        batch = select_rows(full, rows)
        width = batch.input_ids.shape[1]
        values = value_model.compute_values(batch)
        metrics = value_model.train_step(batch, returns[rows, :width], old_full[rows, :width])
        grads = {name: p.grad.full_tensor() for name, p in value_model.model.named_parameters()}
        torch.save({"values": values, "rows": rows, "grads": grads, "metrics": metrics},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU")
def test_fsdp2_two_critic_ranks_equal_one_process_on_the_whole_batch(qwen3_dir, tmp_path):
    single = critic.Critic(qwen3_dir, FSDP_MACHINERY, FSDP_CRITIC, total_steps=1)
    batch = make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size)
    old = single.compute_values(batch)
    torch.save(old, tmp_path / "old.pt")
    mp.spawn(_fsdp_worker, args=(2, free_port(), qwen3_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for part in ranks:        # the values of each rank's rows are the single process's
        width = part["values"].shape[1]
        assert (part["values"] - old[part["rows"], :width]).abs().max() <= 1e-5
    _, returns = algo.gae_advantages(algo.token_rewards(FSDP_REWARDS, batch.loss_mask), old, batch.loss_mask, 1.0,
                                     1.0)
    metrics = single.train_step(batch, returns, old)
    grads = {name: p.grad for name, p in single.model.named_parameters()}
    assert max_abs_diff(ranks[0]["grads"], grads) <= 1e-5, "rank gradients must SUM to the global token mean's"
    for key in ("critic/value_loss", "critic/grad_norm", "critic/returns_mean"):
        assert math.isclose(ranks[0]["metrics"][key], metrics[key], rel_tol=1e-5), key


# ---- the critic as Ray trainer ranks (runtime.CriticGroup) ----

# ---- the loop: warm-up, and the run's configuration ----

TINY_GAE = ["--recipe", "math", "--model", "tiny-qwen3", "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "2", "--rollout.max_tokens", "6", "--run.threads", "1",
            "--algo.estimator", "gae", "--steps", "3", "--critic.freeze_actor_steps", "2", "--critic.lr", "1e-3",
            "--actor.lr", "1e-3", "--train.minibatches", "1"]


def test_the_warm_up_trains_the_critic_alone_and_pushes_no_weights(tmp_path):
    cfg = config.parse_config([*TINY_GAE, "--out", str(tmp_path)])
    model_path = models.resolve_model("tiny-qwen3")
    tok = models.load_tokenizer(model_path)
    recipe = train.load_recipe("math")
    policy = actor.Actor(model_path, cfg["actor"], total_steps=3)
    value_model = critic.Critic(model_path, cfg["actor"], cfg["critic"], total_steps=3)
    engine = Router([rollout.EmbeddedEngine(models.load_model(model_path), seed=1, tokenizer=tok)])
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    critic_start = {k: v.clone() for k, v in value_model.model.state_dict().items()}
    pushes, versions = [], []

    def push() -> dict:
        pushes.append(policy.version)
        versions.append(max_abs_diff(start, dict(policy.model.state_dict())))
        engine.update_weights(policy.export_weights(), policy.version)
        return {}
    os.makedirs(tmp_path / "traces", exist_ok=True)
    train.train_loop(cfg, recipe, model_path, tok, policy, engine, push, 0, str(tmp_path), None, None, value_model)
    # steps 1 and 2 trained the critic alone: no push, the actor unchanged; step 3 trained both and pushed once
    assert pushes == [1] and policy.version == 1 and value_model.version == 3
    assert versions[0] > 0
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("actor/frozen", 0.0) for r in records] == [1.0, 1.0, 0.0]
    assert all(r["critic/version"] == i + 1 for i, r in enumerate(records))
    assert max_abs_diff(critic_start, dict(value_model.model.state_dict())) > 0
    # the run's checkpoint holds the critic, and a resume loads it
    final = tmp_path / "checkpoints" / "final"
    resumed = critic.Critic(model_path, cfg["actor"], cfg["critic"], total_steps=3)
    resumed.load_checkpoint(str(final / critic.CRITIC_FOLDER))
    assert resumed.version == 3 and max_abs_diff(dict(resumed.model.state_dict()),
                                                 dict(value_model.model.state_dict())) == 0.0


def test_the_frozen_steps_leave_the_actor_bitwise_unchanged(tmp_path):
    cfg = config.parse_config([*TINY_GAE, "--train.trace_rows", "0"])
    model_path = models.resolve_model("tiny-qwen3")
    tok = models.load_tokenizer(model_path)
    runner = train.load_recipe("math").AgentRunner(rollout.EmbeddedEngine(models.load_model(model_path), seed=1), tok,
                                                   max_length=cfg["rollout"].max_length)
    rollouts = runner.run(data.arithmetic_tasks(2, seed=0), ["g0", "g0"],
                          engines.SamplingParams(max_tokens=6, seed=0))
    rows = [(r, row) for r in rollouts for row in r.rows]
    policy = actor.Actor(model_path, cfg["actor"], total_steps=3)
    value_model = critic.Critic(model_path, cfg["actor"], cfg["critic"], total_steps=3)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    os.makedirs(tmp_path / "traces")
    metrics = train.train_on_rows(cfg, policy, None, tok, rows, str(tmp_path), 0, value_model)
    assert metrics["actor/frozen"] == 1.0 and policy.version == 0 and value_model.version == 1
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    metrics = train.train_on_rows(cfg, policy, None, tok, rows, str(tmp_path), 2, value_model)   # past the warm-up
    assert "actor/frozen" not in metrics and policy.version == 1 and value_model.version == 2
    assert max_abs_diff(before, dict(policy.model.state_dict())) > 0      # armed: an unfrozen step moves it


@pytest.mark.parametrize("flags, says", [
    (["--critic.value_clip", "0.5"], "only 'gae' builds one"),
    (["--critic.freeze_actor_steps", "2"], "only 'gae' builds one"),
    (["--algo.gae_lambda", "0.9"], "only 'gae' does"),
    (["--algo.gae_whiten", "false"], "only 'gae' does"),
    (["--algo.estimator", "gae", "--algo.gae_gamma", "1.5"], "gae_gamma must be in [0, 1]"),
    (["--algo.estimator", "gae", "--algo.gae_lambda", "-0.1"], "gae_lambda must be in [0, 1]"),
    (["--algo.estimator", "gae", "--critic.freeze_actor_steps", "5", "--steps", "5"], "the actor never trains"),
    (["--algo.estimator", "gae", "--critic.value_clip", "-1"], "critic.value_clip must be >= 0"),
    (["--algo.estimator", "gae", "--critic.lr", "0"], "critic.lr must be > 0"),
    (["--algo.estimator", "gae", "--algo.kl_in_reward", "true", "--algo.kl_coef", "0.1"], "only 'reinforce'"),
])
def test_the_config_refuses_a_critic_that_would_train_silently_wrong(flags, says, capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--recipe", "math", *flags])
    assert says in capsys.readouterr().err


def test_every_critic_and_gae_option_is_in_help_and_the_readme(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--recipe", "tool_use", "--help"])
    shown = capsys.readouterr().out
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    for flag in ["--critic.lr", "--critic.weight_decay", "--critic.max_grad_norm", "--critic.value_clip",
                 "--critic.freeze_actor_steps", "--algo.gae_gamma", "--algo.gae_lambda", "--algo.gae_whiten"]:
        assert flag in shown and f"`{flag}`" in readme, flag
    assert "gae" in shown.rsplit("--algo.estimator", 1)[1][:300]    # the estimator's choices name gae
    config.parse_config(["--recipe", "tool_use", "--algo.estimator", "gae", "--algo.gae_lambda", "0.95",
                         "--critic.freeze_actor_steps", "1"])       # and a right one passes


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
