# Invariants 1 (token identity) and 2 (policy version), and the batch side of 3 (forward consistency): the ledger
# records exactly what the engine sampled and seals on any non-extension of its ids; batches are checked id by id;
# on-policy data make every correction an exact no-op; staleness, gates and IS weights follow their formulas; each
# token's recorded sampling rides into the batch. (Invariant 3 against a real engine: test_rollout.py, test_r3.py.)
import itertools
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import algo
import invariants
from engines import constraints

from invariants import (GATINGS, LEVELS, MODES, SEQ_GATES, CorrectionConfig, Sampling, TokenLedger, build_batch,
                        check_sampled_once, check_token_identity, correction_weights, gate_rollouts, staleness,
                        validate_correction)
from engines import Generation

SAMPLED = Sampling(temperature=0.7)   # the sampling every hand-made token of these tests was drawn with


def generation(ids: list[int], logprobs: list[float], versions: list[int], sampling: Sampling = SAMPLED):
    """An engine output as the runner hands it on (the prompt does not matter to these checks)."""
    return Generation([], ids, logprobs, versions, None, "stop", sampling=sampling)

# ---- invariant 1, token identity: ledger ----


def two_turn_ledger() -> TokenLedger:
    """prompt [1,2,3] -> sampled [4,5] (version 0) -> tool delta [6,7] -> sampled [8] (version 1)."""
    ledger = TokenLedger("r0", "g0")
    assert ledger.extend_or_seal([1, 2, 3]) is False  # first call opens a segment
    ledger.append_sampled([4, 5], [-0.5, -0.25], [0, 0], SAMPLED)
    assert ledger.extend_or_seal([1, 2, 3, 4, 5, 6, 7]) is True
    ledger.append_sampled([8], [-1.0], [1], SAMPLED)
    return ledger


def test_extension_appends_only_the_delta_as_context():
    ledger = two_turn_ledger()
    (seg,) = ledger.segments
    assert seg.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seg.trainable == [False, False, False, True, True, False, False, True]
    assert seg.behavior_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert seg.policy_versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert seg.is_open and ledger.open_token_ids == seg.token_ids


def test_non_extension_seals_with_lcp_and_opens_an_all_context_segment(caplog):
    ledger = two_turn_ledger()
    rerendered = [1, 2, 3, 4, 9, 6, 7]  # history rewritten at position 4 (e.g. a template dropped <think>)
    with caplog.at_level(logging.INFO, logger="invariants"):
        assert ledger.extend_or_seal(rerendered) is False
    first, second = ledger.segments
    assert (first.seal_reason, first.common_prefix_len) == ("non_extension", 4)
    assert "non_extension" in caplog.text and "LCP 4" in caplog.text
    assert second.token_ids == rerendered and not any(second.trainable)  # re-rendered sampled text is context
    assert second.policy_versions == [-1] * 7 and second.segment_id == 1
    ledger.append_sampled([10, 11], [-0.1, -0.2], [1, 1], SAMPLED)
    ledger.seal("done")
    assert ledger.rows() == [first, second] and ledger.open_token_ids == []
    sampled = [generation([4, 5], [-0.5, -0.25], [0, 0]), generation([8], [-1.0], [1]),
               generation([10, 11], [-0.1, -0.2], [1, 1])]
    check_sampled_once(ledger.rows(), sampled)  # every sampled token trainable in exactly one row, as sampled
    # negative controls: a lost sampled token; one whose logprob, version or sampling the rows do not carry
    for wrong in (sampled + [generation([12], [-0.3], [1])],
                  sampled[:2] + [generation([10, 11], [-0.1, -0.25], [1, 1])],
                  sampled[:2] + [generation([10, 11], [-0.1, -0.2], [1, 2])],
                  sampled[:2] + [generation([10, 11], [-0.1, -0.2], [1, 1], Sampling(temperature=1.0))]):
        with pytest.raises(ValueError, match="sampled-once violated"):
            check_sampled_once(ledger.rows(), wrong)


@pytest.mark.parametrize("prompt, lcp", [
    ([1, 2, 3, 4, 5, 6, 7, 9, 11], 7),  # only the last sampled id differs (stop-token tail rewritten)
    ([1, 2, 3, 4, 5, 6, 7], 7),         # the last sampled token dropped
    ([1, 2, 3], 3),                     # truncation / compaction
    ([0, 2, 3, 4, 5, 6, 7, 8, 9], 0),   # first id differs
])
def test_any_prompt_that_does_not_contain_the_open_segment_bitwise_seals(prompt, lcp):
    ledger = two_turn_ledger()  # open segment [1..8]
    assert ledger.extend_or_seal(prompt) is False
    assert ledger.segments[0].common_prefix_len == lcp and ledger.segments[1].token_ids == prompt


