# engines/vllm_engine.py — vLLM behind the engine interface of rollout.py.
#
# Owns: `VLLMEngine`, which drives vLLM's `AsyncLLM` (one private event loop in a background thread) and answers
# the same calls as rollout.EmbeddedEngine: generate (token ids in, `Generation`s out, per-token streaming),
# pause / resume, update_weights, sleep / wake_up (one GPU shared with the actor), sampler state.
# The embedded engine is its reference: tests run both on the same model and compare token for token.
#
# Keeps, for every sampled token:
#   invariant 1 (token identity) - prompts go in as token ids (`TokensPrompt`) and the ids vLLM sampled come back
#     untouched; nothing is detokenized and re-encoded;
#   invariant 2 (policy version) - the version of every token is exact across a weight update, under either of two
#     policies (`drain_on_update`, the embedded engine's too):
#     drain (an MoE model's default) - the update admits no new request (they wait on the engine's loop, then
#       start at the new version: none is lost or failed), lets those in flight finish (each is one turn, bounded
#       by its max_tokens), then loads the weights and resumes. Every token of a request then has one version and
#       vLLM's routes for all its positions: a request that spans an update has no right route set (its tokens
#       after the update were drawn under the new weights' routes at every earlier position, those before under
#       the old ones, and the trainer replays one route per position; vLLM 0.26 reports for it the first routes
#       computed at each position, or none: both seen on an H200, docs/gpu.md). An MoE engine schedules
#       synchronously: under vLLM's asynchronous scheduling even a request never preempted came back with routes
#       for some positions only. A request whose routes vLLM still reports for only some positions comes back with
#       routes None, which the trainer counts in actor/r3_unreplayed_tokens;
#     keep (a dense model's default) - the update pauses vLLM with requests kept, drains vLLM's output pipeline and
#       records, per request, how many tokens were sampled before it (`_pause_and_drain`, `_mark_version`); a kept
#       request is re-prefilled by the new weights (vLLM's `reset_prefix_cache(reset_running_requests=True)`), as
#       the embedded engine does: continuing on the old KV cache would condition new tokens on the old policy's
#       keys and values, so their logprobs would belong to neither version (`reprefill_on_update=False` keeps
#       that behaviour, for measuring it);
#     and a request never takes from vLLM's prefix cache KV that older weights wrote (the cache is salted with the
#     version a request starts at, so it holds even for blocks the reset could not drop), nor KV another session
#     wrote (the salt also holds the request's prefix-cache salt, engines/prefix_cache.py); what it did take is its
#     Generation's cached_prompt_tokens (vLLM's num_cached_tokens), as the embedded engine counts its own reuse;
#   invariant 3 (forward consistency) - the behavior logprob is vLLM's `processed_logprobs` (after a grammar's
#     mask, logit bias, penalties, temperature, min_p, top-k, top-p; fp32), the same distribution
#     processing.adjust_logits and processed_logprobs recompute in the trainer (shown on vLLM's CPU build, field by
#     field; a grammar runs on vLLM's llguidance backend as the very grammar text engines/constraints.py replays); an MoE
#     model returns the experts vLLM routed each position to
#     (`enable_return_routed_experts`), in the layout of `Generation.routes`, for the trainer to replay; a VLM's
#     images go in as vLLM multimodal data: each image's source (the copy the trainer's processor resized, so
#     vLLM's processor computes the same pixels) with its pad run collapsed to the one pad vLLM expands, and the
#     prompt vLLM expanded must equal ours id for id (same runs, so the same M-RoPE positions), or the request
#     fails.
# Weights move through vLLM's weight-transfer API: CUDA IPC when the engine shares the actor's GPU
# (`transfer="ipc"`; the actor may sit in this process or in another one: `begin_weight_update`,
# `receive_weight_chunk`, `finish_weight_update` with `send_ipc_weights` on the trainer's side); on a CPU, where
# there is no IPC, a state dict through `collective_rpc` into `WorkerExtension` (`transfer="rpc"`). Either way
# the weights travel under the checkpoint's names and layout (`checkpoint_state`: transformers 5 renames and fuses
# some models' weights as it loads them) and every key of the engine's checkpoint must arrive. An engine on a GPU of its own gets the weights over the async
# runtime's weight channel (runtime.py: NCCL into its process), then by CUDA IPC from there.
# LoRA (`lora=`, trainer/lora.py): the engine serves the adapter unmerged (vLLM's LoRA layers add alpha/r * B(A x) to the
# frozen base, as PEFT's layer does in the trainer; a merge would round W + alpha/r * B A in the engine's dtype, which
# the trainer never does). A push is the adapter alone, written as a PEFT folder and registered as a new vLLM adapter
# (`_load_adapter`): a request is sampled whole under the adapter of the version it started at (vLLM binds the
# LoRARequest at admission), so a push needs no pause, no drain and no re-prefill, and every token of a request has
# that one version (invariant 2); older adapters are dropped once no request uses them.
# Never: computes rewards, touches the ledger, or trains.
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np
import torch
import transformers

