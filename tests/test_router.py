# The router in front of the engines: sticky sessions, least-loaded placement, results in request
# order, and a weight update that reaches every engine (every later token carries the new version).
import copy

import pytest
import torch

import models
from rollout import EmbeddedEngine, SamplingParams
from router import Router

PARAMS = SamplingParams(max_tokens=3, seed=0, stop_token_ids=(10_000,))


@pytest.fixture()
def two_engines():
    model = models.tiny_model("qwen3", seed=0)
    return [EmbeddedEngine(copy.deepcopy(model)), EmbeddedEngine(copy.deepcopy(model))]


class Recording:
    """An engine wrapper that remembers which prompts it served."""

    def __init__(self, engine):
        self.engine, self.served = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, on_token=None, images=None):
        self.served.extend(tuple(p) for p in prompts)
        return self.engine.generate(prompts, params, on_token, images=images)


def test_a_session_always_lands_on_the_same_engine(two_engines):
    router = Router([Recording(e) for e in two_engines])
    sessions = [f"rollout-{i}" for i in range(8)]
    for _ in range(3):
        router.generate([[i + 1, 2] for i in range(8)], PARAMS, session_ids=sessions)
    for engine in router.engines:
        assert len(set(engine.served)) * 3 == len(engine.served)      # each prompt thrice, same engine
    assert set(router.engines[0].served).isdisjoint(router.engines[1].served)
    assert router.in_flight == [0, 0]


def test_results_come_back_in_request_order(two_engines):
    router = Router(two_engines)
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    routed = router.generate(prompts, PARAMS, session_ids=[f"s{i}" for i in range(6)])
    assert [g.prompt_ids for g in routed] == prompts
    alone = two_engines[0].generate(prompts, PARAMS)
    assert [g.token_ids for g in routed] == [g.token_ids for g in alone]   # same weights, same seed


def test_without_a_session_the_least_loaded_engine_serves(two_engines):
    router = Router(two_engines)
    router.in_flight = [5, 0]
    assert router.pick(None) == 1
    router.in_flight = [0, 2]
    assert router.pick(None) == 0


def test_update_weights_reaches_every_engine_and_stamps_the_new_version(two_engines):
    router = Router(two_engines)
    state = {k: v + 0.01 for k, v in two_engines[0].model.state_dict().items()}
    router.update_weights(state, version=5)
    assert router.version == 5 and all(e.version == 5 for e in two_engines)
    for engine in two_engines:
        assert torch.equal(engine.model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    gens = router.generate([[1, 2], [3, 4]], PARAMS, session_ids=["a", "b"])
    assert all(g.policy_versions == [5] * 3 for g in gens)


def test_a_failed_load_still_resumes_every_engine(two_engines):
    router = Router(two_engines)
    with pytest.raises(ValueError, match="missing keys"):
        router.update_weights({}, version=1)
    assert all(e._running.is_set() for e in two_engines)     # no engine left paused (a leaked pause hangs)
    with pytest.raises(ValueError, match="at least one engine"):
        Router([])
