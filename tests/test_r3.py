# Invariant 3 (forward consistency, R3): replaying the sampler's MoE routes makes the trainer use the sampler's
# experts, keeps the router differentiable (gates from the dense live softmax) and changes nothing when the
# routes already agree. Real transformers MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral), tiny and random-init.
import copy
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from engines.r3 import capture_routes, moe_routers, replay_routes

B, T, LAYERS, TOP_K, EXPERTS, VOCAB = 4, 32, 2, 2, 8, 64
SEED = 10            # with this seed the 1e-3 router perturbation below flips routes in both layers
ROUTER_NOISE = 1e-3  # perturbation of router weights, relative to their mean magnitude
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts_per_tok=TOP_K, initializer_range=0.1, experts_implementation="eager",
            attn_implementation="sdpa")


def tiny_moe(family: str, dtype=torch.float64, seed: int = SEED):
    """Random init in float32 (whatever the process default dtype is), then cast: the same weights every run."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(seed)
        return _build(family).to(dtype).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def _build(family: str):
    if family == "qwen3":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, intermediate_size=64, moe_intermediate_size=32,
                                                  num_experts=EXPERTS, norm_topk_prob=True))
    if family == "qwen2":  # no top-k renormalisation, plus a shared expert
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY, intermediate_size=64, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32, num_experts=EXPERTS,
                                                  norm_topk_prob=False))
    return MixtralForCausalLM(MixtralConfig(**TINY, intermediate_size=32, num_local_experts=EXPERTS))


def token_logprobs(model, ids):
    """[B, T]: logprob of ids[b, t] from the logits at t-1; position 0 = 0."""
    logits = model(ids).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return F.pad(lp, (1, 0))


def as_batch(captured):  # [B*T, L, k] of one forward -> [B, T, L, k]
    return captured.reshape(B, T, LAYERS, TOP_K)


def same_sets(a, b):  # [..., k] -> [...] True where the expert sets agree (order-free)
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


@pytest.fixture(scope="module")
def drift():
    """sampler = a random-init Qwen3-MoE; trainer = the same weights with router weights perturbed by ~1e-3."""
    sampler = tiny_moe("qwen3")
    trainer = copy.deepcopy(sampler)
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    with torch.no_grad():
        for router in moe_routers(trainer):
            noise = torch.randn(router.weight.shape, generator=gen, dtype=router.weight.dtype)
            router.weight.add_(ROUTER_NOISE * router.weight.abs().mean() * noise)
        with capture_routes(sampler) as captured:
            sampler_lp = token_logprobs(sampler, ids)
        with capture_routes(trainer) as live:
            live_lp = token_logprobs(trainer, ids)
    routes, live_routes = as_batch(captured[0]), as_batch(live[0])
    coeff = torch.randn(B, T, generator=gen, dtype=torch.float64)  # a fixed scalar loss: sum(coeff * logprobs)
    return SimpleNamespace(sampler=sampler, trainer=trainer, ids=ids, routes=routes, live_routes=live_routes,
                           sampler_lp=sampler_lp, live_lp=live_lp, coeff=coeff,
                           drifted=~same_sets(routes, live_routes))  # [B, T, L]


def test_capture_records_one_tensor_per_forward_in_layer_order(drift):
    with torch.no_grad(), capture_routes(drift.sampler) as captured:
        drift.sampler(drift.ids)
        drift.sampler(drift.ids[:1, :5])
    assert [tuple(c.shape) for c in captured] == [(B * T, LAYERS, TOP_K), (5, LAYERS, TOP_K)]
    assert torch.equal(as_batch(captured[0]), drift.routes)
    assert torch.equal(captured[1].reshape(1, 5, LAYERS, TOP_K), drift.routes[:1, :5])  # causal: same prefix routes
    assert all(not r._forward_hooks for r in moe_routers(drift.sampler))


def test_trap_armed_without_replay_routes_flip_and_logprobs_move(drift):
    assert drift.drifted[..., 0].sum() > 0 and drift.drifted[..., 1].sum() > 0  # flips in both layers
    assert (drift.sampler_lp - drift.live_lp).abs().max() > 1e-5


def test_replay_forces_the_sampler_experts_and_removes_the_flip_gap(drift):
    with torch.no_grad(), replay_routes(drift.trainer, drift.routes) as stats, \
            capture_routes(drift.trainer) as used:
        replay_lp = token_logprobs(drift.trainer, drift.ids)
    assert torch.equal(as_batch(used[0]), drift.routes)  # 100% identical selections, same order
    assert (stats.replayed_choices, stats.fallback_choices) == (B * T * LAYERS, 0)
    gap_live = (drift.sampler_lp - drift.live_lp).abs().max()
    gap_replay = (drift.sampler_lp - replay_lp).abs().max()  # what remains is the gate-value drift only
    assert gap_replay < gap_live / 10
    assert all("forward" not in r.__dict__ for r in moe_routers(drift.trainer))  # original forward restored


def _router_grad(loss_fn, router):
    router.weight.grad = None
    loss_fn().backward()
    return router.weight.grad.clone()


def _central_difference(loss_fn, router, direction, eps):
    with torch.no_grad():
        router.weight.add_(eps * direction)
        plus = loss_fn()
        router.weight.sub_(2 * eps * direction)
        minus = loss_fn()
        router.weight.add_(eps * direction)
    return float((plus - minus) / (2 * eps))


def _model_loss(drift, replay=replay_routes):
    with replay(drift.trainer, drift.routes):
        return (drift.coeff * token_logprobs(drift.trainer, drift.ids)).sum()


def _block_inputs(drift):
    """Inputs of each MoE block in a replayed trainer forward. Finite differences at 1e-6 start there: the MoE block
    is float64 end to end, while transformers' RMSNorm computes in float32 even inside a float64 model."""
    inputs, layers = {}, drift.trainer.model.layers
    handles = [layers[i].mlp.register_forward_pre_hook(lambda m, args, i=i: inputs.setdefault(i, args[0].detach()))
               for i in range(LAYERS)]
    with torch.no_grad(), replay_routes(drift.trainer, drift.routes):
        drift.trainer(drift.ids)
    for h in handles:
        h.remove()
    return inputs