@pytest.mark.parametrize("call, message", [
    (lambda l: l.append_sampled([4, 5], [-0.1], [0, 0], SAMPLED), "2 token ids, 1 behavior logprobs"),
    (lambda l: l.append_sampled([4], [-0.1], [], SAMPLED), "1 token ids, 1 behavior logprobs and 0 policy versions"),
    (lambda l: l.append_sampled([4], [float("nan")], [0], SAMPLED), "logprob of sampled token 0 .* is nan"),
    (lambda l: l.append_sampled([4], [float("-inf")], [0], SAMPLED), "must be a finite float"),
    (lambda l: l.append_sampled([4, 5], [-0.1, -0.1], [1, 0], SAMPLED), "version decreases .* version 0 after version 1"),
    (lambda l: (l.append_sampled([4], [-0.1], [2], SAMPLED), l.append_sampled([5], [-0.1], [1], SAMPLED)), "version decreases"),
    (lambda l: l.append_sampled([4], [-0.1], [-1], SAMPLED), "policy version of sampled token 0 is -1"),
    (lambda l: l.append_sampled([-4], [-0.1], [0], SAMPLED), "id at index 0 is -4"),
    (lambda l: l.append_context([7, 2.0]), "id at index 1 is 2.0"),
    (lambda l: l.extend_or_seal([1, True]), "id at index 1 is True"),
])
def test_every_append_check_fires_with_a_clear_message(call, message):
    ledger = TokenLedger("r0")
    ledger.extend_or_seal([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        call(ledger)


def test_sampled_tokens_need_a_prompt_first():
    with pytest.raises(ValueError, match="call extend_or_seal"):
        TokenLedger("r0").append_sampled([4], [-0.1], [0], SAMPLED)


def test_routes_first_writer_wins_with_minus_one_sentinel():
    ledger = TokenLedger("r0")
    ledger.extend_or_seal([1, 2, 3])
    first = np.array([[[0, 1], [2, 3]], [[0, 5], [6, 0]]])  # expert 0 is a valid id
    ledger.absorb_routes(first)  # prefill of positions 0, 1 (the engine routed len-1 positions)
    seg = ledger.segments[0]
    assert seg.routes.dtype == np.int16 and seg.routes.shape == (3, 2, 2)
    assert (seg.routes[2] == -1).all()  # not routed yet: -1, never 0
    ledger.append_sampled([4, 5], [-0.1, -0.2], [0, 0], SAMPLED)
    assert seg.routes.shape == (5, 2, 2) and (seg.routes[3:] == -1).all()  # grows with the segment
    second = np.full((5, 2, 2), 7)  # next call's prefill covers positions 0..4
    ledger.absorb_routes(second)
    assert (seg.routes[:2] == first).all() and (seg.routes[2:] == 7).all()  # earlier writer kept
    with pytest.raises(ValueError, match="open segment has 5 tokens"):
        ledger.absorb_routes(second, start=1)
    with pytest.raises(ValueError, match=r"\[layers, top_k\] = \[3, 2\]"):
        ledger.absorb_routes(np.zeros((1, 3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="expert ids must lie in"):
        ledger.absorb_routes(np.full((1, 2, 2), 40000))  # would wrap in int16


def test_a_routed_segment_seals_when_a_turn_comes_from_a_new_version_and_the_next_carries_its_context(caplog):
    """An MoE's second turn at version 1 was drawn under version 1's routes where the segment holds version 0's:
    the segment seals (route_version) and the turn trains in a new segment whose context is all of it, images too.
    The same turn at version 0, or a dense segment (no routes) at version 1, extends."""
    def ledger(second_version: int, routed: bool = True) -> TokenLedger:
        image = invariants.ImageInput(torch.zeros(4, 8), (1, 2, 2), 1)
        record = TokenLedger("r0")
        record.extend_or_seal([1, 9, 3], [image])
        record.append_sampled([4, 5], [-0.5, -0.25], [0, 0], SAMPLED)
        if routed:
            record.absorb_routes(np.zeros((4, 2, 2), dtype=np.int64))     # version 0's forward of positions 0..3
        record.extend_or_seal([1, 9, 3, 4, 5, 6], [image])
        with caplog.at_level(logging.INFO, logger="invariants"):
            record.append_sampled([8], [-1.0], [second_version], SAMPLED)
        if routed:
            record.absorb_routes(np.ones((6, 2, 2), dtype=np.int64))      # the second call's forward of 0..5
        return record
    sealed, reopened = ledger(1).segments
    assert (sealed.seal_reason, sealed.token_ids, sealed.trainable) == ("route_version", [1, 9, 3, 4, 5, 6],
                                                                        [False] * 3 + [True] * 2 + [False])
    assert "route_version" in caplog.text
    assert reopened.token_ids == [1, 9, 3, 4, 5, 6, 8] and reopened.trainable == [False] * 6 + [True]
    assert reopened.images == sealed.images and len(reopened.images) == 1
    assert (sealed.routes[:4] == 0).all() and (sealed.routes[4:] == -1).all()   # each segment one forward's routes
    assert (reopened.routes[:6] == 1).all() and (reopened.routes[6] == -1).all()
    check_sampled_once([sealed, reopened], [generation([4, 5], [-0.5, -0.25], [0, 0]), generation([8], [-1.0], [1])])
    for extended in (ledger(0), ledger(1, routed=False)):
        (seg,) = extended.segments
        assert seg.is_open and seg.trainable == [False] * 3 + [True] * 2 + [False] + [True]
    assert ledger(0).segments[0].routes[:6, 0, 0].tolist() == [0] * 4 + [1] * 2     # first writer wins, as before
    with pytest.raises(ValueError, match="version decreases"):                         # still refused, never sealed
        record = ledger(1)
        record.append_sampled([9], [-0.1], [0], SAMPLED)


def test_an_moe_turn_at_a_new_version_seals_a_segment_whose_earlier_turn_came_back_without_routes():
    """vLLM at times reports routes for only some positions of a request, which then comes back with routes None:
    the segment holds none. A later turn at a new version whose call reported routes (routed=True) still seals, so
    its routes cannot fill the earlier turn's positions (which would replay them, uncounted, under the wrong
    version's experts); the earlier turn's row keeps no routes and its tokens are counted as unreplayed."""
    def ledger(routed: bool) -> TokenLedger:
        record = TokenLedger("r0")
        record.extend_or_seal([1, 9, 3])
        record.append_sampled([4, 5], [-0.5, -0.25], [0, 0], SAMPLED)          # its call reported no routes
        record.extend_or_seal([1, 9, 3, 4, 5, 6])
        record.append_sampled([8], [-1.0], [1], SAMPLED, routed=routed)
        record.absorb_routes(np.ones((6, 2, 2), dtype=np.int64))                 # version 1's forward of 0..5
        return record
    first, second = ledger(routed=True).segments
    assert (first.seal_reason, first.routes) == ("route_version", None)
    assert second.trainable == [False] * 6 + [True] and (second.routes[:6] == 1).all()
    (unsealed,) = ledger(routed=False).segments          # the trap: without the flag version 1's routes land on
    assert unsealed.trainable[3:5] == [True, True] and (unsealed.routes[3:5] == 1).all()   # version 0's tokens


# ---- invariant 1, token identity: batches ----


def batch_rows():
    ledger = TokenLedger("r0", "g0")
    ledger.extend_or_seal([1, 2, 3])
    ledger.absorb_routes(np.zeros((2, 2, 2), dtype=np.int64))
    ledger.append_sampled([4, 5], [-0.5, -0.25], [3, 3], SAMPLED)
    ledger.extend_or_seal([1, 2, 3, 4, 5, 6])
    ledger.append_sampled([8], [-1.0], [3], SAMPLED)   # the version its routes are of (a new one would seal)
    short = TokenLedger("r1", "g0")  # no routes
    short.extend_or_seal([1, 9])
    short.append_sampled([10], [-2.0], [4], SAMPLED)
    return ledger.rows() + short.rows()


def test_build_batch_right_pads_and_token_identity_holds():
    rows = batch_rows()
    batch = build_batch(rows, [1.5, -0.5], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 8], [1, 9, 10, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0, 0]]
    assert batch.behavior_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25, 0, -1.0], [0, 0, -2.0, 0, 0, 0, 0]]
    assert batch.policy_versions.tolist() == [[-1, -1, -1, 3, 3, -1, 3], [-1, -1, 4, -1, -1, -1, -1]]
    assert batch.advantages.tolist() == [[0, 0, 0, 1.5, 1.5, 0, 1.5], [0, 0, -0.5, 0, 0, 0, 0]]
    assert batch.routes.shape == (2, 7, 2, 2) and batch.routes.dtype == torch.long
    assert (batch.routes[0, :2] == 0).all() and (batch.routes[0, 2:] == -1).all() and (batch.routes[1] == -1).all()
    assert (batch.rollout_ids, batch.group_ids) == (["r0", "r1"], ["g0", "g0"])
    check_token_identity(batch, rows)
    per_token = build_batch(rows, [[9.0] * 7, [1, 2, 3]], pad_id=0)  # per-token advantages: context zeroed
    assert per_token.advantages.tolist() == [[0, 0, 0, 9, 9, 0, 9], [0, 0, 3, 0, 0, 0, 0]]
    assert build_batch(rows[1:], [1.0], pad_id=0).routes is None


@pytest.mark.parametrize("corrupt, message", [
    (lambda b: b.input_ids[0].__setitem__(4, 99), r"row 0 .* position 4: trainer input id 99 != sampled"),
    (lambda b: b.input_ids[1].__setitem__(1, 98), r"row 1 .* position 1: trainer input id 98 != context"),
    (lambda b: b.loss_mask.copy_(F.pad(b.loss_mask[:, :-1], (1, 0))), r"row 0 .* position 3: loss_mask"),  # shift
    (lambda b: b.attention_mask[1].__setitem__(5, 1), "attention_mask"),
])
def test_negative_control_a_corrupted_batch_fails_token_identity(corrupt, message):
    rows = batch_rows()
    batch = build_batch(rows, [1.0, 1.0], pad_id=0)
    corrupt(batch)
    with pytest.raises(ValueError, match=message):
        check_token_identity(batch, rows)


# ---- invariant 2, policy version: on-policy identity ----


def on_policy_batch(V=3):
    gen = torch.Generator().manual_seed(0)
    prox = torch.log(torch.rand(3, 6, generator=gen, dtype=torch.float64))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.float64)
    versions = torch.where(mask > 0, V, -1)
    adv = torch.randn(3, 1, generator=gen, dtype=torch.float64) * mask
    return prox, mask, versions, adv


