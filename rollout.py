# rollout.py — the engines that sample tokens, behind one interface.
#
# Owns: `SamplingParams` and `Generation` (the records that leave an engine), `EmbeddedEngine`, a
# batched, KV-cached sampler over any transformers causal LM, and `BatchingEngine`, which merges the
# calls of many concurrent callers into batched engine calls. The vLLM engine implements the same four
# calls (generate, update_weights, pause, resume) and is tested against this one.
#
# Keeps, for every sampled token:
#   invariant 1 (token identity) - the engine's output *is* the token ids; nobody decodes and re-encodes;
#   invariant 2 (policy version) - each token carries the logprob of the distribution it was actually drawn
#     from (invariants.processed_logprobs: post temperature/top-k/top-p, fp32), the sampling that defines that
#     distribution, and the version of the weights that drew it; a weight swap in the middle of a request
#     discards the KV cache and re-prefills (a cache filled by the old weights would condition new tokens on
#     the old policy's keys and values, so their logprobs would belong to neither version);
#   invariant 3 (forward consistency) - MoE routes of every forwarded position are captured for replay, and
#     a vision-language model gets its images and M-RoPE positions from models.vision_inputs, as the trainer
#     does (decode steps continue each row from its own next position, kept here, not in the model).
# Never: computes rewards, touches the ledger, or trains; never drops an image (a text model refuses them).
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

import invariants
import models


# ---- records that cross the engine boundary --------------------------------------------------------

@dataclass
class SamplingParams:
    temperature: float = 1.0           # > 0; logprobs are reported for logits / temperature
    top_p: float = 1.0                 # nucleus; < 1 renormalises the reported logprobs over the nucleus (the
                                       # trainer repeats it: each token's sampling is recorded in the ledger)
    top_k: int = -1                    # -1 = whole vocabulary; 1 = greedy (a point mass, logprob 0)
    max_tokens: int = 64               # new tokens at most
    stop_token_ids: tuple[int, ...] = ()  # empty = the model's eos ids; a stop token is kept and trainable
    stop: tuple[str, ...] = ()         # stop strings: sampling ends at the token that completes one (kept,
                                       # trainable); matched in the decoded text, so the engine needs a tokenizer
    seed: int | None = None            # per-request seed; None draws from the engine's generator
    top_logprobs: int = 0              # also report the k most likely tokens of each step (0..20)


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
    sampling: invariants.Sampling = invariants.UNSAMPLED  # the temperature/top_p/top_k that drew every token: the
                                                          # trainer recomputes their logprobs with exactly these


def validate_sampling(params: SamplingParams) -> None:
    if not params.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {params.temperature}; use top_k=1 for greedy decoding")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {params.top_k}")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if not all(isinstance(s, str) and s for s in params.stop):
        raise ValueError(f"stop strings must be non-empty strings, got {params.stop!r:.80}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}")


MAX_TOP_LOGPROBS = 20


