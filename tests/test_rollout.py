# Engine tests: what the embedded engine reports is what the trainer recomputes (invariant 3), every
# token carries the version that sampled it across a weight swap (invariant 2), and the control plane
# (update_weights, pause, resume) keeps requests.
import copy
import dataclasses
import math
import threading
import time

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import engines
import invariants
import models
import rollout
from engines import SamplingParams, constraints
from engines import r3
from rollout import EmbeddedEngine
from trainer.recompute import batch_logprobs, sequence_logprobs


def _padded(seqs: list[list[int]], pad: int):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    return ids, mask


def _recompute(model, gens, temperature, routes=False):
    """Trainer-side logprobs of every sampled token: one full right-padded forward per batch."""
    seqs = [g.prompt_ids + g.token_ids for g in gens]
    ids, mask = _padded(seqs, pad=0)
    replay = None
    if routes:
        layers, k = gens[0].routes.shape[1:]
        replay = torch.full((len(seqs), ids.shape[1], layers, k), -1, dtype=torch.long)
        for b, g in enumerate(gens):
            replay[b, :len(g.routes)] = torch.from_numpy(g.routes).long()
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, mask, temperature, routes=replay)
    return [lp[b, len(g.prompt_ids):len(g.prompt_ids) + len(g.token_ids)] for b, g in enumerate(gens)]


def _max_gap(gens, recomputed) -> float:
    return max((torch.tensor(g.behavior_logprobs) - r).abs().max().item() for g, r in zip(gens, recomputed))


# Prompts of mixed lengths, per-request budgets and seeds: catches padding and batch-composition bugs.
PROMPTS = [[5, 17, 33, 2, 91], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108], [42]]
PARAMS = [SamplingParams(temperature=0.7, max_tokens=n, seed=s) for n, s in [(12, 1), (5, 2), (9, 3), (16, 4)]]


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("qwen3", seed=0)


def test_engine_logprobs_equal_trainer_recompute_in_fp32(tiny):
    gens = EmbeddedEngine(tiny).generate(PROMPTS, PARAMS)
    assert [len(g.token_ids) for g in gens] != [len(gens[0].token_ids)] * len(gens)   # mixed shapes
    recomputed = _recompute(tiny, gens, temperature=0.7)
    gap = _max_gap(gens, recomputed)
    assert gap <= 1e-5, f"engine vs trainer logprob gap {gap:.2e}"
    # the same request alone in a batch samples the same tokens with the same logprobs
    alone = EmbeddedEngine(tiny).generate([PROMPTS[2]], [PARAMS[2]])[0]
    assert alone.token_ids == gens[2].token_ids
    assert max(abs(a - b) for a, b in zip(alone.behavior_logprobs, gens[2].behavior_logprobs)) <= 1e-5


def test_parity_check_fails_on_wrong_temperature_shift_or_weight(tiny):
    gens = EmbeddedEngine(tiny).generate(PROMPTS, PARAMS)
    # wrong temperature (the logits never divided by it)
    assert _max_gap(gens, _recompute(tiny, gens, temperature=1.0)) > 1e-3
    # off-by-one: the logprob of token t read from position t instead of t-1
    shifted = [r.roll(1) for r in _recompute(tiny, gens, temperature=0.7)]
    assert _max_gap(gens, shifted) > 1e-3
    # one perturbed weight in the trainer's copy
    perturbed = copy.deepcopy(tiny)
    with torch.no_grad():
        perturbed.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    assert _max_gap(gens, _recompute(perturbed, gens, temperature=0.7)) > 1e-5


def test_stop_token_is_kept_and_finish_reasons(tiny):
    engine = EmbeddedEngine(tiny)
    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=30, seed=0))[0]
    stop_at = free.token_ids[3]          # a token the seeded sampler is known to draw at position 3
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=30, seed=0, stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    capped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, seed=0, stop_token_ids=(9999,)))[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 2


def test_ignore_eos_runs_a_reply_past_the_models_eos_to_max_tokens(tiny):
    """A bias that makes the model's eos nearly certain: the reply is that one eos, unless ignore_eos, where it runs
    to max_tokens through every eos it draws; a stop id still ends it, and a grammar without stop ids is refused."""
    engine = EmbeddedEngine(tiny)
    eos = min(engine.eos_ids)
    eager = SamplingParams(max_tokens=12, seed=0, logit_bias=((eos, 50.0),))
    ended = engine.generate([[5, 6, 7]], eager)[0]
    assert ended.token_ids == [eos] and ended.finish_reason == "stop"          # the trap is armed
    ran = engine.generate([[5, 6, 7]], dataclasses.replace(eager, ignore_eos=True))[0]
    assert len(ran.token_ids) == 12 and ran.token_ids.count(eos) >= 11 and ran.finish_reason == "length"
    stopped = engine.generate([[5, 6, 7]], dataclasses.replace(eager, ignore_eos=True, stop_token_ids=(eos,)))[0]
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    with pytest.raises(ValueError, match="ignore_eos"):
        engines.validate_sampling(SamplingParams(ignore_eos=True, constraint=constraints.json_object_spec()))


def test_a_stop_string_ends_sampling_at_the_token_that_completes_it(tiny):
    tok = models.bpe_tokenizer()
    engine = EmbeddedEngine(tiny, tokenizer=tok)
    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=30, seed=0, stop_token_ids=(9999,)))[0]
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    stop = text[len(tok.decode(free.token_ids[:4], skip_special_tokens=True)):][:3]   # spans into token 5 or later
    assert len(stop) == 3 and text.find(stop) >= len(tok.decode(free.token_ids[:3], skip_special_tokens=True))
    ended = next(n for n in range(1, 31) if stop in tok.decode(free.token_ids[:n], skip_special_tokens=True))
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=30, seed=0, stop_token_ids=(9999,),
                                                          stop=("never written", stop)))[0]
    # the same draws up to the token that wrote the stop string's last character; that token is kept
    assert stopped.token_ids == free.token_ids[:ended] and ended < len(free.token_ids)
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop and free.stop_string is None
    # the second request took the first one's KV of [5, 6] from the prefix cache: the same distributions, to fp32
    assert stopped.cached_prompt_tokens == 2
    assert max(abs(a - b) for a, b in zip(stopped.behavior_logprobs, free.behavior_logprobs)) <= 1e-5
    with pytest.raises(ValueError, match="tokenizer"):          # stop strings need text: refused, not ignored
        EmbeddedEngine(tiny).generate([[5, 6, 7]], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[5, 6, 7]], SamplingParams(stop=("",)))