ROLLOUTS = ["sealed", "sealed", "plain"]   # on_policy_batch's rows 0 and 1 are one rollout sealed into two segments


def step_loss(prox, adv, mask, index, estimator: str, loss_agg: str, is_weights=None):
    """The loss of one optimizer step as actor.train_step builds it from algo.py, and its gradient: the clipped
    surrogate at live logprobs pi a little off pi_prox (so some ratios clip), weighed per token by loss_weights over
    the step's kept tokens and rollouts."""
    gen = torch.Generator().manual_seed(1)
    logprobs = (prox + 0.3 * torch.randn(prox.shape, generator=gen, dtype=prox.dtype)).requires_grad_(True)
    cfg = algo.AlgoConfig(estimator=estimator, loss_agg=loss_agg)
    token_loss, _ = algo.policy_loss(logprobs, prox, adv, mask, cfg, is_weights=is_weights, rollout_index=index)
    groups = invariants.rollout_index(["g"] * len(mask))     # both rollouts answer one prompt
    weights = algo.loss_weights(mask, loss_agg, float(mask.sum()), float(invariants.count_rollouts(mask, index)),
                                token_budget=mask.shape[1], rollout_index=index, group_index=groups,
                                global_groups=float(invariants.count_rollouts(mask, groups)))
    loss = (token_loss * weights).sum()
    loss.backward()
    return loss.detach(), logprobs.grad


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_on_policy_every_correction_is_an_exact_identity(level, mode):
    """mu == pi_prox and every token at the trainer's version: invariant 2's correction (apply_correction: gates,
    IS weights, the final mask) fed through algo.py's surrogate and loss weights as a step is gives the plain step's
    loss and gradient bitwise, for every gate, estimator and loss aggregation. Armed: mu one nat off pi_prox on a
    single token, every IS level changes the same step."""
    V = 3
    prox, mask, versions, adv = on_policy_batch(V)
    index = invariants.rollout_index(ROLLOUTS)
    behavior = prox.clone()  # engine logprobs == trainer recompute, every token at version V
    off_policy = prox.clone()
    off_policy[2, 3] -= 1.0  # rho = e on one token of the plain rollout: outside [0.5, 2] for token and seq
    gates = [dict(seq_gate=g) for g in SEQ_GATES] + [dict(gating=g, gate_divergence=1e-9) for g in GATINGS[1:]]
    for gate in gates:
        cfg = CorrectionConfig(level=level, mode=mode, low=0.5, high=2.0, veto=1e-4, **gate)
        correction = invariants.apply_correction(prox, behavior, mask, versions, V, cfg, index)
        assert torch.equal(correction.is_weights, torch.ones_like(prox))  # bitwise
        assert correction.keep.all() and correction.gate_counts["kept"] == 2 and torch.equal(correction.mask, mask)
        for estimator, loss_agg in itertools.product(("grpo", "gspo"), algo.LOSS_AGGREGATIONS):
            plain = step_loss(prox, adv, mask, index, estimator, loss_agg)
            corrected = step_loss(prox, adv, correction.mask, index, estimator, loss_agg, correction.is_weights)
            assert all(torch.equal(a, b) for a, b in zip(plain, corrected)), (gate, estimator, loss_agg)
        if level != "off":
            drifted = invariants.apply_correction(prox, off_policy, mask, versions, V, cfg, index)
            plain = step_loss(prox, adv, mask, index, "grpo", "token_mean")
            corrected = step_loss(prox, adv, drifted.mask, index, "grpo", "token_mean", drifted.is_weights)
            assert not all(torch.equal(a, b) for a, b in zip(plain, corrected))


