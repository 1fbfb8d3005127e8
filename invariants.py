# invariants.py — the three correctness invariants of tracerl, as code, and the one glossary of the words for them.
# Owns every rule about tokens, versions and routes. The numbering below is the project's only one; code, tests and
# docs cite an invariant as "invariant N" with its short name:
#   1. token identity: what the trainer trains on is exactly what the engine sampled over (TokenLedger, segment
#      sealing, TrainBatch and build_batch, the proofs check_token_identity and check_sampled_once);
#   2. policy version (policy-version semantics): every sampled token keeps the version and behavior logprob it
#      was sampled with (and, for score centering, the sampler's top-k head: Segment.top_ids); the staleness gate
#      and importance-sampling (IS) corrections over whole rollouts, and what a rejection removes (apply_correction);
#   3. forward consistency: one processed distribution for engine and trainer (engines/processing.py, at each token's
#      recorded Sampling: the behavior logprob is of that distribution, and the trainer recomputes it) and MoE
#      rollout routing replay (R3, engines/r3.py): the trainer uses the experts the engine used. This module holds what a
#      row carries for them (Sampling, routes, AdjustedRuns).
# Never does: model loading, tokenization, sampling, optimisation, or I/O beyond `logging`; imports nothing of the
# project (a grammar's masks come in as a function: build_batch's grammar_masks). Imported by every stage.
#
# Glossary: one name per concept, used by every module, test and doc.
#   rollout          one agent episode on one prompt: all the tokens the engine sampled for it, and its one reward.
#                    It is the unit of advantages, staleness, the rollout gates, the "seq"/"geo" IS levels and the
#                    seq_mean_* loss aggregations, and of a micro-batch (never split). `rollout_id` names it;
#                    `rollout_index` [B] maps each row of a batch to its rollout (0, 1, ... in order of first row).
#   segment          one training row: a token buffer of one rollout (Segment), sealed when the agent rewrites its
#                    context, so a rollout is one segment or several. In a TrainBatch, index b of every [B, T] or [B]
#                    array is one segment; "row" always means a segment (the ledger's rows() are its segments).
#   group            the rollouts of one prompt (`group_id`): the baseline of the group estimators (algo.py).
#   policy version   optimizer steps taken when the weights were made (actor.Actor.version), recorded per token.
#   staleness        trainer_version - the oldest version over a rollout's trainable tokens, in policy versions,
#                    as is the gate's bound CorrectionConfig.max_staleness. runtime.RuntimeConfig.eta bounds the age
#                    at admission in RL steps (batches) of `minibatches` optimizer steps each, so
#                    runtime.validate_runtime requires max_staleness >= eta * minibatches.
#   behavior policy  mu: the weights that sampled a token, at its version; `behavior_logprobs`, the engine's logprob
#                    of the token in the processed distribution it was drawn from (invariant 3), never re-stamped.
#   proximal policy  pi_prox: the trainer's weights at `trainer_version`, the start of the step's batch (decoupled PPO,
#                    arXiv 2505.24298). `prox_logprobs` is its recompute of each token, detached: the denominator of
#                    the PPO ratio r = pi / pi_prox and the numerator of the IS ratio rho = pi_prox / mu. (Where the
#                    batch is on-policy it is what PPO papers call pi_old; the code never says old.)
#   pi               the live weights in the loss forward; `logprobs`, the only logprobs with a gradient.
#   "seq"            in a config value (the IS level and seq_gate "seq"; the loss_agg seq_mean_token_mean and
#                    seq_mean_token_sum_norm) the literature's "sequence level", which here is the rollout level:
#                    over all of a rollout's segments. The word "sequence" otherwise means a sequence of token ids
#                    (recompute.sequence_logprobs: each token's logprob given the ids before it), never a unit.
from __future__ import annotations

import itertools
import logging
import math
import dataclasses
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

# ---- 1. token identity ----
# Invariant: every trainable token of a training row is an id the engine sampled, at the position it was
# sampled, after exactly the prefix it was sampled under; context tokens (prompt, tool output, template
# filler, re-rendered history) are never trainable. A new engine call extends the open segment only if the
# segment is a bitwise prefix of the new prompt (integer equality, never string equality); otherwise the
# segment is sealed and a new, all-context segment starts (prime-rl's "extension property"; ART issue #883 for why
# re-rendered sampled text must not stay trainable; shown in tests/test_invariants.py and, on a model taught the
# traps, tests/test_session.py).
# Images are part of the prefix: a VLM prompt is its ids plus the images that fill its pad runs, so a segment
# extends only if its images are the first images of the new prompt (the same objects), and the trainer feeds
# each row exactly the images its pads were sampled under. An MoE segment also seals on a new version (invariant 3).


@dataclass(eq=False)
class ImageInput:
    """One image as the model sees it: the image processor's output, made once and shared by engine and trainer."""
    pixel_values: Tensor             # float32 [patches, channels * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]   # (t, h, w) in patches
    n_tokens: int                    # <|image_pad|> tokens it fills in the prompt = t*h*w // merge**2
    # the image at the size the processor resized it to (RGB, PIL): what an engine running its own copy of the
    # processor is given (vLLM), so that its resize is a no-op and it computes these same pixel_values
    source: Any = None


def image_pad_runs(token_ids: Sequence[int], pad_id: int) -> list[int]:
    """Lengths of the maximal runs of pad_id in token_ids, in order (one run per image)."""
    return [len(list(run)) for t, run in itertools.groupby(token_ids) if t == pad_id]


def check_image_pads(token_ids: Sequence[int], images: Sequence[ImageInput], pad_id: int, where: str) -> None:
    """Each image fills exactly one run of pad ids, of its n_tokens, in order; raises ValueError otherwise.
    (The model places image features by pad position and M-RoPE takes one run per image, so counts that only
    match in total would still put one image's features or positions on another image's pads.)"""
    runs = image_pad_runs(token_ids, pad_id)
    wanted = [image.n_tokens for image in images]
    if runs != wanted:
        raise ValueError(f"{where}: the ids hold image pad runs of lengths {runs} but the images fill {wanted} "
                         f"tokens; expand each image's single pad id to its n_tokens (data.expand_image_pads) and "
                         f"pass exactly the images of those pads, in order")


@dataclass(frozen=True)
class Sampling:
    """How the engine drew a token: the processing the trainer must repeat to recompute its behavior logprob
    (invariant 3). Recorded per token, because an agent may send its own temperature/top_p/top_k per request."""
    temperature: float = 1.0         # logits / temperature, > 0
    top_p: float = 1.0               # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1                  # most likely tokens kept; -1 = off
    min_p: float = 0.0               # tokens below min_p * p(most likely) dropped; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (id, bias) added to the raw logits, sorted by id; -inf bans
    repetition_penalty: float = 1.0  # seen ids (prompt + this generation): logit / r if > 0 else logit * r; 1 = off
    frequency_penalty: float = 0.0   # logit -= f * (count of the id in this generation so far); 0 = off
    presence_penalty: float = 0.0    # logit -= p if the id occurred in this generation so far; 0 = off
    constraint: str | None = None    # a grammar the tokens were masked by (engines/constraints.py's canonical JSON spec)
    generation_start: int = -1       # the row position of this generation's first sampled token: where the state of
                                     # the penalties and the constraint starts (the prompt is the row before it)


UNSAMPLED = Sampling()  # what context tokens carry: the plain model distribution (they are never trained)

# The ranges a request may ask for: OpenAI's for the penalties (0 = off) and the logit bias (-inf is a ban, as the
# wire layer's internal bans); vLLM's for min_p (0 = off); repetition (1 = off) up to 10, where a seen id is erased
PROCESSING_RANGES = {"min_p": (0.0, 1.0), "repetition_penalty": (0.01, 10.0), "frequency_penalty": (-2.0, 2.0),
                     "presence_penalty": (-2.0, 2.0)}
MAX_ABS_LOGIT_BIAS = 100.0