def test_top_logprobs_rank_the_distribution_the_token_was_drawn_from(tiny):
    engine = EmbeddedEngine(tiny)
    gen = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, seed=1,
                                                      top_logprobs=5))[0]
    assert len(gen.top_logprobs) == len(gen.token_ids)
    for token, logprob, top in zip(gen.token_ids, gen.behavior_logprobs, gen.top_logprobs):
        values = [v for _, v in top]
        assert len(top) == 5 and values == sorted(values, reverse=True) and values[0] >= logprob
        assert dict(top).get(token, logprob) == logprob            # the sampled token, when listed, agrees
    greedy = engine.generate([[5, 6, 7]], SamplingParams(top_k=1, max_tokens=4, top_logprobs=2))[0]
    assert [top[0] for top in greedy.top_logprobs] == [(t, 0.0) for t in greedy.token_ids]
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2)).__getitem__(0).top_logprobs is None
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.generate([[5, 6, 7]], SamplingParams(top_logprobs=21))


def test_each_token_reaches_the_callback_as_it_is_sampled(tiny):
    engine, seen = EmbeddedEngine(tiny), []
    gens = engine.generate(PROMPTS, PARAMS, on_token=lambda row, token: seen.append((row, token)))
    for row, gen in enumerate(gens):
        assert [t for r, t in seen if r == row] == gen.token_ids
    # interleaved across rows, one step at a time: row 0's second token comes after row 1's first
    assert seen.index((1, gens[1].token_ids[0])) < seen.index((0, gens[0].token_ids[1]))


def test_bad_requests_are_refused_with_clear_errors(tiny):
    engine = EmbeddedEngine(tiny)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1, 2]], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 2]], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])



def test_no_sequence_passes_the_models_position_limit():
    """As vLLM with its max_model_len: a prompt at the limit is refused, a reply stops there (finish 'length')."""
    model = models.tiny_model("qwen3", seed=0)
    model.config.max_position_embeddings = 24
    engine = EmbeddedEngine(model)
    assert engine.max_model_len == 24 == models.position_limit(model.config)
    with pytest.raises(ValueError, match="24 tokens, at or over the model's position limit of 24"):
        engine.generate([list(range(1, 25))], SamplingParams(max_tokens=1))
    gen = engine.generate([list(range(1, 21))], SamplingParams(max_tokens=50, stop_token_ids=(9999,), seed=0))[0]
    assert len(gen.token_ids) == 4 and gen.finish_reason == "length"

def test_update_weights_requires_every_key_and_a_forward_version(tiny):
    engine = EmbeddedEngine(copy.deepcopy(tiny), version=3)
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    with pytest.raises(ValueError, match="backwards"):
        engine.update_weights(state, version=2)
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing keys"):
        engine.update_weights(partial, version=4)
    with pytest.raises(ValueError, match="unexpected keys"):
        engine.update_weights({**state, "extra.weight": torch.zeros(1)}, version=4)
    # a tied model's export may leave out lm_head.weight (it is the embedding)
    engine.update_weights({k: v for k, v in state.items() if k != "lm_head.weight"}, version=4)
    assert engine.version == 4
    gen = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=0))[0]
    assert gen.policy_versions == [4] * len(gen.token_ids)


def test_a_refused_push_loads_nothing_and_a_valid_one_loads_whole(tiny):
    """A push is all or nothing: one stray key, one tensor of another shape or dtype, and nothing of the new weights
    is loaded (bitwise the old ones, the version unchanged); the same push without the fault loads."""
    engine = EmbeddedEngine(copy.deepcopy(tiny), version=3)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = _perturbed(tiny).state_dict()
    first = next(iter(new))
    faults = {"a stray key": {**new, "model.extra.weight": torch.zeros(1)},
              "a tensor of another shape": {**new, first: new[first][:-1]},
              "a tensor of another dtype": {**new, first: new[first].double()}}
    for fault, push in faults.items():
        with pytest.raises(ValueError, match="nothing of it was loaded"):
            engine.update_weights(push, version=4)
        held = engine.model.state_dict()
        assert all(torch.equal(held[k], v) for k, v in old.items()), f"{fault}: the refused push changed weights"
        assert engine.version == 3
    engine.update_weights(new, version=4)                                  # armed: the same weights, valid, load
    assert engine.version == 4 and all(torch.equal(engine.model.state_dict()[k], v) for k, v in new.items())
    assert not all(torch.equal(new[k], v) for k, v in old.items())


def test_weight_swap_mid_request_stamps_each_token_with_its_own_version(tiny):
    """Partial rollout across a weight swap (invariant 2, policy version): tokens before the swap carry version
    v and old-policy logprobs, tokens after carry v+1 and new-policy logprobs; the KV cache is rebuilt."""
    old, new = copy.deepcopy(tiny), copy.deepcopy(tiny)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = EmbeddedEngine(copy.deepcopy(tiny), version=7)
    n_before = 4
    original = engine._record

    def record_then_swap(row, *drawn):       # swap the weights right after the 4th token is drawn
        original(row, *drawn)
        if len(row.token_ids) == n_before:
            engine.update_weights(new.state_dict(), version=8)
    engine._record = record_then_swap
    prompt = [11, 12, 13, 14]
    gen = engine.generate([prompt], SamplingParams(temperature=0.9, max_tokens=10, seed=5, stop_token_ids=(9999,)))[0]
    assert gen.policy_versions == [7] * n_before + [8] * (10 - n_before)
    lp_old = _recompute(old, [gen], 0.9)[0]
    lp_new = _recompute(new, [gen], 0.9)[0]
    behavior = torch.tensor(gen.behavior_logprobs)
    assert (behavior[:n_before] - lp_old[:n_before]).abs().max() <= 1e-5
    assert (behavior[n_before:] - lp_new[n_before:]).abs().max() <= 1e-5
    assert (behavior[n_before:] - lp_old[n_before:]).abs().max() > 1e-3   # each part matches only its version

    # trap armed: continuing on the old KV cache with the new weights gives different logprobs
    ids = torch.tensor([prompt + gen.token_ids[:n_before]])
    cache = DynamicCache()
    with torch.no_grad():
        old(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        stale = new(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
    stale_lp = torch.log_softmax(stale.float() / 0.9, -1)[gen.token_ids[n_before]]
    assert abs(stale_lp.item() - lp_new[n_before].item()) > 1e-4


def test_pause_holds_requests_and_resume_finishes_them(tiny):
    engine = EmbeddedEngine(tiny)
    engine.pause()
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        engine.generate(PROMPTS, SamplingParams(max_tokens=6, seed=0, stop_token_ids=(9999,)))))
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive() and not results          # held at a step boundary, not dropped
    engine.update_weights(tiny.state_dict(), version=1)   # a weight load goes through while paused
    engine.resume()
    worker.join(timeout=60)
    assert len(results) == len(PROMPTS) and all(len(g.token_ids) == 6 for g in results)
    assert all(g.policy_versions == [1] * 6 for g in results)