@pytest.mark.parametrize("level", LEVELS)
def test_is_weights_carry_no_gradient(level):
    prox, mask, _, _ = on_policy_batch()
    prox = prox.requires_grad_(True)
    behavior = (prox.detach() + 0.3).requires_grad_(True)
    w, _ = correction_weights(prox, behavior, mask, CorrectionConfig(level=level))
    assert not w.requires_grad and w.grad_fn is None


# ---- invariant 2, policy version: staleness and gates ----


def test_staleness_of_a_multi_version_rollout_and_the_version_gate():
    v = 5
    ledger = TokenLedger("r0")
    ledger.extend_or_seal([1, 2])
    ledger.append_sampled([3, 4], [-0.1, -0.2], [v, v], SAMPLED)  # weights swapped mid-rollout
    ledger.append_sampled([5], [-0.3], [v + 1], SAMPLED)
    batch = build_batch(ledger.rows(), [1.0], pad_id=0)
    versions_before = batch.policy_versions.clone()
    s = staleness(batch.policy_versions, batch.loss_mask, trainer_version=v + 2)
    assert s.tolist() == [2]  # V - oldest token version, not the newest
    log_ratio = torch.zeros_like(batch.loss_mask)
    keep, counts = gate_rollouts(log_ratio, batch.loss_mask, s, CorrectionConfig(max_staleness=1))
    assert keep.tolist() == [False] and counts["drop_stale"] == 1
    keep, _ = gate_rollouts(log_ratio, batch.loss_mask, s, CorrectionConfig(max_staleness=2))
    assert keep.tolist() == [True]
    assert torch.equal(batch.policy_versions, versions_before)  # tokens are never re-stamped
    assert batch.policy_versions[0].tolist() == [-1, -1, v, v, v + 1]
    with pytest.raises(ValueError, match="future version"):
        staleness(batch.policy_versions, batch.loss_mask, trainer_version=v)