def uses_penalties(s: Sampling) -> bool:
    return s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0


def adjusts_logits(s: Sampling) -> bool:
    """Whether tokens drawn at `s` had their logits changed before the temperature (bias, penalties, grammar)."""
    return bool(s.logit_bias) or uses_penalties(s) or s.constraint is not None


def check_logit_processing(s, where: str, vocab_size: int | None = None) -> None:
    """Refuse a min_p, logit bias, penalty or constraint the processed distribution cannot take (ValueError saying
    what is accepted). `s`: a token's Sampling (check_sampling) or a request's engines.SamplingParams (the same field
    names; validate_sampling, and an engine's check with its vocabulary)."""
    def within(x, low, high) -> bool:     # a real number (not a bool, not NaN) in [low, high]
        return isinstance(x, Real) and not isinstance(x, bool) and low <= x <= high
    for name, (low, high) in PROCESSING_RANGES.items():
        if not within(getattr(s, name), low, high):
            raise ValueError(f"{where}: {name} must be a number in [{low:g}, {high:g}], got {getattr(s, name)!r:.40}")
    if not (s.constraint is None or (isinstance(s.constraint, str) and s.constraint)):
        raise ValueError(f"{where}: constraint must be None or a grammar spec (engines/constraints.py's JSON text), got "
                         f"{s.constraint!r:.60}")
    logit_bias = s.logit_bias
    pairs = isinstance(logit_bias, tuple) and all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Integral) and not isinstance(x[0], bool)
        and x[0] >= 0 and (within(x[1], -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS) or x[1] == -math.inf)
        for x in logit_bias)
    ids = [x[0] for x in logit_bias] if pairs else []
    if not pairs or any(b <= a for a, b in zip(ids, ids[1:])) or (vocab_size and ids and ids[-1] >= vocab_size):
        vocab = f" < {vocab_size}" if vocab_size else ""
        raise ValueError(f"{where}: logit_bias must be a tuple of (token id{vocab}, bias) pairs sorted by id, one per "
                         f"id, each bias in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] or -inf (a ban); got "
                         f"{logit_bias!r:.80}")


def check_sampling(sampling: Sampling, where: str) -> None:
    """Refuse a Sampling the processed distribution cannot be recomputed from."""
    if not isinstance(sampling, Sampling):
        raise ValueError(f"{where}: sampling must be an invariants.Sampling (the engine's Generation.sampling), got "
                         f"{type(sampling).__name__}; a token without its sampling would be trained at a guessed "
                         f"temperature")
    s = sampling
    t, p, k = s.temperature, s.top_p, s.top_k
    if not (isinstance(t, Real) and math.isfinite(t) and t > 0 and isinstance(p, Real) and 0 < p <= 1
            and isinstance(k, Integral) and (k == -1 or k >= 1)):
        raise ValueError(f"{where}: sampling {sampling} is not a distribution: temperature must be finite and > 0, "
                         f"top_p in (0, 1], top_k -1 or >= 1")
    check_logit_processing(s, where)
    g, stateful = s.generation_start, uses_penalties(s) or s.constraint is not None
    if not (isinstance(g, Integral) and not isinstance(g, bool) and (g >= 1 if stateful else g >= -1)):
        raise ValueError(f"{where}: generation_start must be the row position of the generation's first token (the "
                         f"prompt's length, >= 1) when penalties or a constraint are on (they depend on the ids "
                         f"before each token), else -1; got {g!r:.40}")


MAIN_LINE = "main"   # the line of every row but a chat agent's side requests (Segment.line)


@dataclass(eq=False)
class Segment:
    """One training row: a token buffer plus per-position arrays, all of length len(token_ids)."""
    rollout_id: str
    group_id: str
    segment_id: int                  # 0, 1, 2, ... within the rollout
    token_ids: list[int]             # [n] vocabulary ids
    trainable: list[bool]            # [n] True only for engine-sampled tokens
    behavior_logprobs: list[float]   # [n] engine logprob of the sampled token (nats); 0.0 on context tokens
    policy_versions: list[int]       # [n] weight version that sampled the token; -1 on context tokens
    sampling: list[Sampling]         # [n] how each token was drawn; UNSAMPLED on context tokens
    routes: np.ndarray | None = None  # int16 [n, layers, top_k] expert ids; -1 = not routed; None = no routes
    seal_reason: str = ""            # "" while open; why it was sealed
    common_prefix_len: int = -1      # LCP with the prompt that caused the seal (-1 if not sealed by a prompt)
    images: list[ImageInput] = field(default_factory=list)  # the images of its pad runs, in order (VLMs)
    # score centering (trainer/centering.py): the engine's k most likely ids of the distribution that drew each sampled token,
    # and their behavior logprobs, recorded with the token (invariant 2); id 0 at -inf on context and empty slots.
    # None = not recorded (the run does not center)
    top_ids: np.ndarray | None = None                # int64 [n, k]
    top_behavior_logprobs: np.ndarray | None = None  # float32 [n, k]
    line: str = MAIN_LINE    # the rollout's conversation it records: "main", or a chat agent's "side-<k>" (session.py),
                             # whose segment_ids count from 0 apart from the main line's (GAE chains lines apart)

    @property
    def is_open(self) -> bool:
        return self.seal_reason == ""

    @property
    def num_trainable(self) -> int:
        return sum(self.trainable)