def test_moe_routes_cover_every_forwarded_position_and_replay_to_parity():
    moe = models.tiny_model("qwen3_moe", seed=0)
    gens = EmbeddedEngine(moe).generate(PROMPTS, PARAMS)
    layers = len(r3.moe_routers(moe))
    for g in gens:
        assert g.routes.shape == (len(g.prompt_ids) + len(g.token_ids) - 1, layers, moe.config.num_experts_per_tok)
        assert g.routes.min() >= 0
    # the engine's routes are the routes of a full forward over the same tokens
    seq = gens[0].prompt_ids + gens[0].token_ids
    with r3.capture_routes(moe) as captured, torch.no_grad():
        moe(input_ids=torch.tensor([seq]))
    assert (captured[-1][:-1].numpy() == gens[0].routes).all()
    assert _max_gap(gens, _recompute(moe, gens, 0.7, routes=True)) <= 1e-5


class PrefillSizes(EmbeddedEngine):
    """The real engine, recording the ids [rows, width] each prefill forwards."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.shapes: list[tuple[int, int]] = []

    def _forward(self, ids, mask, cache, extra):
        if ids.shape[1] > 1:
            self.shapes.append(tuple(ids.shape))
        return super()._forward(ids, mask, cache, extra)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_the_samples_of_a_group_share_one_prefill_and_each_keeps_its_own_draws(kind):
    """Four samples of two prompts: the prefill forwards the two distinct prompts once; each sample still draws
    its own tokens (seeded: the ids it draws alone), and every logprob (and MoE route) is the trainer's."""
    model = models.tiny_model(kind, seed=0)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[2]]
    params = [SamplingParams(temperature=0.7, max_tokens=8, seed=s) for s in (1, 2, 3, 4)]
    engine = PrefillSizes(model)
    gens = engine.generate(prompts, params)
    assert [rows for rows, _ in engine.shapes] == [2]
    assert len({tuple(g.token_ids) for g in gens[:3]}) == 3                  # three samples, three draws
    for g, p, prompt in zip(gens, params, prompts):
        alone = EmbeddedEngine(model).generate([prompt], [p])[0]
        assert alone.token_ids == g.token_ids
        if kind == "qwen3_moe":
            assert (alone.routes == g.routes).all()
    assert _max_gap(gens, _recompute(model, gens, 0.7, routes=kind == "qwen3_moe")) <= 1e-5


def _in_threads(calls: list) -> list:
    """Run each zero-argument call on its own thread, started 10 ms apart; their results (or errors), in order."""
    out: list = [None] * len(calls)

    def run(i):
        try:
            out[i] = calls[i]()
        except Exception as error:
            out[i] = error
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=120)
    return out


class StepSizes(EmbeddedEngine):
    """The real engine, recording how many rows each decode step forwards."""

    def __init__(self, model):
        super().__init__(model)
        self.sizes: list[int] = []

    def _step(self, batch):
        self.sizes.append(len(batch.rows))
        super()._step(batch)


def test_concurrent_callers_share_decode_steps_and_each_gets_its_own_result(tiny):
    engine = StepSizes(tiny)
    prompts = [[3 + i, 40 + i, 7] for i in range(8)]
    streamed: dict[int, list] = {i: [] for i in range(8)}
    engine.pause()        # hold decoding until every caller has submitted, however fast the machine is

    def resume_once_all_wait():
        while len(engine._waiting) < 8:
            time.sleep(0.001)
        engine.resume()
    threading.Thread(target=resume_once_all_wait, daemon=True).start()
    results = _in_threads([lambda i=i: engine.generate([prompts[i]], SamplingParams(max_tokens=5, seed=i),
                                                       on_token=lambda index, token: streamed[i].append((index, token)))[0]
                           for i in range(8)])
    assert max(engine.sizes) > 1                                   # callers shared forwards
    for i in range(8):
        alone = EmbeddedEngine(tiny).generate([prompts[i]], SamplingParams(max_tokens=5, seed=i))[0]
        assert results[i].prompt_ids == prompts[i] and results[i].token_ids == alone.token_ids
        assert streamed[i] == [(0, t) for t in alone.token_ids]   # each caller hears its own tokens, own index
    with pytest.raises(ValueError, match="temperature"):          # refused in its caller, never inside the batch
        engine.generate([[1, 2]], SamplingParams(temperature=-1))
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2, seed=0))[0].token_ids


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_a_short_request_joins_mid_batch_and_is_not_held_by_a_long_one(kind):
    """Continuous batching: a request that arrives while a long one decodes joins at the next step and leaves
    when it is done; both sample exactly what they sample alone (seeded), and MoE routes still cover every
    forwarded position of each, although their caches were merged and trimmed."""
    model = models.tiny_model(kind, seed=0)
    engine = EmbeddedEngine(model)
    long_params = SamplingParams(temperature=0.7, max_tokens=120, seed=1, stop_token_ids=(9999,))
    short_params = SamplingParams(temperature=0.7, max_tokens=4, seed=2, stop_token_ids=(9999,))
    long_prompt, short_prompt = [5, 17, 33, 2, 91], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    progress, seen_at_short_end = [], []
    started = threading.Event()

    def on_long(_, token):
        progress.append(token)
        if len(progress) == 5:
            started.set()
    long_job = threading.Thread(target=lambda: progress.append(engine.generate([long_prompt], long_params, on_long)))
    long_job.start()
    assert started.wait(60)
    short = engine.generate([short_prompt], short_params)[0]
    seen_at_short_end.append(len(progress))
    long_job.join(timeout=120)
    long = progress[-1][0]
    assert seen_at_short_end[0] < 60                 # the short reply was done long before the long one
    for gen, prompt, params in [(long, long_prompt, long_params), (short, short_prompt, short_params)]:
        alone = EmbeddedEngine(model).generate([prompt], params)[0]
        assert gen.token_ids == alone.token_ids and len(gen.token_ids) == params.max_tokens
        assert gen.behavior_logprobs == pytest.approx(alone.behavior_logprobs, abs=1e-5)
        if kind == "qwen3_moe":
            seq = prompt + gen.token_ids
            assert gen.routes.shape[0] == len(seq) - 1 and gen.routes.min() >= 0
            with r3.capture_routes(model) as captured, torch.no_grad():
                model(input_ids=torch.tensor([seq]))
            assert (captured[-1][:-1].numpy() == gen.routes).all()


