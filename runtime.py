# runtime.py — the async runtime: engines in their own processes (Ray actors), rollouts that stream to the
# trainer while it trains, and weight updates that land in the middle of requests (an MoE model's: once they end).
#
# Owns: `RuntimeConfig` (--runtime.*), starting and stopping Ray (`connect`, `start`, `stop`), `EngineActor` (one
# engine in a Ray actor; tokens streamed back as sampled when the caller listens) and `EngineProxy` (the engine
# interface in the driver, so router.Router places requests, fails over and fans out the control plane as it does
# for local engines), the weights' way to an engine actor (CUDA IPC on the trainer's GPU, else the engine's
# weight_channel.WeightChannel: a two-rank NCCL or gloo group, dtype-faithful buckets), `TrainerGroup` (the actor
# as FSDP2 ranks in Ray actors; with `CriticGroup`, gae's critic shards beside them), `RolloutPool` (prompt groups in flight, admitted by AReaL's capacity rule so that
# no rollout is trained more than eta policy steps after it started), `Runtime.push_weights` (pause, move, bump the
# version, resume) and the runtime's metrics (engine idle fraction, queue depth, staleness histogram, weight-sync
# seconds and bytes; tokens/s per engine and retried/failed requests are the router's). An engine actor or trainer
# rank on a CPU first runs cpu_setup.prepare_cpu_process, as train.py does.
#
# Placement (one machine by default; a cluster under launch.sh): each engine is one Ray actor with
# --runtime.engine_cpus / --runtime.engine_gpus; the trainer is the driver process itself, or, with
# --runtime.trainer_ranks N, N FSDP2 ranks each in a Ray actor (`TrainerGroup`: torch.distributed over gloo or NCCL,
# ranks placed by a Ray placement group on one node or across several and meeting at rank 0's node, each step's
# rollouts dealt between them whole), with the same interface, so the loop in train.py reads as before; agent
# runners are threads of the driver (an episode mostly waits on its engine, and an env step is ordinary Python the
# recipe wrote), or, with --runtime.runners N, N Ray actors (`RunnerActor`) for environments that work the CPU.
#
# Keeps invariant 2 across processes: an engine stamps every token with the version of the weights that drew
# it, and a weight update pauses the engines, loads, bumps the version and resumes; what becomes of the requests
# in flight is each engine's `drain_on_update` policy (rollout.py, engines/vllm_engine.py). Keep, a dense model's default:
# the engines stop between decode steps with their requests kept, so a request that spans the update reads
# [v]*n1 + [v+1]*n2 and its KV cache is re-prefilled by the new weights. Drain, an MoE model's default: the engines
# admit no new request (it waits, then starts at v+1) and load only once the requests in flight have finished at v,
# so every request has one version and the routes it was drawn under, and the push lasts as long as the longest of
# them; a rollout of several turns may still have turns at v and turns at v+1.
# Staleness is bounded by admission, never by discarding finished work: a group is started only while
# (eta + V + 1) * B - (accepted + running) > 0, and groups reach the trainer in admission order.
# Never: computes rewards, builds training rows or trains; never re-stamps a token's version.
from __future__ import annotations

import math
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import algo
import invariants
import models
from agents import load_recipe
from engines import Generation, SamplingParams, per_prompt, validate_sampling
from engines.vllm_engine import VLLMEngine
from engines.weight_channel import WeightChannel, WeightPush, free_port, gpu_uuid, open_group, receive_state
from rollout import EmbeddedEngine
from router import Router
from trainer import cpu_setup, lora

ROOT = os.path.dirname(os.path.abspath(__file__))
MODES = ("sync", "ray")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")    # Ray's placement group strategies


# ---- config ---------------------------------------------------------------------------------------------

@dataclass
class RuntimeConfig:
    mode: str = "sync"          # sync: one process, roll out then train; ray: engines in Ray actors, rollouts stream
    eta: int = 1                # ray: in RL steps (batches), most from a rollout's start to its training (AReaL's eta)
    engines: int = 1            # ray: engine actors behind the router
    engine_cpus: float = 1.0    # CPUs per engine actor (its torch threads)
    engine_gpus: float = 0.0    # GPUs per engine actor (0 = the engine runs on CPU)
    address: str = ""           # a running Ray cluster to join (launch.sh cluster starts one); "" = start Ray here
    object_store_mb: int = 0    # object store of a Ray started here, MiB (0 = Ray's default); rollouts pass through it
    trainer_ranks: int = 1      # ray: FSDP2 ranks of the actor, each a Ray actor on any node (1 = the driver trains)
    trainer_gpus: float = 0.0   # GPUs per trainer rank (0 = gloo on CPUs)
    trainer_placement: str = "PACK"   # Ray placement of the ranks: PACK = one node if they fit, else fewest nodes
    runners: int = 0            # ray: agent runners as Ray actors (0 = threads of the driver)
    runner_cpus: float = 1.0    # CPUs per runner actor (its environments' and tools' work)


