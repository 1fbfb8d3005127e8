# engines/ — what the rollout stage samples with, and the interface every engine speaks.
#
# This file owns the interface: `SamplingParams` (what a request asks for), `Generation` (what leaves an engine:
# the sampled ids, their behavior logprobs and policy versions, MoE routes, the `Sampling` that drew them),
# `validate_sampling` (what the fp32 sampler can honour), `recorded_sampling` (a request's Sampling as each of its
# tokens records it) and the text helpers a streaming reply needs (`IncrementalText`, `find_stop`). The embedded
# engine (rollout.py), the vLLM engine and the router speak it; the wires decode requests into it.
# The package's modules, each serving the rollout stage (rollout.py, router.py, runtime.py):
#   vllm_engine.py     `VLLMEngine`: vLLM's AsyncLLM behind the same four calls as rollout.EmbeddedEngine
#   processing.py      the processed distribution a token is drawn from (invariant 3; the trainer recomputes it)
#   r3.py              MoE routes: captured by the engines, replayed by the trainer (invariant 3)
#   constraints.py     grammar constraints (llguidance) and the replay of their masks for the trainer
#   prefix_cache.py    the embedded engine's store of finished rows' KV, kept per cache key
#   weight_channel.py  the weights to an engine actor that CUDA IPC cannot reach (NCCL or gloo)
#   harvest.py         `ScriptEngine`, an engine that answers from a script, and the texts a tiny model is taught
# Never: computes rewards, touches a ledger, or trains.
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import invariants


# ---- records that cross the engine boundary --------------------------------------------------------

@dataclass
class SamplingParams:
    temperature: float = 1.0           # > 0; logprobs are reported for logits / temperature
    top_p: float = 1.0                 # nucleus; < 1 renormalises the reported logprobs over the nucleus (the
                                       # trainer repeats it: each token's sampling is recorded in the ledger)
    top_k: int = -1                    # -1 = whole vocabulary; 1 = greedy (a point mass, logprob 0)
    max_tokens: int = 64               # new tokens at most
    stop_token_ids: tuple[int, ...] = ()  # empty = the model's eos ids; a stop token is kept and trainable
    ignore_eos: bool = False           # the model's eos ids end nothing (stop_token_ids and stop strings still do):
                                       # every reply of a model that samples eos runs on, for fixed-length benches
    stop: tuple[str, ...] = ()         # stop strings: sampling ends at the token that completes one (kept,
                                       # trainable); matched in the decoded text, so the engine needs a tokenizer
    seed: int | None = None            # per-request seed; None draws from the engine's generator
    top_logprobs: int = 0              # also report the k most likely tokens of each step (0..20)
    min_p: float = 0.0                 # the rest mirror invariants.Sampling's fields of the same names
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    constraint: str | None = None      # constraints.py's canonical JSON spec of a grammar; None = unconstrained
    cache_salt: str = ""               # the prefix cache's keys (engines/prefix_cache.py's header has the rule): the
    given_salt: str = ""               # rollout's own secret; its group's, only on a prompt exactly as the trainer gave


@dataclass
class Generation:
    prompt_ids: list[int]              # exactly the ids that were prefilled
    token_ids: list[int]               # sampled ids, stop token included
    behavior_logprobs: list[float]     # log p(token) under the distribution it was sampled from
    policy_versions: list[int]         # weight version that produced each token's logits
    routes: np.ndarray | None          # int16 [len(prompt)+len(tokens)-1, layers, top_k]; None for dense models
    finish_reason: str                 # "stop" (a stop id or stop string was sampled) | "length" (max_tokens reached)
    stop_string: str | None = None     # the stop string that ended sampling; the tokens that wrote it are kept
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the k best (id, logprob), best first
    sampling: invariants.Sampling = invariants.UNSAMPLED  # the processing that drew every token (recorded_sampling):
                                                          # the trainer recomputes their logprobs with exactly it
    cached_prompt_tokens: int = 0      # of prompt_ids, the first ones whose KV the engine took from its prefix cache
                                       # (an earlier request's) instead of computing it: 0 .. len(prompt_ids) - 1