def test_a_failing_row_fails_alone_and_the_rest_of_its_batch_finishes(tiny):
    """A request the sampler or its prefill cannot serve fails in its own caller; every other request in the
    same batch gets exactly the reply it gets alone (with run-to-completion batching, one error failed all)."""
    class Poisoned(EmbeddedEngine):
        def _prefill(self, rows):
            if any(r.prompt_ids == [66, 66] for r in rows):
                raise RuntimeError("this prompt breaks the forward")
            return super()._prefill(rows)

    engine = Poisoned(tiny)
    params = SamplingParams(max_tokens=6, seed=4, stop_token_ids=(9999,))

    def shouting(index, token):
        raise RuntimeError("the listener failed")
    calls = [lambda i=i: engine.generate([[3 + i, 40 + i, 7]], params)[0] for i in range(6)]
    calls[2] = lambda: engine.generate([[66, 66]], params)                   # fails in its prefill
    calls[4] = lambda: engine.generate([[9, 9, 9]], params, on_token=shouting)   # fails at its first token
    engine.pause()                   # everybody queues, then all are admitted into one batch
    results = _in_threads([*calls, lambda: engine.resume()])[:-1]
    assert isinstance(results[2], RuntimeError) and "breaks the forward" in str(results[2])
    assert isinstance(results[4], RuntimeError) and "listener" in str(results[4])
    for i in (0, 1, 3, 5):
        alone = EmbeddedEngine(tiny).generate([[3 + i, 40 + i, 7]], params)[0]
        assert results[i].token_ids == alone.token_ids
    assert engine.generate([[1, 2]], params)[0].token_ids                 # and the engine keeps serving


def test_a_reprefill_after_a_weight_swap_keeps_the_routes_already_recorded():
    """An MoE request kept across a swap (drain_on_update=False; the default drains): first writer wins, as in the
    ledger and a prefix cache: positions forwarded before the swap keep the routes the tokens sampled so far were
    conditioned on; only positions forwarded after take the new routes."""
    old = models.tiny_model("qwen3_moe", seed=0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for router in r3.moe_routers(new):
            router.weight.add_(2.0 * torch.randn_like(router.weight))
    engine = EmbeddedEngine(copy.deepcopy(old), version=0, drain_on_update=False)
    n_before, original = 4, engine._record

    def record_then_swap(row, *drawn):
        original(row, *drawn)
        if len(row.token_ids) == n_before:
            engine.update_weights(new.state_dict(), version=1)
    engine._record = record_then_swap
    prompt = [11, 12, 13, 14, 15]
    gen = engine.generate([prompt], SamplingParams(max_tokens=8, seed=1, stop_token_ids=(9999,)))[0]
    assert gen.policy_versions == [0] * n_before + [1] * (8 - n_before)

    def routes_of(model):
        with r3.capture_routes(model) as captured, torch.no_grad():
            model(input_ids=torch.tensor([prompt + gen.token_ids]))
        return captured[-1][:-1].numpy()
    before_swap = len(prompt) + n_before - 1               # positions forwarded by the old weights
    old_routes, new_routes = routes_of(old), routes_of(new)
    assert (old_routes[:before_swap] != new_routes[:before_swap]).any()    # armed: the swap moves routes
    assert (gen.routes[:before_swap] == old_routes[:before_swap]).all()    # kept, not overwritten
    assert (gen.routes[before_swap:] == new_routes[before_swap:]).all()


def test_a_weight_swap_from_another_thread_replaces_the_routes_of_the_stale_step():
    """The usual update (the trainer's thread, not a listener: pause, load, resume) of an MoE request kept across it
    (drain_on_update=False) lands between two passes, after the old weights' step has forwarded the newest token:
    no token was sampled from that forward, so the re-prefill's routes for its position replace it, and every route
    after the kept ones is the new weights'."""
    old = models.tiny_model("qwen3_moe", seed=0)
    new = copy.deepcopy(old)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in r3.moe_routers(new):
            router.weight.add_(2.0 * torch.randn_like(router.weight))
    engine = EmbeddedEngine(copy.deepcopy(old), version=0, drain_on_update=False)
    heard = threading.Event()
    prompt, result = [11, 12, 13, 14, 15], []
    worker = threading.Thread(target=lambda: result.extend(engine.generate(
        [prompt], SamplingParams(max_tokens=120, seed=1, stop_token_ids=(9999,)),
        on_token=lambda i, t: heard.set())))
    worker.start()
    assert heard.wait(60)
    engine.pause()             # as the runtime's push does: the pass in progress ends, its step included
    engine.update_weights(new.state_dict(), version=1)
    engine.resume()
    worker.join(timeout=120)
    gen = result[0]
    n1 = gen.policy_versions.count(0)
    assert 1 <= n1 < 120

    def routes_of(model):
        with r3.capture_routes(model) as captured, torch.no_grad():
            model(input_ids=torch.tensor([prompt + gen.token_ids]))
        return captured[-1][:-1].numpy()
    before = len(prompt) + n1 - 1
    old_routes, new_routes = routes_of(old), routes_of(new)
    assert (old_routes[before] != new_routes[before]).any()      # armed: the stale step's position moves
    assert (gen.routes[:before] == old_routes[:before]).all()
    assert (gen.routes[before:] == new_routes[before:]).all()


def _perturbed(model, scale=0.05, seed=1):
    """A copy of `model` with every weight nudged (an optimizer step's size of change)."""
    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return new


def _moe_pair():
    """A tiny MoE and a copy whose every router moved (most positions change experts)."""
    old = models.tiny_model("qwen3_moe", seed=0)
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in r3.moe_routers(new):
            router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=generator))
    return old, new


