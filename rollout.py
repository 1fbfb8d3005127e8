# rollout.py — the engines that sample tokens, behind one interface.
#
# Owns: `SamplingParams` and `Generation` (the records that leave an engine) and `EmbeddedEngine`, a
# continuously batched, KV-cached sampler over any transformers causal LM: concurrent callers' requests
# join the running batch between decode steps and each leaves when it finishes, as in vLLM. The vLLM engine
# implements the same four calls (generate, update_weights, pause, resume) and is tested against this one. No
# sequence passes the model's position limit (`max_model_len`): a prompt at it is refused, a reply stops there.
#
# Keeps, for every sampled token:
#   invariant 1 (token identity) - the engine's output *is* the token ids; nobody decodes and re-encodes;
#   invariant 2 (policy version) - each token carries its behavior logprob and the version of the weights that
#     drew it. A weight update either drains or keeps the requests in flight (`drain_on_update`, the same policy as
#     vllm_engine.VLLMEngine's). Drain, an MoE model's default: the update admits no new request (they wait, then
#     start at the new version), lets those in flight finish, then loads; so every token of a request has one
#     version and every position one route set, the one its tokens were drawn under (a request that spans an
#     update has none: its tokens after the update were drawn under the new weights' routes at every earlier
#     position, and the trainer replays one route per position). Keep, a dense model's default: a weight swap in
#     the middle of a request discards the KV cache and re-prefills (a cache filled by the old weights would
#     condition new tokens on the old policy's keys and values, so their logprobs would belong to neither
#     version); a row's grammar and penalty state depend only on its ids, so they survive the re-prefill; a prompt
#     that starts with a finished row's ids takes that row's KV from the prefix cache (engines/prefix_cache.py; under a
#     salt the request carries, so no session reads another's) only while
#     the weights that computed it are loaded: every weight load empties the cache;
#   invariant 3 (forward consistency) - that logprob is of the distribution the token was actually drawn from
#     (processing.adjust_logits then processed_logprobs: grammar mask, logit bias, penalties, temperature, min_p,
#     top-k, top-p, fp32, in vLLM's order), and the token records the sampling that defines it (a grammar bound
#     to the row's stop ids; where the penalties start); MoE routes of every forwarded position are captured for
#     replay, and a vision-language model gets its images and M-RoPE positions from models.vision_inputs, as the
#     trainer does (decode steps continue each row from its own next position, kept here, not in the model).
# Never: computes rewards, touches the ledger, or trains; never drops an image (a text model refuses them).
from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import invariants
import models
from engines import (Generation, IncrementalText, SamplingParams, find_stop, per_prompt, processing, r3,
                     recorded_sampling, validate_sampling)
from engines.prefix_cache import Entry, PrefixCache, stacked_prefixes
from trainer import lora


# CausalLM classes whose logits are exactly lm_head(decoder(...)) (no scaling, soft-capping or bias): the engine
# may apply their output projection itself (EmbeddedEngine._logits)
PLAIN_HEADS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
VOCAB_SLICE = 2048
# the finished rows' KV an engine keeps for later prompts that start with their ids (engines/prefix_cache.py): 2 GiB holds a
# 30K-token agent episode of a 1.5B model in fp32 (Qwen2.5-1.5B: 57 KB a position), or a few hundred GRPO rows
PREFIX_CACHE_BYTES = 2 * 2**30


# ---- the embedded engine ----------------------------------------------------------------------------

@dataclass
class _Row:
    """One request in flight: from `generate` until it finishes (or fails) on the decoding thread."""
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    text: IncrementalText | None       # the reply decoded so far, kept only when stop strings are asked for
    images: list[invariants.ImageInput]  # the images of the prompt's pad runs, in order (VLMs; [] for text)
    on_token: Callable[[int], None] | None   # the caller's listener for this row's tokens
    sampling: invariants.Sampling      # what every token is drawn at (recorded_sampling)
    matcher: object | None = None      # a constrained row's constraints.Matcher: the ids its grammar allows next
    penalty: tuple[torch.Tensor, torch.Tensor] | None = None  # a penalised row's (seen, counts) [1, V] before its
                                                              # next token (processing.penalty_state)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)   # one [n_positions, L, k] block per forward
    finish_reason: str = ""
    stop_string: str | None = None
    cached_prompt_tokens: int = 0      # prompt positions its first prefill took from the prefix cache
    error: Exception | None = None     # what failed this row (and only this row)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Batch:
    """The rows decoded together and their shared KV cache, left-padded: row b's tokens sit at the right end of
    cache row b, and attention[b] marks them. Rows join after their own prefill and leave as they finish."""
    rows: list[_Row]
    cache: DynamicCache | None
    attention: torch.Tensor | None     # [B, S] long, 1 on real positions
    next_positions: torch.Tensor | None  # [B] the position of each row's next token
    logits: torch.Tensor | None        # [B, vocab] each row's next-token logits, not yet sampled
    version: int                       # the weights that filled the cache