def _check_ids(token_ids: Sequence, what: str) -> list[int]:
    ids = list(token_ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
            raise ValueError(f"{what}: id at index {i} is {t!r}; token ids must be ints >= 0 "
                             f"(pass the engine's token ids, not text or logits)")
    return [int(t) for t in ids]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class TokenLedger:
    """Append-only token record of one rollout: a list of segments, the last one open (if any)."""

    def __init__(self, rollout_id: str, group_id: str = ""):
        self.rollout_id, self.group_id = rollout_id, group_id
        self.segments: list[Segment] = []

    @property
    def _open(self) -> Segment | None:
        return self.segments[-1] if self.segments and self.segments[-1].is_open else None

    @property
    def open_token_ids(self) -> list[int]:
        return list(seg.token_ids) if (seg := self._open) is not None else []

    @property
    def open_images(self) -> list[ImageInput]:
        return list(seg.images) if (seg := self._open) is not None else []

    def _new_segment(self) -> Segment:
        self.segments.append(Segment(self.rollout_id, self.group_id, len(self.segments), [], [], [], [], []))
        return self.segments[-1]

    def _grow(self, seg: Segment, ids: list[int], trainable: bool, logprobs: list[float], versions: list[int],
              sampling: Sampling = UNSAMPLED):
        seg.token_ids.extend(ids)
        seg.trainable.extend([trainable] * len(ids))
        seg.behavior_logprobs.extend(logprobs)
        seg.policy_versions.extend(versions)
        seg.sampling.extend([sampling] * len(ids))
        if seg.routes is not None:  # new positions are not routed yet
            pad = np.full((len(ids),) + seg.routes.shape[1:], -1, dtype=np.int16)
            seg.routes = np.concatenate([seg.routes, pad])
        if seg.top_ids is not None:  # positions without a head (context); append_sampled writes the sampled ones
            seg.top_ids = np.concatenate([seg.top_ids, np.zeros((len(ids), seg.top_ids.shape[1]), np.int64)])
            seg.top_behavior_logprobs = np.concatenate(
                [seg.top_behavior_logprobs, np.full((len(ids), seg.top_ids.shape[1]), -np.inf, np.float32)])

    def extend_or_seal(self, prompt_ids: Sequence[int], images: Sequence[ImageInput] = ()) -> bool:
        """Record the prompt of a new engine call with ALL its images. Returns True if it extends the open segment
        (its ids are a prefix of the prompt and its images, as objects, the first images of `images`; the delta
        is appended as context); otherwise seals the open segment (reason "non_extension", LCP recorded) and
        opens a new segment whose tokens are all context. The first call of a rollout opens a segment; returns
        False. The open segment's images become `images`."""
        prompt = _check_ids(prompt_ids, f"extend_or_seal (rollout {self.rollout_id})")
        images = list(images)
        seg = self._open
        # identity, not equality: a re-processed or replaced image is a different input, even if it looks alike
        same_images = seg is not None and len(seg.images) <= len(images) and \
            all(old is new for old, new in zip(seg.images, images))
        if seg is not None and same_images and prompt[:len(seg.token_ids)] == seg.token_ids:
            delta = prompt[len(seg.token_ids):]
            self._grow(seg, delta, False, [0.0] * len(delta), [-1] * len(delta))
            seg.images = images
            return True
        if seg is not None:
            lcp = common_prefix_len(seg.token_ids, prompt)
            seg.common_prefix_len = lcp
            self.seal("non_extension")
            log.info("rollout %s: segment %d sealed (reason non_extension, LCP %d of %d open tokens, new prompt "
                     "%d tokens, images %s); the new segment is all context", self.rollout_id, seg.segment_id, lcp,
                     len(seg.token_ids), len(prompt), "kept" if same_images else "changed")
        self.append_context(prompt)
        self._open.images = images
        return False

    def append_context(self, token_ids: Sequence[int]) -> None:
        """Append non-trainable tokens (prompt, tool output, template filler) to the open segment (opens one
        if none is open)."""
        ids = _check_ids(token_ids, f"append_context (rollout {self.rollout_id})")
        seg = self._open or self._new_segment()
        self._grow(seg, ids, False, [0.0] * len(ids), [-1] * len(ids))

    def append_sampled(self, token_ids: Sequence[int], behavior_logprobs: Sequence[float],
                       policy_versions: Sequence[int], sampling: Sampling, routed: bool = False,
                       top: Sequence[Sequence[tuple[int, float]]] | None = None, top_k: int = 0) -> None:
        """Append engine-sampled tokens with the logprob and weight version each was sampled with, and the
        sampling (temperature, top_p, top_k) that drew them: the trainer recomputes their logprobs with it. With
        `top_k` > 0 (score centering) each token also keeps the first top_k of its `top` (the engine's
        Generation.top_logprobs: per token, its distribution's best (id, logprob), best first). An MoE
        segment (one holding routes, or `routed`: the new tokens' call reported routes) that sampled at other
        versions than the new tokens' first is sealed first (reason "route_version"), and they open a segment whose
        context is all of it: a segment's routes are one version's (invariant 3)."""
        where = f"append_sampled (rollout {self.rollout_id})"
        ids = _check_ids(token_ids, where)
        check_sampling(sampling, where)
        logprobs, versions = list(behavior_logprobs), list(policy_versions)
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"{where}: got {len(ids)} token ids, {len(logprobs)} behavior logprobs and "
                             f"{len(versions)} policy versions; they must be equal (one logprob and one version "
                             f"per sampled token — a missing logprob must fail, never be zero-filled)")
        seg = self._open
        if seg is None or not seg.token_ids:
            raise ValueError(f"{where}: no open segment with a prompt; call extend_or_seal(prompt_ids) before "
                             f"appending the tokens sampled after that prompt")
        for i, lp in enumerate(logprobs):
            if isinstance(lp, bool) or not isinstance(lp, Real) or not math.isfinite(lp):
                raise ValueError(f"{where}: behavior logprob of sampled token {i} (id {ids[i]}) is {lp!r}; "
                                 f"it must be a finite float (engine processed logprob of the sampled id)")
        head = _head_arrays(top, top_k, len(ids), where) if top_k else None
        if any(seg.trainable) and (seg.top_ids is None) != (head is None):
            raise ValueError(f"{where}: segment {seg.segment_id} {'records' if head is None else 'lacks'} the "
                             f"engine's top logprobs of its sampled tokens but these tokens "
                             f"{'lack' if head is None else 'carry'} them; one run records them for every token or "
                             f"none (algo.score_centering)")
        held = {v for v, tr in zip(seg.policy_versions, seg.trainable) if tr}   # the versions the segment sampled at
        last = max(held, default=-1)
        for i, v in enumerate(versions):
            if isinstance(v, bool) or not isinstance(v, Integral) or v < 0:
                raise ValueError(f"{where}: policy version of sampled token {i} is {v!r}; it must be an int >= 0 "
                                 f"(the engine weight version that produced the token's logits)")
            if v < last:
                raise ValueError(f"{where}: policy version decreases within segment {seg.segment_id}: token {i} "
                                 f"has version {v} after version {last}; weights only move forward, so the engine "
                                 f"is stamping versions wrongly")
            last = v
        if (seg.routes is not None or routed) and held and versions and held != {versions[0]}:
            # the new tokens were drawn under their own version's routes at the positions this segment routed (the
            # engine prefilled them anew; routed: its earlier turns had none, which the new ones must not fill) and
            # no one route per position replays both: they train in a new segment
            self.seal("route_version")
            log.info("rollout %s: segment %d sealed (reason route_version: routes of versions %s, new tokens of "
                     "version %d); the new segment is all context", self.rollout_id, seg.segment_id, held, versions[0])
            self.append_context(seg.token_ids)
            self._open.images = list(seg.images)
            seg = self._open
        if head is not None and seg.top_ids is None:   # the first head of the segment: its context has none
            seg.top_ids = np.zeros((len(seg.token_ids), top_k), np.int64)
            seg.top_behavior_logprobs = np.full((len(seg.token_ids), top_k), -np.inf, np.float32)
        if head is not None and seg.top_ids.shape[1] != top_k:
            raise ValueError(f"{where}: {top_k} top logprobs per token but segment {seg.segment_id} records "
                             f"{seg.top_ids.shape[1]}; a run records one k (algo.score_centering)")
        self._grow(seg, ids, True, [float(x) for x in logprobs], [int(v) for v in versions], sampling)
        if head is not None:
            seg.top_ids[-len(ids):], seg.top_behavior_logprobs[-len(ids):] = head

    def absorb_routes(self, routes: np.ndarray, start: int = 0) -> None:
        """Store MoE routes [n, L, k] at absolute positions start..start+n of the open segment. Rows of -1 mean
        "not routed". First writer wins: a position that already has a route keeps it, because the tokens sampled
        after that position were conditioned on the route it got when it was first forwarded (a prefix cache,
        vLLM's included, never recomputes it at the same version; a new version seals first, in append_sampled).
        The embedded engine keeps the rule inside one request: a re-prefill after a weight swap adds routes only
        for positions that had none."""
        where = f"absorb_routes (rollout {self.rollout_id})"
        seg = self._open
        if seg is None:
            raise ValueError(f"{where}: no open segment; routes belong to the segment of the call that made them")
        r = np.asarray(routes)
        if r.ndim != 3 or not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"{where}: routes must be an integer array [n, layers, top_k], got dtype {r.dtype} "
                             f"shape {r.shape}")
        if r.size and (r.min() < -1 or r.max() > np.iinfo(np.int16).max):
            raise ValueError(f"{where}: expert ids must lie in [-1, 32767], got [{r.min()}, {r.max()}]")
        if start < 0 or start + len(r) > len(seg.token_ids):
            raise ValueError(f"{where}: routes for positions [{start}, {start + len(r)}) but the open segment has "
                             f"{len(seg.token_ids)} tokens; absorb routes after appending the tokens they cover")
        if seg.routes is None:
            seg.routes = np.full((len(seg.token_ids),) + r.shape[1:], -1, dtype=np.int16)
        elif seg.routes.shape[1:] != r.shape[1:]:
            raise ValueError(f"{where}: routes have [layers, top_k] = {list(r.shape[1:])} but the segment holds "
                             f"{list(seg.routes.shape[1:])}")
        block = seg.routes[start:start + len(r)]  # view: writes land in seg.routes
        empty = (block == -1).all(axis=(1, 2))
        block[empty] = r[empty].astype(np.int16)

    def seal(self, reason: str) -> None:
        """Make the open segment immutable; it becomes a complete training row."""
        if not reason:
            raise ValueError("seal: reason must be a non-empty string (e.g. 'done', 'non_extension')")
        seg = self._open
        if seg is None:
            raise ValueError(f"seal (rollout {self.rollout_id}): no open segment to seal")
        n = len(seg.token_ids)
        if not (len(seg.trainable) == len(seg.behavior_logprobs) == len(seg.policy_versions) == len(seg.sampling) == n
                and (seg.routes is None or len(seg.routes) == n) and (seg.top_ids is None or len(seg.top_ids) == n)):
            raise AssertionError(f"segment {seg.segment_id} of rollout {self.rollout_id}: per-position arrays differ "
                                 f"in length from its {n} tokens; change segments only through the ledger")
        seg.seal_reason = reason

    def rows(self) -> list[Segment]:
        """Segments (sealed or open) with at least one trainable token, in order."""
        return [s for s in self.segments if s.num_trainable > 0]