def _routes_of(model, gen) -> np.ndarray:
    """A fresh full forward's routes for every position of gen that was forwarded [P + n - 1, L, k]."""
    with r3.capture_routes(model) as captured, torch.no_grad():
        model(input_ids=torch.tensor([gen.prompt_ids + gen.token_ids]))
    return captured[-1][:-1].numpy()


def _update_during_a_long_request(engine, new_state, pause_first: bool, n_before=5):
    """A long request; at its n_before-th token its decoding is held (in its listener) while, on another thread, a
    weight update starts (after a pause from this thread, as the runtime's push does, or alone) and a short request
    is submitted; then it is let go. Returns (long, short, the engine version each of the long request's tokens saw
    when it was sampled)."""
    held, go, seen, out = threading.Event(), threading.Event(), [], {}

    def listen(_, token):
        seen.append(engine.version)
        if len(seen) == n_before:
            held.set()
            assert go.wait(60)

    def push():
        engine.update_weights(new_state, engine.version + 1)
        if pause_first:
            engine.resume()
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=1, stop_token_ids=(9999,))
    long_job = threading.Thread(target=lambda: out.setdefault("long", engine.generate([[11, 12, 13, 14, 15]], params,
                                                                                      listen)[0]))
    long_job.start()
    assert held.wait(60)
    if pause_first:
        engine.pause()
    update = threading.Thread(target=push)
    update.start()
    while engine._admitting and not pause_first and engine.drain_on_update:   # the update has begun to drain
        time.sleep(0.001)
    short_job = threading.Thread(target=lambda: out.setdefault("short", engine.generate(
        [[7, 8, 9]], SamplingParams(temperature=0.9, max_tokens=6, seed=2, stop_token_ids=(9999,)))[0]))
    short_job.start()
    while not engine._waiting:
        time.sleep(0.001)
    go.set()
    for job in (long_job, update, short_job):
        job.join(timeout=120)
    return out["long"], out["short"], seen


def test_an_moe_update_waits_for_the_request_in_flight_so_every_position_has_the_routes_its_tokens_saw():
    """drain_on_update, an MoE model's default: an update from another thread waits while a long request finishes,
    so all its tokens carry the old version and its routes at every position are a fresh forward's at the old
    weights (the trainer replays them to parity); a request submitted during the drain waits, then runs wholly at
    the new version with the new weights' routes."""
    old, new = _moe_pair()
    for pause_first in (False, True):
        engine = EmbeddedEngine(copy.deepcopy(old), version=0)
        assert engine.drain_on_update
        long, short, seen = _update_during_a_long_request(engine, new.state_dict(), pause_first)
        assert seen == [0] * 40 and long.policy_versions == [0] * 40          # the weights never moved under it
        assert short.policy_versions == [1] * 6 and engine.version == 1
        for gen, weights in ((long, old), (short, new)):
            assert (gen.routes == _routes_of(weights, gen)).all()
            assert _max_gap([gen], _recompute(weights, [gen], 0.9, routes=True)) <= 1e-5
        assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].policy_versions == [1, 1]   # admits again


def test_an_moe_request_kept_across_an_update_has_no_route_set_that_replays_all_its_tokens():
    """The negative control, drain_on_update=False: the long request spans both versions, and no route set serves
    it. Its recorded routes (first writer wins) are the old weights' where the new weights route otherwise, so
    replaying them with the new weights misses the tokens sampled after the update; the new weights' routes (what
    a re-prefill computed) give those tokens their logprobs but miss the ones before the update."""
    old, new = _moe_pair()
    engine = EmbeddedEngine(copy.deepcopy(old), version=0, drain_on_update=False)
    long, short, _ = _update_during_a_long_request(engine, new.state_dict(), pause_first=True)
    n1 = long.policy_versions.count(0)
    assert n1 == 5 and long.policy_versions == [0] * n1 + [1] * (40 - n1) and short.policy_versions == [1] * 6
    cut = len(long.prompt_ids) + n1 - 1                     # positions forwarded by the old weights
    old_routes, new_routes = _routes_of(old, long), _routes_of(new, long)
    assert (long.routes[:cut] == old_routes[:cut]).all() and (long.routes[:cut] != new_routes[:cut]).any()
    behavior = torch.tensor(long.behavior_logprobs)

    def gaps(weights, routes):
        replay = torch.full((1, len(long.prompt_ids) + 40, *routes.shape[1:]), -1, dtype=torch.long)
        replay[0, :len(routes)] = torch.from_numpy(routes).long()
        ids = torch.tensor([long.prompt_ids + long.token_ids])
        with torch.no_grad():
            lp = sequence_logprobs(weights, ids, torch.ones_like(ids), 0.9, routes=replay)[0, len(long.prompt_ids):]
        return (behavior[:n1] - lp[:n1]).abs().max().item(), (behavior[n1:] - lp[n1:]).abs().max().item()
    assert gaps(old, long.routes)[0] <= 1e-5 and gaps(new, long.routes)[1] > 1e-3   # recorded: after the update off
    assert gaps(new, new_routes)[1] <= 1e-5 and gaps(old, new_routes)[0] > 1e-3     # recomputed: before it off
    # so the prefix cache keeps the short request's row (one version), and not the long one's KV and routes
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.lookup(long.prompt_ids, 1) == (None, 0)


