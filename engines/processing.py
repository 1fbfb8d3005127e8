# engines/processing.py — the processed distribution of invariant 3 (forward consistency, invariants.py's header): the one
# order in which the engine and the trainer turn a token's logits into the distribution it was drawn from.
# Owns: steps 1-5 below (adjust_logits, from the row's own ids through penalty_state; adjusted_run_logits for the
# trainer's AdjustedRuns) and steps 6-9 (processed_logprobs). The engine samples from and reports this distribution
# (rollout.py; engines/vllm_engine.py checks vLLM's sampler against it), the trainer recomputes it (trainer/recompute.py).
# Never does: sample, hold a model or a tokenizer, or walk a grammar (engines/constraints.py replays its masks; a run carries
# them). Imports invariants (a token's Sampling, an AdjustedRun). Tests: tests/test_processing.py, and
# tests/test_sampling.py end to end through the engine and the trainer.
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from invariants import AdjustedRun, Sampling, uses_penalties

# ---- the order ----
# Invariant: engine and trainer process the logits of a token in ONE order, vLLM's v1 sampler's (v1/sample/sampler.py,
# ops/penalties.py, logits_processor/builtin.py; vLLM's model runner applies the grammar bitmask before it):
#   z = fp32(logits); 1. constraint: z[v] = -inf where the grammar does not allow v next; 2. logit_bias: z += bias
#   (-inf bans); 3. repetition: z[v] *= (1/r if z[v] > 0 else r) for v in the prompt or the output so far;
#   4. frequency: z[v] -= f * count of v in the output so far; 5. presence: z[v] -= p * [v in the output so far];
#   6. z /= temperature; 7. min_p: drop v with softmax(z)[v] < min_p * max softmax(z); 8. top_k; 9. top_p;
#   log_softmax over what is left.
# Steps 1-5 (`adjust_logits`) are functions of the row's ids: "the prompt" is the row before the generation's first
# token (Sampling.generation_start), "the output" the generation's tokens before this one, as vLLM counts them (its
# prompt_token_ids and output_token_ids); steps 6-9 are `processed_logprobs`. A row whose tokens need steps 1-5
# carries AdjustedRuns in its TrainBatch; every other token pays nothing for them.


def processed_logprobs(logits: Tensor, temperature: Tensor | float, top_p: Tensor | float = 1.0,
                       top_k: Tensor | int = -1, min_p: Tensor | float = 0.0, keep: Tensor | None = None) -> Tensor:
    """Log-probabilities [..., V] (fp32; fp64 from fp64 logits) of the distribution a token is drawn from: steps 6-9
    above (on logits through adjust_logits where a token needs it), renormalised; the most likely token is always
    kept. The engine samples from it and reports it (vLLM's processed logprobs); the trainer recomputes it at each
    token's recorded Sampling. temperature, top_p, top_k, min_p: scalars or tensors of shape logits.shape[:-1].
    `keep` (long ids of that shape), the trainer's sampled ids, is always kept: a sampled token was in the engine's
    set, and fp32 rounding moving a near-tie across a cut must not give it -inf. Only truncated positions pay for
    the sort."""
    lead = logits.shape[:-1]
    temperature, top_p, top_k, min_p = (torch.as_tensor(x, dtype=dtype, device=logits.device).expand(lead) for x, dtype
                                        in ((temperature, torch.float32), (top_p, torch.float32), (top_k, torch.long),
                                            (min_p, torch.float32)))
    # upcast BEFORE dividing (a bf16 divide is off by ~0.1 nats); fp64 logits (score centering's head) stay fp64
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature.unsqueeze(-1)
    truncated = (top_k > 0) | (top_p < 1) | (min_p > 0)
    if not truncated.any():
        return torch.log_softmax(scaled, dim=-1)
    rows, k, p, m = scaled[truncated], top_k[truncated], top_p[truncated], min_p[truncated]   # [N, V], [N] x 3
    with torch.no_grad():   # which tokens are kept is a choice, not a function to differentiate
        probs = torch.softmax(rows, dim=-1)
        drop = probs < probs.amax(-1, keepdim=True) * m.unsqueeze(-1)        # min_p, as vLLM's MinPLogitsProcessor
        ordered, order = rows.sort(dim=-1, descending=True)
        kth = ordered.gather(-1, (k.clamp(1, rows.shape[-1]) - 1).unsqueeze(-1))
        drop |= (k > 0).unsqueeze(-1) & (rows < kth)
        probs = torch.softmax(rows.masked_fill(drop, float("-inf")), dim=-1).gather(-1, order)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.unsqueeze(-1)   # mass before a token already reaches p
        drop |= torch.zeros_like(drop).scatter(-1, order, drop_sorted)
        if keep is not None:
            drop.scatter_(-1, keep.expand(lead)[truncated].unsqueeze(-1), False)
    out = torch.log_softmax(scaled, dim=-1)
    return out.masked_scatter(truncated.unsqueeze(-1), torch.log_softmax(rows.masked_fill(drop, float("-inf")), -1))


