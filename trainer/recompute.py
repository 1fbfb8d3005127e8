# trainer/recompute.py — the trainer's side of invariant 3 (forward consistency): a model's logprob of each token under the
# processed distribution it was drawn from, recomputed through one forward.
# Owns: sequence_logprobs and batch_logprobs (the recompute of the behavior logprob, at each token's recorded
# sampling), forward_logprobs (the same with the detached entropy: the actor's loss forward), the forward's inputs
# as the engine builds them (position ids, a VLM's images), the chunked output projection (only the wanted positions
# reach it, LOGPROB_CHUNK at a time), and shared prefixes (a GRPO group's prompt computed once).
# Never does: hold an optimizer, shard a model, gate, weigh or aggregate a loss (actor.py), or sample (rollout.py).
# Invariant kept: 3 - the engine's position ids, fp32 logits before any processing, engines/processing.py's steps at each
# token's own Sampling (processing.adjusted_run_logits on a row's AdjustedRuns), MoE routes replayed
# (r3.replay_routes), a VLM row fed the very images it was sampled with; the caller picks the precision.
# Tensor convention: per-token arrays are [B, T] aligned to tokens, position 0 never trainable, right padding.
# Tests: tests/test_recompute.py (by hand, padding, the fused head, shared prefixes), tests/test_actor.py (the
# chunked head and shared prefixes inside a step), tests/test_rollout.py and tests/test_sampling.py (the engine's
# logprobs against this recompute).
import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import invariants
import models
from engines import processing, r3

# ---- the forward's inputs, as the engine builds them ----