def test_a_draining_update_refuses_to_run_on_the_decoding_thread():
    """A listener that loads weights under the drain policy would wait for its own request: refused, saying why."""
    old, new = _moe_pair()
    engine = EmbeddedEngine(copy.deepcopy(old), version=0)
    errors = []

    def listen(_, token):
        if not errors:
            try:
                engine.update_weights(new.state_dict(), version=1)
            except RuntimeError as error:
                errors.append(error)
    engine.generate([[5, 6]], SamplingParams(max_tokens=3, seed=0), listen)
    assert errors and "decoding thread" in str(errors[0]) and engine.version == 0


def test_a_weight_swap_reprefills_every_row_of_a_merged_batch_at_its_own_progress(tiny):
    """Two requests that joined the batch at different steps see one weight swap: each carries [v]*n1 + [v+1]*n2
    with its own n1, and each token's logprob is the one its own version's weights give (no row decodes on from
    a cache the old weights filled)."""
    new = copy.deepcopy(tiny)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = EmbeddedEngine(copy.deepcopy(tiny), version=3)
    params = SamplingParams(temperature=0.9, max_tokens=16, seed=6, stop_token_ids=(9999,))
    joined, long_tokens = threading.Event(), []

    def on_long(_, token):
        long_tokens.append(token)
        if len(long_tokens) == 3:
            joined.set()
        if len(long_tokens) == 10:          # on the decoding thread, between two steps
            engine.update_weights(new.state_dict(), version=4)
    results = {}
    long_job = threading.Thread(target=lambda: results.setdefault(
        "long", engine.generate([[5, 17, 33, 2]], params, on_long)[0]))
    long_job.start()
    assert joined.wait(60)
    results["short"] = engine.generate([[7, 8, 9]], params)[0]
    long_job.join(timeout=60)
    n1s = []
    for gen in (results["long"], results["short"]):
        n1 = gen.policy_versions.count(3)
        assert gen.policy_versions == [3] * n1 + [4] * (len(gen.token_ids) - n1) and 0 < n1 < len(gen.token_ids)
        behavior = torch.tensor(gen.behavior_logprobs)
        assert (behavior[:n1] - _recompute(tiny, [gen], 0.9)[0][:n1]).abs().max() <= 1e-5
        assert (behavior[n1:] - _recompute(new, [gen], 0.9)[0][n1:]).abs().max() <= 1e-5
        n1s.append(n1)
    assert n1s[0] == 10 and n1s[1] < 10          # the short one joined later: fewer tokens before the swap


# ---- min_p, logit_bias, penalties and grammars in the engine (their parity with the trainer: test_sampling.py) ----

@pytest.mark.parametrize("field, message", [
    ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \[0.01, 10\]"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"presence_penalty": float("nan")}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"logit_bias": ((5, 101.0),)}, r"each bias in \[-100, 100\] or -inf"),
    ({"logit_bias": ((7, 1.0), (5, 1.0))}, "sorted by id, one per id"),
    ({"logit_bias": ((690, 1.0),)}, r"\(token id < 690, bias\)"),
    ({"logit_bias": {5: 1.0}}, "must be a tuple"),
    ({"constraint": constraints.json_object_spec()}, "tokenizer"),
])
def test_bad_logit_processing_is_refused_saying_what_is_accepted(tiny, field, message):
    engine = EmbeddedEngine(tiny)
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2, **field))
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids      # and it keeps serving


def test_plain_requests_keep_plain_records_and_a_bad_grammar_fails_in_its_caller(tiny):
    gen = EmbeddedEngine(tiny).generate([[1, 2]], SamplingParams(temperature=0.7, top_k=5, max_tokens=2))[0]
    assert gen.sampling == invariants.Sampling(0.7, 1.0, 5) and gen.sampling.generation_start == -1
    engine = EmbeddedEngine(tiny, tokenizer=models.bpe_tokenizer())
    with pytest.raises(ValueError, match="not a constraint spec"):
        engine.generate([[1, 2]], SamplingParams(constraint='{"type": "object"}'))


def test_a_row_whose_grammar_and_bans_leave_no_token_fails_alone(tiny):
    tok = models.bpe_tokenizer()
    engine = EmbeddedEngine(tiny, tokenizer=tok)
    spec = constraints.json_object_spec()
    first = constraints.matcher(constraints.bind(spec, [tok.eos_token_id]), tok, 690).allowed().nonzero().flatten()
    banned = SamplingParams(max_tokens=4, constraint=spec, logit_bias=tuple((int(t), -math.inf) for t in first))
    plain = SamplingParams(max_tokens=6, seed=4, stop_token_ids=(9999,))
    engine.pause()
    results = _in_threads([lambda: engine.generate([[5, 6]], banned), lambda: engine.generate([[7, 8]], plain)[0],
                           lambda: engine.resume()])
    assert isinstance(results[0], ValueError) and "no token is left" in str(results[0])
    assert results[1].token_ids == EmbeddedEngine(tiny).generate([[7, 8]], plain)[0].token_ids


def test_a_weight_swap_keeps_a_rows_grammar_and_penalty_state(tiny):
    """The grammar's place and the penalties' counts live in the row, not in the KV cache: after a swap and a
    re-prefill, the tokens before it match the old policy and the rest the new one, both processed in full."""
    tok = models.bpe_tokenizer()
    new = copy.deepcopy(tiny)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine = EmbeddedEngine(copy.deepcopy(tiny), version=7, tokenizer=tok)
    original = engine._record

    def record_then_swap(row, *drawn):
        original(row, *drawn)
        if len(row.token_ids) == 4:
            engine.update_weights(new.state_dict(), version=8)
    engine._record = record_then_swap
    params = SamplingParams(temperature=0.9, max_tokens=16, seed=5, repetition_penalty=1.5, frequency_penalty=1.0,
                            constraint=constraints.json_object_spec())
    gen = engine.generate([[11, 12, 13, 14]], params)[0]
    assert gen.policy_versions[:5] == [7, 7, 7, 7, 8]
    ledger = invariants.TokenLedger("r", "g")
    ledger.extend_or_seal(gen.prompt_ids)
    ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling)
    batch = invariants.build_batch(ledger.rows(), [1.0], pad_id=0, grammar_masks=constraints.mask_replayer(tok, 690))
    with torch.no_grad():
        old_lp, new_lp = (batch_logprobs(m, batch)[0, 4:4 + len(gen.token_ids)] for m in (tiny, new))
    behavior = torch.tensor(gen.behavior_logprobs)
    assert (behavior[:4] - old_lp[:4]).abs().max() <= 1e-5 and (behavior[4:] - new_lp[4:]).abs().max() <= 1e-5