def _block_loss(drift, layer, inputs, weight, replay=replay_routes):
    """sum(weight * MoE block output) of one layer, its experts fixed to the replayed routes."""
    with replay(drift.trainer, drift.routes):
        return (weight * drift.trainer.model.layers[layer].mlp(inputs[layer])).sum()


def test_router_gradient_is_nonzero_and_matches_finite_differences_under_replay(drift):
    routers, gen = moe_routers(drift.trainer), torch.Generator().manual_seed(0)
    inputs = _block_inputs(drift)
    weight = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
    for layer, router in enumerate(routers):
        direction = torch.randn(router.weight.shape, generator=gen, dtype=torch.float64)
        loss_fn = lambda: _block_loss(drift, layer, inputs, weight)  # noqa: E731
        autodiff = float((_router_grad(loss_fn, router) * direction).sum())
        assert autodiff != 0.0
        assert autodiff == pytest.approx(_central_difference(loss_fn, router, direction, 1e-5), rel=1e-6)
    # end to end through the whole model: non-zero, and equal to finite differences up to the float32 norms
    direction = torch.randn(routers[0].weight.shape, generator=gen, dtype=torch.float64)
    grad = _router_grad(lambda: _model_loss(drift), routers[0])
    assert all(r.weight.grad.abs().sum() > 0 for r in routers)
    assert float((grad * direction).sum()) == pytest.approx(
        _central_difference(lambda: _model_loss(drift), routers[0], direction, 1e-3), rel=1e-3)


@contextmanager
def replay_gathering_from_topk_masked_probs(model, routes):
    """The known bug (ISEEKYAN/Megatron-LM PR #79): gates read from probs already zeroed outside the LIVE top-k."""
    routers = moe_routers(model)
    for layer, router in enumerate(routers):
        target = routes[:, :, layer].reshape(-1, router.top_k)

        def forward(hidden, router=router, target=target):
            logits = F.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight)
            probs = torch.softmax(logits, -1)
            live = torch.topk(probs, router.top_k, -1).indices
            masked = torch.zeros_like(probs).scatter(1, live, probs.gather(1, live))
            gates = masked.gather(1, target)
            return logits, gates / gates.sum(-1, keepdim=True).clamp_min(1e-20), target
        router.forward = forward
    try:
        yield
    finally:
        for router in routers:
            del router.forward


def _drifted_gates_and_logit_grads(drift, replay):
    """Gate values and d loss / d router logit at every (token, layer, expert) the sampler chose but the trainer's
    live router (in this very forward) would not."""
    seen = []

    def keep(module, args, output):
        output[0].retain_grad()
        seen.append(output)
    handles = [r.register_forward_hook(keep) for r in moe_routers(drift.trainer)]
    try:
        _model_loss(drift, replay).backward()
    finally:
        for h in handles:
            h.remove()
    gates, grads = [], []
    for logits, gate, selected in seen:
        live = torch.topk(logits.detach(), TOP_K, -1).indices
        rows, slots = (selected[:, :, None] != live[:, None, :]).all(-1).nonzero(as_tuple=True)
        gates.append(gate[rows, slots].detach())
        grads.append(logits.grad[rows, selected[rows, slots]])
    return torch.cat(gates), torch.cat(grads)