def validate_runtime(cfg: RuntimeConfig, correction, minibatches: int) -> None:
    """Refuse runtime settings that would hang or train silently wrong (ValueError saying why)."""
    if cfg.mode not in MODES:
        raise ValueError(f"runtime.mode {cfg.mode!r} unknown; use one of {MODES}")
    if cfg.runners < 0 or cfg.runner_cpus <= 0 or (cfg.runners and cfg.mode != "ray"):
        raise ValueError(f"runtime: runners >= 0 (runner actors only with --runtime.mode ray) and runner_cpus > 0 are "
                         f"required; got {cfg.runners}, {cfg.runner_cpus} in mode {cfg.mode!r}")
    if cfg.eta < 0 or cfg.engines < 1 or cfg.engine_cpus <= 0 or cfg.engine_gpus < 0 or cfg.object_store_mb < 0:
        raise ValueError(f"runtime: eta >= 0, engines >= 1, engine_cpus > 0, engine_gpus >= 0 and object_store_mb "
                         f">= 0 are required; got {cfg.eta}, {cfg.engines}, {cfg.engine_cpus}, {cfg.engine_gpus}, "
                         f"{cfg.object_store_mb}")
    if cfg.trainer_ranks < 1 or cfg.trainer_gpus < 0 or (cfg.trainer_ranks > 1 and cfg.mode != "ray"):
        raise ValueError(f"runtime: trainer_ranks >= 1 (more than 1 only with --runtime.mode ray) and trainer_gpus "
                         f">= 0 are required; got {cfg.trainer_ranks}, {cfg.trainer_gpus} in mode {cfg.mode!r}")
    if cfg.trainer_placement not in PLACEMENTS:
        raise ValueError(f"runtime.trainer_placement {cfg.trainer_placement!r} unknown; use one of {PLACEMENTS}")
    if cfg.mode != "ray" or cfg.eta == 0:
        return
    if correction.level == "off":
        raise ValueError(f"runtime.eta={cfg.eta} trains tokens drawn by older weights: set --correction.level token "
                         f"(or seq, geo) so each token is weighted by pi_prox / mu of its own version")
    # a policy step is `minibatches` optimizer steps, and versions count optimizer steps
    if correction.max_staleness < cfg.eta * minibatches:
        raise ValueError(f"runtime.eta={cfg.eta} admits rollouts up to {cfg.eta} policy steps = "
                         f"{cfg.eta * minibatches} versions old, but correction.max_staleness="
                         f"{correction.max_staleness} would drop them after they were sampled; set "
                         f"--correction.max_staleness {cfg.eta * minibatches}")


# ---- an engine in its own process -----------------------------------------------------------------------

def embedded_engine(model_path: str, seed: int, threads: int, adapter: lora.LoraSpec | None = None) -> EmbeddedEngine:
    """The engine an EngineActor serves by default: the embedded engine on the GPU Ray gave the actor, else CPU;
    serving a LoRA adapter over the frozen base where the actor trains one."""
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"    # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs
    if device == "cpu":
        cpu_setup.prepare_cpu_process()
    model = models.load_model(model_path)
    if adapter is not None:
        lora.add_lora(model, adapter)
    return EmbeddedEngine(model.to(device), seed=seed, tokenizer=models.load_tokenizer(model_path))


def vllm_engine(model_path: str, seed: int, threads: int, max_model_len: int, memory: float,
                adapter: lora.LoraSpec | None = None) -> VLLMEngine:
    """A vLLM engine in an EngineActor: bf16 on the actor's GPU, the exact fp32 mode on a CPU (vLLM's CPU build).
    On a GPU its weights arrive by CUDA IPC from a trainer on the same GPU, or over its weight channel and then by
    CUDA IPC inside this process; on a CPU, over the channel and then by collective_rpc (engines/vllm_engine.py)."""
    torch.set_num_threads(threads)
    on_gpu = torch.cuda.is_available()
    return VLLMEngine(model_path, seed=seed, dtype="bfloat16" if on_gpu else "float32",
                      transfer="ipc" if on_gpu else "rpc",
                      max_model_len=max_model_len, gpu_memory_utilization=memory, enforce_eager=not on_gpu,
                      lora_spec=adapter)