def test_the_engines_kv_cache_and_grouped_attention_compute_what_transformers_does_bitwise(monkeypatch):
    """The engine's model attends with its KV head groups as they are (no copy per query head) and keeps its cache
    in buffers with room to grow (no copy per step): over a left-padded prefill, decode steps past the room and a
    row leaving the batch, its logits equal stock transformers' (sdpa, a DynamicLayer cache) bit for bit."""
    monkeypatch.setattr(rollout._GrowingLayer, "ROOM", 3)       # the buffers regrow twice in 8 steps
    stock = models.tiny_model("qwen3", seed=0)
    assert stock.config.num_key_value_heads < stock.config.num_attention_heads   # grouped-query attention
    engine = EmbeddedEngine(copy.deepcopy(stock))
    assert engine.model.config._attn_implementation == rollout.GROUPED_SDPA
    assert stock.config._attn_implementation == "sdpa"
    seqs = [[5, 17, 33, 2, 91], [7, 8], [100, 101, 102, 103]]
    ids = torch.tensor([[0] * (5 - len(s)) + s for s in seqs])
    mask = (torch.arange(5) >= torch.tensor([5 - len(s) for s in seqs])[:, None]).long()
    steps = torch.randint(0, 690, (8, 3), generator=torch.Generator().manual_seed(0))

    def decode(model, layer):
        cache = DynamicCache()
        cache.layer_class_to_replicate = layer
        logits = [model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]]
        batch = rollout._Batch([None] * 3, cache, mask, mask.sum(-1), logits[0], 0)
        for t, step in enumerate(steps):
            if t == 4:                          # row 1 leaves: the others' cache rows are copied out
                batch = rollout._select(batch, [0, 2])
            batch.attention = torch.cat([batch.attention, batch.attention.new_ones(len(batch.rows), 1)], 1)
            logits.append(model(input_ids=step[[0, 2] if t >= 4 else [0, 1, 2], None], attention_mask=batch.attention,
                                past_key_values=cache, position_ids=batch.next_positions[:, None]).logits[:, -1])
            batch.next_positions = batch.next_positions + 1
        return logits
    with torch.no_grad():
        ours = decode(engine.model, rollout._GrowingLayer)
        theirs = decode(stock, DynamicLayer)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_engines_draw_is_torch_multinomials_draw_and_leaves_the_generator_where_it_would():
    """rollout.multinomial reads torch's random stream more cheaply than torch.multinomial but must draw the same
    index from every row and consume exactly as much of the stream (seeded replies stay the same): flat, peaked,
    truncated (zeros) and unnormalised rows, one row or several, the engine's vocabulary width included."""
    torch.manual_seed(1)
    for trial in range(120):
        rows, width = int(torch.randint(1, 6, ())), int(torch.randint(1, 3000, ())) if trial else 49152
        logits = torch.randn(rows, width) * float(torch.rand(()) * 20)
        if trial % 3 == 0:
            logits[:, torch.rand(width) < 0.7] = -float("inf")
            logits[:, 0] = 0
        probs = torch.softmax(logits, -1) * (1.0 if trial % 2 else 3.7)
        theirs, ours = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        for _ in range(3):
            assert torch.equal(torch.multinomial(probs, 1, generator=theirs).squeeze(-1),
                               rollout.multinomial(probs, ours))
        assert torch.equal(theirs.get_state(), ours.get_state())
    with pytest.raises(RuntimeError):                          # a bad row is refused as torch refuses it
        rollout.multinomial(torch.tensor([[0.5, float("nan")]]), torch.Generator())


def test_the_engines_output_projection_in_vocabulary_slices_gives_the_models_logits_bitwise(monkeypatch):
    """On a CPU the engine applies a plain model's output projection itself, in slices of the vocabulary: over a
    left-padded prefill and decode steps its logits equal the model's own forward (of the last position, as the
    engine asks it: a product over more rows may round differently) bit for bit."""
    monkeypatch.setattr(rollout, "VOCAB_SLICE", 100)           # the tiny vocabulary in several slices
    stock = models.tiny_model("qwen3", seed=0)
    engine = EmbeddedEngine(copy.deepcopy(stock))
    assert engine._decoder is not None and stock.config.vocab_size > 2 * rollout.VOCAB_SLICE
    seqs = [[5, 17, 33, 2, 91], [7, 8], [100, 101, 102, 103]]
    ids = torch.tensor([[0] * (5 - len(s)) + s for s in seqs])
    mask = (torch.arange(5) >= torch.tensor([5 - len(s) for s in seqs])[:, None]).long()
    steps = torch.randint(0, 690, (4, 3), generator=torch.Generator().manual_seed(0))
    ours, theirs = DynamicCache(), DynamicCache()
    with torch.no_grad():
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        logits = engine._forward(ids, mask, ours, extra)[0]
        assert torch.equal(logits, stock(input_ids=ids, attention_mask=mask, past_key_values=theirs, logits_to_keep=1,
                                         **extra).logits[:, -1])
        for step in steps:
            mask = torch.cat([mask, mask.new_ones(3, 1)], 1)
            extra = {"position_ids": mask.sum(-1, keepdim=True) - 1}
            logits = engine._forward(step[:, None], mask, ours, extra)[0]
            assert torch.equal(logits, stock(input_ids=step[:, None], attention_mask=mask, past_key_values=theirs,
                                             **extra).logits[:, -1])


# ---- prefix reuse: an agent's next turn prefills only what it adds ---------------------------------------