def validate_sampling(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Refuse what the sampler cannot honour (ValueError saying why). Each bound is where the fp32 sampler breaks:
    logits / T overflows or T rounds to 0 in fp32 below MIN_TEMPERATURE or for huge integers; a top_p that rounds
    to 0 in fp32 drops every token; torch seeds live in [-2**63, 2**64). min_p, logit_bias (ids checked against
    `vocab_size` where the engine knows it), the penalties and the constraint: invariants.check_logit_processing."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)
    if not (number(params.temperature) and MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"temperature must be a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got "
                         f"{params.temperature!r:.40}; use top_k=1 for greedy decoding")
    if not (number(params.top_p) and MIN_TOP_P <= params.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] and at least {MIN_TOP_P} (below that it keeps only the most "
                         f"likely token: use top_k=1), got {params.top_p!r:.40}")
    if not integer(params.top_k) or not (params.top_k == -1 or 1 <= params.top_k < 2**63):
        raise ValueError(f"top_k must be -1 (off) or an integer in [1, 2**63), got {params.top_k!r:.40}")
    if not integer(params.max_tokens) or params.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r:.40}")
    if params.seed is not None and not (integer(params.seed) and -2**63 <= params.seed < 2**64):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64) or null, got {params.seed!r:.40}")
    if len(params.stop) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                               for s in params.stop):
        raise ValueError(f"stop must be at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                         f"characters each, got {len(params.stop)} of lengths {[len(s) for s in params.stop][:8]}")
    if not isinstance(params.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be true or false, got {params.ignore_eos!r:.40}")
    if params.ignore_eos and params.constraint is not None and not params.stop_token_ids:
        raise ValueError("a grammar ends on the request's stop ids, and ignore_eos leaves it none: pass "
                         "stop_token_ids with the grammar, or drop ignore_eos")
    if not integer(params.top_logprobs) or not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs!r:.40}")
    invariants.check_logit_processing(params, "sampling", vocab_size)


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MIN_TOP_P = 1e-6
MAX_STOPS, MAX_STOP_CHARS = 16, 1000   # each sampled token is checked against every stop string
MAX_TOP_LOGPROBS = 20


def recorded_sampling(params: SamplingParams, prompt_length: int, constraint: str | None = None) -> invariants.Sampling:
    """The Sampling every token of a request is drawn at (Generation.sampling): its fields, its grammar bound to the
    engine's stop ids (`constraint`, from constraints.bind), and generation_start = the prompt's length where the
    penalties or a grammar depend on the ids before each token (else -1, so plain records stay equal)."""
    p = params
    sampling = invariants.Sampling(float(p.temperature), float(p.top_p), int(p.top_k), float(p.min_p),
                                   tuple((int(t), float(b)) for t, b in p.logit_bias), float(p.repetition_penalty),
                                   float(p.frequency_penalty), float(p.presence_penalty), constraint)
    stateful = invariants.uses_penalties(sampling) or constraint is not None
    return dataclasses.replace(sampling, generation_start=prompt_length) if stateful else sampling


def per_prompt(n_prompts: int, params: SamplingParams | list[SamplingParams],
               images: list[Sequence[invariants.ImageInput]] | None = None,
               ) -> tuple[list[SamplingParams], list[list[invariants.ImageInput]]]:
    """One SamplingParams and one (possibly empty) image list per prompt: a single SamplingParams is shared and None
    is no images anywhere; a list of either must match the prompts."""
    params_list = params if isinstance(params, list) else [params] * n_prompts
    if len(params_list) != n_prompts:
        raise ValueError(f"got {n_prompts} prompts but {len(params_list)} sampling params")
    if images is None:
        return params_list, [[] for _ in range(n_prompts)]
    if len(images) != n_prompts:
        raise ValueError(f"got {n_prompts} prompts but images for {len(images)}; pass one (possibly empty) list "
                         f"of images per prompt")
    return params_list, [list(x) for x in images]


# ---- text: what the sampled ids read as, while they are being sampled ----------------------------------

class IncrementalText:
    """Decodes a growing list of sampled ids piece by piece (special tokens skipped), each piece decoded in a
    short window after the last emitted token, so the cost per token stays constant. A token that ends inside
    a multi-byte character emits nothing until the character is complete. Only text is produced: the ids
    themselves are never re-encoded (invariant 1)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0      # window start, and the end of what has been emitted

    def push(self, token_id: int) -> str:
        """Add one sampled id; returns the new text it completes ('' while a character is still partial)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or not after.startswith(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before):]
        self.text += piece
        self._prefix, self._read = self._read, len(self.ids)
        return piece


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in text[start:] as (index, stop string), or None."""
    hits = [(at, stop) for stop in stops if (at := text.find(stop, start)) >= 0]
    return min(hits) if hits else None
