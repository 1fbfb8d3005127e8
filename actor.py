# actor.py — the single trainable policy: load, FSDP2, logprob recompute, train step, weight export, checkpoints.
#
# Owns: the policy model, its AdamW optimizer and LR schedule, the policy version (= optimizer steps taken), the
# trainer-side logprob forward, one optimizer step over a whole TrainBatch, the weight export for the engine and
# atomic checkpoints.
# Never does: compute rewards or advantages, sample tokens, talk to an engine, or decide correction math itself.
# Invariants kept:
#   3 (forward consistency): logprobs are the engine's processed distribution (processing.adjust_logits on the
#     rows that need it: grammar mask, logit bias, penalties recomputed from the row's ids; then
#     processing.processed_logprobs: fp32 logits / T, min_p, top-k, top-p) at each token's own recorded sampling,
#     in the recompute and in the loss forward alike (gradients through the live logits), with the engine's
#     position ids, the model in eval mode for recompute AND training (no dropout/jitter differences), no
#     autocast, MoE routes replayed through the forward and the backward (r3.replay_routes), and a VLM
#     row fed the very images it was sampled with, at the engine's M-RoPE positions (models.vision_inputs). A
#     prompt that a micro-batch's rows share by their ids is computed once (shared_prefixes), its logprobs and
#     gradients the unshared forward's to fp32 round-off.
#   2 (policy version): the version gate and the train/infer IS weights come from invariants.gate_sequences and
#     invariants.correction_weights, over whole rollouts; this module applies them, drops what they reject from
#     the mask, and weighs each token by algo.loss_weights over the step's GLOBAL counts.
# Tensor convention: per-token arrays are [B, T] aligned to tokens, position 0 never trainable, right padding.
import contextlib
import functools
import math
import os
import shutil
from dataclasses import dataclass, field

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import algo
import invariants
import models
import processing
import r3

CHECKPOINT_MARKER = "ACTOR_CHECKPOINT_COMPLETE"  # written last: a folder without it was cut off mid-save
CHECKPOINT_STATE = "actor_state.pt"              # model + optimizer + scheduler + version (full, unsharded)
RUN_STATE = "run_state.pt"                       # the training loop's own state (train.py), for an exact resume
POLICY_LOSS_METRICS = ("clip_frac", "approx_kl", "ratio_mean")  # token means reported by algo.policy_loss
# the counts of invariants.gate_sequences and the means of invariants.correction_weights, summed over a step: every
# rank sums the same keys in the same order, also a rank whose micro-batches were all fillers
GATE_COUNTS = ("drop_stale", "drop_ratio_band", "drop_veto", "kept")
IS_METRICS = ("is_masked_frac", "is_clipped_frac", "mismatch_abs_log_ratio", "mismatch_k3_kl")


@dataclass
class StepReport:
    """What one optimizer step did, overall and to each token of this rank's rows ([B, T] / [B], on CPU). train_step
    fills it one micro-batch at a time (write) and sets its metrics when the step ends (done)."""
    loss_contribution: Tensor   # token_loss * weight: the token's exact share of the step's loss (0 if not trained)
    is_weights: Tensor          # the detached IS weight its loss was multiplied by (1 off the trainable tokens)
    kept: Tensor                # bool [B]: the row's rollout passed the sequence gate
    staleness: Tensor           # long [B]: trainer version - the oldest version of the row's rollout
    mask: Tensor                # the final loss mask: trainable, in a kept rollout, not rejected by the IS mask
    prox_logprobs: Tensor       # the proximal logprobs the step used: given, or from its own forward
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def empty(cls, shape: torch.Size) -> "StepReport":
        return cls(loss_contribution=torch.zeros(shape), is_weights=torch.ones(shape),
                   kept=torch.zeros(shape[0], dtype=torch.bool), staleness=torch.zeros(shape[0], dtype=torch.long),
                   mask=torch.zeros(shape), prox_logprobs=torch.zeros(shape))

    def write(self, rows: Tensor | slice, width: int, **values: Tensor) -> None:
        for name, value in values.items():
            target = getattr(self, name)
            if target.dim() == 2:
                target[rows, :width] = value.to(target.dtype).cpu()
            else:
                target[rows] = value.to(target.dtype).cpu()

    def done(self, metrics: dict[str, float]) -> "StepReport":
        self.metrics = metrics
        return self


@dataclass
class _Gated:
    """What Actor._gate decided for some whole rollouts ([B, T] / [B])."""
    prox: Tensor
    keep: Tensor
    stale: Tensor
    is_weights: Tensor
    mask: Tensor
    seq_index: Tensor


# ---- logprobs (the trainer side of "behavior logprob") ----

def _forward_inputs(model, input_ids: Tensor, attention_mask: Tensor,
                    images: list[list[invariants.ImageInput]] | None) -> dict[str, Tensor]:
    """Position ids (and a VLM's pixel inputs) of right-padded rows, exactly as the engine builds them."""
    if models.is_vision_model(model):
        images = images if images is not None else [[] for _ in range(input_ids.shape[0])]
        return models.vision_inputs(model, input_ids, attention_mask, images)[0]
    if images is not None and any(images):
        raise ValueError(f"{type(model).__name__} has no vision tower but the batch carries images; they would be "
                         f"dropped silently — train a vision-language model on image rows")
    # 0..len-1 over each row's real tokens, and its padding goes on counting: positions that restart would read to
    # transformers as packed sequences, for which it builds a [B, 1, T, T] mask
    return {"position_ids": torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)}


def _with_blank_image(model, input_ids: Tensor, attention_mask: Tensor,
                      images: list[list[invariants.ImageInput]] | None):
    """Under FSDP2 each vision block is its own shard unit, all-gathered only when it runs: a rank whose
    micro-batch holds no image would skip those collectives while a rank with images waits in them forever.
    So a sharded VLM's image-less micro-batch carries one blank image (the smallest grid: one token) in three
    extra columns after row 0's last column. Causal attention keeps it out of every real token's logits, which
    the caller cuts back to the original width; the vision tower still runs, forward and backward (zero
    gradients), in step with the other ranks. Returns the (possibly widened) ids, mask and images."""
    if not (models.is_vision_model(model) and isinstance(model, FSDPModule)) or any(images or []):
        return input_ids, attention_mask, images
    config, vision = model.config, model.config.vision_config
    merge = vision.spatial_merge_size
    pixels = torch.zeros((merge * merge, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2))
    blank = invariants.ImageInput(pixels, (1, merge, merge), 1)
    ids, mask = F.pad(input_ids, (0, 3)), F.pad(attention_mask, (0, 3))
    ids[0, -3:] = torch.tensor([config.vision_start_token_id, config.image_token_id, config.vision_end_token_id])
    mask[0, -3:] = 1
    return ids, mask, [[blank]] + [[] for _ in range(input_ids.shape[0] - 1)]


LOGPROB_CHUNK = 1024   # positions whose [positions, vocab] logits exist at once (memory only, never results)
KEPT_LOGITS = 2 ** 25  # positions x vocab up to which a forward keeps its logits for backward instead of recomputing
# inductor compiles a big micro-batch's layers apart from a small one's: it guards positions <= 4096 in its C++ code
# and, on a GPU, positions x hidden >= 5 * 2**20 for Triton's mix-order reduction (an RMSNorm backward's two sums
# in one kernel). Warm-up batches were all small, so step 1 on an H200 compiled again: 7.4 s of train against 0.5
BIG_MICRO_BATCH = (4096, 5 * 2**20)     # (positions, positions x hidden elements) a warm-up batch passes