def _head_arrays(top: Sequence[Sequence[tuple[int, float]]] | None, k: int, n: int,
                 where: str) -> tuple[np.ndarray, np.ndarray]:
    """The first k (id, logprob) of each of n tokens' heads as arrays [n, k] (int64, float32), an engine's shorter
    head (it left out ids its distribution excludes) padded with id 0 at -inf. Refuses a missing head, an id that is
    not a vocabulary index, a logprob that is NaN or above 0, or ids that repeat."""
    if top is None or len(top) != n:
        raise ValueError(f"{where}: score centering records the engine's top {k} logprobs of every sampled token, but "
                         f"got {'none' if top is None else len(top)} for {n} tokens; ask the engine for them "
                         f"(SamplingParams.top_logprobs >= {k})")
    ids, logprobs = np.zeros((n, k), np.int64), np.full((n, k), -np.inf, np.float32)
    for i, best in enumerate(top):
        best = list(best)[:k]
        row_ids = [t for t, _ in best]
        if any(isinstance(t, bool) or not isinstance(t, Integral) or t < 0 for t in row_ids) or \
                len(set(row_ids)) != len(row_ids) or \
                any(not isinstance(lp, Real) or math.isnan(lp) or lp > 0 for _, lp in best):
            raise ValueError(f"{where}: top logprobs of sampled token {i} are {best!r:.120}; each must be distinct "
                             f"(id >= 0, logprob <= 0 or -inf) pairs, best first, as the engine reports them")
        ids[i, :len(best)] = row_ids
        logprobs[i, :len(best)] = [lp for _, lp in best]
    return ids, logprobs


# the per-token sampling a TrainBatch carries as [B, T] tensors: field -> (dtype, value on context and padding)
SAMPLING_TENSORS = {"temperature": (torch.float32, 1.0), "top_p": (torch.float32, 1.0), "top_k": (torch.long, -1),
                    "min_p": (torch.float32, 0.0)}


@dataclass(eq=False)
class TrainBatch:
    """Rows right-padded and aligned to tokens: value [b, t] belongs to input_ids[b, t]."""
    input_ids: Tensor          # long [B, T]; pad_id after each row
    attention_mask: Tensor     # long [B, T]; 1 on row tokens, 0 on padding
    loss_mask: Tensor          # float32 [B, T]; 1 on trainable (sampled) tokens
    behavior_logprobs: Tensor  # float32 [B, T]; engine logprobs, 0 on context/padding
    policy_versions: Tensor    # long [B, T]; sampling version, -1 on context/padding
    advantages: Tensor         # float32 [B, T]; 0 on context/padding
    temperature: Tensor        # float32 [B, T]; the temperature that drew each token (1 on context/padding)
    top_p: Tensor              # float32 [B, T]; its nucleus mass (1 = off)
    top_k: Tensor              # long [B, T]; its top-k (-1 = off)
    min_p: Tensor              # float32 [B, T]; its min_p (0 = off)
    routes: Tensor | None      # long [B, T, L, k]; -1 where unknown; None if no row has routes
    rollout_ids: list[str]
    group_ids: list[str]
    images: list[list[ImageInput]]  # per row, the images of its pad runs in order; [] for a text row
    runs: list[list[AdjustedRun]]   # per row, its tokens drawn from adjusted logits (bias, penalties, a grammar);
                                    # [] for a plain row
    top_ids: Tensor | None = None   # long [B, T, k]; the sampler's top-k ids at each sampled token (0 elsewhere);
                                    # None unless the rows record them (score centering)
    top_behavior_logprobs: Tensor | None = None  # float32 [B, T, k]; their behavior logprobs, -inf elsewhere


# a grammar's masks replayed over a run's ids: (constraint spec, the run's ids) -> bool [len(ids), V], the ids the
# grammar allowed before each token. constraints.mask_replayer makes one: the grammar engine, which needs the
# tokenizer, stays out of this module, which imports nothing of the project
GrammarMasks = Callable[[str, Sequence[int]], Tensor]