def test_veto_drops_a_rollout_with_one_tiny_ratio():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    log_ratio = torch.zeros(2, 4)
    log_ratio[0, 2] = math.log(1e-6)
    log_ratio[1, 0] = math.log(1e-9)  # not trainable: ignored
    s = torch.zeros(2, dtype=torch.long)
    keep, counts = gate_rollouts(log_ratio, mask, s, CorrectionConfig(veto=1e-4))
    assert keep.tolist() == [False, True] and counts["drop_veto"] == 1
    assert gate_rollouts(log_ratio, mask, s, CorrectionConfig())[0].all()  # veto 0 = off


def test_seq_and_geo_bands_drop_rollouts_outside_the_band():
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.float32)
    log_ratio = torch.tensor([[9.0, 0.2, 0.2, 0.2, 0.2], [0.0, 0.02, -0.02, 0.03, 0.0]])  # geo means 0.2 and 0.0075
    s = torch.zeros(2, dtype=torch.long)
    keep, counts = gate_rollouts(log_ratio, mask, s, CorrectionConfig(seq_gate="geo", gate_low=0.9, gate_high=1.1))
    assert keep.tolist() == [False, True] and counts["drop_ratio_band"] == 1
    keep, _ = gate_rollouts(log_ratio, mask, s, CorrectionConfig(seq_gate="seq", gate_low=0.5, gate_high=2.0))
    assert keep.tolist() == [False, True]  # sums 0.8 and 0.03: exp(0.8) = 2.23 > 2 drops the first
    keep, _ = gate_rollouts(log_ratio, mask, s, CorrectionConfig(seq_gate="seq", gate_low=0.5, gate_high=2.5))
    assert keep.tolist() == [True, True]


def bernoulli_divergence(logp_mu: float, logp_prox: float, gating: str) -> float:
    """From the definitions, on Python floats: KL(Bern(p) || Bern(q)) = p log(p/q) + (1-p) log((1-p)/(1-q)) and the
    total variation |p - q| of the two policies' probabilities p, q of the sampled token (clamped to [1e-6,
    1 - 1e-6] as the gate does)."""
    p, q = (min(max(math.exp(x), 1e-6), 1 - 1e-6) for x in (logp_mu, logp_prox))
    if gating == "tv":
        return abs(p - q)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