def _per_position(x: Tensor | float | int, real: Tensor) -> Tensor | float | int:
    """A per-token [B, T] sampling tensor -> its values at the positions that draw a real next token; a scalar
    stays a scalar. Token t was drawn from the logits at t - 1 with token t's own sampling."""
    return x[:, 1:][real] if isinstance(x, Tensor) and x.dim() == 2 else x


def _chunked_head_logprobs(hidden: Tensor, head: torch.nn.Module, next_ids: Tensor, temperature, top_p, top_k, min_p,
                           with_entropy: bool, adjust=None, compiled: bool = False) -> Tensor:
    """[N, 2]: each position's logprob of its next id under the processed distribution, and that distribution's
    detached entropy, from hidden states [N, H]. The output projection runs LOGPROB_CHUNK positions at a time, and
    under autograd, past KEPT_LOGITS, each chunk is recomputed in backward (torch.utils.checkpoint), so [N, vocab]
    logits never exist at once: at a 152K vocabulary that tensor is the largest of the whole step. `adjust(logits,
    begin)` (_run_adjuster) applies processing.adjust_logits to the positions of a chunk starting at `begin` that
    need it. `compiled` (the model's layers are): untruncated chunks run _untruncated_head compiled."""
    fused = _compiled_untruncated_head() if compiled and adjust is None and not any(
        bool((x != off).any()) if isinstance(x, Tensor) else x != off
        for x, off in ((top_p, 1.0), (top_k, -1), (min_p, 0.0))) else None

    def chunk(begin, h, ids, t, p, k, m):
        logits = F.linear(h, head.weight, head.bias)
        if fused is not None:
            return fused(logits, t, ids, with_entropy)
        logits = logits.float()                                 # fp32 BEFORE any processing, as the engine
        if adjust is not None:
            logits = adjust(logits, begin)
        log_probs = processing.processed_logprobs(logits, t, p, k, m, keep=ids)
        token = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return torch.stack([token, torch.zeros_like(token)], -1)
        with torch.no_grad():   # H = -sum_v p log p of the same distribution (entr(0) = 0 off the nucleus)
            entropy = torch.special.entr(log_probs.exp()).sum(-1)
        return torch.stack([token, entropy], -1)

    recompute = torch.is_grad_enabled() and len(hidden) * head.weight.shape[0] > KEPT_LOGITS  # CPU math: kept
    pieces, bounds = [], list(range(0, len(hidden), LOGPROB_CHUNK)) + [len(hidden)]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:    # no chunk of one position: dynamo specializes size 1,
        del bounds[-2]                                      # and a compiled head would compile again for it
    for start, end in zip(bounds[:-1], bounds[1:]):
        part = slice(start, end)
        args = [start, hidden[part], next_ids[part]] + [x[part] if isinstance(x, Tensor) and x.dim() else x
                                                        for x in (temperature, top_p, top_k, min_p)]
        pieces.append(checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args))
    return torch.cat(pieces) if pieces else hidden.new_zeros((0, 2), dtype=torch.float32)


def _untruncated_head(logits: Tensor, temperature: Tensor | float, ids: Tensor, with_entropy: bool) -> Tensor:
    """A chunk with no truncated (top_p 1, top_k -1, min_p 0) or adjusted position, z = logits / T: logprob
    z_id - logsumexp(z), entropy logsumexp(z) - sum_v p_v z_v (processed_logprobs' to fp32 rounding). Compiled, its
    memory-bound passes over [n, V] (upcast, scale, reductions; forward and backward) fuse into a few."""
    scaled = logits.float() / (temperature.unsqueeze(-1) if isinstance(temperature, Tensor) else temperature)
    log_z = torch.logsumexp(scaled, -1)
    token = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return torch.stack([token, torch.zeros_like(token)], -1)
    with torch.no_grad():
        entropy = log_z - (torch.softmax(scaled, -1) * scaled).sum(-1)
    return torch.stack([token, entropy], -1)


_compiled_untruncated_head = functools.cache(lambda: torch.compile(_untruncated_head, dynamic=True))


def _is_compiled(model: torch.nn.Module) -> bool:   # Actor's compile: each decoder layer, in place
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())


def _run_adjuster(runs: list[list[invariants.AdjustedRun]], select: Tensor, input_ids: Tensor):
    """The `adjust` of _chunked_head_logprobs for a micro-batch whose rows carry AdjustedRuns (None if none does):
    the tokens start..end-1 of row b's run are predicted at positions start-1 .. end-2 of row b, which are
    selected (wanted_positions includes every run), so they are consecutive flat positions from the flat index of
    (b, start-1) on. Each chunk splices the adjusted logits of the runs it meets between the others, in one
    concatenation."""
    if not any(runs):
        return None
    flat = (select.flatten().cumsum(0) - 1).view_as(select).tolist()   # flat index of each selected position
    spans = [(flat[b][run.start - 1], flat[b][run.start - 1] + run.end - run.start, b, run)
             for b, row_runs in enumerate(runs) for run in row_runs]

    def adjust(logits: Tensor, begin: int) -> Tensor:              # logits [n, V] of flat positions begin ..
        pieces, at = [], 0
        for low, high, b, run in spans:
            a, z = max(low, begin) - begin, min(high, begin + len(logits)) - begin
            if a < z:
                pieces += [logits[at:a], processing.adjusted_run_logits(run, logits[a:z], input_ids[b],
                                                                        run.start + begin + a - low, logits.shape[-1])]
                at = z
        return torch.cat(pieces + [logits[at:]]) if pieces else logits
    return adjust


def wanted_positions(loss_mask: Tensor, runs: list[list[invariants.AdjustedRun]] | None) -> Tensor:
    """bool [B, T]: the tokens whose logprob a step uses: the trainable ones, and every token of an adjusted run
    (its replayed logits are spliced in by flat position). Prompts and tool outputs never reach the output
    projection: in a math batch that is two thirds of the positions, and the head is a fifth of the FLOPs."""
    wanted = loss_mask > 0
    for b, row_runs in enumerate(runs or []):
        for run in row_runs:
            wanted[b, run.start:run.end] = True
    return wanted


@contextlib.contextmanager
def _head_returns(model, forward):
    """Run `forward(hidden_states)` in place of the output projection for the block: the model's own forward (its
    FSDP2 hooks, a VLM's vision inputs) stays untouched, and what it returns as "logits" is forward's result."""
    head = model.get_output_embeddings()
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


# ---- shared prefixes: a GRPO group's prompt computed once ----
# The rows of a group repeat one prompt (samples_per_prompt times), and in a math batch the prompt is two thirds of
# the tokens. Rows of a micro-batch whose ids agree up to before their first wanted position form a set: its prefix
# runs once, with the KV cache kept under autograd, the cache is expanded to the set's rows (an index along the batch:
# the backward sums the rows' gradients into the one prefix), and each row's remainder runs on it at its own position
# ids. No wanted position is in a prefix (a prefix ends one token before the first position that predicts a wanted
# token), so the head sees the same positions in the same order as the plain forward, and each logprob is the plain
# forward's to fp32 round-off: invariant 3 holds, and the ids themselves decide, never a group id.