# Generation requests and control calls run in separate thread pools of the actor: a weight update must never
# queue behind the requests it is meant to pause.
@ray.remote(concurrency_groups={"data": 256, "control": 4})
class EngineActor:
    """One engine, built by `build(*args)` in this process."""

    def __init__(self, build: Callable, *args):
        self.engine = build(*args)
        self.channel, self.channel_device = None, "cpu"     # the weight channel, once the trainer opens it
        self._cancelled: set[str] = set()    # streamed requests whose caller stopped listening (cancel)
        # the engine's busy clock: seconds with at least one request in flight, whichever process sent it
        self._clock = threading.Lock()
        self._in_flight, self._busy_s, self._busy_since = 0, 0.0, 0.0

    @ray.method(concurrency_group="data", num_returns="streaming")
    def generate(self, prompts: list[list[int]], params: list[SamplingParams], images: list, stream: str | None):
        """With `stream` (the request's id), yields ("tokens", [(row, token_id), ...]) as tokens are sampled
        (whatever accumulated since the last yield, so a fast engine costs one message per batch of tokens, not per
        token), then ("done", generations); without, only ("done", generations), and the engine gets no listener
        (per-step outputs cost a vLLM engine throughput). The engine's own error (a ValueError for a bad request) is
        raised to the caller as it is."""
        with self._clock:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1
        try:
            yield from self._generate(prompts, params, images, stream)
        finally:
            self._cancelled.discard(stream)
            with self._clock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy_s += time.monotonic() - self._busy_since

    @ray.method(concurrency_group="control")
    def cancel(self, request_id: str) -> None:
        """Stop sampling the streamed request `request_id`: its caller stopped listening (a client that hung up).
        Its listener raises at the next token, which fails that request alone on either engine (the embedded one
        drops its rows, vLLM aborts it), as it does for a caller in this process."""
        self._cancelled.add(request_id)

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams], images: list, stream: str | None):
        if not stream:
            yield "done", self.engine.generate(prompts, params, images=images)
            return
        sampled: queue.SimpleQueue = queue.SimpleQueue()
        result: dict = {}

        def listen(row: int, token_id: int) -> None:
            if stream in self._cancelled:
                raise RequestCancelled(f"request {stream}: its caller stopped listening")
            sampled.put((row, token_id))

        def work() -> None:
            try:
                result["outs"] = self.engine.generate(prompts, params, on_token=listen, images=images)
            except BaseException as error:
                result["error"] = error
            finally:
                sampled.put(None)
        threading.Thread(target=work, daemon=True, name="engine-request").start()
        finished = False
        while not finished:
            tokens = [sampled.get()]
            while not sampled.empty():
                tokens.append(sampled.get())
            finished = tokens[-1] is None
            tokens = [t for t in tokens if t is not None]
            if tokens:
                yield "tokens", tokens
        if "error" in result:
            raise result["error"]
        yield "done", result["outs"]

    @ray.method(concurrency_group="control")
    def control(self, method: str, *args):
        """The engine's `method` (pause, resume, update_weights, the CUDA IPC update's three calls, check_images,
        sampler_state, load_sampler_state): a top-level ObjectRef among `args` arrives here as the value itself."""
        return getattr(self.engine, method)(*args)

    @ray.method(concurrency_group="control")
    def placement(self) -> tuple[str | None, str | None, int]:
        """(the GPU this actor holds, or None; the checkpoint of its engine if that takes CUDA IPC updates (a vLLM
        engine on the GPU), else None; the most positions its engine serves, prompt and reply)."""
        gpu = gpu_uuid(torch.cuda.current_device()) if torch.cuda.is_available() else None
        takes_ipc = isinstance(self.engine, VLLMEngine) and self.engine.transfer == "ipc"
        return gpu, self.engine.model_path if takes_ipc else None, self.engine.max_model_len

    @ray.method(concurrency_group="control")
    def open_weight_channel(self, address: str, port: int, backend: str, timeout_s: float) -> None:
        self.channel = open_group(address, port, 1, backend, timeout_s)
        self.channel_device = "cuda" if backend == "nccl" else "cpu"

    @ray.method(concurrency_group="control")
    def receive_weights(self, plan: list[list[tuple]], version: int) -> None:
        """The engine's end of WeightChannel.send; the engine's update_weights checks the names against its
        checkpoint."""
        self.engine.update_weights(receive_state(self.channel, plan, self.channel_device), version)

    @ray.method(concurrency_group="control")
    def busy_seconds(self) -> float:
        with self._clock:
            return self._busy_s + (time.monotonic() - self._busy_since if self._in_flight else 0.0)

    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        """Stop the engine's own processes (vLLM's engine core) before Ray kills this actor."""
        if isinstance(self.engine, VLLMEngine):
            self.engine.shutdown()


class EngineDied(RuntimeError):
    """The engine's process is gone. An engine-level error: router.Router takes the engine out of rotation and
    retries its requests on a live one (or counts them as lost)."""


class RequestCancelled(Exception):
    """A streamed request whose caller stopped listening: raised by its listener in the engine's process."""


