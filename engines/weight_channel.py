# engines/weight_channel.py — the trainer's weights to an engine in another process (a runtime.EngineActor) when CUDA IPC
# cannot carry them: one two-rank process group per engine.
#
# Owns: `WeightPush` (one update as Runtime.push_weights hands it to every engine proxy), `WeightChannel` (the
# trainer's end, rank 0; EngineActor.open_weight_channel and receive_weights are the engine's, rank 1), the bucket
# plan both ends walk (`weight_plan`), `send_state` / `receive_state`, and the helpers they and the runtime share
# (`open_group`, `free_port`, `gpu_uuid`). NCCL from GPU to GPU when each has a GPU of its own, gloo through host
# memory otherwise. A group per engine, not one for all: an engine that dies breaks only its own channel (the
# router takes it out; the others keep their updates).
#
# Keeps invariant 3 (engine and trainer agree on the model): tensors travel in dtype-faithful buckets, grouped by
# dtype and never cast (an fp32 router or norm cast to bf16 changes the engine's model), each bucket one flat
# buffer; the engine checks coverage by name when it loads them.
# Never: loads weights into a model, pauses an engine or stamps a version (the engine and router.Router do).
from __future__ import annotations

import math
from dataclasses import dataclass

import ray
import torch


# ---- one push ---------------------------------------------------------------------------------------------------

@dataclass
class WeightPush:
    """One weight update as Runtime.push_weights hands it to every engine proxy: the trainer's tensors and the GPU
    they sit on (None on a CPU). An engine on that GPU maps them by CUDA IPC; the others receive them over their
    weight channel."""
    tensors: dict[str, torch.Tensor]
    gpu_uuid: str | None


# ---- the channel: buckets over a two-rank process group -------------------------------------------------

BUCKET_BYTES = 512 * 2**20


def weight_plan(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[tuple]]:
    """The buckets of a state dict, in the order both ends walk them: [(name, dtype name, shape), ...] per bucket,
    one dtype per bucket, a tensor larger than bucket_bytes alone in its own."""
    buckets: list[list[tuple]] = []
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in state.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        bucket, size = [], 0
        for name in names:
            nbytes = state[name].numel() * state[name].element_size()
            if bucket and size + nbytes > bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append((name, str(dtype).removeprefix("torch."), list(state[name].shape)))
            size += nbytes
        buckets.append(bucket)
    return buckets


def open_group(address: str, port: int, rank: int, backend: str, timeout_s: float):
    """A process group of two (trainer, engine) on its own TCP store, apart from any torch.distributed world either
    process belongs to (a trainer's FSDP2 ranks have theirs)."""
    import datetime
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, 2, rank == 0, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _broadcast(group, buffer: torch.Tensor) -> None:
    import torch.distributed as dist
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def send_state(group, state: dict[str, torch.Tensor], plan: list[list[tuple]], device: str) -> None:
    """Rank 0: each bucket of `plan` as one flat buffer of its dtype on `device`."""
    for bucket in plan:
        _broadcast(group, torch.cat([state[name].detach().reshape(-1).to(device) for name, _, _ in bucket]))


def receive_state(group, plan: list[list[tuple]], device: str) -> dict[str, torch.Tensor]:
    """Rank 1: each bucket into a buffer of its own dtype, split back into named tensors of their shapes."""
    state = {}
    for bucket in plan:
        sizes = [math.prod(shape) for _, _, shape in bucket]
        buffer = torch.empty(sum(sizes), dtype=getattr(torch, bucket[0][1]), device=device)
        _broadcast(group, buffer)
        state.update((name, part.view(shape)) for (name, _, shape), part in zip(bucket, buffer.split(sizes)))
    return state


class WeightChannel:
    """The trainer's end of one engine's weight channel (EngineActor.open_weight_channel is the other)."""

    def __init__(self, handle, backend: str, timeout_s: float = 300.0):
        self.backend = backend
        address, port = ray.util.get_node_ip_address(), free_port()
        opened = handle.open_weight_channel.remote(address, port, backend, timeout_s)
        self.group = open_group(address, port, 0, backend, timeout_s)      # waits for the engine to join
        ray.get(opened)

    def send(self, handle, state: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast `state` bucket by bucket while the engine receives it and loads it as `version`."""
        plan = weight_plan(state)
        loaded = handle.receive_weights.remote(plan, version)
        send_state(self.group, state, plan, "cuda" if self.backend == "nccl" else "cpu")
        ray.get(loaded)


def gpu_uuid(device: int) -> str:
    """A GPU's physical id, as vLLM's CUDA IPC keys its handles (device indices differ between processes)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def free_port() -> int:
    """A port free on every interface of this node (the rendezvous store listens on all of them)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