def build_batch(rows: list[Segment], advantages: Sequence[float] | Sequence[Sequence[float]],
                pad_id: int, grammar_masks: GrammarMasks | None = None) -> TrainBatch:
    """Right-pad rows into a TrainBatch. advantages: one scalar per row (broadcast onto its trainable tokens) or
    one list per row with a value per token (context positions are zeroed). grammar_masks is needed only by rows
    sampled under a grammar: their masks are replayed here, once (adjusted_runs)."""
    if not rows:
        raise ValueError("build_batch: no rows; pass the ledgers' rows() (segments with trainable tokens)")
    if len(advantages) != len(rows):
        raise ValueError(f"build_batch: {len(advantages)} advantages for {len(rows)} rows; give one per row")
    B, T = len(rows), max(len(r.token_ids) for r in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.float32)
    behavior = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    adv = torch.zeros(B, T, dtype=torch.float32)
    sampled = {name: torch.full((B, T), fill, dtype=dtype) for name, (dtype, fill) in SAMPLING_TENSORS.items()}
    shapes = {r.routes.shape[1:] for r in rows if r.routes is not None}
    if len(shapes) > 1:
        raise ValueError(f"build_batch: rows carry routes of different [layers, top_k] shapes {sorted(shapes)}")
    routes = torch.full((B, T) + shapes.pop(), -1, dtype=torch.long) if shapes else None
    heads = {r.top_ids.shape[1] for r in rows if r.top_ids is not None}
    if len(heads) > 1 or (heads and any(r.top_ids is None for r in rows)):
        raise ValueError(f"build_batch: rows record top-k heads of sizes {sorted(heads)} and some none; a run's rows "
                         f"all record one k (algo.score_centering)")
    k = heads.pop() if heads else 0
    top_ids = torch.zeros((B, T, k), dtype=torch.long) if k else None
    top_behavior = torch.full((B, T, k), -math.inf, dtype=torch.float32) if k else None
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        if row.trainable and row.trainable[0]:
            raise ValueError(f"build_batch: row {b} (rollout {row.rollout_id}) has a trainable token at position "
                             f"0; nothing predicts position 0, a sampled token always follows a prompt")
        mask = torch.tensor(row.trainable, dtype=torch.bool)
        input_ids[b, :n] = torch.tensor(row.token_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = mask.float()
        behavior[b, :n] = torch.tensor(row.behavior_logprobs, dtype=torch.float32)
        versions[b, :n] = torch.tensor(row.policy_versions, dtype=torch.long)
        for name, (dtype, _) in SAMPLING_TENSORS.items():
            sampled[name][b, :n] = torch.tensor([getattr(x, name) for x in row.sampling], dtype=dtype)
        a = advantages[b]
        if isinstance(a, Real):
            per_token = torch.full((n,), float(a), dtype=torch.float32)
        else:
            per_token = torch.as_tensor(a, dtype=torch.float32).reshape(-1)
            if len(per_token) != n:
                raise ValueError(f"build_batch: row {b} has {n} tokens but {len(per_token)} per-token advantages")
        if not torch.isfinite(per_token).all():
            raise ValueError(f"build_batch: row {b} has a non-finite advantage")
        adv[b, :n] = torch.where(mask, per_token, 0.0)
        if row.routes is not None:
            routes[b, :n] = torch.from_numpy(row.routes.astype(np.int64))
        if k:
            top_ids[b, :n] = torch.from_numpy(row.top_ids)
            top_behavior[b, :n] = torch.from_numpy(row.top_behavior_logprobs)
    return TrainBatch(input_ids, attention_mask, loss_mask, behavior, versions, adv, **sampled, routes=routes,
                      rollout_ids=[r.rollout_id for r in rows], group_ids=[r.group_id for r in rows],
                      images=[list(r.images) for r in rows],
                      runs=[adjusted_runs(r, grammar_masks) for r in rows], top_ids=top_ids,
                      top_behavior_logprobs=top_behavior)


def select_rows(batch: TrainBatch, index: list[int]) -> TrainBatch:
    """The TrainBatch restricted to rows `index`, at its full width (tensors sliced, per-row lists picked): a
    minibatch, or one FSDP2 rank's share of a step."""
    def pick(value):
        return value[index] if isinstance(value, Tensor) else [value[i] for i in index] if isinstance(value, list) \
            else value
    return type(batch)(**{f.name: pick(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def check_token_identity(batch: TrainBatch, rows: list[Segment], image_pad_id: int | None = None) -> None:
    """Prove the trainer's input equals what was sampled: every id of every row (sampled ids and the prefix they
    were sampled under) sits unchanged at its position, loss_mask == trainable mask, padding is masked out, and
    each row carries the very images (same objects, same order) it was sampled with. With `image_pad_id` (the
    model's image token, for a VLM) also checks each image fills exactly its run of pads.
    Raises ValueError naming the first bad (row, position)."""
    B, T = batch.input_ids.shape
    if B != len(rows):
        raise ValueError(f"token identity: batch has {B} rows but {len(rows)} segments were given")
    if len(batch.images) != B or len(batch.runs) != B:
        raise ValueError(f"token identity: batch has {B} rows but images for {len(batch.images)} and adjusted runs "
                         f"for {len(batch.runs)}; one list per row")
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        if n > T:
            raise ValueError(f"token identity: row {b} has {n} tokens but the batch is only {T} wide")
        ids = torch.tensor(row.token_ids, dtype=torch.long)
        trainable = torch.tensor(row.trainable, dtype=torch.bool)
        bad = (batch.input_ids[b, :n].cpu() != ids).nonzero()
        if len(bad):
            t = int(bad[0])
            kind = "sampled (trainable)" if row.trainable[t] else "context"
            raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}) position {t}: trainer "
                             f"input id {int(batch.input_ids[b, t])} != {kind} id {row.token_ids[t]}; the trainer "
                             f"must consume the ledger's ids, never re-tokenized text")
        expected_mask = F.pad(trainable.to(batch.loss_mask.dtype), (0, T - n))
        bad = (batch.loss_mask[b].cpu() != expected_mask).nonzero()
        if len(bad):
            t = int(bad[0])
            raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}) position {t}: loss_mask "
                             f"is {float(batch.loss_mask[b, t])} but the token is "
                             f"{'trainable' if expected_mask[t] else 'not trainable'}; the loss mask must equal "
                             f"the sampled-token mask (is it shifted by one?)")
        # invariants 2 and 3 ride on the same positions: each trainable token keeps its own behavior logprob,
        # version and sampling (the trainer recomputes its logprob with that temperature/top_p/top_k)
        t = trainable.nonzero().squeeze(-1)
        recorded = {"behavior logprob": (batch.behavior_logprobs, torch.tensor(row.behavior_logprobs)),
                    "policy version": (batch.policy_versions, torch.tensor(row.policy_versions)),
                    **{name: (getattr(batch, name), torch.tensor([getattr(x, name) for x in row.sampling]))
                       for name in SAMPLING_TENSORS}}
        for what, (in_batch, in_row) in recorded.items():
            bad = (in_batch[b, t].cpu() != in_row[t].to(in_batch.dtype)).nonzero()
            if len(bad):
                p = int(t[int(bad[0])])
                raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}) position {p}: the "
                                 f"batch's {what} {in_batch[b, p].item()} differs from the one the token was sampled "
                                 f"with, {in_row[p].item()}; build batches with invariants.build_batch")
        _check_head(batch, b, row, t)
        runs, spans = [(run.start, run.end, run.sampling) for run in batch.runs[b]], _adjusted_spans(row)
        if runs != spans:
            raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}): the batch adjusts the "
                             f"logits of spans {[r[:2] for r in runs]} but the row's tokens were drawn from adjusted "
                             f"logits (bias, penalties, a grammar) at {[r[:2] for r in spans]}; build batches with "
                             f"invariants.build_batch")
        if (batch.attention_mask[b, :n] != 1).any() or (batch.attention_mask[b, n:] != 0).any():
            raise ValueError(f"token identity violated: row {b} attention_mask must be 1 on its {n} tokens and 0 "
                             f"on the right padding")
        images = batch.images[b]
        if len(images) != len(row.images) or any(x is not y for x, y in zip(images, row.images)):
            raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}) carries {len(images)} "
                             f"images that are not the {len(row.images)} it was sampled with; the trainer must "
                             f"feed the ledger's images, never re-processed ones")
        if image_pad_id is not None:
            check_image_pads(row.token_ids, images, image_pad_id, f"token identity violated: row {b}")


def _check_head(batch: TrainBatch, b: int, row: Segment, trainable: Tensor) -> None:
    """Row b of the batch carries the row's recorded top-k head (ids and behavior logprobs) at every sampled
    position, or neither records one."""
    if (batch.top_ids is None) != (row.top_ids is None):
        raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}): the "
                         f"{'row' if batch.top_ids is None else 'batch'} records the sampler's top-k heads and the "
                         f"{'batch' if batch.top_ids is None else 'row'} does not; build batches with "
                         f"invariants.build_batch")
    if row.top_ids is None:
        return
    t = trainable.tolist()
    same = batch.top_ids.shape[2] == row.top_ids.shape[1] and \
        np.array_equal(batch.top_ids[b, t].cpu().numpy(), row.top_ids[t]) and \
        np.array_equal(batch.top_behavior_logprobs[b, t].cpu().numpy(), row.top_behavior_logprobs[t])
    if not same:
        raise ValueError(f"token identity violated: row {b} (rollout {row.rollout_id}): the batch's top-k heads at its "
                         f"sampled tokens differ from the ones the engine reported with them (invariant 2); build "
                         f"batches with invariants.build_batch")