class EngineProxy:
    """The engine interface (rollout.EmbeddedEngine's) in the driver, for one EngineActor, so router.Router and the
    agent runners use engines in other processes as they use local ones. When the caller passes `on_token`, tokens
    stream back as they are sampled (it hears them live, as loopback's streaming needs); otherwise only the result.
    Failover is the router's: a dead actor raises EngineDied on every call."""

    def __init__(self, index: int, handle, version: int):
        self.index, self.handle = index, handle
        self.version = version         # kept here, so reading it costs no round trip
        self.gpu_uuid, self.model_path, self.max_model_len = ray.get(handle.placement.remote())
        self.takes_ipc = self.model_path is not None
        self.channel: WeightChannel | None = None       # opened at the first update that is not CUDA IPC
        self.dead = False

    def _died(self, error: ray.exceptions.RayActorError) -> EngineDied:
        """Mark the engine dead; the error in one line (Ray's message spans many: its first says what happened, its
        last why), as the router's logs, stats and a checkpoint's missing-stream note quote it."""
        self.dead = True
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return EngineDied(f"engine {self.index}'s process died: " + " ".join(dict.fromkeys(lines[:1] + lines[-1:])))

    def _call(self, method: str, *args):
        """The engine's `method` in its actor (EngineActor.control)."""
        if self.dead:
            raise EngineDied(f"engine {self.index}'s process died earlier")
        try:
            return ray.get(self.handle.control.remote(method, *args))
        except ray.exceptions.RayActorError as error:
            raise self._died(error) from None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None,
                 images: list[Sequence] | None = None) -> list[Generation]:
        if self.dead:
            raise EngineDied(f"engine {self.index}'s process died earlier")
        request_id = uuid.uuid4().hex if on_token is not None else None
        stream = self.handle.generate.remote(prompts, *per_prompt(len(prompts), params, images), request_id)
        try:
            for ref in stream:
                kind, payload = ray.get(ref)
                if kind == "done":
                    return payload
                try:
                    for row, token_id in payload:      # "tokens" come only when asked for, so on_token is set
                        on_token(row, token_id)
                except BaseException:
                    # the caller stopped listening (a client hung up): the engine stops sampling for it, as an
                    # engine in this process does when its listener raises
                    self.handle.cancel.remote(request_id)
                    raise
        except ray.exceptions.RayActorError as error:
            raise self._died(error) from None
        finally:
            del stream                 # a caller's listener that raised leaves the rest of the stream unread
        raise EngineDied(f"engine {self.index} ended a request without its result")

    def check(self, params: SamplingParams) -> None:
        validate_sampling(params)      # every engine actor has a tokenizer, so stop strings are always served

    def check_images(self, prompt: list[int], images: Sequence) -> None:
        self._call("check_images", prompt, list(images))

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def update_weights(self, state, version: int) -> None:
        """`state` is a state dict (sent as a call argument, through Ray's object store) or, from
        Runtime.push_weights, a WeightPush: CUDA IPC when the trainer's tensors sit on this engine's GPU, else the
        engine's weight channel (NCCL from another GPU, gloo from a CPU)."""
        if not isinstance(state, WeightPush):
            self._call("update_weights", state, version)
        elif self.takes_ipc and state.gpu_uuid == self.gpu_uuid:
            from engines.vllm_engine import checkpoint_state, push_spec, send_ipc_weights
            tensors = checkpoint_state(state.tensors, self.model_path)     # the names vLLM's checkpoint uses
            names = self._call("begin_weight_update", push_spec(tensors), version)   # checked whole first
            send_ipc_weights({name: tensors[name] for name in names},
                             lambda update_info: self._call("receive_weight_chunk", update_info))
            self._call("finish_weight_update", version)
        else:
            try:
                if self.channel is None:
                    both_gpus = state.gpu_uuid is not None and self.gpu_uuid not in (None, state.gpu_uuid)
                    self.channel = WeightChannel(self.handle, "nccl" if both_gpus else "gloo")
                self.channel.send(self.handle, state.tensors, version)
            except ray.exceptions.RayActorError as error:
                raise self._died(error) from None
            except Exception:
                self.channel = None         # a broken channel is not reused: the next update opens a new one
                raise
        self.version = version

    def sampler_state(self):
        return self._call("sampler_state")

    def load_sampler_state(self, state) -> None:
        self._call("load_sampler_state", state)


# ---- the trainer as FSDP2 ranks, each a Ray actor ------------------------------------------------------------

@ray.remote
class TrainerRank:
    """One rank of the policy: actor.Actor under torch.distributed (NCCL on GPUs, gloo on CPUs), holding its FSDP2
    shard. Made in two steps, `locate` then `join`, because the ranks meet at rank 0's node, which is known only
    once Ray has placed rank 0. Every call after `join` is collective: the TrainerGroup makes it on all ranks."""

    def __init__(self, threads: int):
        torch.set_num_threads(threads)
        if not torch.cuda.is_available():
            cpu_setup.prepare_cpu_process()

    def locate(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, a port free on this node): rank 0's IP and port are where every rank meets."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), free_port()

    def join(self, rank: int, world_size: int, master_ip: str, master_port: int, socket_env: dict[str, str],
             model_path: str, cfg, total_steps: int, seed: int, critic_cfg=None) -> None:
        import torch.distributed as dist

        import actor
        import critic
        # An interface named on this node (its `ray start` environment) wins over the driver's. Named nowhere,
        # gloo binds the address this host's name resolves to (loopback when it resolves to none), which serves
        # one machine; across hosts that may be a loopback alias, and only the user knows which interface the
        # nodes share, so none is guessed here.
        for name, value in socket_env.items():
            os.environ.setdefault(name, value)
        os.environ.update(MASTER_ADDR=master_ip, MASTER_PORT=str(master_port))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)
        self.policy = actor.Actor(model_path, cfg, total_steps=total_steps, seed=seed)
        # gae: the critic's shard beside the actor's, over the same process group (critic.Critic)
        self.critic = critic.Critic(model_path, cfg, critic_cfg, total_steps, seed) if critic_cfg else None

    def call(self, method: str, *args, critic: bool = False, **kwargs):
        """The policy's `method` on this rank, or with `critic` the critic's."""
        return getattr(self.critic if critic else self.policy, method)(*args, **kwargs)

    def version(self) -> int:
        return self.policy.version

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective (every rank gathers the full tensors); only rank 0 sends them back, once."""
        state = self.policy.export_weights("cpu")
        return state if self.policy.rank == 0 else None


class _Checkpoints:
    """A group's checkpoints: each rank saves or loads its part (`_all`: the actor's or the critic's method)."""

    def save_checkpoint(self, path: str, run_state: dict | None = None) -> None:
        self._all("save_checkpoint", path, run_state)

    def load_checkpoint(self, path: str) -> dict:
        return self._all("load_checkpoint", path)[0]