def adjust_logits(logits: Tensor, sampling: Sampling, allowed: Tensor | None = None, seen: Tensor | None = None,
                  counts: Tensor | None = None) -> Tensor:
    """Steps 1-5 for L tokens drawn at one `sampling`: logits [L, V] -> fp32 [L, V]. allowed [L, V] bool: what the
    grammar allowed before each token (None = unconstrained); seen, counts [L, V]: penalty_state (None without
    penalties). Gradients flow through the logits; the repetition's factor (chosen by the logit's sign) is no-grad."""
    z = logits.float()
    if allowed is not None:
        z = z.masked_fill(~allowed, float("-inf"))
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], device=z.device)
        bias = torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32, device=z.device)
        z = z.index_add(-1, ids, bias.expand(len(z), -1))
    if uses_penalties(sampling):
        r, f, p = (torch.tensor(x, dtype=torch.float32, device=z.device) for x in
                   (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty))
        with torch.no_grad():   # vLLM's apply_repetition_penalties: logits *= 1/r where > 0, else r, on seen ids
            scale = torch.where(seen, torch.where(z > 0, 1.0 / r, r), torch.ones_like(z))
        z = z * scale - f * counts - p * (counts > 0)      # then vLLM's frequency, then its presence
    return z


def penalty_state(ids: Tensor, generation_start: int, first: int, count: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Before each of the row's tokens at first .. first+count-1 of a generation starting at generation_start: seen
    [count, V] bool (in the prompt ids[:generation_start] or the output so far: repetition) and counts [count, V]
    fp32 (in the output ids[generation_start:t]: frequency, presence). ids: long [>= first + count - 1], the row."""
    base = torch.bincount(ids[generation_start:first], minlength=vocab_size).float()
    joined = F.one_hot(ids[first:first + count - 1], vocab_size).float()   # each token joins the output after it
    counts = base + F.pad(joined, (0, 0, 1, 0)).cumsum(0)
    prompt = torch.bincount(ids[:generation_start], minlength=vocab_size) > 0
    return prompt | (counts > 0), counts


def adjusted_run_logits(run: AdjustedRun, logits: Tensor, row_ids: Tensor, first: int, vocab_size: int) -> Tensor:
    """adjust_logits [L, V] of an AdjustedRun's tokens at row positions first .. first+L-1, from their logits and
    the row's ids (its penalties' state, and its grammar masks unpacked)."""
    count, s, seen, counts, allowed = len(logits), run.sampling, None, None, None
    if uses_penalties(s):
        seen, counts = penalty_state(row_ids, s.generation_start, first, count, vocab_size)
    if run.masks is not None:
        packed = run.masks[run.mask_index[first - run.start:first - run.start + count]].to(logits.device)
        bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
        allowed = bits.bool().flatten(-2)[:, :vocab_size]
    return adjust_logits(logits, s, allowed, seen, counts)