def check_sampled_once(rows: list[Segment], generations: Sequence) -> None:
    """Every token the engine sampled for one rollout is trainable in exactly one of its rows, with its own
    behavior logprob, policy version and sampling: the trainable positions of the rows, read in segment order,
    equal the rollout's engine generations (engines.Generation, or anything with token_ids, behavior_logprobs,
    policy_versions and sampling) concatenated in call order, and rows that record top-k heads (score centering)
    hold each token's first k of its generation's top_logprobs. One pass over the tokens; train.py runs it on every
    rollout, so a runner or session that loses, duplicates or alters a sampled token fails the run loudly instead of
    training on it."""
    if len({r.rollout_id for r in rows}) > 1:
        raise ValueError("check_sampled_once: pass the rows of one rollout at a time")
    trained = [(t, lp, v, s) for r in rows
               for t, tr, lp, v, s in zip(r.token_ids, r.trainable, r.behavior_logprobs, r.policy_versions, r.sampling)
               if tr]
    sampled = [(int(t), float(lp), int(v), g.sampling) for g in generations
               for t, lp, v in zip(g.token_ids, g.behavior_logprobs, g.policy_versions)]
    if trained != sampled:
        i = common_prefix_len(trained, sampled)
        what = "" if i >= min(len(trained), len(sampled)) else \
            f": trainable (id, logprob, version, sampling) {trained[i]} vs sampled {sampled[i]}"
        raise ValueError(f"sampled-once violated (rollout {rows[0].rollout_id if rows else '?'}): {len(sampled)} "
                         f"sampled tokens vs {len(trained)} trainable ones; first difference at sampled index {i}"
                         f"{what}; a sampled token was lost, duplicated or altered between engine and rows")
    recorded = [r for r in rows if r.top_ids is not None]
    if recorded:     # score centering: each sampled token's head, as the engine reported it with the token
        where = f"sampled-once violated (rollout {rows[0].rollout_id})"
        if len(recorded) != len(rows):
            raise ValueError(f"{where}: {len(recorded)} of its {len(rows)} rows record the sampler's top-k heads")
        k = recorded[0].top_ids.shape[1]
        ids, logprobs = _head_arrays([top for g in generations for top in (g.top_logprobs or [])],
                                     k, len(sampled), where)
        kept = [np.asarray(r.trainable, dtype=bool) for r in rows]
        if not (np.array_equal(np.concatenate([r.top_ids[m] for r, m in zip(rows, kept)]), ids) and np.array_equal(
                np.concatenate([r.top_behavior_logprobs[m] for r, m in zip(rows, kept)]), logprobs)):
            raise ValueError(f"{where}: the top-k heads its rows record differ from the ones the engine reported "
                             f"with the sampled tokens; a head was lost or altered between engine and rows")


# ---- 2. policy version ----
# Invariant: each sampled token keeps the weight version v_t and the behavior logprob log mu_{v_t}(y_t|h_t) it
# was sampled with; they are never re-stamped or replaced by current-policy values. A rollout's staleness at
# trainer version V is s = V - min_t v_t over its trainable tokens, in policy versions (AReaL, arXiv 2505.24298;
# slime sample_staleness); the gate trains a rollout iff s <= max_staleness, in policy versions too. The
# train-infer mismatch is corrected with detached IS weights on log rho_t = log pi_prox(y_t|h_t) - log mu(y_t|h_t)
# (decoupled PPO: AReaL arXiv 2505.24298, Hilton et al. 2110.00641), pi_prox the trainer's recompute at the
# weights of version V (the glossary's proximal policy):
#   token: u_t = rho_t                       seq: u = exp(sum_t log rho_t)      geo: u = exp(mean_t log rho_t)
#   mask:  w = u * 1[low <= u <= high]       (token: IcePop, Ring-1T arXiv 2510.18855; token/seq: MIS, Liu et al.
#                                             "When Speed Kills Stability", 2025)
#   clip:  w = clamp(u, low, high)
#   trunc: w = min(u, high)                  (TIS, Yao et al. 2025, fengyao.notion.site/off-policy-rl)
# where seq and geo run t over every trainable token of the rollout, all its segments. Weights are detached (sg[w]
# multiplies the surrogate) and are 1 on non-trainable positions. The rollout gates (Seq-MIS / Geo-RS / veto, verl
# rollout_corr_math §3.3-3.5; the divergence gate, below) drop whole rollouts. Both bands must contain 1, so when
# mu == pi_prox and every v_t == V: rho == 1, w == 1 exactly, nothing is dropped (a divergence is 0), and the
# corrected loss is the plain loss (tests/test_invariants.py runs algo.py's loss both ways).
#
# A rollout, not a segment, is the sample: a rollout whose context was rewritten is sealed into several segments,
# but its staleness is the oldest version over all of them, its seq/geo ratio multiplies (averages) rho over all of
# them, and a gate drops all of them together (tests/test_invariants.py, a sealed rollout is one rollout for every
# gate). `rollout_index` [B] maps segments to rollouts (rollout_index(batch.rollout_ids)); None means each segment
# is a rollout of its own.
#
# One rule for what a rejection does (verl's rollout correction, which rejects through the response mask): a
# token the mask mode rejects (w = 0) and every token of a rollout a gate drops leave the loss AND every
# denominator of the step (tokens, rollouts, and a rollout's own token count). Rejection means "this sample
# was not drawn", so the loss is the mean over accepted samples. (IcePop's paper keeps masked tokens in its
# 1/|y_i|; we do not, so the token mask and the rollout gates cannot disagree about what was trained.)

#
# The divergence gate (FlashREINFORCE's trust region, as OpenRLHF's is_correction_gating): with p = mu(y_t|h_t) and
# q = pi_prox(y_t|h_t), the probabilities of each sampled token (clamped to [1e-6, 1 - 1e-6]),
#   binary_kl: d_t = p log(p/q) + (1-p) log((1-p)/(1-q))   (KL of the Bernoulli "this token or not", mu to pi_prox)
#   tv:        d_t = |p - q|                                 (their total variation on that event)
# and a rollout is kept iff the mean of d_t over its trainable tokens is at most gate_divergence; the survivors take
# the IS weights of `level` (token: FlashREINFORCE's per-token IS). d_t is computed in float64 and clamped at 0: the
# binary KL of logprobs -1.0 and -0.99999 comes out -4.5e-8 in float32, and against a zero lower bound (OpenRLHF's
# band [0, delta]) such a rollout of all but identical policies would be rejected.

LEVELS = ("off", "token", "seq", "geo")
MODES = ("mask", "clip", "trunc")
SEQ_GATES = ("off", "seq", "geo")
GATINGS = ("ratio", "binary_kl", "tv")
DIVERGENCE_PROB_CLAMP = 1e-6  # p and q in [1e-6, 1 - 1e-6] keep both logs of the binary KL finite (OpenRLHF's)
MAX_LOG_RATIO = 30.0  # clamp on log rho and log u before exp (keeps weights finite)


@dataclass
class CorrectionConfig:
    max_staleness: int = 0       # in policy versions (optimizer steps): staler rollouts are dropped (async: eta x
                                 # minibatches, runtime.validate_runtime)
    level: str = "off"           # off | token | seq | geo: what the IS weight u is computed over
    mode: str = "mask"           # mask | clip | trunc: how u is bounded into the weight w
    low: float = 0.5             # band [low, high] for u; must contain 1
    high: float = 5.0
    seq_gate: str = "off"        # off | seq | geo: drop rollouts whose ratio is outside [gate_low, gate_high]
    gate_low: float = 0.5
    gate_high: float = 2.0
    veto: float = 0.0            # drop a rollout if any token ratio rho_t < veto (0 = off)
    gating: str = "ratio"        # ratio: seq_gate's band | binary_kl | tv: a mean divergence <= gate_divergence
    gate_divergence: float = 1e-3  # the most mean binary_kl / tv (mu to pi_prox, sampled tokens) a kept rollout has


def validate_correction(cfg: CorrectionConfig) -> None:
    """Refuse configurations that are unknown or that would not reduce to the plain loss when on-policy."""
    for name, known in (("correction level", LEVELS), ("correction mode", MODES), ("seq_gate", SEQ_GATES),
                        ("gating", GATINGS)):
        if (value := getattr(cfg, name.split()[-1])) not in known:
            raise ValueError(f"{name} {value!r} unknown; use one of {known}")
    if not (0.0 <= cfg.low <= 1.0 <= cfg.high):
        raise ValueError(f"IS band [low, high] = [{cfg.low}, {cfg.high}] must satisfy 0 <= low <= 1 <= high so "
                         f"that identical policies get weight exactly 1")
    if not (0.0 <= cfg.gate_low <= 1.0 <= cfg.gate_high):
        raise ValueError(f"gate band [gate_low, gate_high] = [{cfg.gate_low}, {cfg.gate_high}] must satisfy "
                         f"0 <= gate_low <= 1 <= gate_high so that identical policies keep every rollout")
    if isinstance(cfg.max_staleness, bool) or not isinstance(cfg.max_staleness, Integral) or cfg.max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0 (policy versions; 0 = strictly on-policy), got "
                         f"{cfg.max_staleness!r}")
    if not (0.0 <= cfg.veto < 1.0):
        raise ValueError(f"veto must lie in [0, 1) (typical 1e-4..1e-6; 0 = off), got {cfg.veto}")
    if cfg.gating != "ratio" and cfg.seq_gate != "off":
        raise ValueError(f"gating {cfg.gating!r} gates rollouts by their mean divergence instead of the ratio band, "
                         f"so seq_gate {cfg.seq_gate!r} would be ignored; set seq_gate off (or gating ratio)")
    if cfg.gating != "ratio" and not 0.0 < cfg.gate_divergence < math.inf:
        raise ValueError(f"gate_divergence must be a finite bound > 0 on a rollout's mean {cfg.gating} (FlashREINFORCE "
                         f"uses ~1e-3), got {cfg.gate_divergence}; at 0 only bitwise-identical policies would train")