class TrainerGroup(_Checkpoints):
    """actor.Actor's interface over --runtime.trainer_ranks FSDP2 ranks, one Ray actor each, placed by a placement
    group (one bundle of `cpus` CPUs and `gpus` GPUs per rank; `placement` is its strategy: PACK uses one node when
    the ranks fit there and spreads over the fewest nodes when they do not). The ranks rendezvous at rank 0's node.
    A step's rows are dealt to the ranks by whole rollouts, balanced by tokens (a rollout's rows stay on one rank:
    its rollout-level terms, the gates, GSPO's ratio and the seq_mean aggregations, need them together; by whole
    groups where the loss weighs a token by its group's kept tokens, algo.GROUP_AGGREGATIONS); each rank
    trains its own rows and the loss's global denominators are all-reduced inside actor.train_step, so the step equals
    one process on the whole batch."""

    def __init__(self, ranks: int, model_path: str, cfg, total_steps: int, seed: int, cpus: float, gpus: float,
                 placement: str = "PACK", ready_timeout_s: float = 600.0, critic_cfg=None):
        from transformers import AutoConfig
        bundle = {"CPU": cpus, "GPU": gpus}
        self.placement = placement_group([bundle] * ranks, strategy=placement)
        try:       # a placement the cluster cannot hold would otherwise wait forever, silently
            ray.get(self.placement.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement)
            raise RuntimeError(
                f"runtime: {ranks} trainer ranks of {bundle} each (placement {placement}) were not placed within "
                f"{ready_timeout_s:.0f} s; the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free. Add nodes, lower --runtime.trainer_ranks or "
                f"--runtime.trainer_gpus, or relax --runtime.trainer_placement") from None

        def rank_actor(r: int):
            in_bundle = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r)
            return TrainerRank.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=in_bundle).remote(
                max(1, int(cpus)))
        socket_env = {name: os.environ[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                      if name in os.environ}
        # rank 0 first: the rendezvous (torch's TCPStore) listens on its node, whichever node Ray chose
        self.ranks = [rank_actor(0)]
        try:
            _, master_ip, master_port = ray.get(self.ranks[0].locate.remote())
            self.ranks += [rank_actor(r) for r in range(1, ranks)]
            ray.get([rank.join.remote(r, ranks, master_ip, master_port, socket_env, model_path, cfg, total_steps,
                                      seed, critic_cfg) for r, rank in enumerate(self.ranks)])
        except BaseException:           # a rank that failed to start must not keep the others' resources
            self.shutdown()
            raise
        self.model = SimpleNamespace(config=AutoConfig.from_pretrained(model_path))     # what train.py reads of the model
        self.device = torch.device("cpu")       # the driver holds no weights: exports come to it on the CPU

    @property
    def version(self) -> int:
        return ray.get(self.ranks[0].version.remote())

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([r.call.remote(method, *args, **kwargs) for r in self.ranks])

    def _deal(self, batch, whole_groups: bool = False) -> list[list[int]]:
        """Each rank's row indices: whole rollouts (whole groups), the next one to the rank with the fewest tokens so
        far."""
        tokens = batch.attention_mask.sum(-1).tolist()
        units: dict[str, list[int]] = {}
        for i, unit in enumerate(batch.group_ids if whole_groups else batch.rollout_ids):
            units.setdefault(unit, []).append(i)
        shares: list[list[int]] = [[] for _ in self.ranks]
        load = [0] * len(self.ranks)
        for rows in sorted(units.values(), key=lambda rows: -sum(tokens[i] for i in rows)):
            r = load.index(min(load))
            shares[r] += rows
            load[r] += sum(tokens[i] for i in rows)
        return [sorted(rows) for rows in shares]

    def _by_rows(self, method: str, batch, *per_row: torch.Tensor, critic: bool = False) -> tuple[list, list]:
        """Each rank's answer to `method` over its dealt rows (and its rows of each `per_row` [B, T]), and the deal."""
        shares = self._deal(batch)
        return ray.get([r.call.remote(method, invariants.select_rows(batch, rows), *(t[rows] for t in per_row),
                                      critic=critic) for r, rows in zip(self.ranks, shares)]), shares

    def recompute_logprobs(self, batch) -> torch.Tensor:
        return _gather(*self._by_rows("recompute_logprobs", batch), batch.input_ids.shape)

    def train_step(self, batch, prox_logprobs: torch.Tensor | None, algo_cfg: algo.AlgoConfig, *args,
                   ref_logprobs=None, **kwargs):
        shares = self._deal(batch, algo_cfg.loss_agg in algo.GROUP_AGGREGATIONS)
        reports = ray.get([r.call.remote("train_step", invariants.select_rows(batch, rows),
                                         None if prox_logprobs is None else prox_logprobs[rows], algo_cfg, *args,
                                         ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                                         **kwargs) for r, rows in zip(self.ranks, shares)])
        shape = batch.input_ids.shape
        report = reports[0]              # the step's metrics are global, the same on every rank
        for name in ("loss_contribution", "is_weights", "kept", "staleness", "mask", "prox_logprobs"):
            setattr(report, name, _gather([getattr(p, name) for p in reports], shares,
                                          shape if getattr(report, name).ndim == 2 else shape[:1]))
        return report

    def export_weights(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The full weights, on the driver's CPU (`device` is the driver's, which holds no GPU tensors)."""
        return ray.get([r.export_weights.remote() for r in self.ranks])[0]

    def shutdown(self) -> None:
        """End the ranks and give their placement group's resources back to the cluster."""
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement)