@dataclass
class SharedPrefixes:
    """Which rows of a micro-batch share which prefix (shared_prefixes)."""
    leaders: Tensor     # long [S]: a row of each set; its ids[:lengths[s]] are the set's prefix
    lengths: Tensor     # long [S]: each set's prefix length, >= 1
    row_set: Tensor     # long [B]: the set of each row (0 for a row without prefix: its cache columns are masked)
    row_prefix: Tensor  # long [B]: the prefix length each row reuses (0 = none)
    saved: int          # token positions not computed: sum over sets of (rows - 1) * length


def _prefix_limits(positions: Tensor, attention_mask: Tensor) -> list[int]:
    """Per row, the longest prefix holding no position that predicts a wanted token: token t is predicted at t-1,
    so a row whose first wanted token is s may share its ids[:s-1] (a row without one, all but its last id)."""
    lengths = attention_mask.sum(-1)
    first = torch.where(positions.any(-1), positions.int().argmax(-1), lengths)
    return (torch.minimum(first, lengths) - 1).clamp(min=0).tolist()


def shared_prefixes(input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> SharedPrefixes | None:
    """Sets of rows (bool [B, T] `positions`: the wanted ones) that start with the same ids, chosen to skip the most
    token positions; None if no two rows share one. Rows sorted by their ids are cut into runs of neighbours,
    each run sharing the longest prefix common to all of its rows (the shortest neighbour LCP, capped by each row's
    _prefix_limits); the cut maximising the positions saved, sum (rows - 1) * prefix, is found exactly by dynamic
    programming over the cut points."""
    caps = _prefix_limits(positions.cpu(), attention_mask.cpu())
    ids = input_ids.cpu()
    order = sorted(range(len(caps)), key=lambda b: ids[b, :caps[b]].tolist())
    ids = ids[order]
    differ = ids[1:] != ids[:-1]                         # [n-1, T]: where neighbours in id order first differ
    link = [0] + torch.where(differ.any(-1), differ.int().argmax(-1), ids.shape[1]).tolist()
    cap = [caps[b] for b in order]
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)   # best[i]: most positions saved over rows :i
    for i in range(1, len(order) + 1):
        best[i], cut[i], common = best[i - 1], i - 1, cap[i - 1]
        for j in range(i - 2, -1, -1):                   # the run j .. i-1
            common = min(common, cap[j], link[j + 1])
            if common == 0:
                break
            if best[j] + (i - 1 - j) * common > best[i]:
                best[i], cut[i] = best[j] + (i - 1 - j) * common, j
    if best[-1] == 0:
        return None
    row_set, row_prefix, leaders, lengths, i = [0] * len(order), [0] * len(order), [], [], len(order)
    while i > 0:
        j = cut[i]
        common = min(cap[j:i] + link[j + 1:i])
        if common > 0:
            for k in range(j, i):
                row_set[order[k]], row_prefix[order[k]] = len(leaders), common
            leaders.append(order[j])
            lengths.append(common)
        i = j
    device = input_ids.device
    return SharedPrefixes(torch.tensor(leaders, device=device), torch.tensor(lengths, device=device),
                          torch.tensor(row_set, device=device), torch.tensor(row_prefix, device=device), best[-1])


def _caches_prefixes(model) -> bool:
    """Whether the model's forward can take a shared prefix's KV: a text model whose every layer keeps a plain full
    KV cache. Not a VLM (its positions and image features come from models.vision_inputs over the whole row), not
    sliding-window or recurrent layers (their caches hold a window or a state, not every position's keys)."""
    if models.is_vision_model(model):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def _shared_prefix_forward(model, input_ids: Tensor, attention_mask: Tensor, real: Tensor,
                           prefixes: SharedPrefixes, head_logprobs) -> Tensor:
    """head_logprobs of the hidden states at `real` (bool [B, T-1], row-major, as the plain forward selects them),
    each set's prefix run once. Two forwards: the sets' prefixes [S, P] (right-padded) filling a KV cache, then every
    row's remainder [B, R] from position row_prefix on, over the cache's row of its set."""
    device, width = input_ids.device, int(prefixes.lengths.max())
    span = torch.arange(width, device=device)
    cache = DynamicCache(config=model.config)
    with _head_returns(model, lambda hidden: hidden[:, :0]):        # no prefix position is wanted
        model(input_ids=input_ids[prefixes.leaders, :width], attention_mask=(span < prefixes.lengths[:, None]).long(),
              position_ids=span.expand(len(prefixes.leaders), -1), past_key_values=cache, use_cache=True)
    cache.batch_select_indices(prefixes.row_set)                      # [S, heads, P, d] -> [B, heads, P, d]
    lengths = attention_mask.sum(-1)
    rest = int((lengths - prefixes.row_prefix).max())
    columns = prefixes.row_prefix[:, None] + torch.arange(rest, device=device)    # [B, R]: each column's position
    rest_mask = (columns < lengths[:, None]).long()
    select = F.pad(real, (0, width + rest)).gather(1, columns)        # the wanted positions of the remainders
    if int(select.sum()) != int(real.sum()):
        raise RuntimeError("a shared prefix holds a wanted position; shared_prefixes must stop before it")
    mask = torch.cat([(span < prefixes.row_prefix[:, None]).long(), rest_mask], 1)   # [B, P + R]
    with _head_returns(model, lambda hidden: head_logprobs(hidden[select])):
        return model(input_ids=input_ids.gather(1, columns.clamp(max=input_ids.shape[1] - 1)), attention_mask=mask,
                     position_ids=columns, past_key_values=cache, use_cache=True).logits          # [N, 2]