def rollout_index(rollout_ids: Sequence[str]) -> Tensor:
    """[B] long: the rollout (0..R-1, in order of first appearance) each segment belongs to. The gates, the IS levels
    and the loss aggregations count rollouts, all their segments together: so a micro-batch holds whole rollouts."""
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(r, len(first)) for r in rollout_ids], dtype=torch.long)


def _each_rollout(rollout_index: Tensor | None, rows: int) -> Tensor:   # None: each segment is its own rollout
    return torch.arange(rows) if rollout_index is None else rollout_index


def per_rollout(row_values: Tensor, rollout_index: Tensor | None, reduce: str = "sum") -> Tensor:
    """[B] per-segment values -> [B] per-segment values of their rollout: the sum (or amin/amax) over the segments
    of each rollout, broadcast back to every one of them."""
    index = _each_rollout(rollout_index, len(row_values)).to(row_values.device)
    size = int(index.max()) + 1 if len(index) else 0
    zeros = torch.zeros(size, dtype=row_values.dtype, device=row_values.device)
    totals = zeros.index_add(0, index, row_values) if reduce == "sum" else \
        zeros.scatter_reduce(0, index, row_values, reduce, include_self=False)
    return totals[index]


def count_rollouts(loss_mask: Tensor, rollout_index: Tensor | None) -> int:
    """Rollouts with at least one token in loss_mask [B, T]."""
    rows = loss_mask.sum(-1) > 0
    return len(set(_each_rollout(rollout_index, len(rows))[rows.cpu()].tolist()))


def staleness(policy_versions: Tensor, loss_mask: Tensor, trainer_version: int,
              rollout_index: Tensor | None = None) -> Tensor:
    """[B] long per segment, in policy versions: trainer_version - the oldest version over the trainable tokens of
    the segment's rollout (every segment of a rollout gets the rollout's staleness; 0 for a rollout with no
    trainable token)."""
    trainable = loss_mask > 0
    v = policy_versions[trainable]
    if len(v) and (v.min() < 0 or v.max() > trainer_version):
        raise ValueError(f"staleness: trainable tokens carry versions in [{int(v.min())}, {int(v.max())}] but must "
                         f"lie in [0, trainer version {trainer_version}]; an unversioned (-1) or future version "
                         f"means the engine stamped tokens wrongly")
    big = torch.iinfo(torch.long).max
    oldest = per_rollout(torch.where(trainable, policy_versions.long(), big).min(dim=-1).values, rollout_index,
                         "amin")
    return torch.where(oldest < big, trainer_version - oldest, 0)


def _masked_log_ratio(log_ratio: Tensor, loss_mask: Tensor, where: str) -> Tensor:
    trainable = loss_mask > 0
    if not torch.isfinite(log_ratio[trainable]).all():
        raise ValueError(f"{where}: log ratio (prox - behavior) is not finite on a trainable token; a logprob is "
                         f"NaN/inf, which must be fixed at its source, not masked")
    return torch.where(trainable, log_ratio, 0.0)


def _rollout_log_ratio(lr: Tensor, loss_mask: Tensor, level: str, rollout_index: Tensor | None) -> Tensor:
    """[B] log u of each segment's rollout for level seq (sum over its trainable tokens) or geo (mean)."""
    total = per_rollout(lr.sum(-1), rollout_index)
    if level == "seq":
        return total.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return total / per_rollout((loss_mask > 0).sum(-1).to(lr.dtype), rollout_index).clamp_min(1)


def token_divergence(behavior_logprobs: Tensor, prox_logprobs: Tensor, gating: str) -> Tensor:
    """[B, T] float64 d_t >= 0 of the divergence gate (section header): the binary KL or the total variation between
    mu and pi_prox on each sampled token's event, from their logprobs."""
    p, q = (x.double().exp().clamp(DIVERGENCE_PROB_CLAMP, 1 - DIVERGENCE_PROB_CLAMP)
            for x in (behavior_logprobs, prox_logprobs))
    if gating == "binary_kl":
        return (p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))).clamp_min(0.0)
    if gating == "tv":
        return (p - q).abs()
    raise ValueError(f"gating {gating!r} has no divergence; use one of {GATINGS[1:]}")


def gate_rollouts(log_ratio: Tensor, loss_mask: Tensor, staleness: Tensor, cfg: CorrectionConfig,
                  rollout_index: Tensor | None = None, behavior_logprobs: Tensor | None = None) -> tuple[Tensor, dict]:
    """keep [B] bool per segment (all segments of a rollout agree) and drop counts per reason, in rollouts (one may
    fail several reasons). log_ratio = prox - behavior [B, T]; staleness [B] in policy versions. Drops: staleness >
    max_staleness (both in policy versions); seq/geo ratio outside [gate_low, gate_high] (Seq-MIS / Geo-RS, verl
    rollout_corr_math §3.4–3.5); a mean binary_kl / tv above gate_divergence (gating; needs behavior_logprobs, as
    pi_prox's logprobs are behavior + log_ratio); any trainable token with rho_t < veto (tested on the unclamped
    ratio, so a veto below e^-30 still fires)."""
    validate_correction(cfg)
    if cfg.gating != "ratio" and behavior_logprobs is None:
        raise ValueError(f"gating {cfg.gating!r} compares the two policies' probabilities of each token; pass "
                         f"behavior_logprobs (apply_correction does)")
    with torch.no_grad():
        lr = _masked_log_ratio(log_ratio, loss_mask, "gate_rollouts")
        trainable = loss_mask > 0
        stale = staleness > cfg.max_staleness          # policy versions against policy versions
        band = torch.zeros_like(stale)
        if cfg.seq_gate != "off":
            s = _rollout_log_ratio(lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), loss_mask, cfg.seq_gate, rollout_index)
            lo = math.log(cfg.gate_low) if cfg.gate_low > 0 else -math.inf
            band = (s < lo) | (s > math.log(cfg.gate_high))
        divergent = torch.zeros_like(stale)
        if cfg.gating != "ratio":
            d = torch.where(trainable, token_divergence(behavior_logprobs, behavior_logprobs + lr, cfg.gating), 0.0)
            tokens = per_rollout(trainable.sum(-1).double(), rollout_index).clamp_min(1.0)
            divergent = per_rollout(d.sum(-1), rollout_index) / tokens > cfg.gate_divergence
        veto = torch.zeros_like(stale)
        if cfg.veto > 0:
            veto = per_rollout((trainable & (lr < math.log(cfg.veto))).any(-1).long(), rollout_index) > 0
        keep = ~(stale | band | divergent | veto)
    first: dict[int, int] = {}        # count each rollout once, at its first segment, if it has a trainable token
    rollout_of = _each_rollout(rollout_index, len(keep)).tolist()
    first_row = torch.tensor([first.setdefault(i, b) == b for b, i in enumerate(rollout_of)], dtype=torch.bool)
    counted = first_row & (per_rollout(trainable.any(-1).long(), rollout_index).cpu() > 0)
    counts = {"drop_stale": int((stale.cpu() & counted).sum()), "drop_ratio_band": int((band.cpu() & counted).sum()),
              "drop_divergence": int((divergent.cpu() & counted).sum()), "drop_veto": int((veto.cpu() & counted).sum()),
              "kept": int((keep.cpu() & counted).sum())}
    return keep, counts


