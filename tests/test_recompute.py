# trainer/recompute.py, the trainer's side of invariant 3 (forward consistency): the logprob of each token given the ids
# before it, against a hand computation; right padding and the fp32 temperature change nothing; the fused head a
# compiled actor runs is processed_logprobs; a prompt that rows share, computed once, gives the unshared logprobs
# and gradients. Against a real engine and inside a train step: tests/test_actor.py, tests/test_rollout.py,
# tests/test_sampling.py.
import pytest
import torch

import invariants
import models
from engines import processing
from trainer import recompute
from test_actor import TEMPERATURE, grads, make_batch, max_abs_diff, shared_prompt_rows, tiny_llama


# ---- sequence_logprobs: the engine's behavior logprob, recomputed ----

def test_sequence_logprobs_equals_hand_computation():
    model = models.tiny_model("qwen3")
    batch = make_batch([9, 6], prompt_len=3, vocab=model.config.vocab_size)
    with torch.no_grad():
        got = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, TEMPERATURE)
        for b, n in enumerate([9, 6]):
            ids = batch.input_ids[b, :n]
            logits = model(input_ids=ids[None]).logits[0].double() / TEMPERATURE
            for t in range(1, n):  # log p(token t) = z_{t-1}[id_t] - logsumexp(z_{t-1}), z = logits / T
                expected = logits[t - 1, ids[t]] - torch.logsumexp(logits[t - 1], dim=-1)
                assert abs(got[b, t].item() - expected.item()) < 1e-5
    assert got.dtype == torch.float32
    assert (got[:, 0] == 0).all(), "position 0 has no logprob"
    assert (got[1, 6:] == 0).all(), "padding positions are 0.0"


def test_temperature_is_applied_in_fp32_not_in_the_model_dtype():
    model = models.tiny_model("qwen3").to(torch.bfloat16)
    batch = make_batch([12], prompt_len=2, vocab=model.config.vocab_size)
    with torch.no_grad():
        got = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, TEMPERATURE)
        logits = model(input_ids=batch.input_ids).logits[0, :-1]
        targets = batch.input_ids[0, 1:, None]
        fp32 = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets).squeeze(-1)
        bf16_divide = torch.log_softmax((logits / TEMPERATURE).float(), -1).gather(-1, targets).squeeze(-1)
    assert got.dtype == torch.float32
    assert torch.allclose(got[0, 1:], fp32, atol=1e-6)
    # the trap is armed: dividing in bf16 (about 0.1 nats off on a real model at T=0.7) misses by 100x the tolerance
    assert (bf16_divide - fp32).abs().max() > 1e-4


def test_right_padded_rows_equal_the_same_rows_unpadded():
    model = models.tiny_model("qwen3")
    lengths = [11, 4, 7]
    batch = make_batch(lengths, prompt_len=2, vocab=model.config.vocab_size)
    with torch.no_grad():
        padded = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, TEMPERATURE)
        for b, n in enumerate(lengths):
            alone = recompute.sequence_logprobs(model, batch.input_ids[b:b + 1, :n],
                                                batch.attention_mask[b:b + 1, :n], TEMPERATURE)
            assert (padded[b, :n] - alone[0]).abs().max() <= 1e-6



# ---- the fused head of a compiled actor ----

def test_the_fused_head_is_processed_logprobs_untruncated():
    """_untruncated_head (what a compiled actor runs for untruncated positions) is processed_logprobs' token
    logprob and its distribution's entropy, with their gradient."""
    logits = torch.randn(7, 50, dtype=torch.float64).float().requires_grad_()
    temperature, ids = torch.rand(7) + 0.3, torch.randint(50, (7,))
    fused = recompute._untruncated_head(logits, temperature, ids, with_entropy=True)
    reference = processing.processed_logprobs(logits, temperature)
    entropy = -(reference.exp() * reference).sum(-1)
    assert (fused[:, 0] - reference.gather(-1, ids[:, None])[:, 0]).abs().max() <= 1e-6
    assert (fused[:, 1] - entropy).abs().max() <= 1e-5
    assert not torch.autograd.grad(fused[:, 1].sum(), logits, retain_graph=True)[0].any()   # a detached metric
    fused_grad, = torch.autograd.grad(fused[:, 0].sum(), logits)
    reference_grad, = torch.autograd.grad(reference.gather(-1, ids[:, None]).sum(), logits)
    assert (fused_grad - reference_grad).abs().max() <= 1e-6



# ---- shared prefixes: a group's prompt computed once, the same numbers as the unshared forward ----

def sampling_of(batch: invariants.TrainBatch) -> dict:
    return {**{name: getattr(batch, name) for name in invariants.SAMPLING_TENSORS}, "runs": batch.runs,
            "positions": recompute.wanted_positions(batch.loss_mask, batch.runs)}


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_moe"])
def test_shared_prompts_give_the_unshared_logprobs_and_gradients(kind):
    model = tiny_llama() if kind == "llama" else models.tiny_model(kind)
    rows, at = shared_prompt_rows(model.config.vocab_size)
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=0)
    sampling = sampling_of(batch)
    plan = recompute.shared_prefixes(batch.input_ids, batch.attention_mask, sampling["positions"])

    # the plan shares only ids that are equal, and never a position that predicts a wanted token
    for b in range(len(rows)):
        for c in range(len(rows)):
            if plan.row_set[b] == plan.row_set[c] and plan.row_prefix[b] and plan.row_prefix[c]:
                n = int(plan.row_prefix[b])
                assert n == plan.row_prefix[c] and batch.input_ids[b, :n].equal(batch.input_ids[c, :n])
        assert plan.row_prefix[b] <= int(sampling["positions"][b].nonzero()[0]) - 1
    same = lambda *names: len({int(plan.row_set[at[n]]) for n in names}) == 1  # noqa: E731
    assert same("a0", "a1", "a2", "later") and int(plan.row_prefix[at["a0"]]) == 11
    assert not same("a0", "one_off"), "a prompt one id away from A's must not take A's prefix"
    assert same("b0", "b1", "last_off") and int(plan.row_prefix[at["b0"]]) == 7   # all but B's last prompt id
    assert same("c0", "c1") and plan.saved > 0

    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    results = []
    for prefixes in (None, plan):
        model.zero_grad()
        logprobs = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, prefixes=prefixes,
                                               **sampling)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), grads(model)))
    (plain, plain_grads), (shared, shared_grads) = results
    assert (plain - shared).abs().max() <= 1e-5
    scale = max(g.abs().max().item() for g in plain_grads.values())
    assert max_abs_diff(plain_grads, shared_grads) <= 1e-5 * scale, "the prefix's gradient sums over its rows"

    # negative control: the one-id-off row made to reuse A's prefix gets other logprobs, so the id check is armed
    forged = recompute.SharedPrefixes(**{**vars(plan), "row_set": plan.row_set.clone(),
                                         "row_prefix": plan.row_prefix.clone()})
    forged.row_set[at["one_off"]], forged.row_prefix[at["one_off"]] = plan.row_set[at["a0"]], 11
    with torch.no_grad():
        wrong = recompute.sequence_logprobs(model, batch.input_ids, batch.attention_mask, prefixes=forged, **sampling)
    assert (wrong[at["one_off"]] - plain[at["one_off"]]).abs().max() > 1e-3
    assert (wrong[at["a0"]] - plain[at["a0"]]).abs().max() <= 1e-5