def params_per_prompt(params: SamplingParams | list[SamplingParams], n_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: a single one is shared, a list must match the prompts."""
    params_list = params if isinstance(params, list) else [params] * n_prompts
    if len(params_list) != n_prompts:
        raise ValueError(f"got {n_prompts} prompts but {len(params_list)} sampling params")
    return params_list


def images_per_prompt(images: list[Sequence[invariants.ImageInput]] | None,
                      n_prompts: int) -> list[list[invariants.ImageInput]]:
    """One (possibly empty) image list per prompt; None means no images anywhere."""
    if images is None:
        return [[] for _ in range(n_prompts)]
    if len(images) != n_prompts:
        raise ValueError(f"got {n_prompts} prompts but images for {len(images)}; pass one (possibly empty) list "
                         f"of images per prompt")
    return [list(x) for x in images]


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


# ---- the embedded engine ----------------------------------------------------------------------------

@dataclass
class _Row:
    """One request in flight inside `generate`."""
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    text: IncrementalText | None       # the reply decoded so far, kept only when stop strings are asked for
    images: list[invariants.ImageInput]  # the images of the prompt's pad runs, in order (VLMs; [] for text)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)   # one [n_positions, L, k] block per forward
    finish_reason: str = ""
    stop_string: str | None = None


class EmbeddedEngine:
    """Batched sampling with a KV cache over a transformers causal LM or VLM (left-padded prefill, then one
    token per step). Thread-safe: `update_weights`, `pause` and `resume` may be called from another
    thread while `generate` runs; they take effect between decode steps. The tokenizer is needed only to
    match stop strings."""

    def __init__(self, model: torch.nn.Module, version: int = 0, seed: int = 0, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self.pad_id = _pad_id(model)
        self.eos_ids = _eos_ids(model)
        self.is_moe = bool(invariants.moe_routers(model))
        self.is_vision = models.is_vision_model(model)
        self._generator = torch.Generator().manual_seed(seed)
        self._step_lock = threading.RLock()      # one decode step or one weight load at a time
        self._running = threading.Event()        # cleared by pause(): generate waits at a step boundary
        self._running.set()

    # -- the control plane used by the trainer and the async runtime --

    def pause(self) -> None:
        """Stop decoding at the next step boundary; requests in flight are kept, not dropped."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a full state dict from the actor and stamp `version` on every later token.
        Every key must land (a refit that filters keys by name can silently ship a handful of a model's
        parameters); only a tied `lm_head.weight` may be absent from the export (it is the embedding)."""
        if version < self.version:
            raise ValueError(f"weight version must not go backwards: engine at {self.version}, got {version}")
        with self._step_lock:
            result = self.model.load_state_dict(state, strict=False)
            missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and _tied(self.model))]
            if result.unexpected_keys or missing:
                raise ValueError(f"weight update does not match the engine's model: unexpected keys "
                                 f"{result.unexpected_keys[:5]}, missing keys {missing[:5]}")
            self.version = version

    def sampler_state(self) -> torch.Tensor:
        """The engine's own random stream (requests without a seed draw from it). A checkpoint saves it, so a
        resumed run samples exactly the tokens the uninterrupted run would have."""
        return self._generator.get_state()

    def load_sampler_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    # -- the data plane --

    def check(self, params: SamplingParams) -> None:
        """Refuse sampling parameters this engine cannot honour (ValueError saying why)."""
        validate_sampling(params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings are matched in decoded text: build the engine with "
                             "EmbeddedEngine(model, tokenizer=...)")

    def check_images(self, prompt: list[int], images: Sequence[invariants.ImageInput]) -> None:
        """Refuse images this engine cannot place (ValueError saying why): any image on a text-only model (it
        would be dropped silently), or, on a VLM, images that do not fill the prompt's image pad runs one to one."""
        if not self.is_vision:
            if images:
                raise ValueError(f"{type(self.model).__name__} has no vision tower, so it cannot see the "
                                 f"{len(images)} images it was given; serve a vision-language model or leave the "
                                 f"images out of the prompt")
            return
        invariants.check_image_pads(prompt, images, self.model.config.image_token_id, "prompt")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 images: list[Sequence[invariants.ImageInput]] | None = None) -> list[Generation]:
        """Sample a completion for every prompt. Token ids in, token ids out. `on_token(index, token_id)` is
        called as each token is sampled (index into `prompts`), from the decoding thread; it must not raise.
        `images[i]` are the images of prompt i, one per run of image pad ids, already expanded to their
        n_tokens (data.expand_image_pads); only a vision-language model takes them."""
        params_list = params_per_prompt(params, len(prompts))
        images_list = images_per_prompt(images, len(prompts))
        rows = []
        for prompt, p, row_images in zip(prompts, params_list, images_list):
            self.check(p)
            if not prompt:
                raise ValueError("a prompt must hold at least one token id")
            self.check_images(prompt, row_images)
            generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else self._generator
            stop = frozenset(p.stop_token_ids) if p.stop_token_ids else self.eos_ids
            rows.append(_Row(list(prompt), p, stop, generator, IncrementalText(self.tokenizer) if p.stop else None,
                             row_images))
        if rows:
            self._decode(rows, on_token)
        return [self._finish(row) for row in rows]

    def _decode(self, rows: list[_Row], on_token) -> None:
        cache, last_logits, cache_version = None, None, None
        attention = next_positions = None
        while True:
            active = [i for i, r in enumerate(rows) if not r.finish_reason]
            if not active:
                return
            self._running.wait()                 # pause(): hold the requests until resume()
            with self._step_lock:
                if cache is None or cache_version != self.version:
                    # (re-)prefill everything seen so far with the current weights: after a weight swap
                    # the old KV cache belongs to the old policy and must not be reused
                    cache, last_logits, attention, next_positions = self._prefill(rows)
                    cache_version = self.version
                for i in active:
                    self._sample_one(rows[i], last_logits[i])
                    if on_token is not None:
                        on_token(i, rows[i].token_ids[-1])
                if all(r.finish_reason for r in rows):
                    return
                last_logits, attention, next_positions = self._step(rows, cache, attention, next_positions)

    def _prefill(self, rows: list[_Row]):
        """Forward prompt + tokens so far for every row, left-padded, with every row's images (also on a
        re-prefill after a weight swap). Returns the cache, the logits of the last position of each row
        [B, vocab], the attention mask [B, S] and each row's next position [B]."""
        seqs = [r.prompt_ids + r.token_ids for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, width - len(s):] = torch.tensor(s)
            mask[b, width - len(s):] = 1
        if self.is_vision:
            extra, next_positions = models.vision_inputs(self.model, ids, mask, [r.images for r in rows])
        else:
            extra, next_positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, mask.sum(-1)
        cache = DynamicCache()
        logits, routes = self._forward(ids, mask, cache, extra)
        if routes is not None:
            # first writer wins (as in the ledger, and as a prefix cache does): a re-prefill after a weight swap
            # adds routes only for positions never forwarded before; those already recorded are the routes the
            # tokens sampled so far were conditioned on
            for b, (r, s) in enumerate(zip(rows, seqs)):
                routed = sum(len(block) for block in r.routes)
                r.routes.append(routes[b, width - len(s) + routed:])
        return cache, logits[:, -1], mask, next_positions

    def _step(self, rows: list[_Row], cache, attention: torch.Tensor, next_positions: torch.Tensor):
        """Feed each row's newest token at its own next position (finished rows keep feeding theirs; nobody
        reads those logits). For a VLM the three M-RoPE axes of a text token are equal."""
        last = torch.tensor([[r.token_ids[-1]] for r in rows])
        attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        positions = next_positions[:, None]                                    # [B, 1]
        if self.is_vision:
            positions = positions[None].expand(3, -1, -1)                      # [3, B, 1]
        logits, routes = self._forward(last, attention, cache, {"position_ids": positions})
        if routes is not None:
            for b, r in enumerate(rows):
                if not r.finish_reason:
                    r.routes.append(routes[b])
        return logits[:, -1], attention, next_positions + 1

    def _forward(self, ids, mask, cache, extra: dict[str, torch.Tensor]):
        """One model forward; `extra` holds position_ids and, for a VLM prefill, the pixel inputs."""
        if not self.is_moe:
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
            return out.logits, None
        with invariants.capture_routes(self.model) as captured:
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
        b, s = ids.shape
        routes = captured[-1].reshape(b, s, *captured[-1].shape[1:]).numpy().astype(np.int16)
        return out.logits, routes

    def _sample_one(self, row: _Row, logits: torch.Tensor) -> None:
        logprobs = invariants.processed_logprobs(logits, row.params.temperature, row.params.top_p, row.params.top_k)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=row.generator))
        row.token_ids.append(token)
        row.logprobs.append(float(logprobs[token]))
        row.versions.append(self.version)
        if row.params.top_logprobs:
            best = torch.topk(logprobs, row.params.top_logprobs)
            row.top.append(list(zip(best.indices.tolist(), best.values.tolist())))
        if token in row.stop_ids:
            row.finish_reason = "stop"
        elif row.text is not None and self._wrote_stop_string(row, token):
            row.finish_reason = "stop"
        elif len(row.token_ids) >= row.params.max_tokens:
            row.finish_reason = "length"

    @staticmethod
    def _wrote_stop_string(row: _Row, token: int) -> bool:
        """Did this token complete a stop string? Only the new text, plus the tail a stop could straddle, is
        searched."""
        piece = row.text.push(token)
        if not piece:
            return False
        longest = max(len(s) for s in row.params.stop)
        hit = find_stop(row.text.text, row.params.stop, max(0, len(row.text.text) - len(piece) - longest + 1))
        row.stop_string = hit[1] if hit else None
        return hit is not None

    def _finish(self, row: _Row) -> Generation:
        routes = None
        if self.is_moe:
            # positions 0 .. len(prompt)+len(tokens)-2 were forwarded; the last sampled token never is
            routes = np.concatenate(row.routes, axis=0)[: len(row.prompt_ids) + len(row.token_ids) - 1]
        p = row.params
        return Generation(row.prompt_ids, row.token_ids, row.logprobs, row.versions, routes, row.finish_reason,
                          row.stop_string, row.top if p.top_logprobs else None,
                          invariants.Sampling(float(p.temperature), float(p.top_p), int(p.top_k)))