def _token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: Tensor | float,
                    images: list[list[invariants.ImageInput]] | None = None, with_entropy: bool = False,
                    top_p: Tensor | float = 1.0, top_k: Tensor | int = -1, min_p: Tensor | float = 0.0,
                    runs: list[list[invariants.AdjustedRun]] | None = None, positions: Tensor | None = None,
                    prefixes: SharedPrefixes | None = None) -> tuple[Tensor, Tensor | None]:
    """[B,T] logprob of each token given its prefix (position 0, padding and tokens outside `positions` = 0.0) under the
    distribution that drew it, and, if asked, the detached [B,T] entropy of that distribution. temperature, top_p,
    top_k, min_p: scalars, or [B,T] tensors aligned to tokens (a TrainBatch's: each token's own recorded sampling);
    runs: per row, its TrainBatch.runs (bias, penalties, a grammar; right-padded rows). `images`: per row, for a VLM.
    Only real positions (bool [B,T], default every real token) reach the output projection, in chunks. `prefixes`
    (shared_prefixes of these rows and positions): each shared prefix computed once, where the model allows it."""
    if not bool((torch.as_tensor(temperature) > 0).all()):
        raise ValueError("temperature must be > 0 on every token; pass the sampling each token was drawn with "
                         "(TrainBatch.temperature)")
    width = input_ids.shape[1]
    real = attention_mask[:, 1:].bool()                  # [B, T-1]: positions whose next token is a real token
    if positions is not None:
        real = real & positions[:, 1:].to(real.device)
    head = model.get_output_embeddings()
    adjust = _run_adjuster(runs, real, input_ids) if runs else None

    def head_logprobs(hidden: Tensor) -> Tensor:         # [N, H]: the hidden states of `real`, row-major
        return _chunked_head_logprobs(hidden, head, input_ids[:, 1:][real],
                                      *(_per_position(x, real) for x in (temperature, top_p, top_k, min_p)),
                                      with_entropy, adjust, _is_compiled(model))

    if prefixes is not None and not any(images or []) and _caches_prefixes(model):
        per_position = _shared_prefix_forward(model, input_ids, attention_mask, real, prefixes, head_logprobs)
    else:
        ids, mask, images = _with_blank_image(model, input_ids, attention_mask, images)
        # no attention mask: the rows are right-padded and attention causal, so no real token sees a pad, and a mask
        # would cost a [B, 1, T, T] tensor (two rows of 24K tokens: 6.2 GB and 43 s on a CPU, 0.65 GB and 4 s without)
        with _head_returns(model, lambda hidden: head_logprobs(hidden[:, :width - 1][real])):  # T' > T: blank image
            per_position = model(input_ids=ids, attention_mask=None, use_cache=False,
                                 **_forward_inputs(model, ids, mask, images)).logits          # [N, 2]
    grid = torch.zeros(real.shape, dtype=torch.float32, device=per_position.device)

    def on_tokens(values: Tensor) -> Tensor:             # [N] -> [B, T], 0 at position 0 and on padding
        return F.pad(grid.masked_scatter(real, values), (1, 0))
    return on_tokens(per_position[:, 0]), (on_tokens(per_position[:, 1].detach()) if with_entropy else None)


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: Tensor | float,
                      routes: Tensor | None = None, images: list[list[invariants.ImageInput]] | None = None,
                      top_p: Tensor | float = 1.0, top_k: Tensor | int = -1, min_p: Tensor | float = 0.0,
                      runs: list[list[invariants.AdjustedRun]] | None = None,
                      positions: Tensor | None = None, prefixes: SharedPrefixes | None = None) -> Tensor:
    """log pi(token_t | tokens_<t) as the engine defines behavior logprobs: processing.processed_logprobs(logits
    through processing.adjust_logits where `runs` say, temperature, top_p, top_k, min_p) at the sampled id. [B,T]
    fp32 aligned to tokens; position 0 and padding are 0.0. The sampling arguments are scalars or [B,T] per-token
    tensors, and runs a TrainBatch's (a batch's recorded sampling). `routes` (long [B,T,L,k]) replays the engine's
    MoE expert choice; `images` (per row, a VLM's) are the images of each row's pad runs; `positions` (bool [B,T])
    limits the work to the tokens wanted (the rest read 0.0), and `prefixes` (shared_prefixes of the same rows and
    positions) computes each prefix they share once. Gradients flow unless the caller is under torch.no_grad()."""
    replay = r3.replay_routes(model, routes) if routes is not None else contextlib.nullcontext()
    with replay:
        return _token_logprobs(model, input_ids, attention_mask, temperature, images, top_p=top_p, top_k=top_k,
                               min_p=min_p, runs=runs, positions=positions, prefixes=prefixes)[0]


def batch_logprobs(model, batch: invariants.TrainBatch) -> Tensor:
    """sequence_logprobs of a whole TrainBatch's wanted tokens at each token's recorded sampling, without routes
    (a frozen reference or teacher model, which has no routes of its own to replay)."""
    return sequence_logprobs(model, batch.input_ids, batch.attention_mask, images=batch.images, runs=batch.runs,
                             positions=wanted_positions(batch.loss_mask, batch.runs),
                             **{name: getattr(batch, name) for name in invariants.SAMPLING_TENSORS})


# ---- config ----

LR_SCHEDULES = ("constant", "cosine")
# fp32: every op in fp32, the exact mode (the engine's logprobs are recomputed to ~1e-6; the parity tests use it).
# bf16: matrix products in bf16 (torch.autocast on one process; FSDP2's MixedPrecisionPolicy when sharded), with
# fp32 master weights, fp32 AdamW state, fp32 gradient reduction, and logits upcast to fp32 before the
# temperature; what remains of the train/infer mismatch is what the IS correction and the gates are for.
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE_MODES = ("auto", "true", "false")
MEMORY_SHARE = 0.6                # of the memory free at the step (the GPU's, or a CPU's RAM) auto micro-batches fill
MICRO_BATCH_TOKENS_RANGE = (2048, 65536)   # auto token caps are kept inside this range


@dataclass
class ActorConfig:
    lr: float = 1e-5                           # peak AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (beta1, beta2)
    weight_decay: float = 0.0                  # decoupled AdamW weight decay
    max_grad_norm: float = 1.0                 # global L2 norm the gradient is clipped to, over all ranks
    lr_schedule: str = "constant"              # one of LR_SCHEDULES, applied after warmup
    warmup_steps: int = 0                      # optimizer steps of linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1                  # cosine ends at lr * min_lr_ratio on the last step
    micro_batch_size: int = 0                  # rows per forward/backward (0 = no cap)
    micro_batch_tokens: int = 0                # rows x longest row (0 = auto: from the GPU's memory or the RAM free)
    precision: str = "auto"                    # fp32 | bf16 | auto (bf16 on a GPU, fp32 on a CPU); see PRECISIONS
    activation_checkpointing: bool = False     # recompute each decoder layer in backward (memory for compute)
    compile: str = "auto"                      # torch.compile each decoder layer: true | false | auto (on a GPU)


def validate_actor(cfg: ActorConfig) -> None:
    """Refuse settings that would train wrong or not at all. Raises ValueError naming the fix."""
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {cfg.betas}; the usual choice is (0.9, 0.999)")
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
    if not cfg.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {cfg.max_grad_norm}; use a large value to clip rarely")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}; expected one of {LR_SCHEDULES}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 1, or 0 for auto, got {cfg.micro_batch_size}")
    if cfg.micro_batch_tokens < 0:
        raise ValueError(f"micro_batch_tokens must be >= 1, or 0 for auto, got {cfg.micro_batch_tokens}")
    if cfg.compile not in COMPILE_MODES:
        raise ValueError(f"unknown compile {cfg.compile!r}; expected one of {COMPILE_MODES}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; expected one of {PRECISIONS}")
    if cfg.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")