class CriticGroup(_Checkpoints):
    """critic.Critic's interface over a TrainerGroup built with a critic_cfg: each rank holds a critic shard beside
    its actor shard; rows are dealt as the actor's are (whole rollouts, balanced by tokens) and the value loss's
    global token count is all-reduced inside critic.Critic.train_step."""

    def __init__(self, trainers: TrainerGroup):
        self.trainers = trainers

    def _all(self, method: str, *args) -> list:
        return self.trainers._all(method, *args, critic=True)

    def compute_values(self, batch) -> torch.Tensor:
        return _gather(*self.trainers._by_rows("compute_values", batch, critic=True), batch.input_ids.shape)

    def train_step(self, batch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        return self.trainers._by_rows("train_step", batch, returns, old_values, critic=True)[0][0]


def _gather(parts: list[torch.Tensor], shares: list[list[int]], shape) -> torch.Tensor:
    out = torch.zeros(shape, dtype=parts[0].dtype)
    for part, rows in zip(parts, shares):
        if rows:
            out[rows] = part
    return out


# ---- agent runners in their own processes --------------------------------------------------------------------

@ray.remote
class RunnerActor:
    """The recipe's AgentRunner in a Ray actor (--runtime.runners), so environments and tools that work the CPU
    run beside the trainer rather than in its process. It samples through a router of its own over the same engine
    actors (sticky sessions hold within a runner: a rollout never leaves the runner that started it); the driver's
    router keeps the control plane (pause, weights, resume). Many groups run at once, on the actor's threads."""

    def __init__(self, recipe: str, model_path: str, engines: list, version: int, runner_kwargs: dict):
        self.router = Router([EngineProxy(i, handle, version) for i, handle in enumerate(engines)])
        self.runner = load_recipe(recipe).AgentRunner(
            self.router, models.load_tokenizer(model_path), image_processor=models.load_image_processor(model_path),
            **runner_kwargs)

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> list:
        return self.runner.run(tasks, group_ids, sampling)

    def failures(self) -> dict[str, int]:
        """The runner's failure counts (reason -> count) over its life."""
        return dict(self.runner.failures)

    def metrics(self) -> dict[str, float]:
        return self.router.metrics()


class RunnerGroup:
    """The runner interface (`run`, `failures`) over the runner actors: each call goes to the one with the fewest
    calls in flight."""

    def __init__(self, handles: list):
        self.handles = handles
        self._in_flight = [0] * len(handles)
        self._lock = threading.Lock()

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> list:
        with self._lock:
            pick = min(range(len(self.handles)), key=self._in_flight.__getitem__)
            self._in_flight[pick] += 1
        try:
            return ray.get(self.handles[pick].run.remote(tasks, group_ids, sampling))
        finally:
            with self._lock:
                self._in_flight[pick] -= 1

    @property
    def failures(self) -> dict[str, int]:
        """Every runner's failure counts, summed (each actor keeps its own over its life)."""
        total: Counter[str] = Counter()
        for counts in ray.get([h.failures.remote() for h in self.handles]):
            total.update(counts)
        return dict(total)

    def metrics(self) -> dict[str, float]:
        """The runners' routers' metrics, merged: counts summed, live engines the fewest any runner sees, and an
        engine's tokens/s summed over runners (each router sees its own share while it has requests there)."""
        merged: dict[str, float] = {}
        for m in ray.get([h.metrics.remote() for h in self.handles]):
            for key, value in m.items():
                if key not in merged:
                    merged[key] = value
                elif key == "perf/engines_live":
                    merged[key] = min(merged[key], value)
                else:
                    merged[key] += value
        return merged


# ---- the runtime: Ray, the engines, the weights ----------------------------------------------------------

class Runtime:
    """The engines of a run, as Ray actors, and their proxies."""

    def __init__(self, cfg: RuntimeConfig, build: Callable, build_args: Callable[[int], tuple], version: int):
        # named actors, so an operator (or a test) can find one: ray.get_actor("tracerl-engine-0"); all are
        # started before any proxy asks its actor where it sits, so the engines are built side by side, and all
        # before the first request
        handles = [EngineActor.options(name=f"tracerl-engine-{i}", num_cpus=cfg.engine_cpus,
                                       num_gpus=cfg.engine_gpus).remote(build, *build_args(i))
                   for i in range(cfg.engines)]
        self.proxies = [EngineProxy(i, handle, version) for i, handle in enumerate(handles)]
        self.runners: RunnerGroup | None = None
        self._last: tuple[float, list[float]] | None = None

    def push_weights(self, router, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Pause every engine, load `state`, stamp `version` on every later token, resume (router.update_weights
        does the pause/load/resume fan-out to the live engines). A dense model's engine keeps its requests in
        flight across the load (partial rollout, AReaL's interruptible rollout: a request reads [v]*n1 + [v+1]*n2);
        an MoE model's lets them finish at the old version first (its `drain_on_update`), so the push waits for the
        longest of them. An engine on the GPU that holds `state` (a vLLM engine colocated with a trainer in this
        process) maps the tensors by CUDA IPC, with no copy; every other engine receives a broadcast over its weight
        channel (NCCL between GPUs, gloo otherwise). Coverage by name is the engine's check."""
        t0 = time.monotonic()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        if lora.is_adapter_state(state):
            # a LoRA adapter (megabytes) goes to every engine as a call argument, through Ray's object store
            router.update_weights({name: t.cpu() for name, t in state.items()}, version)
            return {"runtime/weight_sync_s": time.monotonic() - t0, "runtime/weight_sync_bytes": float(nbytes),
                    "runtime/weight_sync_ipc_engines": 0.0}
        first = next(iter(state.values()))
        push = WeightPush(state, gpu_uuid(first.device.index or 0) if first.is_cuda else None)
        router.update_weights(push, version)
        ipc = sum(p.takes_ipc and p.gpu_uuid == push.gpu_uuid for p in self.proxies)
        del push
        return {"runtime/weight_sync_s": time.monotonic() - t0, "runtime/weight_sync_bytes": float(nbytes),
                "runtime/weight_sync_ipc_engines": float(ipc)}

    def engine_metrics(self) -> dict[str, float]:
        """Each engine's idle fraction since the last call: 1 - (time with a request in flight) / (wall time), from
        the engine actor's own busy clock, so requests from the driver's runners and from runner actors both count
        (tokens/s, retries and failures are the routers': router.Router.metrics, RunnerGroup.metrics)."""
        busy = []
        for ref in [p.handle.busy_seconds.remote() for p in self.proxies]:
            try:
                busy.append(ray.get(ref))
            except ray.exceptions.RayActorError:       # a dead engine samples nothing
                busy.append(None)
        now = time.monotonic()
        last, self._last = self._last, (now, busy)
        if last is None:
            return {}
        wall = max(now - last[0], 1e-9)
        idle = [1.0 if b is None or b0 is None else 1.0 - min((b - b0) / wall, 1.0) for b, b0 in zip(busy, last[1])]
        m = {f"runtime/engine{e}_idle_frac": f for e, f in enumerate(idle)}
        m["runtime/engine_idle_frac"] = sum(idle) / len(idle)
        return m

    def start_runners(self, cfg: RuntimeConfig, recipe: str, model_path: str, version: int,
                      runner_kwargs: dict) -> RunnerGroup:
        """--runtime.runners agent runners as Ray actors, each with its own router over this runtime's engines."""
        self.runners = RunnerGroup([RunnerActor.options(num_cpus=cfg.runner_cpus, max_concurrency=256).remote(
            recipe, model_path, [p.handle for p in self.proxies], version, runner_kwargs) for _ in range(cfg.runners)])
        return self.runners

    def stop(self) -> None:
        if self.runners is not None:
            for handle in self.runners.handles:
                ray.kill(handle)
        for p in self.proxies:
            try:                # a vLLM engine's own processes stop with it; a dead actor has nothing left to stop
                ray.get(p.handle.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(p.handle)


def connect(cfg: RuntimeConfig) -> None:
    """Start Ray here (or join cfg.address). Workers import this repository's modules, so it goes on their
    PYTHONPATH (on a cluster, the repository must sit at the same path on every node)."""
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
                                      "TRACERL_CACHE", "HF_HOME", "TRACERL_SANDBOX_ACCEPT", cpu_setup.SWITCH)
           if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    if cfg.address:
        ray.init(address=cfg.address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        # the engines' and trainer ranks' CPUs are reserved; the driver (runner threads) uses what is left
        # address="local": a new Ray of our own, even where another cluster runs on this machine
        ranks = cfg.trainer_ranks if cfg.trainer_ranks > 1 else 0
        cpus = math.ceil(cfg.engines * cfg.engine_cpus + cfg.runners * cfg.runner_cpus) + ranks
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=cfg.object_store_mb * 2**20 or None, runtime_env={"env_vars": env})


def start(cfg: RuntimeConfig, build: Callable, build_args: Callable[[int], tuple], version: int) -> Runtime:
    """The engine actors, on the Ray this process is connected to (connecting first if it is not)."""
    if not ray.is_initialized():
        connect(cfg)
    return Runtime(cfg, build, build_args, version)


def stop(runtime: Runtime | None) -> None:
    if runtime is not None:
        runtime.stop()
    ray.shutdown()


# ---- the streaming pool: prompt groups in flight, admitted by AReaL's capacity rule --------------------------

@dataclass
class Group:
    """One prompt group on its way from admission to the trainer."""
    index: int                     # admission order over the run (the group's task is tasks[index % len(tasks)])
    admitted_at: int               # policy steps trained when it started (V in the capacity rule)
    rollouts: list = field(default_factory=list)   # agents.Rollout, filled when it finishes
    done: bool = False


class RolloutPool:
    """Keeps prompt groups in flight on runner threads and hands the trainer B = groups_per_step finished groups
    per step, in admission order.

    Admission (AReaL, arXiv 2505.24298; areal/core/staleness_manager.py, without its max_concurrent term):
        capacity = min(eta + V + 1, steps) * B - (accepted + running)
    V = policy steps trained, accepted = groups finished and kept (consumed or waiting), steps = the run's last
    step, so no group is started that no step of the run would train. AReaL's max_concurrent - running is not
    needed: running plus kept-but-unconsumed groups never exceed (eta + 1) * B, since V * B of the accepted are
    consumed. Why it bounds staleness: when a group starts at V = a, at
    most (eta + a + 1) * B kept-or-running groups precede it or are it, so in admission order it is kept at most
    (eta + a + 1) * B - 1-th, and taking B per step in that order trains it by step eta + a. A group whose
    rollouts all failed, or (algo.filter_zero_variance) whose rewards are all equal, is not kept: its slot
    re-opens and a new group fills it, so the batch keeps its size. With eta = 0 a step's groups go out as one
    runner call, the batch the synchronous loop sends, so eta = 0 samples exactly what the synchronous loop
    samples; with eta >= 1 each group is its own call and reaches the trainer as soon as its turn comes."""

    def __init__(self, runner, tasks: list, sampling: SamplingParams, groups_per_step: int, samples_per_group: int,
                 eta: int, filter_zero_variance: bool, steps: int, first_step: int = 0):
        self.runner, self.tasks, self.sampling = runner, tasks, sampling
        self.B, self.G, self.eta, self.filter = groups_per_step, samples_per_group, eta, filter_zero_variance
        self.trained, self.steps = first_step, steps   # V, and the run's last step (no group is started beyond it)
        self.next_index = first_step * groups_per_step
        self.accepted = first_step * groups_per_step   # consumed groups count as accepted forever
        self.groups: dict[int, Group] = {}             # running or finished, not yet consumed (kept groups only)
        self.filtered = self.failed_groups = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        with self.cond:
            self._admit()

    @property
    def running(self) -> int:
        return sum(not g.done for g in self.groups.values())

    def _admit(self) -> None:
        """Start as many groups as the capacity rule allows (under self.cond)."""
        capacity = min(self.eta + self.trained + 1, self.steps) * self.B - (self.accepted + self.running)
        if capacity <= 0:
            return
        wave = [Group(self.next_index + i, self.trained) for i in range(capacity)]
        self.next_index += capacity
        for g in wave:
            self.groups[g.index] = g
        for part in ([wave] if self.eta == 0 else [[g] for g in wave]):
            threading.Thread(target=self._run, args=(part,), daemon=True, name="rollout-group").start()

    def _run(self, part: list[Group]) -> None:
        """Runner thread: roll out the groups of `part` (samples_per_group episodes each) through the agent."""
        tasks = [self.tasks[g.index % len(self.tasks)] for g in part for _ in range(self.G)]
        group_ids = [f"g{g.index}" for g in part for _ in range(self.G)]
        try:
            rollouts = self.runner.run(tasks, group_ids, self.sampling)
        except BaseException as error:   # no engine left, or a bug: the trainer re-raises it
            with self.cond:
                self.error = error
                self.cond.notify_all()
            return
        with self.cond:
            for g in part:
                g.rollouts = [r for r in rollouts if r.group_id == f"g{g.index}"]
                g.done = True
                if not g.rollouts:
                    self.failed_groups += 1
                    del self.groups[g.index]
                elif self.filter and not any(algo.keep_groups_with_variance(
                        [r.reward for r in g.rollouts], [r.group_id for r in g.rollouts],
                        [r.rollout_id for r in g.rollouts])):
                    self.filtered += 1
                    del self.groups[g.index]
                else:
                    self.accepted += 1
            self._admit()
            self.cond.notify_all()

    def take(self) -> tuple[list, dict[str, float]]:
        """Block until the B oldest kept-or-running groups have all finished; return their rollouts (group by
        group, in admission order) and the pool's metrics."""
        t0 = time.monotonic()
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"a rollout group failed: {type(self.error).__name__}: {self.error}") \
                        from self.error
                head = [self.groups[i] for i in sorted(self.groups)[:self.B]]
                if len(head) == self.B and all(g.done for g in head):
                    break
                self.cond.wait()
            waiting = sum(g.done for g in self.groups.values())
            for g in head:
                del self.groups[g.index]
            m = {"runtime/queue_finished": float(waiting), "runtime/queue_running": float(self.running),
                 "runtime/filtered_groups_total": float(self.filtered),
                 "runtime/failed_groups_total": float(self.failed_groups),
                 "runtime/admitted_at_min": float(min(g.admitted_at for g in head)),
                 "time/wait_for_rollouts_s": time.monotonic() - t0}
        return [r for g in head for r in g.rollouts], m

    def trained_step(self, steps: int) -> None:
        """The trainer finished `steps` policy steps and the engines hold their weights: admit more."""
        with self.cond:
            self.trained = steps
            self._admit()


def staleness_metrics(rollouts: list, trainer_version: int, bound: int) -> dict[str, float]:
    """Histogram over the step's rollouts of s = trainer version - the oldest version among its sampled tokens
    (slime's sample_staleness), in versions (optimizer steps), buckets 0..bound and above; and how many rollouts
    carry more than one version (a dense model's requests kept across a weight update; under an MoE engine's drain,
    rollouts whose turns fell on both sides of one)."""
    hist = [0] * (bound + 2)
    multi = 0
    for r in rollouts:
        versions = [v for g in r.generations for v in g.policy_versions]
        if not versions:
            continue
        hist[min(trainer_version - min(versions), bound + 1)] += 1
        multi += len(set(versions)) > 1
    m = {f"runtime/staleness_{s}": float(n) for s, n in enumerate(hist[:-1])}
    m["runtime/staleness_over"] = float(hist[-1])
    m["runtime/multi_version_rollouts"] = float(multi)
    return m
