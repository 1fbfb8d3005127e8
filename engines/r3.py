# engines/r3.py — MoE Rollout Routing Replay (R3, arXiv 2510.11370): the routing half of invariant 3 (forward consistency,
# invariants.py's header), as hooks on a transformers model's top-k routers.
# Owns: finding a model's routers (moe_routers), recording the experts each forward selects (capture_routes: what the
# embedded engine reports per token) and forcing a forward to select recorded ones (replay_routes: every trainer
# forward that must match the sampler), with the gates recomputed from the live router so that it keeps learning.
# Never does: decide which route a token keeps (invariants.TokenLedger.absorb_routes: first writer wins, a new policy
# version seals the segment), sample, or train. Imports nothing of the project. Tests: tests/test_r3.py.
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---- the invariant ----
# Invariant: in every trainer forward that must match the sampler (behavior-logprob check, pi_prox recompute,
# loss forward, activation recompute), each MoE layer uses the experts the engine selected for each token
# (Rollout Routing Replay, arXiv 2510.11370). Only the discrete top-k selection S* is replayed; gates are
# recomputed from the trainer's live router logits s = W h, gathered from the DENSE softmax at S* and
# renormalised as the router family does (Qwen3/Qwen2-MoE if norm_topk_prob, Mixtral always):
#   g_i = softmax(s)_i / sum_{j in S*} softmax(s)_j  for i in S*
# so the router keeps learning. Gathering from top-k-masked probs would read exact zeros for drifted experts
# and silently kill their gradients (ISEEKYAN/Megatron-LM PR #79). A token's route at a layer holding -1 (not
# routed, e.g. the last token or padding) falls back to the live choice and is counted. The layer axis L of routes
# is the model's MoE router order (= decoder layer order when every layer is MoE). A segment's routes are one policy
# version's: a prefix cache keeps a route only within a version, so a turn drawn at a new version seals the segment
# (invariants.TokenLedger.append_sampled, reason "route_version"; no one route per position would replay both).


def _router_classes() -> tuple[type, type, type]:
    """(Qwen3Moe, Qwen2Moe, Mixtral) top-k router classes of the installed transformers."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    return Qwen3MoeTopKRouter, Qwen2MoeTopKRouter, MixtralTopKRouter


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k router modules in layer (call) order."""
    return [m for m in model.modules() if isinstance(m, _router_classes())]


@contextmanager
def capture_routes(model: nn.Module) -> Iterator[list[Tensor]]:
    """Yield a list; every model forward inside the block appends the selected experts, long [N_tokens, L, k]
    (N_tokens = tokens of that forward, flattened batch-major as the routers see them)."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"capture_routes: {type(model).__name__} has no supported MoE router "
                         f"(Qwen3Moe/Qwen2Moe/Mixtral TopKRouter)")
    captured: list[Tensor] = []
    pending: list[Tensor] = []

    def hook_for(layer: int):
        def hook(module, args, output):
            if layer != len(pending):
                raise RuntimeError(f"capture_routes: router {layer} ran while router {len(pending)} was expected; "
                                   f"routers must run once per forward in layer order")
            pending.append(output[2].detach().long().clone())
            if len(pending) == len(routers):
                captured.append(torch.stack(pending, dim=1))
                pending.clear()
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@dataclass
class ReplayStats:
    """Counts over every router call inside one replay_routes block, of choices (one token's top-k at one layer)."""
    replayed_choices: int = 0   # forced to the recorded experts
    fallback_choices: int = 0   # with a -1 recorded, so the live router chose (includes padding)


def _replay_forward(router: nn.Module, layer: int, target: Tensor, stats: ReplayStats):
    fallback = (target < 0).any(-1)  # [N]
    n_fallback = int(fallback.sum())
    mixtral = isinstance(router, _router_classes()[2])
    renorm = mixtral or bool(router.norm_topk_prob)  # Mixtral always renormalises; Qwen only if norm_topk_prob
    cast_back = not mixtral  # Qwen routers return gates in the logits dtype; Mixtral keeps the softmax dtype

    def forward(hidden_states: Tensor):
        h = hidden_states.reshape(-1, router.weight.shape[1])
        if h.shape[0] != target.shape[0]:
            raise ValueError(f"replay_routes: MoE layer {layer} routes {h.shape[0]} tokens but the replayed routes "
                             f"give {target.shape[0]} (B*T); pass routes [B, T, L, k] for exactly the batch being "
                             f"forwarded (one full forward, no KV-cache decoding)")
        logits = F.linear(h, router.weight)
        # softmax in at least fp32, as the module does (never downcast a float64 model)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        live = torch.topk(probs, router.top_k, dim=-1).indices
        selected = torch.where(fallback[:, None], live, target)
        gates = probs.gather(1, selected)  # from the DENSE live probs (never from top-k-masked probs)
        if renorm:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if cast_back:
            gates = gates.to(logits.dtype)
        stats.replayed_choices += target.shape[0] - n_fallback
        stats.fallback_choices += n_fallback
        return logits, gates, selected

    return forward


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor) -> Iterator[ReplayStats]:
    """Force every MoE router's top-k selection to routes (long [B, T, L, k]); a choice with any -1 recorded
    stays the live one. Gates come from the live logits. Restores the routers on exit (also on exception). Yields
    ReplayStats. Keep the block open through backward when activation checkpointing recomputes the forward."""
    routers = moe_routers(model)
    if routes.ndim != 4 or routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"replay_routes: routes must be an integer tensor [B, T, L, k], got {routes.dtype} "
                         f"{list(routes.shape)}")
    if routes.shape[2] != len(routers):
        raise ValueError(f"replay_routes: routes have {routes.shape[2]} layers but the model has {len(routers)} "
                         f"MoE routers")
    stats, saved = ReplayStats(), []
    try:
        for layer, router in enumerate(routers):
            k, num_experts = router.top_k, router.weight.shape[0]
            if routes.shape[3] != k:
                raise ValueError(f"replay_routes: routes have top_k {routes.shape[3]} but layer {layer} selects {k}")
            target = routes[:, :, layer, :].reshape(-1, k).to(router.weight.device, torch.long)
            if target.numel() and (target.min() < -1 or target.max() >= num_experts):
                raise ValueError(f"replay_routes: layer {layer} routes hold expert ids in [{int(target.min())}, "
                                 f"{int(target.max())}]; valid ids are 0..{num_experts - 1}, or -1 for not routed")
            ordered = target.sort(-1).values
            if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, :1] >= 0)).any():
                raise ValueError(f"replay_routes: layer {layer} has a route naming the same expert twice; a "
                                 f"top-k selection holds {k} distinct experts")
            saved.append((router, router.__dict__.get("forward")))
            router.forward = _replay_forward(router, layer, target, stats)
        yield stats
    finally:
        for router, previous in saved:
            if previous is None:
                del router.forward
            else:
                router.forward = previous