@pytest.mark.parametrize("gating", GATINGS[1:])
def test_the_divergence_gate_keeps_a_rollout_iff_its_mean_divergence_is_within_the_bound(gating):
    gen = torch.Generator().manual_seed(7)
    behavior = torch.log(torch.rand(4, 6, generator=gen) * 0.9 + 0.05)
    drift = torch.tensor([[0.01], [0.3], [1.0], [0.05]])
    prox = (behavior + drift * torch.randn(4, 6, generator=gen)).clamp(max=0.0)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]],
                        dtype=torch.float32)
    means = [sum(bernoulli_divergence(behavior[b, t].item(), prox[b, t].item(), gating)
                 for t in range(6) if mask[b, t]) / mask[b].sum().item() for b in range(4)]
    d = invariants.token_divergence(behavior, prox, gating)
    assert max(abs(d[b, t].item() - bernoulli_divergence(behavior[b, t].item(), prox[b, t].item(), gating))
               for b in range(4) for t in range(6) if mask[b, t]) <= 1e-12
    bound = sorted(means)[1] * 1.01                   # between the second and third smallest rollout means
    cfg = CorrectionConfig(gating=gating, gate_divergence=bound)
    keep, counts = gate_rollouts(prox - behavior, mask, torch.zeros(4, dtype=torch.long), cfg,
                                 behavior_logprobs=behavior)
    assert keep.tolist() == [m <= bound for m in means] and counts["drop_divergence"] == 2 == counts["kept"]
    with pytest.raises(ValueError, match="pass behavior_logprobs"):
        gate_rollouts(prox - behavior, mask, torch.zeros(4, dtype=torch.long), cfg)
    # a sealed rollout is one rollout: rows 2 (far) and 3 (near) of one rollout are gated on their joint mean
    index = invariants.rollout_index(["a", "b", "c", "c"])
    joint = (means[2] * 4 + means[3] * 2) / 6
    keep, _ = gate_rollouts(prox - behavior, mask, torch.zeros(4, dtype=torch.long),
                            CorrectionConfig(gating=gating, gate_divergence=joint * 1.001), index, behavior)
    assert keep.tolist() == [True, True, True, True]
    keep, _ = gate_rollouts(prox - behavior, mask, torch.zeros(4, dtype=torch.long),
                            CorrectionConfig(gating=gating, gate_divergence=joint * 0.999), index, behavior)
    assert keep.tolist() == [True, True, False, False]


def test_the_binary_kl_of_all_but_identical_policies_is_zero_not_below():
    """fp32 rounding puts the binary KL of logprobs -1.0 (mu) and -0.99999 (pi_prox) at -4.5e-8; a divergence is never
    below 0 (here its exact value, 3e-11), and the gate keeps such a rollout under a bound of 1e-9."""
    behavior, prox = torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -0.99999]])
    p, q = behavior.exp(), prox.exp()
    assert (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log())[0, 1] < -4e-8        # the trap, in fp32
    d = invariants.token_divergence(behavior, prox, "binary_kl")[0, 1].item()
    assert 0.0 <= d == pytest.approx(bernoulli_divergence(-1.0, prox[0, 1].item(), "binary_kl"), abs=1e-15)
    keep, _ = gate_rollouts(prox - behavior, torch.tensor([[0.0, 1.0]]), torch.zeros(1, dtype=torch.long),
                            CorrectionConfig(gating="binary_kl", gate_divergence=1e-9), behavior_logprobs=behavior)
    assert keep.all()


def test_a_veto_below_the_log_ratio_clamp_still_fires():
    mask = torch.tensor([[0, 1, 1]], dtype=torch.float32)
    log_ratio = torch.tensor([[0.0, 0.0, -40.0]])             # rho = e^-40, below the clamp at e^-30
    keep, counts = gate_rollouts(log_ratio, mask, torch.zeros(1, dtype=torch.long), CorrectionConfig(veto=1e-15))
    assert keep.tolist() == [False] and counts["drop_veto"] == 1


def test_a_sealed_rollout_is_one_rollout_for_staleness_and_every_gate():
    # rows 0 and 1: one rollout sealed in two; row 1 was sampled a version later. Row 2: another rollout.
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    versions = torch.tensor([[-1, 3, 3, -1], [-1, -1, 4, 4], [-1, 4, 4, 4]])
    index = invariants.rollout_index(["a", "a", "b"])
    s = staleness(versions, mask, trainer_version=4, rollout_index=index)
    assert s.tolist() == [1, 1, 0]                            # the rollout's oldest token decides, for both rows
    assert staleness(versions, mask, trainer_version=4).tolist() == [1, 0, 0]   # armed: per row, row 1 looks fresh
    zero = torch.zeros(3, 4)
    keep, counts = gate_rollouts(zero, mask, s, CorrectionConfig(max_staleness=0), index)
    assert keep.tolist() == [False, False, True] and counts == {"drop_stale": 1, "drop_ratio_band": 0,
                                                                 "drop_divergence": 0, "drop_veto": 0, "kept": 1}
    # the seq ratio multiplies over both rows: 0.5 + 0.5 nats is out of [1/2, 2], each row alone is inside
    log_ratio = torch.tensor([[0, 0.25, 0.25, 0], [0, 0, 0.25, 0.25], [0, 0, 0, 0]])
    cfg = CorrectionConfig(seq_gate="seq", gate_low=0.5, gate_high=2.0)
    assert gate_rollouts(log_ratio, mask, torch.zeros(3, dtype=torch.long), cfg, index)[0].tolist() == \
        [False, False, True]
    assert gate_rollouts(log_ratio, mask, torch.zeros(3, dtype=torch.long), cfg)[0].all()
    w, _ = correction_weights(log_ratio, torch.zeros(3, 4), mask, CorrectionConfig(level="seq", mode="trunc",
                                                                                   high=10.0), index)
    assert torch.allclose(w[:2][mask[:2] > 0], torch.full((4,), math.exp(1.0)))   # one weight for the rollout
    veto = torch.tensor([[0, 0, 0, 0], [0, 0, -20.0, 0], [0, 0, 0, 0]])
    keep, _ = gate_rollouts(veto, mask, torch.zeros(3, dtype=torch.long), CorrectionConfig(veto=1e-6), index)
    assert keep.tolist() == [False, False, True]              # a vetoed row takes its whole rollout with it