import invariants
import models
from engines import Generation, SamplingParams, per_prompt, recorded_sampling, validate_sampling
from trainer import lora

LORA_SLOTS = 4     # adapters vLLM holds at once: the newest, and older ones while requests started under them finish
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the max_lora_rank values vLLM accepts

# vLLM's client gives its engine-core process 5 s after SIGTERM, then kills it. The process does end itself on
# SIGTERM, but its orderly teardown (its workers' exit, a full collection of the heap it froze at start, the spawned
# interpreter's finalisation) took 4.2-8.3 s on a shared 2-core CPU at the tiny test model (killed in 2 of 3 there)
ENGINE_EXIT_S = 30.0
# vLLM's layerwise reload logs "<class>: Failed to load weights" under this logger for a module that got no weight
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def available() -> bool:
    """Whether vLLM can be imported here (the `--rollout.engine auto` choice needs it and a GPU)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def is_moe_config(config: dict) -> bool:
    """Whether a checkpoint's config.json describes a mixture of experts (its routes are then returned for R3).
    transformers writes the expert count under different names: Qwen3-MoE's num_local_experts (num_experts before
    transformers 5), DeepSeek's n_routed_experts."""
    text_config = config.get("text_config", config)
    return any(key in text_config for key in ("num_local_experts", "num_experts", "n_routed_experts"))


def register_in_process(architectures: list[str]) -> None:
    """Import the vLLM classes of these architectures here and register them whole (vLLM's public
    `ModelRegistry.register_model`). vLLM otherwise inspects a class it has not cached in VLLM_CACHE_ROOT/modelinfos
    in a fresh Python process, so that importing it cannot initialise CUDA in this one: a second import of vLLM and
    torch, 22.6 s of a 111 s start on an H200 with empty caches (docs/gpu.md), against 3.3 s on a 2-core CPU to
    import the class here. Harmless here: the engine core runs in a process of its own, spawned whenever this one
    holds CUDA (vLLM checks), and there it resolves the class by its usual lazy entry."""
    from vllm import ModelRegistry
    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if entry is not None and hasattr(entry, "module_name"):     # a lazy entry (module, class), not yet imported
            ModelRegistry.register_model(arch, entry.load_model_cls())


def checkpoint_state(state: dict[str, torch.Tensor], model_path: str) -> dict[str, torch.Tensor]:
    """The trainer's state dict under the names and layout of the checkpoint at `model_path`, which is what vLLM
    loads and what `begin_weight_update` checks coverage against. transformers 5 converts some models' weights as
    it loads them: Qwen2.5-VL's language model moves under `model.language_model.`, an MoE's per-expert matrices
    fuse into one tensor per layer; so a trainer's state dict of those models names no key of their checkpoint.
    transformers' own inverse (`revert_weight_conversion`, what `save_pretrained` applies) undoes it: renamed keys
    keep their tensors, split experts are views of the fused ones (no copy). A model transformers loads as saved
    comes back unchanged."""
    from transformers.core_model_loading import revert_weight_conversion
    return revert_weight_conversion(models.meta_model(model_path), dict(state))


def send_ipc_weights(state: dict[str, torch.Tensor], send: Callable[[dict], None]) -> None:
    """The trainer's side of a CUDA IPC update (vLLM's IPCWeightTransferEngine): export handles to the CUDA
    tensors of `state` and pass each chunk's update info to `send`, which must return only once the engine has
    loaded it (the tensors are only borrowed until then). `send` is VLLMEngine.receive_weight_chunk, or a call to
    it in another process on the same GPU."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
    IPCWeightTransferEngine.trainer_send_weights(
        iter(state.items()), IPCTrainerSendWeightsArgs(send_mode=lambda update_info: send(asdict(update_info))))


# ---- the worker side: runs inside vLLM's worker process -------------------------------------------------------

class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`), so `collective_rpc` can load a state dict where CUDA IPC
    is not available. vLLM's layerwise reload wraps the load, as its own weight-transfer engines do: it restores
    the loaders that vLLM's post-load processing (e.g. the CPU's weight repacking) took off the parameters."""

    def tracerl_exact_top_p(self) -> None:
        """vLLM's exact top-k/top-p (sort, softmax, cumsum: the trainer's processing.processed_logprobs) in place of
        its Triton pivot search, which a GPU batch of 8 or more rows takes: a bisection of at most 18 steps with a
        fast exp, so the nucleus of a token near its edge differs from the one the trainer recomputes."""
        from vllm.v1.sample.ops import topk_topp_sampler
        topk_topp_sampler.apply_top_k_top_p = topk_topp_sampler.apply_top_k_top_p_pytorch

    def tracerl_quiet_reload(self) -> None:
        """Drop vLLM's "Failed to load weights" warning for the modules a full push leaves out by design; it printed
        once each push for two (a tied SmolLM2 on an H200), though the push took effect: modules whose tensors are all
        non-persistent buffers, computed from the config and in no checkpoint (the rotary embedding's cos/sin
        cache), and modules whose every parameter is an earlier module's (a tied output head: the embedding's weight,
        which the push loads through the embedding). vLLM keeps such a module's own tensors, which is right for both.
        The warning names a class: a class with any instance that does load keeps its warnings, and so does any
        other module that got nothing."""
        import logging
        by_design, loaded, seen = set(), set(), set()
        for module in self.model_runner.model.modules():
            params = [p for p in module._parameters.values() if p is not None]
            buffers = {name for name, b in module._buffers.items() if b is not None}
            if params or buffers:
                computed = not params and buffers <= module._non_persistent_buffers_set
                tied = bool(params) and all(id(p) in seen for p in params)
                (by_design if computed or tied else loaded).add(type(module).__name__)
            seen.update(id(p) for p in params)
        quiet = by_design - loaded
        logging.getLogger(RELOAD_LOGGER).addFilter(
            lambda record: not (record.msg == "%s: Failed to load weights" and record.args[0] in quiet))

    def tracerl_load_weights(self, serialized_state: bytes) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        model = self.model_runner.model
        state = torch.load(io.BytesIO(serialized_state), weights_only=True)
        initialize_layerwise_reload(model)
        model.load_weights(iter(state.items()))
        finalize_layerwise_reload(model, self.model_config)
        # On a CPU, vLLM computes the output projection from a repacked copy of the embedding (it keeps the weight
        # for the lookup, so a tied head reads the copy); the reload above does not redo that copy: redo it here,
        # or a tied model would sample from its old head
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform
        if current_platform.is_cpu():
            for module in model.modules():
                if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                    module.quant_method.process_weights_after_loading(module)