REUSE_PARAMS = SamplingParams(temperature=0.8, max_tokens=12, seed=7, stop_token_ids=(9999,))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_a_turn_that_extends_the_last_prefills_only_its_new_ids_and_samples_what_a_full_prefill_does(kind):
    """Three turns of an agent episode (each prompt: the last one, its reply, then a tool result), each after the
    first batched with a stranger, a prompt that shares only the episode's first ten ids and a second sample of the
    turn, all leaving at different steps: each row takes from the prefix cache exactly the positions it shares with
    a finished row, the prefill forwards only the rest (the second sample shares its forward), and every row samples
    the tokens and logprobs (and an MoE row the routes) an engine without the cache samples, which are the trainer's
    recompute (fp32)."""
    model = models.tiny_model(kind, seed=0)
    engine, plain = PrefillSizes(model), EmbeddedEngine(model, prefix_cache_bytes=0)
    moe = kind == "qwen3_moe"
    prompt, last = PROMPTS[2] * 4, None
    for turn in range(3):
        batch = [prompt] + ([[200 + turn, 201, 202], prompt[:10] + [300 + turn, 301], prompt] if turn else [])
        params = [REUSE_PARAMS, dataclasses.replace(REUSE_PARAMS, max_tokens=5),
                  dataclasses.replace(REUSE_PARAMS, max_tokens=20), dataclasses.replace(REUSE_PARAMS, seed=8)]
        gens, full = engine.generate(batch, params[:len(batch)]), plain.generate(batch, params[:len(batch)])
        episode = len(last.prompt_ids) + len(last.token_ids) - 1 if turn else 0
        reused = [episode, 0, 10, episode][:len(batch)]
        assert [g.cached_prompt_tokens for g in gens] == reused
        assert engine.shapes[-1] == (min(len(batch), 3), max(len(p) - k for p, k in zip(batch, reused)))
        for g, f in zip(gens, full):
            assert g.token_ids == f.token_ids and g.cached_prompt_tokens <= len(g.prompt_ids) - 1
            assert max(abs(a - b) for a, b in zip(g.behavior_logprobs, f.behavior_logprobs)) <= 1e-5
            assert not moe or (g.routes == f.routes).all()
        assert _max_gap(gens, _recompute(model, gens, 0.8, routes=moe)) <= 1e-5
        last, prompt = gens[0], prompt + gens[0].token_ids + [400 + turn, 401, 402]   # the reply, a tool result
    # the episode's turns hold one entry (each turn's replaced the last's), beside the others of turns 1 and 2
    assert len(engine.prefix_cache) == 1 + 2 * 3
    assert [g.cached_prompt_tokens for g in full] == [0, 0, 0, 0]


def test_kv_of_old_weights_is_never_reused_after_an_update_and_would_be_caught_if_it_were(tiny):
    """Invariant 2: a weight load empties the prefix cache, and an entry of an older version is refused even where
    one survives, so the turn after an update computes its whole prompt with the new weights (the trainer's
    recompute under them, to fp32). Armed: an engine made to hand out the old entries as current reuses their KV,
    and its logprobs then miss the new weights' by far more than the tolerance."""
    new = _perturbed(tiny)

    def next_turn_after_an_update(engine: EmbeddedEngine):
        first = engine.generate([PROMPTS[2] * 4], REUSE_PARAMS)[0]
        assert len(engine.prefix_cache) == 1
        engine.update_weights(new.state_dict(), version=1)
        gen = engine.generate([first.prompt_ids + first.token_ids + [7, 8]], REUSE_PARAMS)[0]
        assert gen.policy_versions == [1] * len(gen.token_ids)
        return gen, (torch.tensor(gen.behavior_logprobs) - _recompute(new, [gen], 0.8)[0]).abs().max().item()

    gen, gap = next_turn_after_an_update(EmbeddedEngine(copy.deepcopy(tiny)))
    assert gen.cached_prompt_tokens == 0 and gap <= 1e-5
    kept = EmbeddedEngine(copy.deepcopy(tiny))
    kept.prefix_cache.drop = lambda: None                      # the entries survive the load ...
    gen, gap = next_turn_after_an_update(kept)
    assert gen.cached_prompt_tokens == 0 and gap <= 1e-5       # ... and their version still refuses them
    stale = EmbeddedEngine(copy.deepcopy(tiny))
    stale.prefix_cache.drop = lambda: None
    lookup = stale.prefix_cache.lookup
    stale.prefix_cache.lookup = lambda ids, version, salts: lookup(ids, 0, salts)   # the old entries handed out as current
    gen, gap = next_turn_after_an_update(stale)
    assert gen.cached_prompt_tokens > 0 and gap > 1e-3


def test_a_row_that_finishes_in_a_pass_whose_listener_loaded_new_weights_is_not_kept(tiny):
    """A listener on the decoding thread may load weights in the middle of a pass (drain_on_update=False): a row
    that finishes in that pass holds KV of the old weights, so it stays out of the prefix cache; the same row
    finishing without an update is kept (armed)."""
    engine = EmbeddedEngine(copy.deepcopy(tiny), drain_on_update=False)
    params = SamplingParams(max_tokens=4, seed=1, stop_token_ids=(9999,))
    engine.generate([PROMPTS[0]], params)
    assert len(engine.prefix_cache) == 1
    new, heard = _perturbed(tiny), []

    def listener(index, token_id):
        heard.append(token_id)
        if len(heard) == params.max_tokens:
            engine.update_weights(new.state_dict(), version=1)
    gen = engine.generate([PROMPTS[1]], params, on_token=listener)[0]
    assert gen.policy_versions == [0] * 4 and engine.version == 1
    assert len(engine.prefix_cache) == 0


def test_a_vision_model_computes_every_prompt_whole():
    """A VLM's positions (M-RoPE) come from its whole prompt: its engine keeps no prefix, even for text."""
    engine = EmbeddedEngine(models.tiny_model("qwen2_5_vl", seed=0))
    first = engine.generate([PROMPTS[2]], REUSE_PARAMS)[0]
    again = engine.generate([first.prompt_ids + first.token_ids], REUSE_PARAMS)[0]
    assert (first.cached_prompt_tokens, again.cached_prompt_tokens, len(engine.prefix_cache)) == (0, 0, 0)