class EmbeddedEngine:
    """Continuous batching with a KV cache over a transformers causal LM or VLM. Any number of threads may call
    `generate`; their requests join the running batch between two decode steps (after a prefill of their own)
    and each leaves as soon as it finishes, so a long reply never holds a short one. One decoding thread runs
    while there is work. A request fails alone: bad input is refused in its caller, and an error while
    prefilling or sampling one row fails that row only. `update_weights`, `pause` and `resume` may be called
    from any thread; they take effect between decode steps. The tokenizer is needed only for stop strings and
    grammar constraints. `drain_on_update` (None: True for an MoE model) makes a weight update wait for the
    requests in flight to finish rather than re-prefill them (the header's invariant 2). `prefix_cache_bytes`
    bounds the finished rows' KV kept for later prompts that extend them (0: none; a vision model keeps none)."""

    def __init__(self, model: torch.nn.Module, version: int = 0, seed: int = 0, tokenizer=None,
                 drain_on_update: bool | None = None, prefix_cache_bytes: int = PREFIX_CACHE_BYTES):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self.pad_id = _pad_id(model)
        self.eos_ids = _eos_ids(model)
        self.is_moe = bool(r3.moe_routers(model))
        self.drain_on_update = self.is_moe if drain_on_update is None else drain_on_update
        self.is_vision = models.is_vision_model(model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]   # the logits' width
        self.max_model_len = models.position_limit(model.config)   # prompt + reply, as vLLM's max_model_len
        # a VLM's positions (M-RoPE) and image features come from the whole prompt at once (models.vision_inputs)
        self.prefix_cache = PrefixCache(0 if self.is_vision else prefix_cache_bytes)
        self.device = next(model.parameters()).device     # inputs, caches and sampling all live on the model's
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(GROUPED_SDPA)   # the same outputs, bitwise, without copying KV heads
        # a prefill needs the logits of each row's last position only: the others would cost a vocabulary-wide
        # projection per prompt token
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters \
            else {}
        # a plain decoder under a plain output projection, on a CPU: the engine applies the projection itself, in
        # vocabulary slices (_logits)
        head = model.get_output_embeddings()
        self._decoder = model.model if self.device.type == "cpu" and type(model).__name__ in PLAIN_HEADS and \
            getattr(head, "bias", None) is None else None
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._step_lock = threading.RLock()      # one decode step or one weight load at a time
        self._running = threading.Event()        # cleared by pause() (keep): decoding waits at a step boundary
        self._running.set()
        self._admission = threading.Lock()       # guards _waiting, _admitting and _decoding
        self._waiting: list[_Row] = []           # submitted, not yet in the batch
        self._admitting = True                   # cleared by pause() (drain) and by a draining update
        self._decoding: threading.Thread | None = None   # the decoding thread, while one runs
        self._idle = threading.Condition(self._admission)   # notified when the decoding thread ends

    # -- the control plane used by the trainer and the async runtime --

    def pause(self) -> None:
        """Keep: stop decoding at the next step boundary, requests in flight kept, not dropped. Drain: admit no
        new request (they wait for resume); those in flight decode on to their end, so a weight update that
        follows (the runtime's push: pause every engine, update each, resume) finds them finished sooner."""
        if self.drain_on_update:
            with self._admission:
                self._admitting = False
        else:
            self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._admit_again()

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a full state dict from the actor (or, into a model with a LoRA adapter, the adapter's tensors) and
        stamp `version` on every later token; under the drain policy only once the requests in flight have finished
        (new ones wait, then start at `version`).
        Every key must land (a refit that filters keys by name can silently ship a handful of a model's
        parameters); only a tied output embedding may be absent from the export (models.tied_output_key). A push is
        all or nothing: it is checked whole (names, shapes, dtypes) before any tensor is loaded, so a refused one
        leaves the weights and the version as they were."""
        if version < self.version:
            raise ValueError(f"weight version must not go backwards: engine at {self.version}, got {version}")
        self._check_push(state)
        reopen = False
        if self.drain_on_update:
            with self._admission:
                if self._decoding is threading.current_thread():
                    raise RuntimeError("a draining weight update waits for the requests in flight to finish, so "
                                       "it cannot run on the decoding thread (from a listener): update from "
                                       "another thread, or build the engine with drain_on_update=False")
                reopen, self._admitting = self._admitting, False
                while self._decoding is not None:
                    self._idle.wait()
        try:
            with self._step_lock:
                # before the load, which may change weights and then fail: the KV kept is the old policy's
                self.prefix_cache.drop()
                self.model.load_state_dict(state, strict=False)   # checked above: every key lands, none else
                self.version = version
        finally:
            if reopen:          # as it was: a caller's pause() holds new requests until its resume()
                self._admit_again()

    def _check_push(self, state: dict[str, torch.Tensor]) -> None:
        """Refuse a push that does not fit the model whole (ValueError naming the keys): a key the model lacks, a key
        it holds that the push leaves out (of a model with a LoRA adapter, lora.add_lora, only the adapter's: its
        base is frozen; never the tied output embedding), a tensor of another shape or dtype (a load would cast it:
        the engine would serve weights the trainer does not hold)."""
        own = self.model.state_dict()
        tied, adapter = models.tied_output_key(self.model), lora.adapter_keys(self.model)
        unexpected = [k for k in state if k not in own]
        missing = [k for k in adapter or own if k not in state and k != tied]
        unfit = [f"{k}: {tuple(v.shape)} {v.dtype}, not {tuple(own[k].shape)} {own[k].dtype}" for k, v in state.items()
                 if k in own and not (isinstance(v, torch.Tensor) and v.shape == own[k].shape and v.dtype == own[k].dtype)]
        if unexpected or missing or unfit:
            raise ValueError(f"weight update does not match the engine's model, so nothing of it was loaded: unexpected "
                             f"keys {unexpected[:5]}, missing keys {missing[:5]}, tensors of another shape or dtype "
                             f"{unfit[:5]}")

    def _admit_again(self) -> None:
        """Open admission, and start a decoding thread for the requests that waited."""
        with self._admission:
            self._admitting = True
            self._start_decoding()

    def _start_decoding(self) -> None:
        """A decoding thread, if requests wait and none runs (the caller holds _admission)."""
        if self._waiting and self._decoding is None:
            self._decoding = threading.Thread(target=self._decode, name="embedded-engine", daemon=True)
            self._decoding.start()

    def sampler_state(self) -> torch.Tensor:
        """The engine's own random stream (requests without a seed draw from it). A checkpoint saves it, so a
        resumed run samples exactly the tokens the uninterrupted run would have."""
        return self._generator.get_state()

    def load_sampler_state(self, state: torch.Tensor) -> None:
        self._generator.set_state(state)

    # -- the data plane --

    def check(self, params: SamplingParams) -> None:
        """Refuse sampling parameters this engine cannot honour (ValueError saying why)."""
        validate_sampling(params, self.vocab_size)
        if (params.stop or params.constraint is not None) and self.tokenizer is None:
            raise ValueError("stop strings are matched in decoded text and a grammar in the tokens' text: build the "
                             "engine with EmbeddedEngine(model, tokenizer=...)")

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

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 images: list[Sequence[invariants.ImageInput]] | None = None) -> list[Generation]:
        """Sample a completion for every prompt. Token ids in, token ids out. `on_token(index, token_id)` is
        called as each token is sampled (index into `prompts`), from the decoding thread; it must not block
        for long (every request in the batch waits for it). `images[i]` are the images of prompt i, one per
        run of image pad ids, already expanded to their n_tokens (data.expand_image_pads); only a
        vision-language model takes them. Raises the first error of its own rows; other callers never see it."""
        params_list, images_list = per_prompt(len(prompts), params, images)
        rows = []
        for index, (prompt, p, row_images) in enumerate(zip(prompts, params_list, images_list)):
            self.check(p)
            if not prompt:
                raise ValueError("a prompt must hold at least one token id")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"the prompt holds {len(prompt)} tokens, at or over the model's position limit of "
                                 f"{self.max_model_len}: nothing past it is served")
            # a reply stops at the position limit, as vLLM stops one at its max_model_len
            p = dataclasses.replace(p, max_tokens=min(p.max_tokens, self.max_model_len - len(prompt)))
            self.check_images(prompt, row_images)
            generator = torch.Generator(self.device).manual_seed(p.seed) if p.seed is not None else self._generator
            stop = frozenset(p.stop_token_ids) if p.stop_token_ids else frozenset() if p.ignore_eos else self.eos_ids
            listener = None if on_token is None else (lambda token_id, i=index: on_token(i, token_id))
            rows.append(self._row(list(prompt), p, stop, generator, row_images, listener))
        if rows:
            with self._admission:
                self._waiting += rows
                if self._admitting:
                    self._start_decoding()
            for row in rows:
                row.done.wait()
        for row in rows:
            if row.error is not None:
                raise row.error
        return [self._finish(row) for row in rows]

    def _row(self, prompt: list[int], p: SamplingParams, stop: frozenset[int], generator, images, listener) -> _Row:
        """A request's row, with the state its logit processing starts from: a constrained row's matcher (its
        grammar bound to the stop ids this row ends on, so that a finished grammar allows only them and the row
        ends on one), a penalised row's view of its prompt. Built in the caller: a bad grammar fails there."""
        constraint = None
        if p.constraint is not None:
            from engines import constraints   # the grammar engine loads only when a request is constrained
            constraint = constraints.bind(p.constraint, sorted(stop))
        row = _Row(prompt, p, stop, generator, IncrementalText(self.tokenizer) if p.stop else None, images, listener,
                   recorded_sampling(p, len(prompt), constraint))
        if constraint is not None:
            row.matcher = constraints.matcher(constraint, self.tokenizer, self.vocab_size)
        if invariants.uses_penalties(row.sampling):
            ids = torch.tensor(prompt, device=self.device)
            row.penalty = processing.penalty_state(ids, len(prompt), len(prompt), 1, self.vocab_size)
        return row

    # -- the decoding thread --

    @torch.inference_mode()       # no autograd bookkeeping on any tensor of a step (no_grad still versions them)
    def _decode(self) -> None:
        """Admit, sample, drop the finished, step; until no request is left (a later generate starts a new
        thread). An error no row can be blamed for fails the rows in flight, and decoding goes on."""
        batch = _Batch([], None, None, None, None, self.version)
        while True:
            self._running.wait()                 # pause() (keep): hold the requests until resume()
            with self._admission:
                arrived = []
                if self._admitting:              # else they wait for the update (drain) or the resume
                    arrived, self._waiting = self._waiting, []
                if not arrived and not batch.rows:
                    self._decoding = None
                    self._idle.notify_all()      # a draining update waits for this
                    return
            with self._step_lock:
                try:
                    batch = self._admit(batch, arrived)
                    self._sample_all(batch)
                    batch, left = self._leave(batch)
                    _hand_back(left)
                    # a listener on this thread may have loaded new weights during the pass: then the cache is
                    # stale, and stepping on it would record routes no weights produce; the next pass re-prefills
                    if batch.rows and batch.version == self.version:
                        self._step(batch)
                except Exception as error:       # the model itself failed: fail what is in flight, keep serving
                    left = [row for row in batch.rows + arrived if not row.done.is_set()]
                    for row in left:
                        row.error = error
                    batch = _Batch([], None, None, None, None, self.version)
                    _hand_back(left)

    def _admit(self, batch: _Batch, arrived: list[_Row]) -> _Batch:
        """Bring the batch to the current weights and add the new rows. After a weight swap the cache belongs to
        the old policy and must not be reused: every row is re-prefilled (prompt + tokens so far). New rows are
        prefilled together and merged in; if that prefill fails, each is tried alone, so only a row that fails
        by itself is refused."""
        if batch.rows and batch.version != self.version:
            # the old weights' last step forwarded each row's newest token, but no token was sampled from that
            # forward: its routes conditioned nothing, so the re-prefill's (what the next token is drawn from)
            # replace them; the routes of positions that did produce sampled tokens stay (first writer wins)
            for row in batch.rows:
                if row.routes:
                    row.routes = [np.concatenate(row.routes)[: len(row.prompt_ids) + len(row.token_ids) - 1]]
            batch = self._prefill(batch.rows)
        if not arrived:
            return batch
        if batch.rows and not _mergeable(batch.cache):   # a cache kind whose rows cannot be stacked: start over
            return self._prefill(batch.rows + arrived)
        try:
            joined = [self._prefill(arrived)]
        except Exception:
            joined = []
            for row in arrived:
                try:
                    joined.append(self._prefill([row]))
                except Exception as error:
                    row.error = error
                    row.done.set()
        for new in joined:
            batch = _merge(batch, new)
        return batch

    def _sample_all(self, batch: _Batch) -> None:
        """One token for every row, each from its own processed distribution, all computed and drawn at once on
        the model's device: the rows drawing from the engine's stream in one multinomial call, each seeded row
        from its own generator, so a seeded row draws the same ids whatever else is in the batch. If the batch
        call fails (some row's parameters or grammar), each row is tried alone and only the one at fault fails."""
        rows = batch.rows
        try:
            logprobs = processing.processed_logprobs(self._adjusted(rows, batch.logits),
                                                     *(torch.tensor([getattr(r.params, name) for r in rows])
                                                       for name in ("temperature", "top_p", "top_k", "min_p")))
            drawn = self._draw(rows, logprobs)      # [B, vocab] above
        except Exception:
            logprobs, drawn = None, [None] * len(rows)
        for b, row in enumerate(rows):
            try:
                if drawn[b] is None:              # alone: this row's own distribution and draw
                    p = row.params
                    row_logprobs = processing.processed_logprobs(self._adjusted([row], batch.logits[b:b + 1])[0],
                                                                 p.temperature, p.top_p, p.top_k, p.min_p)
                    token = int(multinomial(row_logprobs.exp()[None], row.generator)[0])
                    drawn[b] = (token, float(row_logprobs[token]))
                self._record(row, *drawn[b], logprobs[b] if logprobs is not None else row_logprobs)
                # the version of the weights that computed these logits, even if a listener (on this thread)
                # has loaded newer ones since: the rows after it in this pass still sample from the old logits
                row.versions.append(batch.version)
                if row.on_token is not None:
                    row.on_token(row.token_ids[-1])
            except Exception as error:           # this row's sampling or its listener: this row fails
                row.error = error

    def _adjusted(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """logits [B, vocab] with processing.adjust_logits applied to each row that asked for a logit bias,
        penalties or a grammar, from its own state (matcher, penalty view); the other rows' logits are untouched
        and cost nothing."""
        special = [b for b, row in enumerate(rows) if row.matcher is not None or row.penalty is not None
                   or row.sampling.logit_bias]
        if not special:
            return logits
        logits = logits.float().clone()
        for b in special:
            row = rows[b]
            allowed = None if row.matcher is None else row.matcher.allowed().to(self.device)[None]
            z = processing.adjust_logits(logits[b:b + 1], row.sampling, allowed, *(row.penalty or (None, None)))
            if not torch.isfinite(z).any():
                raise ValueError(f"no token is left to sample: the request's grammar and logit_bias ban every id "
                                 f"(after {len(row.token_ids)} tokens); send a grammar and bans that leave one")
            logits[b] = z[0]
        return logits

    def _draw(self, rows: list[_Row], logprobs: torch.Tensor) -> list[tuple[int, float]]:
        """(token, its logprob) per row, with one device-to-host copy for the whole batch."""
        probs = logprobs.exp()
        tokens = torch.empty(len(rows), dtype=torch.long, device=logprobs.device)
        shared = [b for b, row in enumerate(rows) if row.generator is self._generator]
        if len(shared) == len(rows):
            tokens = multinomial(probs, self._generator)
        elif shared:
            tokens[shared] = multinomial(probs[shared], self._generator)
        for b, row in enumerate(rows):
            if row.generator is not self._generator:
                tokens[b] = multinomial(probs[b:b + 1], row.generator)[0]
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return list(zip(tokens.tolist(), chosen.tolist()))

    def _leave(self, batch: _Batch) -> tuple[_Batch, list[_Row]]:
        """The batch of the rows still decoding (only their cache rows kept), and the finished or failed rows."""
        left = [row for row in batch.rows if row.finish_reason or row.error]
        if left:
            # a listener may have loaded new weights during the pass: then this KV is the old policy's, and stays out
            if batch.version == self.version and self.prefix_cache.budget_bytes and _mergeable(batch.cache):
                self._keep_prefixes(batch)
            batch = _select(batch, [b for b, row in enumerate(batch.rows) if not (row.finish_reason or row.error)])
        return batch, left

    def _keep_prefixes(self, batch: _Batch) -> None:
        """Give the prefix cache each finished row's KV: the positions its attention marks, which are its prompt and
        sampled ids but the last (sampled, never fed), with an MoE row's routes at those positions. A row that
        spans a weight update is left out: its KV is the new weights' (re-prefilled) but its first routes are the
        old ones' (first writer wins), so a later prompt would take KV and routes of two policies."""
        for b, row in enumerate(batch.rows):
            if not row.finish_reason or row.error or row.versions[0] != batch.version:
                continue
            forwarded = (row.prompt_ids + row.token_ids)[:-1]
            columns = batch.attention[b].nonzero().squeeze(-1)
            keys = [layer.keys[b].index_select(1, columns) for layer in batch.cache.layers]
            values = [layer.values[b].index_select(1, columns) for layer in batch.cache.layers]
            routes = np.concatenate(row.routes)[:len(forwarded)] if row.routes else None
            self.prefix_cache.keep(forwarded, keys, values, routes, batch.version, row.params.cache_salt)
            if row.params.given_salt:     # the given prompt alone, for its group's samples (never a sampled id)
                n = len(row.prompt_ids)
                self.prefix_cache.keep(row.prompt_ids, [k[:, :n].clone() for k in keys], [v[:, :n].clone() for v in values],
                                       None if routes is None else routes[:n], batch.version, row.params.given_salt)

    def _prefill(self, rows: list[_Row], salts: list[tuple[str, ...]] | None = None) -> _Batch:
        """Forward prompt + tokens so far for every row, left-padded, with every row's images (also on a
        re-prefill after a weight swap), into a fresh cache. A row whose ids begin with a finished row's (an
        agent's last turn) takes the KV of that common prefix from the prefix cache, under the salts it carries
        (`salts[b]`, by default its own), and forwards only the rest: the cache starts with each row's reused
        positions, left-padded to the longest, and the forwarded ids follow, left-padded too (a padded position is
        masked out wherever it sits). Rows whose text is the same (the samples of a group, arriving together) are
        forwarded once and share that forward's cache rows and logits: a row's result depends on its own ids alone,
        so a copy is what its own forward would give; that forward takes from the cache only under the salts every
        one of them carries (engines/prefix_cache.py's rule: no row learns of an entry another's salt reaches)."""
        seqs = [r.prompt_ids + r.token_ids for r in rows]
        salts = salts or [_salts(r.params) for r in rows]
        if not self.is_vision and len(rows) > 1 and not any(r.routes for r in rows):
            first: dict[tuple[int, ...], int] = {}
            of = [first.setdefault(tuple(s), len(first)) for s in seqs]
            if len(first) < len(rows):
                distinct = [rows[seqs.index(list(key))] for key in first]
                common = [tuple(salt for salt in _salts(row.params)
                                if all(salt in salts[b] for b, k in enumerate(of) if k == i))
                          for i, row in enumerate(distinct)]
                shared = self._prefill(distinct, common)
                for r, k in zip(rows, of):          # each copy records the routes its own forward would, and reuse
                    if r is not distinct[k]:
                        r.routes, r.cached_prompt_tokens = list(distinct[k].routes), distinct[k].cached_prompt_tokens
                return _select(shared, of, rows)
        reused = [self._reusable(s, row_salts) for s, row_salts in zip(seqs, salts)]   # (entry, positions taken)
        past = max(k for _, k in reused)
        width = max(len(s) - k for s, (_, k) in zip(seqs, reused))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), past + width), dtype=torch.long)
        for b, (s, (_, k)) in enumerate(zip(seqs, reused)):
            ids[b, width - len(s) + k:] = torch.tensor(s[k:])
            mask[b, past - k:past] = 1
            mask[b, past + width - len(s) + k:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.is_vision:
            extra, next_positions = models.vision_inputs(self.model, ids, mask, [r.images for r in rows])
        else:
            extra, next_positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]}, mask.sum(-1)
        cache = DynamicCache()
        cache.layer_class_to_replicate = _GrowingLayer
        for keys, values in stacked_prefixes(reused, past):   # none when no row reuses a position
            cache.layers.append(_GrowingLayer())
            cache.layers[-1].update(keys, values)
        logits, routes = self._forward(ids, mask, cache, extra)
        for b, (r, s, (entry, k)) in enumerate(zip(rows, seqs, reused)):
            if not r.token_ids:                     # a first prefill: what the request's prompt reused
                r.cached_prompt_tokens = k
            if routes is not None:
                # first writer wins (as in the ledger, and as a prefix cache does): a re-prefill after a weight swap
                # adds routes only for positions never forwarded before; those already recorded are the routes the
                # tokens sampled so far were conditioned on; reused positions keep the routes that computed them
                routed = sum(len(block) for block in r.routes)
                if k > routed:
                    r.routes.append(entry.routes[routed:k])
                    routed = k
                r.routes.append(routes[b, width - len(s) + routed:])
        return _Batch(list(rows), cache, mask, next_positions, logits, self.version)

    def _reusable(self, ids: list[int], salts: tuple[str, ...]) -> tuple[Entry | None, int]:
        """The prefix cache's entry under one of `salts` sharing the most first ids with `ids` at the loaded weights,
        and how many of its positions to take: all it shares but `ids`' last, whose logits the row samples from."""
        if not self.prefix_cache.budget_bytes:
            return None, 0
        entry, shared = self.prefix_cache.lookup(ids, self.version, salts)
        taken = min(shared, len(ids) - 1)
        return (entry, taken) if taken > 0 else (None, 0)

    def _step(self, batch: _Batch) -> None:
        """Feed each row's newest token at its own next position. For a VLM the three M-RoPE axes of a text
        token are equal."""
        rows = batch.rows
        last = torch.tensor([[r.token_ids[-1]] for r in rows], device=self.device)
        batch.attention = torch.cat([batch.attention, batch.attention.new_ones((len(rows), 1))], dim=1)
        positions = batch.next_positions[:, None]                              # [B, 1]
        if self.is_vision:
            positions = positions[None].expand(3, -1, -1)                      # [3, B, 1]
        logits, routes = self._forward(last, batch.attention, batch.cache, {"position_ids": positions})
        if routes is not None:
            for b, r in enumerate(rows):
                r.routes.append(routes[b])
        batch.logits, batch.next_positions = logits, batch.next_positions + 1

    def _forward(self, ids, mask, cache, extra: dict[str, torch.Tensor]):
        """One model forward: each row's last-position logits [B, vocab], and its routes for an MoE model. `extra`
        holds position_ids and, for a VLM prefill, the pixel inputs."""
        if not self.is_moe:
            return self._logits(ids, mask, cache, extra), None
        with r3.capture_routes(self.model) as captured:
            logits = self._logits(ids, mask, cache, extra)
        b, s = ids.shape
        routes = captured[-1].reshape(b, s, *captured[-1].shape[1:]).cpu().numpy().astype(np.int16)
        return logits, routes

    def _logits(self, ids, mask, cache, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last position's logits [B, vocab]. On a CPU the one big product hidden [B, d] x [d, vocab] runs
        about a third faster in slices of VOCAB_SLICE ids (a slice's weights stay in cache while the rows use them),
        and bit for bit the same: each logit is the same dot product either way (tests/test_rollout.py checks)."""
        kwargs = dict(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
        if self._decoder is None:
            return self.model(**kwargs, **self._last_logits).logits[:, -1]
        hidden = self._decoder(**kwargs).last_hidden_state[:, -1]             # [B, d]
        weight = self.model.get_output_embeddings().weight                     # [vocab, d]
        return torch.cat([hidden @ weight[i:i + VOCAB_SLICE].T for i in range(0, len(weight), VOCAB_SLICE)], dim=-1)

    def _record(self, row: _Row, token: int, logprob: float, logprobs: torch.Tensor) -> None:
        """Append the drawn token and its logprob to the row (with the distribution's k best when asked), and
        finish the row at a stop token, a stop string or max_tokens."""
        row.token_ids.append(token)
        row.logprobs.append(logprob)
        if row.params.top_logprobs:
            best = torch.topk(logprobs, row.params.top_logprobs)
            row.top.append(list(zip(best.indices.tolist(), best.values.tolist())))
        if token in row.stop_ids:
            row.finish_reason = "stop"
        elif row.text is not None and self._wrote_stop_string(row, token):
            row.finish_reason = "stop"
        elif len(row.token_ids) >= row.params.max_tokens:
            row.finish_reason = "length"
        if not row.finish_reason:               # the state the next token's logit processing reads
            if row.matcher is not None:
                row.matcher.accept(token)
            if row.penalty is not None:
                seen, counts = row.penalty
                seen[0, token], counts[0, token] = True, counts[0, token] + 1

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
        return Generation(row.prompt_ids, row.token_ids, row.logprobs, row.versions, routes, row.finish_reason,
                          row.stop_string, row.top if row.params.top_logprobs else None, row.sampling,
                          row.cached_prompt_tokens)


def _salts(params: SamplingParams) -> tuple[str, ...]:
    """The prefix cache's salts a request may take KV from (engines/prefix_cache.py's rule)."""
    return (params.cache_salt, params.given_salt) if params.given_salt else (params.cache_salt,)


def _hand_back(rows: list[_Row]) -> None:
    """Wake the callers of rows that left the batch. The decoding thread calls it only once the batch it replaced
    is gone: freeing a tensor releases the GIL, and a daemon thread that takes it back while the interpreter
    shuts down (the caller of the last rows may already be exiting) is ended by a forced unwind that meets a
    noexcept C++ frame in torch and aborts the process ("terminate called without an active exception")."""
    for row in rows:
        row.done.set()


# ---- the draw: torch.multinomial's tokens, without its cost on a CPU ---------------------------------------

def multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of probs [N, V] (fp32, unnormalised), exactly torch.multinomial(probs, 1, generator=...)
    .squeeze(-1) would draw, and with the generator left exactly where it would leave it: the seeded replies users
    and tests read stay the same. On a CPU torch draws q ~ Exp(1) per entry, q = -log1p(-u) with u the low 53 bits
    of one random64 of the generator's stream (in fp64, cast to fp32), and takes the first argmax of probs / q.
    That serial exponential_ costs about 30 ms per 32 x 49,152 draw; here torch.randint(0, 2**53) reads the same
    random64s (its range is a power of two, so the same 53 bits) at a quarter of that, and the log is taken only for
    the few entries that can win: q >= u, so an entry whose bound probs / u falls short of the exact score of the
    bound's own best cannot be the argmax. Elsewhere (a GPU's Philox stream) it is torch.multinomial itself."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    low, high = torch.aminmax(probs, dim=-1)   # a row of non-negative entries sums to 0 where its maximum is 0
    if not (bool(low.min() >= 0) and bool(high.max() < float("inf"))) or bool((high == 0).any()):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)   # torch's own error, nothing drawn
    bits = torch.randint(0, 2**53, probs.shape, generator=generator)    # [N, V] u * 2**53, exactly
    inverse = bits / probs                     # ~ 2**53 * u / p, the inverse of an upper bound on p / q
    best = inverse.argmin(-1)
    with np.errstate(divide="ignore"):
        threshold = torch.tensor([2.0**53 / _exact_score(p, b) * (1 + 1e-5) for p, b in
                                  zip(probs.gather(-1, best[:, None]).squeeze(-1).tolist(),
                                      bits.gather(-1, best[:, None]).squeeze(-1).tolist())])
    # a NaN (p = u = 0) is argmin's pick and torch's argmax's too: its row's threshold is NaN, with no candidates
    rows, cols = (inverse <= threshold[:, None]).nonzero(as_tuple=True)
    tokens = best.tolist()
    winner: dict[int, np.float32] = {}
    for r, c, p, b in zip(rows.tolist(), cols.tolist(), probs[rows, cols].tolist(), bits[rows, cols].tolist()):
        s, held = _exact_score(p, b), winner.get(r)
        # torch's argmax: the first NaN, else the first maximum (candidates come in column order)
        if held is None or not np.isnan(held) and (np.isnan(s) or s > held):
            winner[r], tokens[r] = s, c
    return torch.tensor(tokens)


def _exact_score(p: float, bits: int) -> np.float32:
    """probs / q for one entry as torch computes it: q = fp32(-log1p(-u)) in fp64, u = bits * 2**-53, an fp32
    division (p / 0 = inf, 0 / 0 = NaN where u = 0)."""
    q = np.float32(-math.log1p(-(bits * 2.0**-53)))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(p) / q


# ---- attention: grouped KV heads as they are ------------------------------------------------------------

GROUPED_SDPA = "sdpa_grouped"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa, except that on a CPU a grouped-query layer hands its KV heads to torch as they are:
    transformers repeats them to one per query head whenever a mask is given (CUDA's fused kernels need that), which
    copies the whole KV cache in every layer of every decode step; torch's CPU kernels take the groups
    (enable_gqa) and give bitwise the same output (tests/test_rollout.py checks)."""
    if query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1 or dropout or \
            kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         is_causal=query.shape[2] > 1 and attention_mask is None and causal,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)   # the masks sdpa takes


# ---- the batch's KV cache: rows join and leave between steps ----------------------------------------------

class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room for ROOM more positions: a decode step
    writes its one new position in place, where DynamicLayer's torch.cat copies the whole layer's cache at every
    step. When the room runs out, or the engine has replaced the tensors (rows joined), the next update moves them
    into new buffers: one copy per ROOM steps or per change of rows. Rows leave through `keep`, in one copy too."""
    ROOM = 64
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    _view: torch.Tensor | None = None      # the keys this layer last returned: anything else is somebody's copy

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = length + key_states.shape[-2]
        if self.keys is not self._view or end > self._buffers[0].shape[-2]:
            b, heads, _, dim = key_states.shape
            self._buffers = (key_states.new_empty(b, heads, end + self.ROOM, dim),
                             value_states.new_empty(b, value_states.shape[1], end + self.ROOM, value_states.shape[-1]))
            if length:
                self._buffers[0][:, :, :length], self._buffers[1][:, :, :length] = self.keys, self.values
        keys, values = self._buffers
        keys[:, :, length:end], values[:, :, length:end] = key_states, value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        self._view = self.keys
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, start: int = 0) -> None:
        """Only the cache rows `rows` (a row may repeat), from position `start` on, gathered straight into new
        buffers with room."""
        length = self.keys.shape[-2] - start
        buffers = []
        for t in (self.keys, self.values):
            buffer = t.new_empty(len(rows), t.shape[1], length + self.ROOM, t.shape[-1])
            torch.index_select(t[:, :, start:], 0, rows, out=buffer[:, :, :length])
            buffers.append(buffer)
        self._buffers = tuple(buffers)
        self.keys, self.values = self._buffers[0][:, :, :length], self._buffers[1][:, :, :length]
        self._view = self.keys


def _mergeable(cache: DynamicCache) -> bool:
    """Plain full-attention layers ([B, heads, S, dim] keys and values) can be stacked and sliced by row."""
    return all(type(layer) is _GrowingLayer for layer in cache.layers)


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(batch: _Batch, new: _Batch) -> _Batch:
    """`new`'s rows appended to `batch`'s: both left-padded to the longer length (a padded position is masked
    out, so its zero keys are never attended), caches stacked row-wise. Both hold the same weights' cache."""
    if not batch.rows:
        return new
    width = max(batch.attention.shape[1], new.attention.shape[1])
    for layer, joining in zip(batch.cache.layers, new.cache.layers):
        layer.keys = torch.cat([_pad_left(layer.keys, width, 2), _pad_left(joining.keys, width, 2)])
        layer.values = torch.cat([_pad_left(layer.values, width, 2), _pad_left(joining.values, width, 2)])
    return _Batch(batch.rows + new.rows, batch.cache,
                  torch.cat([_pad_left(batch.attention, width, 1), _pad_left(new.attention, width, 1)]),
                  torch.cat([batch.next_positions, new.next_positions]), torch.cat([batch.logits, new.logits]),
                  batch.version)


def _select(batch: _Batch, keep: list[int], rows: list[_Row] | None = None) -> _Batch:
    """The batch's row keep[b] as row b (a row may be taken several times; `rows` names them, by default the
    batch's own), and only the cache columns one of them still attends (padding that every remaining row has on
    its left goes, so a long finished row does not widen everybody's steps)."""
    if not keep:
        return _Batch([], None, None, None, None, batch.version)
    picked = torch.tensor(keep, device=batch.attention.device)
    attention, start = batch.attention[picked], 0
    if _mergeable(batch.cache):
        start = int(attention.any(0).long().argmax())      # the first column some row attends
        for layer in batch.cache.layers:
            layer.keep(picked, start)
    else:                                                   # a cache kind with its own layout: rows only
        batch.cache.batch_select_indices(picked)
    return _Batch(rows if rows is not None else [batch.rows[b] for b in keep], batch.cache, attention[:, start:],
                  batch.next_positions[picked], batch.logits[picked], batch.version)


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
