# engines/processing.py, by hand: the processed distribution a token is drawn from (invariant 3, forward consistency), step
# by step on a few logits. Engine against trainer through real requests: tests/test_sampling.py, tests/test_rollout.py;
# adjust_logits against vLLM's own penalty code: tests/test_vllm_engine.py.
import math

import torch

import invariants
from engines.processing import adjust_logits, penalty_state, processed_logprobs


def test_greedy_is_a_point_mass_and_top_p_renormalises():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    greedy = processed_logprobs(logits, 1.0, top_k=1)
    assert greedy[0] == 0 and torch.isinf(greedy[1:]).all()
    nucleus = processed_logprobs(logits, 1.0, top_p=0.7)
    kept = torch.isfinite(nucleus)
    assert kept.tolist() == [True, True, False, False]
    assert torch.allclose(nucleus.exp().sum(), torch.tensor(1.0))


def test_a_sampled_token_outside_the_trainers_nucleus_keeps_a_finite_logprob():
    logits = torch.tensor([[3.0, 2.999, -1.0, -2.0]])
    alone = processed_logprobs(logits, 1.0, top_p=0.45)
    assert torch.isinf(alone[0, 1])                 # armed: by its own logits the trainer would cut token 1
    kept = processed_logprobs(logits, 1.0, top_p=0.45, keep=torch.tensor([1]))
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    assert torch.allclose(kept.exp().sum(), torch.tensor(1.0))


def test_penalties_and_bias_by_hand_on_five_logits():
    """vLLM's order on logits z = [2, -1, 0.5, 0, 3]: the bias first (+1 on id 0, a ban on id 3), then repetition
    r = 2 on ids seen in the prompt [1] or the output [2, 2, 4] (a positive logit divided, a negative one
    multiplied), then frequency f = 0.5 per output occurrence, then presence p = 0.25 per output id."""
    s = invariants.Sampling(logit_bias=((0, 1.0), (3, -math.inf)), repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, generation_start=1)
    row = torch.tensor([1, 2, 2, 4, 0])                     # prompt [1]; the token at position 4 is being predicted
    seen, counts = penalty_state(row, generation_start=1, first=4, count=1, vocab_size=5)
    assert seen.tolist() == [[False, True, True, False, True]] and counts.tolist() == [[0, 0, 2, 0, 1]]
    z = adjust_logits(torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]]), s, seen=seen, counts=counts)
    by_hand = [2 + 1,                    # biased, never seen
               -1 * 2,                   # prompt id, negative: multiplied by r
               0.5 / 2 - 0.5 * 2 - 0.25,  # output id twice: divided, then f twice and p once
               -math.inf,                # banned
               3 / 2 - 0.5 - 0.25]       # output id once
    assert z[0].tolist() == by_hand
    # then min_p after the temperature: p(v) < 0.1 * max p drops v; ids 1 and 2 are at exp(-5) and exp(-4) of the
    # max, id 4 at exp(-2.25) = 0.105 stays
    kept = torch.isfinite(processed_logprobs(z, 1.0, min_p=0.1))[0].tolist()
    assert kept == [True, False, False, False, True]