def test_mismatch_k3_estimates_kl_of_the_behavior_policy_to_the_trainer():
    # exact enumeration over a 4-token vocabulary: E_{y ~ mu}[k3(rho_y)] = KL(mu || pi), rho = pi / mu
    mu = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    pi = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    expected = 0.0
    for y in range(4):
        metrics = invariants.mismatch_metrics(torch.tensor([[0.0, pi[y].log()]]), torch.tensor([[0.0, mu[y].log()]]),
                                              mask)
        expected += mu[y].item() * metrics["k3_kl"]
    assert expected == pytest.approx((mu * (mu / pi).log()).sum().item(), abs=1e-12)
    assert expected != pytest.approx((pi * (pi / mu).log()).sum().item(), abs=1e-3)   # not the other direction


# ---- invariant 2, policy version: IS weights ----


def off_policy_batch():
    behavior = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5], [0.5, 0.4, 0.2, 0.1, 0.3]], dtype=torch.float64))
    prox = torch.log(torch.tensor([[0.9, 0.6, 0.1, 0.5, 0.45], [0.1, 0.4, 0.3, 0.4, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    return prox, behavior, mask


def test_tis_weight_is_min_of_rho_and_the_cap():
    prox, behavior, mask = off_policy_batch()
    w, metrics = correction_weights(prox, behavior, mask, CorrectionConfig(level="token", mode="trunc", high=2.0))
    expected = torch.where(mask > 0, torch.minimum(torch.exp(prox - behavior), torch.tensor(2.0)), 1.0)
    assert torch.equal(w, expected)  # row 1 token 3: rho 4 -> 2; row 0 token 2: rho 0.2 untouched
    lr = (prox - behavior)[mask > 0]
    assert metrics["is_clipped_frac"] == pytest.approx(1 / 7) and metrics["is_masked_frac"] == 0.0
    assert metrics["mismatch_abs_log_ratio"] == pytest.approx(float(lr.abs().mean()))
    assert metrics["mismatch_k3_kl"] == pytest.approx(float((lr.exp() - 1 - lr).mean()))


def test_mask_mode_zeroes_outside_the_band_and_clip_clamps():
    prox, behavior, mask = off_policy_batch()
    rho = torch.exp(prox - behavior)
    w, metrics = correction_weights(prox, behavior, mask, CorrectionConfig(level="token", mode="mask", low=0.5,
                                                                           high=2.0))
    in_band = (rho >= 0.5) & (rho <= 2.0)
    assert torch.equal(w, torch.where(mask > 0, torch.where(in_band, rho, 0.0), 1.0))
    assert metrics["is_masked_frac"] == pytest.approx(2 / 7)  # rho 0.2 and 4.0 are masked
    w, _ = correction_weights(prox, behavior, mask, CorrectionConfig(level="token", mode="clip", low=0.5, high=2.0))
    assert torch.equal(w, torch.where(mask > 0, rho.clamp(0.5, 2.0), 1.0))
    geo = torch.exp(((prox - behavior) * mask).sum(-1) / mask.sum(-1))  # [0.68, 1.82]
    w, _ = correction_weights(prox, behavior, mask, CorrectionConfig(level="geo", mode="mask", low=0.5, high=1.5))
    assert torch.allclose(w[0, 1:], geo[0].expand(4)) and (w[1, 1:4] == 0).all()  # broadcast; row 1 masked
    seq = torch.exp(((prox - behavior) * mask).sum(-1))
    w, _ = correction_weights(prox, behavior, mask, CorrectionConfig(level="seq", mode="trunc", high=5.0))
    assert torch.allclose(w[0, 1:], seq[0].expand(4)) and (w[1, 1:4] == 5.0).all()


def test_non_finite_log_ratio_on_a_trainable_token_is_refused():
    prox, behavior, mask = off_policy_batch()
    prox[0, 2] = float("nan")
    with pytest.raises(ValueError, match="not finite on a trainable token"):
        correction_weights(prox, behavior, mask, CorrectionConfig(level="token"))


@pytest.mark.parametrize("bad, message", [
    (dict(level="sequence"), "level 'sequence' unknown"),
    (dict(mode="cap"), "mode 'cap' unknown"),
    (dict(seq_gate="token"), "seq_gate 'token' unknown"),
    (dict(low=1.2), "band"),
    (dict(high=0.9), "band"),
    (dict(gate_low=1.5), "gate band"),
    (dict(gate_high=0.5), "gate band"),
    (dict(max_staleness=-1), "max_staleness"),
    (dict(veto=1.0), "veto"),
    (dict(veto=-1e-4), "veto"),
    (dict(gating="kl"), "gating 'kl' unknown"),
    (dict(gating="binary_kl", seq_gate="geo"), "seq_gate 'geo' would be ignored"),
    (dict(gating="tv", gate_divergence=0.0), "gate_divergence must be a finite bound > 0"),
])
def test_validate_correction_refuses_bad_configs(bad, message):
    validate_correction(CorrectionConfig())  # defaults are valid
    with pytest.raises(ValueError, match=message):
        validate_correction(CorrectionConfig(**bad))


# ---- invariant 3, forward consistency: the processing a token was drawn with rides in the batch ----

@pytest.mark.parametrize("sampling, message", [
    (Sampling(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
    (Sampling(repetition_penalty=11.0, generation_start=3), r"repetition_penalty must be a number in \[0.01, 10\]"),
    (Sampling(logit_bias=((3, math.inf),)), r"each bias in \[-100, 100\] or -inf"),
    (Sampling(logit_bias=((3, 1.0), (3, 2.0))), "one per id"),
    (Sampling(constraint=""), "constraint must be None or a grammar spec"),
    (Sampling(frequency_penalty=0.5), "generation_start must be the row position"),    # penalties need a start
    (Sampling(generation_start=-2), "generation_start must be"),
])
def test_a_sampling_the_trainer_cannot_recompute_is_refused(sampling, message):
    ledger = TokenLedger("r0")
    ledger.extend_or_seal([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        ledger.append_sampled([4], [-0.1], [0], sampling)


def test_plain_rows_carry_no_adjusted_runs():
    batch = build_batch(batch_rows(), [1.0, 1.0], pad_id=0)
    assert batch.runs == [[], []] and (batch.min_p == 0).all()


def processed_ledger(first: Sampling, second: Sampling) -> TokenLedger:
    """prompt [1,2,3] -> [4,5] at `first` -> tool delta [6] -> [8] at `second`."""
    ledger = TokenLedger("r0", "g0")
    ledger.extend_or_seal([1, 2, 3])
    ledger.append_sampled([4, 5], [-0.5, -0.25], [0, 0], first)
    ledger.extend_or_seal([1, 2, 3, 4, 5, 6])
    ledger.append_sampled([8], [-1.0], [0], second)
    return ledger


def test_each_generation_drawn_from_adjusted_logits_is_one_run_of_its_row():
    penalised = Sampling(0.7, frequency_penalty=1.0, generation_start=3)
    biased = Sampling(0.7, min_p=0.1, logit_bias=((2, 1.0),))
    rows = processed_ledger(penalised, biased).rows()
    batch = build_batch(rows, [1.0], pad_id=0)
    assert [(run.start, run.end, run.sampling) for run in batch.runs[0]] == [(3, 5, penalised), (6, 7, biased)]
    assert batch.min_p[0].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0.1])
    check_token_identity(batch, rows)
    batch.runs = [batch.runs[0][:1]]                      # negative control: a run lost on the way to the trainer
    with pytest.raises(ValueError, match=r"adjusts the logits of spans \[\(3, 5\)\] but .* at \[\(3, 5\), \(6, 7\)\]"):
        check_token_identity(batch, rows)


def test_a_generation_that_does_not_start_at_its_generation_start_is_refused():
    """The trainer counts a generation's output from generation_start: a record that places it elsewhere (a
    prompt the ledger does not hold) would penalise the wrong ids, so the batch is refused."""
    rows = processed_ledger(Sampling(0.7, presence_penalty=1.0, generation_start=2), SAMPLED).rows()
    with pytest.raises(ValueError, match="generation_start 2 begin at row position 3"):
        build_batch(rows, [1.0], pad_id=0)


def test_a_constrained_row_needs_the_tokenizer_to_replay_its_grammar():
    spec = constraints.bind(constraints.json_object_spec(), [2])
    rows = processed_ledger(Sampling(0.7, constraint=spec, generation_start=3), SAMPLED).rows()
    with pytest.raises(ValueError, match="pass grammar_masks="):
        build_batch(rows, [1.0], pad_id=0)