def lr_factor(step: int, cfg: ActorConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at 0-based optimizer step `step`: linear warmup (step+1)/warmup_steps, then constant
    or cosine from 1 down to min_lr_ratio at total_steps (SGDR, Loshchilov & Hutter 1608.03983, no restarts)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- model facts ----

def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_right_padded(attention_mask: Tensor) -> None:
    if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("training batches must be RIGHT-padded (attention_mask 1...1 0...0 per row); "
                         "build them with invariants.build_batch")


# ---- the actor ----

class Actor:
    """The policy under training. Under torch.distributed with world size > 1 each rank holds a FSDP2 shard and
    passes ITS OWN rows of the step's batch; every method is then collective (call it on all ranks)."""

    def __init__(self, model_path: str, cfg: ActorConfig, total_steps: int, seed: int = 0):
        validate_actor(cfg)
        if total_steps < 1 or cfg.warmup_steps > total_steps:
            raise ValueError(f"total_steps (optimizer steps of the run) must be >= 1 and >= warmup_steps="
                             f"{cfg.warmup_steps}, got {total_steps}")
        self.cfg, self.total_steps = cfg, total_steps
        torch.manual_seed(seed)
        self.world_size = dist.get_world_size() if _is_distributed() else 1
        self.rank = dist.get_rank() if _is_distributed() else 0
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
                       else torch.device("cpu"))
        # fp32 master weights always; the compute is fp32 (exact: no autocast, which would also run the MoE
        # routers in bf16 and flip expert choices away from the engine's) or bf16 (PRECISIONS)
        self.precision = cfg.precision if cfg.precision != "auto" else \
            ("bf16" if self.device.type == "cuda" else "fp32")
        self.model = models.load_model(model_path, dtype=torch.float32).to(self.device).eval()
        self.is_moe = bool(r3.moe_routers(self.model))
        # compiling fuses each layer's norms and activations: 1.7x the eager step at the 0.6B shape on an H200
        # (bench/gpu.py), paid in warm_up (or else the first steps); on a CPU it would add minutes of compile
        self.compiled = cfg.compile == "true" or (cfg.compile == "auto" and self.device.type == "cuda")
        if self.compiled:          # in place: parameter names, hooks and the state dict stay the module's own
            for layer in models.decoder_layers(self.model):
                layer.compile()
        if cfg.activation_checkpointing:
            self._checkpoint_layers()
        if self.world_size > 1:
            self._shard()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay,
                                           fused=self.world_size == 1)   # CPU too: 0.10 s a step, not 0.39 (135M)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(step, cfg, total_steps))
        self.version = 0  # optimizer steps taken = version of the current weights

    def warm_up(self) -> None:
        """Compile now what the first steps would (no-op unless compiled): a train forward and backward and a
        no-grad recompute over right-padded batches of 2, 3, 3, 1 and N rows (torch._dynamo makes rows and length
        dynamic at the second, and specializes one row), the third a real step's micro-batch in small: its wanted
        positions span LOGPROB_CHUNK chunks past KEPT_LOGITS, so the head runs checkpointed chunks that are views of a
        longer tensor (a guard of their own: else the first step compiles the head again); the last as many positions
        as a big micro-batch (BIG_MICRO_BATCH), capped as a step's. Weights, optimizer and RNG stay."""
        if not self.compiled:
            return
        text, draw = self.model.config.get_text_config(), torch.Generator().manual_seed(0)
        vocab = text.vocab_size
        # the third's rows: 1.5x the wanted positions of a chunk or of KEPT_LOGITS (at a vocabulary of 8K or more)
        wide = min(max(LOGPROB_CHUNK, KEPT_LOGITS // vocab), 4 * LOGPROB_CHUNK) // 2 + 28
        positions, elements = BIG_MICRO_BATCH
        big = max(positions, elements // text.hidden_size if self.device.type == "cuda" else 0) + 1
        big = min(big, self._micro_batch_limits()[1] or big)
        rows_big = max(3, math.ceil(big / (models.position_limit(self.model.config) // 2)))
        shapes = ((2, 48), (3, 80), (3, wide), (1, 64), (rows_big, max(math.ceil(big / rows_big), 16 * rows_big) + 16))
        for rows, length in shapes:
            segments = []
            for r, n in enumerate(range(length, length - 16 * rows, -16)):   # right-padded rows of unlike lengths
                sampled = [t >= 12 for t in range(n)]
                segments.append(invariants.Segment(
                    f"warm-up {r}", f"warm-up {r}", 0, torch.randint(vocab, (n,), generator=draw).tolist(), sampled,
                    [0.0] * n, [0 if s else -1 for s in sampled],
                    [invariants.Sampling(0.7) if s else invariants.UNSAMPLED for s in sampled]))
            batch = invariants.build_batch(segments, [1.0] * rows, pad_id=0)
            input_ids, attention_mask, _, images, sampling, _ = self._rows(batch, torch.arange(rows))
            with self._compute():
                _token_logprobs(self.model, input_ids, attention_mask, images=images, with_entropy=True,
                                **sampling)[0].sum().backward()
            with torch.no_grad(), self._compute():
                sequence_logprobs(self.model, input_ids, attention_mask, images=images, **sampling)
        self.optimizer.zero_grad(set_to_none=True)   # (no empty_cache: vLLM fails if memory is freed as it profiles)

    def _checkpoint_layers(self) -> None:
        """Keep only each decoder layer's input in forward and recompute the layer in backward. torch's wrapper,
        not transformers' own switch, which acts only in train mode (the model stays in eval mode). MoE routes
        stay replayed in the recompute: train_step keeps replay_routes open through backward."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        layers = set(models.decoder_layers(self.model))
        apply_activation_checkpointing(
            self.model, check_fn=lambda module: module in layers,
            checkpoint_wrapper_fn=lambda layer: checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT))

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # bf16: all-gather bf16 copies of the fp32 shards for compute, reduce-scatter gradients in fp32
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.precision == "bf16" else MixedPrecisionPolicy()
        for layer in models.decoder_layers(self.model):
            fully_shard(layer, mesh=mesh, mp_policy=mixed)
        fully_shard(self.model, mesh=mesh, mp_policy=mixed)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # SUM the rank gradients instead of FSDP's mean: each rank's loss (or, in a step that takes its
                # proximal logprobs from its own forward, its summed gradient) is divided by the GLOBAL
                # denominators, so the sum is the global token-mean gradient (prime-rl #2562).
                # Divide factor 1 alone asks for PREMUL_SUM, which gloo refuses; force_sum makes it a plain SUM.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def _compute(self):
        """The forward's precision: autocast to bf16 on one process (FSDP2 casts the sharded model itself)."""
        if self.precision == "bf16" and self.world_size == 1:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- collectives that degrade to no-ops on one process --

    def _reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _micro_batch_limits(self) -> tuple[int, int]:
        """(rows, padded tokens) per micro-batch; 0 = no cap. Auto: no row cap, and as many tokens as MEMORY_SHARE of
        the memory free now holds at the model's activation cost per token (Korthikanti et al. 2205.05198, 34h bytes
        per layer at 16 bits; here 16 h + 8 intermediate values a layer, at the compute's bytes), measured at each
        step: on a GPU when an engine sharing it is asleep, on a CPU the RAM available (one 16-row micro-batch, not
        two of 8, took a 135M CPU train step from 6.5 to 6.0 s: fewer dense [V, H] tied-embedding gradients)."""
        rows, tokens = self.cfg.micro_batch_size, self.cfg.micro_batch_tokens
        if not tokens:
            text = self.model.config.get_text_config()
            width = 2 if self.precision == "bf16" else 4
            intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
            per_token = text.num_hidden_layers * (16 * text.hidden_size + 8 * intermediate) * width
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            else:
                free = psutil.virtual_memory().available
            tokens = min(max(int(MEMORY_SHARE * free / per_token), MICRO_BATCH_TOKENS_RANGE[0]),
                         MICRO_BATCH_TOKENS_RANGE[1])
            tokens = int(self._reduce([tokens], dist.ReduceOp.MIN)[0])
        return rows, tokens

    def _micro_batches(self, batch: invariants.TrainBatch) -> list[Tensor | None]:
        """Row indices of this rank's micro-batches: whole rollouts (GSPO's sequence ratio and the sequence gates need
        all of a rollout's rows in one forward), the rollouts of one prompt together (shared_prefixes computes it
        once), longest first so that rows of like length share a micro-batch and little padding is computed, at most
        _micro_batch_limits() rows and padded tokens (rows x longest row) unless one rollout alone is larger; padded
        with None up to the most any rank has: FSDP2 runs collectives in every forward/backward, so a rank that ran
        fewer would leave the others waiting in a collective forever."""
        lengths = batch.attention_mask.sum(-1).tolist()
        rollouts: dict[str, list[int]] = {}
        for b, rollout_id in enumerate(batch.rollout_ids):
            rollouts.setdefault(rollout_id, []).append(b)
        # rollouts that may share a prefix (the same ids up to their first row's _prefix_limits) form a unit, kept in
        # one micro-batch when it fits in one (else split into whole rollouts): units longest first, and within a
        # unit its rollouts longest first
        limits = _prefix_limits(wanted_positions(batch.loss_mask, batch.runs), batch.attention_mask)
        units: dict[tuple, list[list[int]]] = {}
        for rows in rollouts.values():
            units.setdefault(tuple(batch.input_ids[rows[0], :limits[rows[0]]].tolist()), []).append(rows)
        longest = lambda rows: max(lengths[b] for b in rows)  # noqa: E731
        size, tokens = self._micro_batch_limits()
        fits = lambda count, width: not ((size and count > size) or (tokens and count * width > tokens))  # noqa: E731
        groups, current, width = [], [], 0
        for unit in sorted(units.values(), key=lambda unit: -max(map(longest, unit))):
            unit = sorted(unit, key=lambda rows: -longest(rows))
            whole = [b for rows in unit for b in rows]
            for rows in [whole] if fits(len(whole), longest(whole)) else unit:
                grown = max(width, longest(rows))
                if current and not fits(len(current) + len(rows), grown):
                    groups.append(current)                    # these rows start the next micro-batch
                    current, grown = [], longest(rows)
                current, width = current + rows, grown
        if current:
            groups.append(current)
        most = int(self._reduce([len(groups)], dist.ReduceOp.MAX)[0])
        return [torch.tensor(sorted(rows)) for rows in groups] + [None] * (most - len(groups))

    def _filler_forward(self) -> Tensor:
        """A forward that keeps this rank in step with the others when it has no rows left; returns 0 * logits."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        ids, mask, images = _with_blank_image(self.model, ids, torch.ones_like(ids), None)
        with self._compute():
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False,
                              **_forward_inputs(self.model, ids, mask, images)).logits.float().sum() * 0.0

    def _cut(self, t: Tensor, rows: Tensor, width: int) -> Tensor:
        return t[rows, :width].to(self.device)

    def _rows(self, batch: invariants.TrainBatch,
              rows: Tensor) -> tuple[Tensor, Tensor, Tensor | None, list, dict, int]:
        """input_ids, attention_mask, routes, images and the per-token sampling of `rows` (with the wanted
        positions), cut to their longest row (right padding), and that width."""
        width = max(int(batch.attention_mask[rows].sum(-1).max()), 1)
        routes = self._cut(batch.routes, rows, width) if batch.routes is not None else None
        sampling = {name: self._cut(getattr(batch, name), rows, width) for name in invariants.SAMPLING_TENSORS}
        sampling["runs"] = [batch.runs[b] for b in rows.tolist()]
        sampling["positions"] = wanted_positions(self._cut(batch.loss_mask, rows, width), sampling["runs"])
        input_ids = self._cut(batch.input_ids, rows, width)
        attention_mask = self._cut(batch.attention_mask, rows, width)
        # the prefixes a micro-batch's rows share are computed once, except where that cannot be exact: routes
        # replayed (R3 replays each row's own recorded routes, and a shared prefix would carry one row's),
        # checkpointed layers (their recompute in backward would append to the KV cache a second time), compiled
        # layers (the cache's layer index makes each layer a graph of its own: past torch._dynamo's recompile limit
        # of 8 the other layers run eager), and FSDP2 (its collectives run in every forward call; the calls of a
        # shared forward depend on the rows, so ranks could make different numbers of calls and wait forever).
        # actor/prefix_tokens_saved reads 0 then.
        if routes is None and not (self.cfg.activation_checkpointing or self.compiled) and self.world_size == 1:
            sampling["prefixes"] = shared_prefixes(input_ids, attention_mask, sampling["positions"])
        return input_ids, attention_mask, routes, [batch.images[b] for b in rows.tolist()], sampling, width

    # -- logprob recompute (pi_old / pi_prox) --

    @torch.no_grad()
    def recompute_logprobs(self, batch: invariants.TrainBatch, model: torch.nn.Module | None = None) -> Tensor:
        """Logprobs of the current weights on this rank's rows, [B,T] fp32 on CPU, each wanted token (trainable, or
        in an adjusted run; 0.0 elsewhere) at its own recorded sampling (TrainBatch.temperature/top_p/top_k/min_p and
        runs), with MoE routes replayed. `model`: a frozen reference or teacher on this device instead, in the same
        precision and micro-batches (no routes: it has none of its own to replay)."""
        own = model is None
        model = self.model if own else model
        _check_right_padded(batch.attention_mask)
        batch_size, length = batch.input_ids.shape
        out = torch.zeros((batch_size, length), dtype=torch.float32)
        for rows in self._micro_batches(batch):
            if rows is None:
                self._filler_forward()
                continue
            input_ids, attention_mask, routes, images, sampling, width = self._rows(batch, rows)
            with self._compute():
                out[rows, :width] = sequence_logprobs(model, input_ids, attention_mask, routes=routes if own else None,
                                                      images=images, **sampling).cpu()
        return out

    # -- one optimizer step --

    def train_step(self, batch: invariants.TrainBatch, prox_logprobs: Tensor | None, algo_cfg: algo.AlgoConfig,
                   correction_cfg: invariants.CorrectionConfig, trainer_version: int,
                   ref_logprobs: Tensor | None = None, token_budget: int | None = None) -> "StepReport":
        """ONE optimizer step over this rank's rows of the step's batch (all micro-batches, all ranks).
        prox_logprobs: [B,T] recomputed with the weights of `trainer_version` (the proximal policy), or None when
        those weights are the current ones (the batch's first optimizer step): each micro-batch's own forward then
        gives them, detached, and the separate recompute pass is saved. That is exact, not an approximation: the
        proximal logprobs ARE these weights' logprobs, the PPO ratio is 1 with the policy gradient as its gradient,
        and the gates and the mismatch metrics see the numbers a recompute gives.
        ref_logprobs: [B,T] of the reference model, needed when the KL is a loss term (algo.kl_loss_coef > 0).
        token_budget: Dr.GRPO's constant (most sampled tokens a rollout can hold), for seq_mean_token_sum_norm.
        The rows of a rollout must be on one rank. Returns the step's metrics and what the step did to each token
        (StepReport.prox_logprobs: the proximal logprobs used). Gradients of the step stay on the parameters until
        the next call (zeroed at the start)."""
        _check_right_padded(batch.attention_mask)
        if prox_logprobs is None and trainer_version != self.version:
            raise ValueError(f"prox_logprobs=None means the proximal policy is the current weights (version "
                             f"{self.version}), but trainer_version is {trainer_version}; pass recompute_logprobs "
                             f"of the batch taken at version {trainer_version}")
        if prox_logprobs is not None and prox_logprobs.shape != batch.input_ids.shape:
            raise ValueError(f"prox_logprobs must be [B,T]={tuple(batch.input_ids.shape)} aligned to tokens, "
                             f"got {tuple(prox_logprobs.shape)}; use recompute_logprobs(batch)")
        kl_coef = algo.kl_loss_coef(algo_cfg)
        if kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={algo_cfg.kl_coef} adds a KL loss term but ref_logprobs is None; pass the "
                             f"reference model's logprobs, or set kl_coef=0")
        record = StepReport.empty(batch.input_ids.shape)
        sums = dict.fromkeys(["loss", "entropy", "kl_ref", "prefix_tokens_saved", "r3_unreplayed_tokens",
                              "trainable_tokens", "gated_tokens", "rollouts", "staleness", "logprob_diff",
                              *POLICY_LOSS_METRICS, *(f"gate/{k}" for k in GATE_COUNTS),
                              *(f"is/{k}" for k in IS_METRICS)], 0.0)
        maxes = {"staleness_max": 0.0, "logprob_diff_max": 0.0}
        gate = functools.partial(self._gate, trainer_version=trainer_version, correction_cfg=correction_cfg,
                                 sums=sums, maxes=maxes)
        self.optimizer.zero_grad(set_to_none=True)

        # (1)-(2) with the proximal logprobs given, the sequence gates and IS weights of the whole step come first, so
        # the GLOBAL denominators (3) are known and every token's loss weight is final before any backward
        weights = None
        if prox_logprobs is not None:
            whole = gate(prox_logprobs.float(), batch.behavior_logprobs.float(), batch.loss_mask.float(),
                         batch.policy_versions, invariants.sequence_index(batch.rollout_ids))
            record.write(slice(None), batch.input_ids.shape[1], prox_logprobs=prox_logprobs,
                         is_weights=whole.is_weights, mask=whole.mask, kept=whole.keep, staleness=whole.stale)
            global_tokens, global_seqs = self._global_counts(whole.mask, whole.seq_index)
            if global_tokens == 0:  # the gates dropped every token of the step, on every rank: no update
                return record.done(self._step_metrics(sums, maxes, global_tokens, global_seqs, 0.0, skipped=True))
            weights = algo.loss_weights(whole.mask, algo_cfg.loss_agg, global_tokens, global_seqs, token_budget,
                                        whole.seq_index)

        # (4) micro-batches of whole rollouts: forward with grad, backward. Without proximal logprobs, each micro-batch
        # is gated on its own forward's (every gate is per rollout or per token, and a micro-batch holds whole
        # rollouts), its tokens weighed by the numerators of algo.loss_weights, and the summed gradient divided by
        # the global count once at the end (the gradient is linear in the weights). `record` is filled in place as
        # they run: with the proximal logprobs given it is complete already; without, a micro-batch's own gate
        # replaces its rows' cut of it (mb.update) before any use, so no micro-batch reads another's unfilled rows.
        per_token = {"behavior": batch.behavior_logprobs, "loss_mask": batch.loss_mask, "advantages": batch.advantages,
                     "versions": batch.policy_versions, "prox": record.prox_logprobs, "w": record.is_weights,
                     "mask": record.mask}
        if weights is not None:
            per_token["weights"] = weights
        if kl_coef > 0:
            per_token["ref"] = ref_logprobs
        for rows in self._micro_batches(batch):
            if rows is None:
                self._filler_forward().backward()
                continue
            input_ids, attention_mask, routes, images, sampling, width = self._rows(batch, rows)
            mb = {name: self._cut(t, rows, width) for name, t in per_token.items()}
            seq_index = invariants.sequence_index([batch.rollout_ids[b] for b in rows.tolist()]).to(self.device)
            # MoE routes stay replayed through the backward too (an activation-checkpointed recompute would
            # otherwise route live and disagree with the forward)
            replay = r3.replay_routes(self.model, routes) if routes is not None else contextlib.nullcontext()
            # trainable tokens whose predicting position has a layer with no recorded route: the live router chose
            # there (invariant 3 holds only where routes were recorded). No routes at all on an MoE model: every one
            # (vLLM reports none for a request kept across a weight update: bench/fp32_parity.py on an H200)
            unrouted = ((routes[:, :-1] < 0).flatten(2).any(-1) if routes is not None else
                        torch.full_like(mb["loss_mask"][:, 1:], self.is_moe, dtype=torch.bool))
            sums["r3_unreplayed_tokens"] += float((unrouted & (mb["loss_mask"][:, 1:] > 0)).sum())
            with replay:
                with self._compute():
                    logprobs, entropy = _token_logprobs(self.model, input_ids, attention_mask, images=images,
                                                        with_entropy=True, **sampling)
                if weights is None:
                    own = gate(logprobs.detach().float(), mb["behavior"].float(), mb["loss_mask"].float(),
                               mb["versions"], seq_index)
                    record.write(rows, width, prox_logprobs=own.prox, is_weights=own.is_weights, mask=own.mask,
                                 kept=own.keep, staleness=own.stale)
                    mb.update(prox=own.prox, w=own.is_weights, mask=own.mask,
                              weights=algo.loss_numerators(own.mask, algo_cfg.loss_agg, token_budget, seq_index))
                token_loss, pl_metrics = algo.policy_loss(logprobs, mb["prox"], mb["advantages"].float(), mb["mask"],
                                                          algo_cfg, is_weights=mb["w"], seq_index=seq_index)
                if kl_coef > 0:  # KL to the reference as a loss term, not IS-weighted
                    kl = algo.kl_divergence(logprobs, mb["ref"].float(), algo_cfg.kl_estimator) * mb["mask"]
                    token_loss = token_loss + kl_coef * kl
                    sums["kl_ref"] += float(kl.detach().sum())
                token_share = token_loss * mb["weights"]      # each token's share of the step's loss
                loss = token_share.sum()
                loss.backward()       # also with nothing kept: under FSDP2 every rank runs every backward
            record.write(rows, width, loss_contribution=token_share.detach())
            mb_tokens = float(mb["mask"].sum())
            sums["prefix_tokens_saved"] += sampling["prefixes"].saved if sampling.get("prefixes") else 0.0
            sums["loss"] += float(loss.detach())
            sums["entropy"] += float((entropy * mb["mask"]).sum())
            for name in POLICY_LOSS_METRICS:  # per-micro-batch token means -> token-weighted sums
                sums[name] += pl_metrics[name] * mb_tokens

        if weights is None:   # (3) the step's global counts, known now: the shares and gradient get their divisor
            global_tokens, global_seqs = self._global_counts(record.mask, invariants.sequence_index(batch.rollout_ids))
            if global_tokens == 0:
                self.optimizer.zero_grad(set_to_none=True)
                return record.done(self._step_metrics(sums, maxes, global_tokens, global_seqs, 0.0, skipped=True))
            denominator = algo.loss_denominator(algo_cfg.loss_agg, global_tokens, global_seqs)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(denominator)
            record.loss_contribution /= denominator
            sums["loss"] /= denominator

        # (5) clip the global gradient norm, step, advance the schedule and the version
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm)
        if not math.isfinite(grad_norm):  # a NaN/inf gradient would poison AdamW's moments: skip the update
            self.optimizer.zero_grad(set_to_none=True)
            record.loss_contribution.zero_()
            return record.done(self._step_metrics(sums, maxes, global_tokens, global_seqs, grad_norm, skipped=True))
        metrics = self._step_metrics(sums, maxes, global_tokens, global_seqs, grad_norm, skipped=False)
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        metrics["actor/version"] = float(self.version)
        return record.done(metrics)

    def _global_counts(self, mask: Tensor, seq_index: Tensor) -> tuple[float, float]:
        """Kept tokens and kept rollouts of the step over every rank (rollouts are rank-local, so counts add up)."""
        return tuple(self._reduce([float(mask.sum()), float(invariants.count_sequences(mask.cpu(), seq_index))]))

    @staticmethod
    def _gate(prox: Tensor, behavior: Tensor, loss_mask: Tensor, versions: Tensor, seq_index: Tensor, *,
              trainer_version: int, correction_cfg: invariants.CorrectionConfig, sums: dict,
              maxes: dict) -> "_Gated":
        """The sequence gates (version: staleness <= eta; veto; seq/geo band, each over a whole rollout) and the
        train/infer IS weights pi_prox / mu per token (each against its own behavior logprob, detached) of some
        whole rollouts; a token the mask mode rejects (w = 0) leaves the mask, so it leaves every denominator too.
        Adds their figures to the step's sums and maxima."""
        stale = invariants.staleness(versions, loss_mask, trainer_version, seq_index)
        log_ratio = (prox - behavior) * loss_mask
        keep, gate_counts = invariants.gate_sequences(log_ratio, loss_mask, stale, correction_cfg, seq_index)
        gated = loss_mask * keep.to(loss_mask.dtype).unsqueeze(-1)
        is_weights, is_metrics = invariants.correction_weights(prox, behavior, gated, correction_cfg, seq_index)
        mask = gated * (is_weights > 0).to(gated.dtype)

        trainable_rows = loss_mask.sum(-1) > 0
        diff = log_ratio.abs()  # |log pi_old - log mu|: train/infer mismatch before any correction
        rollout_staleness = {int(i): float(s) for i, s, t in zip(seq_index, stale, trainable_rows) if t}
        gated_tokens = float(gated.sum())
        additions = {"trainable_tokens": float(loss_mask.sum()), "gated_tokens": gated_tokens,
                     "rollouts": float(len(rollout_staleness)), "staleness": sum(rollout_staleness.values()),
                     "logprob_diff": float(diff.sum()),
                     **{f"gate/{k}": float(v) for k, v in gate_counts.items()},
                     # the invariants' IS metrics are means over these gated tokens: weight them back into sums
                     **{f"is/{k}": float(v) * gated_tokens for k, v in is_metrics.items()}}
        for name, value in additions.items():
            sums[name] += value
        maxes["staleness_max"] = max(maxes["staleness_max"], max(rollout_staleness.values(), default=0.0))
        maxes["logprob_diff_max"] = max(maxes["logprob_diff_max"], float(diff.max()) if diff.numel() else 0.0)
        return _Gated(prox, keep, stale, is_weights, mask, seq_index)

    # -- step metrics (summed over micro-batches and ranks, then divided by global counts) --

    def _step_metrics(self, sums: dict, maxes: dict, global_tokens: float, global_seqs: float, grad_norm: float,
                      skipped: bool) -> dict[str, float]:
        total = dict(zip(sums, self._reduce(list(sums.values()))))
        top = dict(zip(maxes, self._reduce(list(maxes.values()), dist.ReduceOp.MAX)))
        kept = max(global_tokens, 1.0)
        metrics = {"actor/loss": total["loss"], "actor/grad_norm": grad_norm,
                   "actor/bf16": float(self.precision == "bf16"),    # which precision this run's actor computed in
                   "actor/lr": self.scheduler.get_last_lr()[0], "actor/skipped": float(skipped),
                   "actor/version": float(self.version),
                   "actor/kept_tokens": global_tokens, "actor/kept_seqs": global_seqs,
                   "actor/entropy": total["entropy"] / kept, "actor/kl_ref": total["kl_ref"] / kept,
                   # token positions the forward did not compute: prompts shared by a micro-batch's rows, run once
                   "actor/prefix_tokens_saved": total["prefix_tokens_saved"],
                   "actor/r3_unreplayed_tokens": total["r3_unreplayed_tokens"],   # MoE: trained on live routes
                   **{f"actor/{name}": total[name] / kept for name in POLICY_LOSS_METRICS},
                   "actor/staleness_mean": total["staleness"] / max(total["rollouts"], 1.0),   # per rollout
                   "actor/staleness_max": top["staleness_max"],
                   "actor/logprob_diff_mean": total["logprob_diff"] / max(total["trainable_tokens"], 1.0),
                   "actor/logprob_diff_max": top["logprob_diff_max"]}
        metrics.update({k: v for k, v in total.items() if k.startswith("gate/")})
        metrics.update({k: v / max(total["gated_tokens"], 1.0) for k, v in total.items() if k.startswith("is/")})
        return metrics

    # -- weights out --

    @torch.no_grad()
    def export_weights(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Full (unsharded) weights for the engine, copied to `device` (the CPU, or the GPU an engine shares with
        the actor, where the copy never crosses PCIe): EVERY state_dict entry (a refit that filters by name can
        silently ship a handful of a model's parameters), each in its own dtype (an fp32 router or norm cast to bf16
        changes the engine's model), minus the tied output embedding by its exact key (models.tied_output_key).
        Collective under FSDP2; every rank gets the full dict."""
        skip, full = models.tied_output_key(self.model), lambda t: t.full_tensor() if isinstance(t, DTensor) else t
        return {name: full(value).detach().to(device, copy=True) for name, value in self.model.state_dict().items()
                if name != skip}

    # -- checkpoints --

    def save_checkpoint(self, path: str, run_state: dict | None = None) -> None:
        """Write model, optimizer, scheduler, version and RNG states to `path` atomically: everything goes to
        `path`.tmp, the marker is written last, then the folder is renamed into place (replacing an old one).
        `run_state`: what the training loop needs to continue exactly (its step, the engines' sampler streams,
        Python's RNG), saved beside the actor's own state and handed back by load_checkpoint."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        path = os.path.normpath(path)
        tmp = path + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        if self.rank == 0:
            torch.save({"model": model_state, "optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                        "version": self.version, "world_size": self.world_size}, os.path.join(tmp, CHECKPOINT_STATE))
            torch.save(run_state or {}, os.path.join(tmp, RUN_STATE))
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        rng = {"cpu": torch.get_rng_state(), "cuda": cuda_rng}
        torch.save(rng, os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        self._barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, CHECKPOINT_MARKER), "w") as f:
                f.write(f"version {self.version}\n")
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
        self._barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Restore a folder written by save_checkpoint (any world size; RNG states when the rank's file exists).
        Returns the run_state it was saved with ({} if none)."""
        if not os.path.exists(os.path.join(path, CHECKPOINT_MARKER)):
            raise FileNotFoundError(
                f"{path!r} is not a complete actor checkpoint: the marker file {CHECKPOINT_MARKER} is missing, so the "
                f"save was interrupted or the folder is something else. Resume from an earlier complete checkpoint.")
        state = torch.load(os.path.join(path, CHECKPOINT_STATE), map_location="cpu", weights_only=True)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        run_state = os.path.join(path, RUN_STATE)
        return torch.load(run_state, weights_only=True) if os.path.exists(run_state) else {}

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