def test_negative_control_topk_masked_gates_kill_the_drifted_expert_gradient(drift):
    gates, grads = _drifted_gates_and_logit_grads(drift, replay_routes)
    assert len(gates) > 0 and (gates > 0).all() and (grads.abs() > 1e-8).all()  # ours: drifted experts learn
    bad_gates, bad_grads = _drifted_gates_and_logit_grads(drift, replay_gathering_from_topk_masked_probs)
    assert (bad_gates == 0).all() and (bad_grads.abs() < 1e-14).all()  # the bug: silently dead
    # A loss on the layer-0 tokens whose routes drifted: the replayed forward depends on the router (finite
    # differences are non-zero); our gradient matches them, the masked-gather gradient is zero.
    router, inputs = moe_routers(drift.trainer)[0], _block_inputs(drift)
    weight = drift.drifted[..., 0, None] * torch.randn(B, T, 32, generator=torch.Generator().manual_seed(2),
                                                       dtype=torch.float64)
    direction = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    numeric = _central_difference(lambda: _block_loss(drift, 0, inputs, weight), router, direction, 1e-5)
    ours = _router_grad(lambda: _block_loss(drift, 0, inputs, weight), router)
    bad = _router_grad(lambda: _block_loss(drift, 0, inputs, weight, replay_gathering_from_topk_masked_probs), router)
    assert abs(numeric) > 1e-6
    assert float((ours * direction).sum()) == pytest.approx(numeric, rel=1e-6)
    assert abs(float((bad * direction).sum())) < 1e-12


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mixtral"])
def test_replaying_a_models_own_routes_is_a_bitwise_noop(family):
    model = tiny_moe(family, torch.float32)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with capture_routes(model) as captured:
            plain = model(ids).logits
        with replay_routes(model, as_batch(captured[0])):
            replayed = model(ids).logits
    assert torch.equal(plain, replayed)  # same experts, and gates computed exactly as the family's router does


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mixtral"])
def test_replay_forces_arbitrary_routes_and_the_router_still_learns(family):
    model = tiny_moe(family, torch.float32)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    forced = torch.rand(B, T, LAYERS, EXPERTS, generator=gen).argsort(-1)[..., :TOP_K]  # distinct random experts
    with replay_routes(model, forced), capture_routes(model) as used:
        token_logprobs(model, ids).sum().backward()
    assert torch.equal(as_batch(used[0]), forced)
    assert all(r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_rows_with_minus_one_fall_back_to_live_routing_and_are_counted():
    model = tiny_moe("qwen3", torch.float32)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    with torch.no_grad(), capture_routes(model) as live:
        model(ids)
    forced = torch.rand(B, T, LAYERS, EXPERTS, generator=gen).argsort(-1)[..., :TOP_K]
    forced[:, -1] = -1            # last token of every row: never routed by the engine
    forced[0, 3, 0] = torch.tensor([5, -1])  # a partial row counts as unknown too
    unknown = (forced < 0).any(-1)
    with torch.no_grad(), replay_routes(model, forced) as stats, capture_routes(model) as used:
        model(ids)
    used = as_batch(used[0])
    assert (stats.fallback_choices, stats.replayed_choices) == (int(unknown.sum()), int((~unknown).sum()))
    assert torch.equal(used[~unknown], forced[~unknown])
    # layer 0 sees the same hidden states with or without replay, so its fallback rows equal the live choice
    assert torch.equal(used[:, :, 0][unknown[:, :, 0]], as_batch(live[0])[:, :, 0][unknown[:, :, 0]])


def test_wrong_routes_are_refused_and_routers_restored():
    model = tiny_moe("qwen3", torch.float32)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(6))
    good = torch.zeros(B, T, LAYERS, TOP_K, dtype=torch.long)
    good[..., 1] = 1
    with pytest.raises(ValueError, match=r"routes 128 tokens but the replayed routes give 132"):
        with replay_routes(model, torch.cat([good, good[:, :1]], dim=1)):
            model(ids)
    for bad, message in [(good[:, :, :1], "layers"), (good[..., :1], "top_k"), (good + 7, "expert ids"),
                         (good.float(), "integer"), (good * 0, "same expert twice")]:
        with pytest.raises(ValueError, match=message):
            with replay_routes(model, bad):
                model(ids)
    assert all("forward" not in r.__dict__ for r in moe_routers(model))