def forward_inputs(model, input_ids: Tensor, attention_mask: Tensor,
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


def with_blank_image(model, input_ids: Tensor, attention_mask: Tensor,
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


def _per_position(x: Tensor | float | int, real: Tensor) -> Tensor | float | int:
    """A per-token [B, T] sampling tensor -> its values at the positions that draw a real next token; a scalar
    stays a scalar. Token t was drawn from the logits at t - 1 with token t's own sampling."""
    return x[:, 1:][real] if isinstance(x, Tensor) and x.dim() == 2 else x


def _chunked_head_logprobs(hidden: Tensor, head: torch.nn.Module, next_ids: Tensor, temperature, top_p, top_k, min_p,
                           with_entropy: bool, adjust=None, compiled: bool = False) -> Tensor:
    """[N, m + 1]: each position's logprob of its next id under the processed distribution, and that distribution's
    detached entropy, from hidden states [N, H]; next_ids [N] (m = 1), or [N, m]: the next id and the ids of a
    score-centering head, each read from the same distribution (-inf where the processing excludes one), all in
    fp64 (the centering's coefficients reach 1e5 and more, and their sum over the head cancels to order 1). The
    output projection runs LOGPROB_CHUNK positions at a time, and under autograd, past KEPT_LOGITS, each chunk is
    recomputed in backward (torch.utils.checkpoint), so [N, vocab] logits never exist at once: at a 152K vocabulary
    that tensor is the largest of the whole step. `adjust(logits, begin)` (_run_adjuster) applies
    processing.adjust_logits to the positions of a chunk starting at `begin` that need it. `compiled` (the model's
    layers are): untruncated chunks run _untruncated_head compiled (the sampled ids alone)."""
    fused = _compiled_untruncated_head() if compiled and adjust is None and next_ids.dim() == 1 and not any(
        bool((x != off).any()) if isinstance(x, Tensor) else x != off
        for x, off in ((top_p, 1.0), (top_k, -1), (min_p, 0.0))) else None

    def chunk(begin, h, ids, t, p, k, m):
        logits = F.linear(h, head.weight, head.bias)
        if fused is not None:
            return fused(logits, t, ids, with_entropy)
        logits = logits.float()                                 # fp32 BEFORE any processing, as the engine
        if adjust is not None:
            logits = adjust(logits, begin)
        if ids.dim() == 2:      # a score-centering head: normalised in fp64 (trainer/centering.py, alpha large)
            logits = logits.double()
        log_probs = processing.processed_logprobs(logits, t, p, k, m, keep=ids if ids.dim() == 1 else ids[:, 0])
        tokens = log_probs.gather(-1, ids.view(len(ids), -1))                   # [n, m]
        if not with_entropy:
            return torch.cat([tokens, torch.zeros_like(tokens[:, :1])], -1)
        with torch.no_grad():   # H = -sum_v p log p of the same distribution (entr(0) = 0 off the nucleus)
            entropy = torch.special.entr(log_probs.exp()).sum(-1)
        return torch.cat([tokens, entropy.unsqueeze(-1)], -1)

    recompute = torch.is_grad_enabled() and len(hidden) * head.weight.shape[0] > KEPT_LOGITS  # CPU math: kept
    pieces, bounds = [], list(range(0, len(hidden), LOGPROB_CHUNK)) + [len(hidden)]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:    # no chunk of one position: dynamo specializes size 1,
        del bounds[-2]                                      # and a compiled head would compile again for it
    for start, end in zip(bounds[:-1], bounds[1:]):
        part = slice(start, end)
        args = [start, hidden[part], next_ids[part]] + [x[part] if isinstance(x, Tensor) and x.dim() else x
                                                        for x in (temperature, top_p, top_k, min_p)]
        pieces.append(checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args))
    width = 2 if next_ids.dim() == 1 else next_ids.shape[1] + 1
    return torch.cat(pieces) if pieces else hidden.new_zeros((0, width), dtype=torch.float64 if next_ids.dim() == 2
                                                              else torch.float32)


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


def prefix_limits(positions: Tensor, attention_mask: Tensor) -> list[int]:
    """Per row, the longest prefix holding no position that predicts a wanted token: token t is predicted at t-1,
    so a row whose first wanted token is s may share its ids[:s-1] (a row without one, all but its last id)."""
    lengths = attention_mask.sum(-1)
    first = torch.where(positions.any(-1), positions.int().argmax(-1), lengths)
    return (torch.minimum(first, lengths) - 1).clamp(min=0).tolist()


def shared_prefixes(input_ids: Tensor, attention_mask: Tensor, positions: Tensor) -> SharedPrefixes | None:
    """Sets of rows (bool [B, T] `positions`: the wanted ones) that start with the same ids, chosen to skip the most
    token positions; None if no two rows share one. Rows sorted by their ids are cut into runs of neighbours,
    each run sharing the longest prefix common to all of its rows (the shortest neighbour LCP, capped by each row's
    prefix_limits); the cut maximising the positions saved, sum (rows - 1) * prefix, is found exactly by dynamic
    programming over the cut points."""
    caps = prefix_limits(positions.cpu(), attention_mask.cpu())
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


def forward_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: Tensor | float,
                     images: list[list[invariants.ImageInput]] | None = None, with_entropy: bool = False,
                     top_p: Tensor | float = 1.0, top_k: Tensor | int = -1, min_p: Tensor | float = 0.0,
                     runs: list[list[invariants.AdjustedRun]] | None = None, positions: Tensor | None = None,
                     prefixes: SharedPrefixes | None = None,
                     candidates: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """[B,T] logprob of each token given its prefix (position 0, padding and tokens outside `positions` = 0.0) under the
    distribution that drew it, and, if asked, the detached [B,T] entropy of that distribution. temperature, top_p,
    top_k, min_p: scalars, or [B,T] tensors aligned to tokens (a TrainBatch's: each token's own recorded sampling);
    runs: per row, its TrainBatch.runs (bias, penalties, a grammar; right-padded rows). `images`: per row, for a VLM.
    Only real positions (bool [B,T], default every real token) reach the output projection, in chunks. `prefixes`
    (shared_prefixes of these rows and positions): each shared prefix computed once, where the model allows it.
    `candidates` (long [B,T,k], a TrainBatch's top_ids: score centering) also returns the [B,T,k] logprobs of those
    ids in the distribution that drew each token (third value, fp64; None without candidates), with gradient."""
    if not bool((torch.as_tensor(temperature) > 0).all()):
        raise ValueError("temperature must be > 0 on every token; pass the sampling each token was drawn with "
                         "(TrainBatch.temperature)")
    width = input_ids.shape[1]
    real = attention_mask[:, 1:].bool()                  # [B, T-1]: positions whose next token is a real token
    if positions is not None:
        real = real & positions[:, 1:].to(real.device)
    head = model.get_output_embeddings()
    adjust = _run_adjuster(runs, real, input_ids) if runs else None

    next_ids = input_ids[:, 1:][real]
    if candidates is not None:                           # [N, 1 + k]: the sampled id, then its head's
        next_ids = torch.cat([next_ids.unsqueeze(-1), candidates[:, 1:][real].to(next_ids.device)], -1)

    def head_logprobs(hidden: Tensor) -> Tensor:         # [N, H]: the hidden states of `real`, row-major
        return _chunked_head_logprobs(hidden, head, next_ids,
                                      *(_per_position(x, real) for x in (temperature, top_p, top_k, min_p)),
                                      with_entropy, adjust, _is_compiled(model))

    if prefixes is not None and not any(images or []) and _caches_prefixes(model):
        per_position = _shared_prefix_forward(model, input_ids, attention_mask, real, prefixes, head_logprobs)
    else:
        ids, mask, images = with_blank_image(model, input_ids, attention_mask, images)
        # no attention mask: the rows are right-padded and attention causal, so no real token sees a pad, and a mask
        # would cost a [B, 1, T, T] tensor (two rows of 24K tokens: 6.2 GB and 43 s on a CPU, 0.65 GB and 4 s without)
        with _head_returns(model, lambda hidden: head_logprobs(hidden[:, :width - 1][real])):  # T' > T: blank image
            per_position = model(input_ids=ids, attention_mask=None, use_cache=False,
                                 **forward_inputs(model, ids, mask, images)).logits          # [N, m + 1]
    grid = torch.zeros(real.shape, dtype=torch.float32, device=per_position.device)

    def on_tokens(values: Tensor) -> Tensor:             # [N] -> [B, T], 0 at position 0 and on padding
        return F.pad(grid.masked_scatter(real, values), (1, 0))
    entropy = on_tokens(per_position[:, -1].detach().float()) if with_entropy else None
    if candidates is None:
        return on_tokens(per_position[:, 0]), entropy, None
    heads = per_position.new_full(real.shape + (candidates.shape[-1],), -math.inf)   # -inf off the sampled positions
    heads = F.pad(heads.masked_scatter(real.unsqueeze(-1), per_position[:, 1:-1]), (0, 0, 1, 0), value=-math.inf)
    return on_tokens(per_position[:, 0].float()), entropy, heads


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
        return forward_logprobs(model, input_ids, attention_mask, temperature, images, top_p=top_p, top_k=top_k,
                                min_p=min_p, runs=runs, positions=positions, prefixes=prefixes)[0]


def batch_logprobs(model, batch: invariants.TrainBatch) -> Tensor:
    """sequence_logprobs of a whole TrainBatch's wanted tokens at each token's recorded sampling, without routes
    (a frozen reference or teacher model, which has no routes of its own to replay)."""
    return sequence_logprobs(model, batch.input_ids, batch.attention_mask, images=batch.images, runs=batch.runs,
                             positions=wanted_positions(batch.loss_mask, batch.runs),
                             **{name: getattr(batch, name) for name in invariants.SAMPLING_TENSORS})