# ---- the engine ---------------------------------------------------------------------------------------------------

class VLLMEngine:
    """The rollout engine of a GPU run. `generate` may be called from any number of threads; each call's requests
    join vLLM's running batch at once (vLLM batches continuously) and stream their tokens through `on_token`.
    A request fails alone: its error is raised in its own caller only. `drain_on_update` (None: True for an MoE
    model) makes a weight update wait for the requests in flight rather than keep them (the header's invariant 2).
    `prefix_caching=False` computes every prompt whole (bench/prefix_reuse.py measures what vLLM's cache saves)."""

    def __init__(self, model_path: str, version: int = 0, seed: int = 0, *, dtype: str = "auto",
                 transfer: str = "ipc", sleep_mode: bool = False, drain_on_update: bool | None = None,
                 reprefill_on_update: bool = True, prefix_caching: bool = True,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.5, enforce_eager: bool = False,
                 lora_spec: lora.LoraSpec | None = None):
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig
        from vllm.v1.engine.async_llm import AsyncLLM
        if transfer not in ("ipc", "rpc"):
            raise ValueError(f"transfer must be 'ipc' (CUDA IPC) or 'rpc' (a state dict, CPU), got {transfer!r}")
        self.model_path = model_path
        self.version = version
        self.transfer = transfer
        self.reprefill_on_update = reprefill_on_update
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        text_config = config.get("text_config", config)
        self.is_moe = is_moe_config(config)
        self.drain_on_update = self.is_moe if drain_on_update is None else drain_on_update
        self.is_vision = "vision_config" in config
        self.vocab_size = text_config["vocab_size"]
        # prompt + reply (None: the model's position limit); vLLM refuses a longer prompt, stops a reply there
        self.max_model_len = max_model_len or models.position_limit(transformers.AutoConfig.from_pretrained(model_path))
        # the ids a request without stop ids ends on, as the embedded engine reads them (a grammar is bound to them)
        eos = None
        if os.path.exists(os.path.join(model_path, "generation_config.json")):
            with open(os.path.join(model_path, "generation_config.json")) as f:
                eos = json.load(f).get("eos_token_id")
        eos = eos if eos is not None else text_config.get("eos_token_id")
        self.eos_ids = sorted(eos if isinstance(eos, list) else [eos])
        self._tokenizer = None                        # loaded for the first constrained request
        self._image_pad = config.get("image_token_id")
        self._checkpoint = _checkpoint_tensors(model_path)
        self._tied = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))
        self._paused = False
        self._resume_after_update = False
        self._control = threading.Lock()              # one pause/update/resume sequence at a time
        self._active: dict[str, _Request] = {}          # request id -> its record, while it runs
        self._admitting = asyncio.Event()             # cleared by pause() (drain): new requests wait on it
        self._admitting.set()
        self._drained = asyncio.Event()               # set when the last request in flight ends
        self._generation_paused = False               # vLLM's scheduler is paused (pause() when keeping requests)
        self._served = {"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0}   # over the engine's life
        if lora_spec is not None and dtype == "float32" and torch.cuda.is_available():
            raise ValueError("vLLM's LoRA kernels on a GPU take fp16 and bf16 weights only: serve a LoRA adapter in "
                             "bfloat16 (the fp32 mode serves adapters on vLLM's CPU build)")
        self.lora_spec = lora_spec
        self._adapters: dict[int, object] = {}       # version -> its vLLM LoRARequest, while current or still in use
        self._adapter_root = tempfile.mkdtemp(prefix="tracerl-adapters-") if lora_spec else None
        adapter_args = {} if lora_spec is None else dict(
            enable_lora=True, max_loras=LORA_SLOTS,
            max_lora_rank=next((r for r in VLLM_LORA_RANKS if r >= lora_spec.rank), lora_spec.rank))
        register_in_process(config.get("architectures") or [])
        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, seed=seed, max_model_len=self.max_model_len, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
            max_logprobs=20, enable_return_routed_experts=self.is_moe, enable_sleep_mode=sleep_mode,
            enable_prefix_caching=prefix_caching, worker_extension_cls=f"{__name__}.WorkerExtension",
            disable_log_stats=True,
            # an MoE model schedules synchronously (R3): under vLLM's asynchronous scheduling (0.26's default) the
            # routes of a request it never preempted came back for some positions only, or none; synchronous, every
            # request of bench/fp32_parity.py's r3_update had routes for every position (docs/gpu.md)
            async_scheduling=False if self.is_moe else None,
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),   # engines/constraints.py's engine
            weight_transfer_config={"backend": "ipc"} if transfer == "ipc" else None, **adapter_args)
        if transfer == "ipc":
            # the CUDA IPC handles name a storage class, which vLLM's RPC encodes only by pickle; both ends of that
            # pickle are this process and the engine it started
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        exact = dtype == "float32" and torch.cuda.is_available()
        if exact:
            # fp32 on a GPU agrees with the trainer's fp32 recompute only with both of these (bench/fp32_parity.py
            # on an H200, 8,192 tokens at T 0.8: mean |diff| 1.9e-3 nats as vLLM comes, 4.7e-6 with both): vLLM's
            # fp32 attention (Triton) runs its dots in TF32 unless TRITON_F32_DEFAULT=ieee, in the engine process
            # this one spawns, with kernels of their own (Triton's cache does not key on the setting) ...
            os.environ["TRITON_F32_DEFAULT"] = "ieee"
            os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "f32-ieee"))
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True).start()
        self._llm = self._call(_build(AsyncLLM, args))
        self._call(self._llm.collective_rpc("tracerl_quiet_reload"))
        if exact:    # ... and its top-p is the exact sort, not the approximate kernel
            self._call(self._llm.collective_rpc("tracerl_exact_top_p"))
        if transfer == "ipc":
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
            self._call(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={})))

    def _call(self, coroutine):
        """Run a coroutine on the engine's loop from any other thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # -- the control plane used by the trainer and the async runtime --

    def pause(self) -> None:
        """Keep: stop sampling; requests in flight are kept (vLLM's pause mode "keep"), and every token sampled
        before the pause has been counted before this returns, so it keeps the old version. Drain: admit no new
        request (they wait for resume); those in flight run on to their end, so a weight update that follows (the
        runtime's push: pause every engine, update each, resume) finds them finished sooner."""
        with self._control:
            if not self._paused:
                self._call(self._close_admission() if self.drain_on_update else self._pause_and_drain())
                self._paused = True

    def resume(self) -> None:
        with self._control:
            if self._paused:
                self._call(self._resume())
                self._paused = False

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a full state dict from the actor and stamp `version` on every later token. Pauses unless already
        paused; then, draining, waits for the requests in flight to finish, or, keeping them, re-prefills them with
        the new weights. On a GPU the tensors go by CUDA IPC (a CPU tensor is copied to the engine's GPU first).
        `state` may use the trainer's names or the checkpoint's (checkpoint_state). An engine built with a LoRA
        spec takes the adapter's tensors alone (lora.adapter_state) and serves them as a new adapter instead."""
        if self.lora_spec is not None:
            self._load_adapter(state, version)
            return
        state = checkpoint_state(state, self.model_path)
        names = self.begin_weight_update(push_spec(state), version)
        if self.transfer == "ipc":
            send_ipc_weights({name: state[name].cuda() for name in names}, self.receive_weight_chunk)
        else:
            with self._control:
                self._send_rpc({name: state[name] for name in names})
        self.finish_weight_update(version)

    def _load_adapter(self, state: dict[str, torch.Tensor], version: int) -> None:
        """A LoRA push (the header): the adapter as a PEFT folder, registered with vLLM (loaded now, so an adapter
        that does not fit the model fails the push, not a later request), then current for every request that
        starts from here on; the requests in flight keep the adapter they started under."""
        from vllm.lora.request import LoRARequest
        if not lora.is_adapter_state(state):
            raise ValueError(f"this engine serves a LoRA adapter: a weight update must hold the adapter's tensors "
                             f"alone (lora.adapter_state), got keys such as {sorted(state)[:3]}")
        if version < self.version:
            raise ValueError(f"weight version must not go backwards: engine at {self.version}, got {version}")
        path = os.path.join(self._adapter_root, f"v{version}")
        shutil.rmtree(path, ignore_errors=True)
        lora.write_peft_folder(state, self.lora_spec, path)
        # vLLM's adapter ids start at 1 (0 is the base); a reloaded version (a rejoin) replaces its own adapter
        self._call(self._swap_adapter(version, LoRARequest(f"tracerl-v{version}", version + 1, path,
                                                           load_inplace=version in self._adapters)))

    async def _swap_adapter(self, version: int, request) -> None:
        await self._llm.add_lora(request)
        self._adapters[version] = request
        self.version = version      # on the loop: a request starts under one (version, adapter) pair, never a mix
        await self._drop_unused_adapters()

    async def _drop_unused_adapters(self) -> None:
        """Remove from vLLM, and from disk, every adapter that is neither current nor used by a request in flight."""
        in_use = {request.version_starts[0][0] for request in self._active.values()} | {self.version}
        for version in [v for v in self._adapters if v not in in_use]:
            await self._llm.remove_lora(self._adapters.pop(version).lora_int_id)
            shutil.rmtree(os.path.join(self._adapter_root, f"v{version}"), ignore_errors=True)

    # An update in three calls, so the trainer may sit in another process on the same GPU (the async runtime's
    # engine actor): begin, then the trainer's send_ipc_weights hands each chunk's CUDA IPC handles to
    # receive_weight_chunk, then finish. An update that fails between begin and finish leaves the engine paused
    # with some weights new: the caller takes it out of rotation (router.Router does) rather than sample with it.

    def begin_weight_update(self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]], version: int) -> list[str]:
        """Check the push whole before any tensor moves (a push is all or nothing: vLLM loads layer by layer, so a
        fault found while loading would leave some layers new): `spec` (push_spec, under the checkpoint's names:
        checkpoint_state) must cover the engine's checkpoint, name nothing else, and give each tensor the
        checkpoint's shape and kind (floating point where it is: vLLM casts to the dtype it serves, as it cast the
        checkpoint). Then pause (draining: and wait for the requests in flight to finish), and open vLLM's weight
        update. Returns the names to send (a tied head is the embedding: the checkpoint has no copy of it)."""
        if version < self.version:
            raise ValueError(f"weight version must not go backwards: engine at {self.version}, got {version}")
        names = [name for name in spec if not (self._tied and name == "lm_head.weight")]
        missing = sorted(self._checkpoint.keys() - set(names))
        unexpected = sorted(set(names) - self._checkpoint.keys())
        unfit = [f"{name}: {spec[name][0]} {spec[name][1]}, not {self._checkpoint[name][0]}" for name in names
                 if name in self._checkpoint and (spec[name][0], spec[name][1].is_floating_point) !=
                 self._checkpoint[name]]
        if missing or unexpected or unfit:
            raise ValueError(f"weight update does not match the engine's checkpoint, so nothing of it was loaded: "
                             f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, tensors of another shape "
                             f"or kind {unfit[:5]}")
        self._resume_after_update = not self._paused
        self.pause()
        with self._control:
            if self.drain_on_update:
                self._call(self._drain())
            if self.transfer == "ipc":
                self._call(self._llm.start_weight_update())
        return names

    def receive_weight_chunk(self, update_info: dict) -> None:
        """One chunk of CUDA IPC handles from send_ipc_weights: vLLM's workers map the trainer's tensors and load
        them (layerwise reload), with no copy through the host."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        self._call(self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, version: int) -> None:
        """Close the update, re-prefill kept requests with the new weights (there are none after a drain), stamp
        `version`, resume."""
        with self._control:
            if self.transfer == "ipc":
                self._call(self._llm.finish_weight_update())
            # kept requests lose their KV blocks and are recomputed by the new weights when they resume
            self._call(self._llm.reset_prefix_cache(reset_running_requests=self.reprefill_on_update))
            self._call(self._mark_version(version))
        if self._resume_after_update:
            self.resume()

    def sleep(self) -> None:
        """Free the GPU for the actor: weights to host memory, KV cache discarded (vLLM sleep level 1; needs
        `sleep_mode=True`). Called between steps, when no request is in flight."""
        self._call(self._llm.sleep(level=1))

    def wake_up(self) -> None:
        self._call(self._llm.wake_up())

    def counters(self) -> dict[str, int]:
        """What the engine holds now and has served so far, for watching it across steps (bench/vllm_steps.py):
        requests in flight here and in vLLM's client (both 0 between steps, or a request's state leaked), tasks on
        the engine's loop, and the prompt tokens vLLM served from its prefix cache rather than computed."""
        async def count() -> dict[str, int]:
            return {"active_requests": len(self._active),
                    "vllm_request_states": len(self._llm.output_processor.request_states),
                    "loop_tasks": len(asyncio.all_tasks()) - 1,        # less this one
                    **self._served}
        return self._call(count())

    def sampler_state(self) -> None:
        """None: vLLM's own random stream cannot be saved, so a run resumed with this engine draws fresh tokens
        (its weights, optimizer and step are still exact). Giving every request a seed would make it savable, but
        vLLM samples seeded requests one by one (a per-request generator each), which costs throughput."""
        return None

    def load_sampler_state(self, state) -> None:
        if state is not None:
            raise ValueError("this checkpoint holds an embedded engine's sampler stream; vLLM cannot take it: resume "
                             "with --rollout.engine embedded, or start the vLLM run from the checkpoint's weights")

    def shutdown(self) -> None:
        # vLLM stops its engine processes before it cancels its client's output task, which then logs the engine's
        # exit as a failure (EngineDeadError): cancel that task first
        self._call(self._stop_output_handler())
        # SIGTERM, then up to ENGINE_EXIT_S for the engine core to end itself (it returns as soon as it has): past
        # vLLM's default 5 s it was killed midway through its teardown
        self._llm.shutdown(timeout=ENGINE_EXIT_S)
        del self._llm           # its finaliser shuts down again: let it run now, not at interpreter exit
        # a task vLLM's client leaves on the loop (its engine-core output queue, after a run that ended on an
        # error) would be destroyed pending at exit, with asyncio's error log: cancel and await what is left
        self._call(self._cancel_pending())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)

    @staticmethod
    async def _cancel_pending() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_output_handler(self) -> None:
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler

    # -- moving weights --

    def _send_rpc(self, state: dict[str, torch.Tensor]) -> None:
        """A state dict through collective_rpc (a CPU engine). Sent as bytes, because vLLM's RPC re-pickles what it
        received and a tensor arrives there as an unpicklable memoryview."""
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, buffer)
        self._call(self._llm.collective_rpc("tracerl_load_weights", args=(buffer.getvalue(),)))

    # -- the data plane --

    def check(self, params: SamplingParams) -> None:
        """Refuse sampling parameters this engine cannot honour (ValueError saying why)."""
        validate_sampling(params, self.vocab_size)

    def check_images(self, prompt: list[int], images: Sequence[invariants.ImageInput]) -> None:
        """Refuse images this engine cannot place (ValueError saying why), as rollout.EmbeddedEngine does: any
        image on a text-only model, or images that do not fill a VLM prompt's pad runs one to one; and an image
        without its source (vLLM runs its own processor: data.image_inputs keeps the resized copy it needs)."""
        if not self.is_vision:
            if images:
                raise ValueError(f"this engine serves a text-only model, which cannot see the {len(images)} images "
                                 f"it was given; serve a vision-language model or leave the images out of the prompt")
            return
        invariants.check_image_pads(prompt, images, self._image_pad, "prompt")
        if any(image.source is None for image in images):
            raise ValueError("the vLLM engine runs the model's image processor itself and needs each image's "
                             "source: make ImageInputs with data.image_inputs")

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 images: list[Sequence[invariants.ImageInput]] | None = None) -> list[Generation]:
        """Sample a completion for every prompt (see rollout.EmbeddedEngine.generate: same arguments, same
        results). `on_token(index, token_id)` runs on the engine's loop as tokens arrive."""
        params_list, images_list = per_prompt(len(prompts), params, images)
        requests = []
        for index, (prompt, p, row_images) in enumerate(zip(prompts, params_list, images_list)):
            self.check(p)
            if not prompt:
                raise ValueError("a prompt must hold at least one token id")
            self.check_images(prompt, row_images)
            listener = None if on_token is None else (lambda token_id, i=index: on_token(i, token_id))
            grammar = None
            if p.constraint is not None:    # bound to the ids the request ends on, as the embedded engine binds it
                from engines import constraints
                grammar = constraints.bind(p.constraint, sorted(p.stop_token_ids or self.eos_ids))
                if self._tokenizer is None:
                    self._tokenizer = transformers.AutoTokenizer.from_pretrained(self.model_path)
                constraints.matcher(grammar, self._tokenizer, self.vocab_size)   # one that cannot build fails here
            requests.append(_Request(list(prompt), p, listener, row_images,
                                     recorded_sampling(p, len(prompt), grammar), self._tokenizer))
        futures = [asyncio.run_coroutine_threadsafe(self._run(r), self._loop) for r in requests]
        errors = []
        for future in futures:
            try:
                future.result()
            except Exception as e:      # noqa: BLE001 - each request's error is its own; raised below, first first
                errors.append(e)
        if errors:
            raise errors[0]
        return [r.generation() for r in requests]

    async def _run(self, request: _Request) -> None:
        from vllm.inputs import TokensPrompt
        request_id = uuid.uuid4().hex
        while not self._admitting.is_set():   # a draining update: start after it, at its version
            await self._admitting.wait()
        # the salt enters the hash of the prompt's first KV block, so a request reuses only blocks written under the
        # same salt: within one weight version only (the update's cache reset cannot drop the blocks of requests it
        # keeps on their old KV cache, reprefill_on_update=False), and by engines/prefix_cache.py's rule: under the
        # rollout's own salt, or, for a prompt exactly as the trainer gave it to the group, under the group's. vLLM
        # keys a request's every block under one salt, so a given prompt's reply is written under the group's salt
        # too, yet no sibling can reach it (a request under that salt holds the given prompt and nothing more, and a
        # block matches only if all its ids do); the price is the rollout's next turn, which starts its own salt's
        # chain and computes the first turn's prompt and reply once more
        p = request.params
        salt = f"v{self.version}:{p.given_salt or p.cache_salt}"
        prompt = TokensPrompt(prompt_token_ids=request.prompt_ids, cache_salt=salt)
        if request.images:      # vLLM expands each image's single pad to the image's run itself
            prompt.update(prompt_token_ids=_collapse_pad_runs(request.prompt_ids, self._image_pad),
                          multi_modal_data={"image": [image.source for image in request.images]})
        # registered before it reaches vLLM, so an update that runs meanwhile marks it (at 0 tokens) too; under LoRA
        # the request is sampled whole by the adapter of this version (None at a version no adapter was pushed for:
        # the base, which an adapter equals at its start, B = 0)
        request.version_starts.append((self.version, 0))
        adapter = self._adapters.get(self.version)
        self._active[request_id] = request
        try:
            try:
                queue = await self._llm.add_request(request_id, prompt, _vllm_params(request), lora_request=adapter)
            except _client_errors() as e:  # the request's own bad input (an out-of-vocab stop id, too long a prompt)
                raise ValueError(str(e)) from e
            while not request.finished:
                request.take(queue.get_nowait() or await queue.get())
            self._served["requests"] += 1
            self._served["prompt_tokens"] += len(request.prompt_ids)
            self._served["cached_prompt_tokens"] += request.cached_tokens
        except BaseException:
            await self._llm.abort(request_id)
            raise
        finally:
            self._active.pop(request_id, None)
            if not self._active:
                self._drained.set()
            if self.lora_spec is not None and len(self._adapters) > 1:
                await self._drop_unused_adapters()

    async def _close_admission(self) -> None:
        self._admitting.clear()

    async def _resume(self) -> None:
        """Undo either pause: vLLM's scheduler runs again (if it was paused) and new requests start."""
        if self._generation_paused:
            await self._llm.resume_generation()
            self._generation_paused = False
        self._admitting.set()

    async def _drain(self) -> None:
        """With admission closed: wait until every request in flight has finished."""
        while self._active:
            self._drained.clear()
            await self._drained.wait()

    async def _pause_and_drain(self) -> None:
        """Pause with requests kept, then wait until every token sampled before the pause has been counted by
        vLLM's client. vLLM answers the pause once the engine is idle, on the same socket as the outputs, so those
        outputs are already queued in the client, but the client processes them on its own task, later. An empty
        marker put behind them is taken only after every output before it was processed."""
        from vllm.v1.engine import EngineCoreOutputs
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        self._generation_paused = True
        outputs = self._llm.engine_core.outputs_queue
        marker = EngineCoreOutputs()
        outputs.put_nowait(marker)
        while any(item is marker for item in outputs._queue):
            await asyncio.sleep(0)

    async def _mark_version(self, version: int) -> None:
        """While paused and drained: every request in flight gets its next tokens at `version`, from the count of
        tokens vLLM's client has processed for it (exactly those sampled before the pause)."""
        # vLLM keys its states by an internal id (ours plus a suffix); each state keeps ours as external_req_id
        states = {state.external_req_id: state for state in self._llm.output_processor.request_states.values()}
        for request_id, request in self._active.items():
            state = states.get(request_id)
            request.version_starts.append((version, state.detokenizer.num_output_tokens() if state else 0))
        self.version = version      # here, on the loop, so no request can start between the marks and the bump


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request's own bad input: ValueError up to 0.26, its VLLMClientError since."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def _build(engine_class, args):
    async def build():
        return engine_class.from_engine_args(args)
    return build()