def mismatch_metrics(prox_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor) -> dict[str, float]:
    """Train/infer mismatch over the trainable tokens: mean and max |log pi_prox - log mu|, and the k3 estimate of
    KL(mu || pi_prox) from samples of mu: E_mu[(rho - 1) - log rho], rho = pi_prox / mu (Schulman, kl-approx)."""
    with torch.no_grad():
        trainable = loss_mask > 0
        lr = _masked_log_ratio(prox_logprobs - behavior_logprobs, loss_mask, "mismatch_metrics")
        n = trainable.sum().clamp_min(1)
        k3 = torch.expm1(lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) - lr
        return {"logprob_diff_mean": float(lr.abs().sum() / n),
                "logprob_diff_max": float(lr.abs().max()) if lr.numel() else 0.0,
                "k3_kl": float(torch.where(trainable, k3, 0.0).sum() / n)}


def correction_weights(prox_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor,
                       cfg: CorrectionConfig, rollout_index: Tensor | None = None) -> tuple[Tensor, dict]:
    """Detached IS weights w [B, T] (1 on non-trainable positions) and mismatch metrics; formulas above. In mask
    mode a rejected token gets w = 0 exactly (u > 0 otherwise); the caller removes it from the loss mask, so it
    leaves every denominator too (the rejection rule above)."""
    validate_correction(cfg)
    with torch.no_grad():
        trainable = loss_mask > 0
        lr = _masked_log_ratio(prox_logprobs - behavior_logprobs, loss_mask, "correction_weights")
        rho = lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        if cfg.level == "token":
            u = rho
        elif cfg.level in ("seq", "geo"):
            u = _rollout_log_ratio(lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), loss_mask, cfg.level,
                                   rollout_index).exp()[:, None].expand_as(rho)
        else:
            u = torch.ones_like(rho)
        if cfg.level == "off":
            w = u
        elif cfg.mode == "mask":
            w = torch.where((u >= cfg.low) & (u <= cfg.high), u, 0.0)
        elif cfg.mode == "clip":
            w = u.clamp(cfg.low, cfg.high)
        else:
            w = u.clamp(max=cfg.high)
        w = torch.where(trainable, w, 1.0)
        n = trainable.sum().clamp_min(1)
        changed = trainable & (w != u)
        mismatch = mismatch_metrics(prox_logprobs, behavior_logprobs, loss_mask)
        metrics = {"is_masked_frac": float((changed & (w == 0)).sum() / n),
                   "is_clipped_frac": float((changed & (w != 0)).sum() / n),
                   "mismatch_abs_log_ratio": mismatch["logprob_diff_mean"], "mismatch_k3_kl": mismatch["k3_kl"]}
    return w.detach(), metrics


@dataclass
class Correction:
    """What invariant 2 decided for some whole rollouts (apply_correction), [B] or [B, T]."""
    keep: Tensor           # bool [B]: the segment's rollout passed every gate
    staleness: Tensor      # long [B]: in policy versions, the segment's rollout's
    is_weights: Tensor     # [B, T] detached IS weights, 1 off the trainable tokens
    mask: Tensor           # [B, T] the final loss mask: trainable, in a kept rollout, not rejected by the IS mask
    gate_counts: dict      # gate_rollouts' drop counts, in rollouts
    is_metrics: dict       # correction_weights' means over the gated tokens


def apply_correction(prox_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor, policy_versions: Tensor,
                     trainer_version: int, cfg: CorrectionConfig, rollout_index: Tensor | None = None) -> Correction:
    """Invariant 2 on some whole rollouts, in its order: their staleness, the rollout gates, the IS weights of what
    the gates kept, and the rejection rule (a token the mask mode rejects leaves the mask, so every denominator)."""
    stale = staleness(policy_versions, loss_mask, trainer_version, rollout_index)
    keep, gate_counts = gate_rollouts(prox_logprobs - behavior_logprobs, loss_mask, stale, cfg, rollout_index,
                                      behavior_logprobs)
    gated = loss_mask * keep.to(loss_mask.dtype).unsqueeze(-1)
    is_weights, is_metrics = correction_weights(prox_logprobs, behavior_logprobs, gated, cfg, rollout_index)
    return Correction(keep, stale, is_weights, gated * (is_weights > 0).to(gated.dtype), gate_counts, is_metrics)


# ---- 3. forward consistency: what a row carries for it ----
# The processed distribution is engines/processing.py's and the routing replay engines/r3.py's; the record they read is here: each
# token's Sampling (section 1), a segment's routes (TokenLedger.absorb_routes), and a row's AdjustedRuns, its tokens
# drawn from logits that engines/processing.py's steps 1-5 changed (a grammar, a logit bias, penalties).


@dataclass(eq=False)
class AdjustedRun:
    """Consecutive tokens of one row drawn at one Sampling that adjusts logits (bias, penalties, a grammar): the
    trainer repeats engines/processing.py's steps 1-5 on exactly these positions, from the row's own ids
    (processing.adjusted_run_logits)."""
    start: int                       # row position of the first token (= sampling.generation_start when it is set)
    end: int                         # one past the last
    sampling: Sampling
    masks: Tensor | None = None      # uint8 [U, ceil(V/8)] the distinct allowed-sets of the grammar, bit j of byte
                                     # i = id 8i + j (V/8 bytes a set: 19 KB at a 152K vocabulary)
    mask_index: Tensor | None = None  # long [end - start]: which of them was in force before each token


def _adjusted_spans(row: Segment) -> list[tuple[int, int, Sampling]]:
    """(start, end, sampling) of each maximal span of trainable tokens at one Sampling that adjusts logits."""
    if not any(adjusts_logits(x) for x in {id(x): x for x in row.sampling}.values()):
        return []           # a plain row: one pass over its few distinct Sampling objects
    spans, t, n = [], 0, len(row.token_ids)
    while t < n:
        s, end = row.sampling[t], t + 1
        while end < n and row.trainable[end] and (row.sampling[end] is s or row.sampling[end] == s):
            end += 1
        if row.trainable[t] and adjusts_logits(s):
            spans.append((t, end, s))
        t = end
    return spans


def adjusted_runs(row: Segment, grammar_masks: GrammarMasks | None = None) -> list[AdjustedRun]:
    """The AdjustedRuns of a row, a grammar's masks replayed over each constrained run's ids by `grammar_masks`
    (constraints.mask_replayer: it needs the tokenizer and the model's logits width, which this module never
    holds). Refuses a run that does not start at its generation_start: the prompt the engine penalised would not
    be the row before it."""
    runs = []
    for start, end, s in _adjusted_spans(row):
        if s.generation_start >= 0 and s.generation_start != start:
            raise ValueError(f"rollout {row.rollout_id}: tokens sampled with generation_start {s.generation_start} "
                             f"begin at row position {start}; the engine's prompt must be the row before a "
                             f"generation (penalties and grammars are recomputed from it)")
        run = AdjustedRun(start, end, s)
        if s.constraint is not None:
            if grammar_masks is None:
                raise ValueError("build_batch: a row was sampled under a grammar constraint; pass grammar_masks="
                                 "constraints.mask_replayer(tokenizer, vocab_size) (the model's logits width) so the "
                                 "trainer can replay its masks")
            allowed = grammar_masks(s.constraint, row.token_ids[start:end])
            vocab_size = allowed.shape[-1]
            bits = F.pad(allowed, (0, -vocab_size % 8)).view(len(allowed), -1, 8).to(torch.uint8)
            packed = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
            run.masks, run.mask_index = torch.unique(packed, dim=0, return_inverse=True)
        runs.append(run)
    return runs