# ---- batching: many callers, one batched engine call ---------------------------------------------------

@dataclass
class _Pending:
    prompts: list[list[int]]
    params: list[SamplingParams]
    on_token: Callable[[int, int], None] | None
    images: list[list[invariants.ImageInput]]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Generation] | None = None
    error: BaseException | None = None


class BatchingEngine:
    """Coalesces `generate` calls from many threads (one per chat session, say) into batched calls of the
    wrapped engine: a worker thread takes everything queued once callers stop arriving (no new call for
    `gather_s`, or `max_gather_s` after the first), and runs it as one batch. A batch runs to completion, so
    a caller that just missed it waits for all of it: gathering until arrivals pause lets a burst of sessions
    (an agent group starting together) share one batch. Each caller gets exactly its own results; an error
    fails only the calls of that batch."""

    def __init__(self, engine, gather_s: float = 0.02, max_gather_s: float = 0.2):
        self.engine, self.gather_s, self.max_gather_s = engine, gather_s, max_gather_s
        self._queue: list[_Pending] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._serve, daemon=True, name="batching-engine").start()

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 images: list[Sequence[invariants.ImageInput]] | None = None) -> list[Generation]:
        params_list = params_per_prompt(params, len(prompts))
        images_list = images_per_prompt(images, len(prompts))
        for p in params_list:       # a bad request is refused here, never inside a shared batch
            self.engine.check(p)
        for prompt, row_images in zip(prompts, images_list):
            self.engine.check_images(prompt, row_images)
        pending = _Pending([list(p) for p in prompts], params_list, on_token, images_list)
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.result

    def check(self, params: SamplingParams) -> None:
        self.engine.check(params)

    def check_images(self, prompt: list[int], images: Sequence[invariants.ImageInput]) -> None:
        self.engine.check_images(prompt, images)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def sampler_state(self) -> torch.Tensor:
        return self.engine.sampler_state()

    def load_sampler_state(self, state: torch.Tensor) -> None:
        self.engine.load_sampler_state(state)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                first, seen = time.monotonic(), 0
                while len(self._queue) > seen and time.monotonic() - first < self.max_gather_s:
                    seen = len(self._queue)           # let concurrent callers join while they keep arriving
                    self._cond.wait(self.gather_s)
                batch, self._queue = self._queue, []
            owners = [(b, i) for b in batch for i in range(len(b.prompts))]   # batch row -> (caller, its index)

            def on_token(row: int, token_id: int) -> None:
                caller, index = owners[row]
                if caller.on_token is not None:
                    caller.on_token(index, token_id)
            streaming = any(b.on_token is not None for b in batch)          # no per-token call when none listens
            try:
                outs = self.engine.generate([p for b in batch for p in b.prompts], [q for b in batch for q in b.params],
                                            on_token if streaming else None,
                                            images=[x for b in batch for x in b.images])
            except BaseException as exc:
                for b in batch:
                    b.error = exc
                    b.done.set()
                continue
            for b in batch:
                b.result, outs = outs[:len(b.prompts)], outs[len(b.prompts):]
                b.done.set()


# ---- model facts the engine needs -------------------------------------------------------------------

def _eos_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = eos if eos is not None else model.config.get_text_config().eos_token_id   # a VLM keeps ids in its text config
    if eos is None:
        raise ValueError("the model declares no eos_token_id; pass SamplingParams.stop_token_ids")
    return frozenset(eos if isinstance(eos, list) else [eos])


def _pad_id(model) -> int:
    pad = model.config.get_text_config().pad_token_id
    return pad if pad is not None else min(_eos_ids(model))


def _tied(model) -> bool:
    return model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