class _Request:
    """One prompt in flight: what it asked for and what has come back. Versions are kept as (version, index of
    the first token at that version) starts, appended at each weight update, so a request that is not streamed
    can take vLLM's final output alone (per-step outputs cost throughput) and still version every token."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, listener: Callable[[int], None] | None,
                 images: Sequence[invariants.ImageInput], sampling: invariants.Sampling, tokenizer=None):
        self.prompt_ids, self.params, self.listener, self.images = prompt_ids, params, listener, list(images)
        self.sampling, self.tokenizer = sampling, tokenizer   # what every token is drawn at; a grammar's tokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.version_starts: list[tuple[int, int]] = []
        self.finished = False
        self.finish_reason = "length"
        self.stop_string: str | None = None
        self.routes: np.ndarray | None = None
        self.cached_tokens = 0                      # prompt tokens vLLM took from its prefix cache

    def take(self, output) -> None:
        """Append the new tokens of one output (vLLM's RequestOutput: a delta when streamed, else the final one)."""
        if self.images and output.prompt_token_ids is not None and list(output.prompt_token_ids) != self.prompt_ids:
            # vLLM's processor gave an image another number of tokens than the trainer's processor did: its
            # features and M-RoPE positions would sit elsewhere than where the trainer puts them (invariant 3)
            raise ValueError(f"vLLM expanded the image pads of this prompt to {len(output.prompt_token_ids)} ids, "
                             f"not the {len(self.prompt_ids)} the trainer's image processor made; the engine's "
                             f"checkpoint must hold the same image processor as the trainer's")
        completion = output.outputs[0]
        flat, k = completion.logprobs, self.params.top_logprobs   # vLLM's FlatLogprobs (see _vllm_params)
        for j, token in enumerate(completion.token_ids):
            first, end = flat.start_indices[j], flat.end_indices[j]   # the sampled token's entry, then the top k
            self.token_ids.append(token)
            self.logprobs.append(float(flat.logprobs[first]))
            if k:
                best = sorted((flat.ranks[i], flat.token_ids[i], flat.logprobs[i]) for i in range(first + 1, end)
                              if flat.ranks[i] is not None and flat.ranks[i] <= k)
                self.top.append([(t, float(lp)) for _, t, lp in best][:k])
            if self.listener is not None:
                self.listener(token)
        if getattr(completion, "routed_experts", None) is not None:
            self.routes = np.asarray(completion.routed_experts, dtype=np.int16)
        if output.finished:
            self.cached_tokens = output.num_cached_tokens or 0
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended the request with {completion.finish_reason!r}")
            self.finish_reason = completion.finish_reason
            self.stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
            self.finished = True

    def versions(self) -> list[int]:
        """The version of every token: the latest start at or before its index (a later mark at the same index
        wins: no token was sampled between those two updates). One run per mark, not a search per token: this
        runs on the engine's loop for every token of a batch as it finishes."""
        n = len(self.token_ids)
        marks = sorted((start, k, v) for k, (v, start) in enumerate(self.version_starts))
        versions = []
        for (start, _, version), (end, _, _) in zip(marks, marks[1:] + [(n, 0, 0)]):
            versions += [version] * (min(end, n) - min(start, n))
        return versions

    def generation(self) -> Generation:
        p = self.params
        routes, forwarded = None, len(self.prompt_ids) + len(self.token_ids) - 1   # positions 0 .. forwarded-1
        if self.routes is not None and len(self.routes) >= forwarded:
            routes = self.routes[:forwarded]    # else vLLM reported routes for some positions only: as none
        return Generation(self.prompt_ids, self.token_ids, self.logprobs, self.versions(), routes,
                          self.finish_reason, self.stop_string, self.top if p.top_logprobs else None, self.sampling,
                          self.cached_tokens)


def _collapse_pad_runs(token_ids: list[int], pad_id: int) -> list[int]:
    """Each run of image pad ids -> one pad id (the inverse of data.expand_image_pads)."""
    return [t for i, t in enumerate(token_ids) if not (t == pad_id and i > 0 and token_ids[i - 1] == pad_id)]


def _vllm_params(request: _Request):
    """tracerl's SamplingParams -> vLLM's, with the same meaning: stop ids replace the model's eos ids (and are
    kept), as ignore_eos drops them; the tokens that wrote a stop string are kept; the sampled token's processed
    logprob is always returned. min_p, the logit bias and the three penalties go in as themselves: vLLM's sampler
    applies them in the order processing.adjust_logits and processed_logprobs repeat (vLLM's prompt and output ids
    are the row before and after generation_start). vLLM clamps a bias to [-100, 100], so a ban (-inf) goes in as -100: its probability,
    e^-100 against the rest, is below what an fp32 logprob resolves, and the trainer's -inf agrees (tested). A
    grammar goes in as constraints.lark_grammar, the text the embedded engine and the replay build their matchers
    from, with its stop ids as the request's (so it ends where the grammar does). Logprobs come flat (a few lists
    per request, not a dict and a Logprob per token: vLLM's client runs in this process, and 256 x 512 tokens of
    those kept Python's collector busy for seconds a step)."""
    from engines import constraints
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    p, grammar = request.params, request.sampling.constraint
    stop_ids = json.loads(grammar)["stop"] if grammar is not None else list(p.stop_token_ids)
    return VLLMSamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1, max_tokens=p.max_tokens,
        stop_token_ids=stop_ids or None, ignore_eos=bool(stop_ids) or p.ignore_eos, stop=list(p.stop) or None,
        structured_outputs=None if grammar is None else
        StructuredOutputsParams(grammar=constraints.lark_grammar(grammar, request.tokenizer)),
        include_stop_str_in_output=True, seed=p.seed, logprobs=p.top_logprobs,
        min_p=p.min_p, logit_bias={t: max(b, -100.0) for t, b in p.logit_bias} or None,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        output_kind=RequestOutputKind.DELTA if request.listener else RequestOutputKind.FINAL_ONLY,
        detokenize=bool(p.stop), flat_logprobs=True)


def _checkpoint_tensors(model_path: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """The tensors of the checkpoint the engine loaded, what a full weight update must send: name -> (shape, whether
    floating point), read from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open
    index = os.path.join(model_path, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        with safe_open(os.path.join(model_path, file), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                tensors[name] = (tuple(piece.get_shape()), piece.get_dtype().startswith(("F", "BF")))
    return tensors


def push_spec(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What begin_weight_update checks a push by, before any tensor moves: each name's shape and dtype."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
