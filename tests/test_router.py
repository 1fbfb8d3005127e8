# The router in front of several real EmbeddedEngines: a session (a multi-turn rollout, a loopback session over
# real HTTP and the openai SDK) stays on one engine; otherwise the engine with the fewest outstanding tokens
# serves; engines sample at the same time; an engine streams tokens only to a caller that listens; an engine that
# dies or hangs is taken out and its requests are retried on another with exactly the seeded tokens, or raised as
# lost, never dropped, while one that is only slow keeps its requests; the control plane reaches live engines
# only, and an engine rejoins only with the current weights.
import copy
import logging
import threading
import time
from dataclasses import replace

import openai
import pytest
import torch

import data
import models
from engines import SamplingParams
from loopback import LoopbackServer
from rollout import EmbeddedEngine
from router import EngineFailure, Router
from test_agents import SAMPLING, RecordingEngine, TwoTurnEnv, make_tasks, runner_for
from test_rollout import PARAMS, PROMPTS

SHORT = SamplingParams(max_tokens=3, seed=0, stop_token_ids=(10_000,))     # never stops early: exactly 3 tokens


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return models.bpe_tokenizer()


@pytest.fixture()
def two_engines(tiny):
    return [RecordingEngine(copy.deepcopy(tiny)), RecordingEngine(copy.deepcopy(tiny))]


def served_by(engines, prompt: list[int]) -> list[int]:
    """The engines whose recorded calls include `prompt`."""
    return [e for e, engine in enumerate(engines) if any(prompt in call.prompts for call in engine.calls)]


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


class Dying:
    """A real engine that dies mid-run: once `after` tokens have been sampled, the generate in flight and every
    later call (and every control call) raise, as a crashed engine process's proxy would, until `revive()`."""

    def __init__(self, engine, after: int):
        self.engine, self.after, self.sampled = engine, after, 0
        self.control: list[str] = []       # the control calls that reached it

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def dead(self) -> bool:
        return self.sampled >= self.after

    def revive(self) -> None:
        self.after = float("inf")

    def generate(self, prompts, params, on_token=None, images=None):
        if self.dead():
            raise RuntimeError("engine process died")

        def counting(index, token_id):
            self.sampled += 1
            if self.dead():
                raise RuntimeError("engine process died")
            if on_token is not None:
                on_token(index, token_id)
        return self.engine.generate(prompts, params, counting, images=images)

    def _control(self, name, *args):
        if self.dead():
            raise RuntimeError("engine process died")
        self.control.append(name)
        return getattr(self.engine, name)(*args)

    def pause(self):
        return self._control("pause")

    def resume(self):
        return self._control("resume")

    def update_weights(self, state, version):
        return self._control("update_weights", state, version)

    def sampler_state(self):
        return self._control("sampler_state")

    def load_sampler_state(self, state):
        return self._control("load_sampler_state", state)


class Hanging:
    """A real engine whose generate hangs until the test releases it, then samples as usual."""

    def __init__(self, engine):
        self.engine, self.release, self.ended = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, on_token=None, images=None):
        try:
            self.release.wait()
            return self.engine.generate(prompts, params, on_token, images=images)
        finally:
            self.ended.set()


class Paced:
    """A real engine that records the listener (`on_token`) each generate call was given and samples
    `per_token_s` slower a token: a listener of its own sleeps on the decoding thread, so every request in the
    batch is slowed, a probe that joins it included, as on a loaded engine that still samples."""

    def __init__(self, engine, per_token_s: float = 0.0):
        self.engine, self.per_token_s = engine, per_token_s
        self.listeners: list = []          # each generate call's on_token, in call order

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, on_token=None, images=None):
        self.listeners.append(on_token)

        def paced(index, token_id):
            time.sleep(self.per_token_s)
            if on_token is not None:
                on_token(index, token_id)
        return self.engine.generate(prompts, params, paced, images=images)


def assert_equal_to_reference(gens, reference) -> None:
    """Seeded requests: the same ids whichever engine and batch drew them, logprobs to fp32 batch noise."""
    for g, r in zip(gens, reference, strict=True):
        assert g.prompt_ids == r.prompt_ids and g.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(g.behavior_logprobs, r.behavior_logprobs)) <= 1e-5


# ---- sticky sessions ----

def test_every_turn_of_a_multi_turn_rollout_goes_to_the_engine_that_served_its_first(two_engines, tokenizer):
    router = Router(two_engines)
    runner = runner_for(TwoTurnEnv, router, tokenizer, max_turns=2, max_length=256)
    rollouts = runner.run(make_tasks("a", "b", "c", "d"), ["g"] * 4, SAMPLING)
    homes = []
    for r in rollouts:
        assert r.num_turns == 2
        first, second = (served_by(two_engines, g.prompt_ids) for g in r.generations)
        assert first == second and len(first) == 1           # both turns on one engine, the one holding the prefix
        homes += first
    assert sorted(homes) == [0, 0, 1, 1]                      # the group was spread over both engines


def test_a_session_beats_load_and_a_request_without_one_goes_by_load(two_engines):
    router = Router(two_engines)
    router.generate([[1, 2], [3, 4]], SHORT, session_ids=["a", "b"])
    assert served_by(two_engines, [1, 2]) == [0] and served_by(two_engines, [3, 4]) == [1]
    two_engines[0].pause()                                   # engine 0 holds a long request: it is the loaded one
    threads = [threading.Thread(target=router.generate, args=([[9, 9, 9]], SamplingParams(max_tokens=40, seed=0)))]
    threads[0].start()
    wait_until(lambda: router.stats()[0].in_flight == 1)
    threads.append(threading.Thread(target=router.generate, args=([[1, 2, 5], [6, 7]], SHORT),
                                    kwargs={"session_ids": ["a", None]}))
    threads[1].start()
    wait_until(lambda: sum(s.in_flight for s in router.stats()) == 3)
    two_engines[0].resume()
    for t in threads:
        t.join()
    assert served_by(two_engines, [1, 2, 5]) == [0]          # session "a" stays on its engine under load
    assert served_by(two_engines, [6, 7]) == [1]             # without a session the unloaded engine serves


def test_the_router_serves_the_context_every_engine_serves(two_engines):
    two_engines[1].max_model_len = 100
    assert [e.max_model_len for e in two_engines] == [65536, 100] and Router(two_engines).max_model_len == 100


def test_sticky_assignments_are_bounded_least_recently_used_first(two_engines):
    router = Router(two_engines, max_sessions=2)
    router.generate([[1], [2]], SHORT, session_ids=["a", "b"])
    router.generate([[3]], SHORT, session_ids=["a"])          # "a" used again: "b" is now the least recent
    router.generate([[4]], SHORT, session_ids=["c"])
    assert list(router._sessions) == ["a", "c"]


def test_a_loopback_session_over_http_stays_on_one_engine_across_turns(two_engines, tokenizer):
    router = Router(two_engines)
    server = LoopbackServer(router, tokenizer, template=data.CHATML_TEMPLATE)
    server.start()
    try:
        homes = []
        for s in range(3):
            info = server.create_session(sampling=SamplingParams(max_tokens=6))
            client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
            messages, prompts = [{"role": "user", "content": f"hello {s}"}], []
            for k in range(3):
                reply = client.chat.completions.create(model="policy", messages=messages, seed=k,
                                                       extra_body={"return_token_ids": True})
                prompts.append(reply.model_extra["prompt_token_ids"])
                messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": f"and {k}?"}]
            session = server.close_session(info.session_id)
            assert len(session.ledger.segments) == 1            # every turn extended the one record
            engines = {tuple(served_by(two_engines, p)) for p in prompts}
            assert len(engines) == 1 and len(next(iter(engines))) == 1
            homes += engines.pop()
        assert set(homes) == {0, 1}                               # sessions opened one by one still spread
    finally:
        server.stop()


def test_a_turn_no_engine_can_serve_is_a_503_the_sdk_retries_and_the_server_keeps_serving(tiny, tokenizer):
    """Every engine dead: the OpenAI SDK's turn gets a 503 (a status its retry policy retries), nothing is
    recorded in the session, and once an engine rejoins the same turn goes through."""
    router = Router([Dying(EmbeddedEngine(tiny), after=0)])
    server = LoopbackServer(router, tokenizer, template=data.CHATML_TEMPLATE)
    server.start()
    try:
        info = server.create_session(sampling=SamplingParams(max_tokens=4))
        client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
        messages = [{"role": "user", "content": "hello"}]
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="policy", messages=messages)
        assert refused.value.status_code == 503 and "no engine could serve this turn" in str(refused.value)
        router.engines[0].revive()
        router.rejoin(0, tiny.state_dict(), version=0)
        reply = client.chat.completions.create(model="policy", messages=messages)
        assert reply.choices[0].message.content is not None
        session = server.close_session(info.session_id)
        assert len(session.ledger.segments) == 1 and router.lost == 1     # only the served turn was recorded
    finally:
        server.stop()

# ---- load: least outstanding tokens, engines side by side ----

def test_the_engine_with_fewest_outstanding_tokens_serves_not_the_one_with_fewest_requests(two_engines):
    router = Router(two_engines)
    for engine in two_engines:
        engine.pause()                                          # requests stay in flight until resumed
    threads = [threading.Thread(target=router.generate, args=([[1, 2]], replace(SHORT, max_tokens=50))),
               threading.Thread(target=router.generate, args=([[3], [4]], replace(SHORT, max_tokens=2)))]
    threads[0].start()
    wait_until(lambda: router.stats()[0].in_flight == 1)       # 50 tokens outstanding on engine 0
    threads[1].start()
    wait_until(lambda: router.stats()[1].in_flight == 2)       # both short ones to engine 1: 2 then 4 tokens
    threads.append(threading.Thread(target=router.generate, args=([[5]], replace(SHORT, max_tokens=2))))
    threads[-1].start()
    wait_until(lambda: sum(s.in_flight for s in router.stats()) == 4)
    stats = router.stats()
    assert [s.in_flight for s in stats] == [1, 3]              # engine 1 took it with more requests but 4 < 50 tokens
    assert [s.outstanding_tokens for s in stats] == [50, 6]
    for engine in two_engines:
        engine.resume()
    for t in threads:
        t.join()
    stats = router.stats()
    assert [s.outstanding_tokens for s in stats] == [0, 0] and [s.served for s in stats] == [1, 3]
    assert [s.tokens for s in stats] == [50, 6] and all(s.tokens_per_s > 0 for s in stats)


def test_two_engines_sample_at_the_same_time(two_engines):
    router = Router(two_engines)
    heard: dict[int, list[float]] = {0: [], 1: []}

    def slow_listener(index, token_id):          # runs on the engine's decoding thread, so it slows that engine
        heard[index].append(time.monotonic())
        time.sleep(0.05)
    started = time.monotonic()
    router.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=8, seed=0, stop_token_ids=(10_000,)), slow_listener)
    wall = time.monotonic() - started
    assert [s.served for s in router.stats()] == [1, 1]                       # one request per engine
    assert max(h[0] for h in heard.values()) < min(h[-1] for h in heard.values())   # their sampling overlapped
    assert wall < 2 * 8 * 0.05                                                # less than the two run one after another


# ---- streaming only for a caller that listens ----

def test_an_engine_gets_a_listener_only_when_the_caller_passed_one(tiny):
    paced = Paced(EmbeddedEngine(tiny))
    router = Router([paced])
    quiet = router.generate([[1, 2]], SHORT)
    heard = []
    streamed = router.generate([[1, 2]], SHORT, on_token=lambda i, t: heard.append(t))
    assert paced.listeners[0] is None and callable(paced.listeners[1]) and len(paced.listeners) == 2
    assert heard == streamed[0].token_ids == quiet[0].token_ids                  # the same seeded reply either way
    assert router.stats()[0].tokens == 6                                         # counted when not streamed too


def test_outstanding_tokens_of_a_call_not_streamed_are_held_until_it_answers_then_released(two_engines):
    router = Router(two_engines)
    for engine in two_engines:
        engine.pause()                                          # requests stay in flight until resumed
    long = replace(SHORT, max_tokens=20)
    threads = [threading.Thread(target=router.generate, args=([[1, 2]], long))]
    threads[0].start()
    wait_until(lambda: router.stats()[0].in_flight == 1)
    threads.append(threading.Thread(target=router.generate, args=([[3, 4]], long),
                                    kwargs={"on_token": lambda i, t: None}))
    threads[1].start()
    wait_until(lambda: router.stats()[1].in_flight == 1)
    two_engines[1].resume()                                     # the streamed call runs down its reservation
    threads[1].join(timeout=60)
    assert [s.outstanding_tokens for s in router.stats()] == [20, 0]
    two_engines[0].resume()                                     # the call not streamed releases its own at the end
    threads[0].join(timeout=60)
    stats = router.stats()
    assert [s.outstanding_tokens for s in stats] == [0, 0] and [s.in_flight for s in stats] == [0, 0]
    assert [s.tokens for s in stats] == [20, 20] and [s.served for s in stats] == [1, 1]


def test_a_call_not_streamed_on_a_slow_but_live_engine_is_probed_and_kept_not_failed_over(tiny):
    """25 tokens at 0.2 s each: the request takes 5 s, two and a half timeouts, without the router seeing a token;
    the probes join the running batch and answer, so the engine stays in and the request's own answer returns."""
    paced = Paced(EmbeddedEngine(copy.deepcopy(tiny)), per_token_s=0.2)
    router = Router([paced], timeout_s=2.0)
    params = [replace(SHORT, max_tokens=25)]
    gens = router.generate([[1, 2]], params)
    assert paced.listeners[0] is None and len(paced.listeners) >= 2       # the request, then at least one probe
    assert_equal_to_reference(gens, EmbeddedEngine(tiny).generate([[1, 2]], params))
    stats = router.stats()[0]
    assert stats.live and stats.failed == 0 and stats.served == 1 and router.lost == 0
    assert stats.outstanding_tokens == 0 and stats.in_flight == 0


def test_a_call_not_streamed_on_a_hung_engine_fails_over_once_the_probe_hangs_too(tiny):
    hanging, healthy = Hanging(EmbeddedEngine(copy.deepcopy(tiny))), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([hanging, healthy], timeout_s=1.0)
    try:
        started = time.monotonic()
        gens = router.generate(PROMPTS, PARAMS)
        assert 2.0 <= time.monotonic() - started < 30            # no answer for 1 s, then a probe hung for 1 s
        assert_equal_to_reference(gens, EmbeddedEngine(tiny).generate(PROMPTS, PARAMS))
        stats = router.stats()
        assert not stats[0].live and "answered nothing for 1 s and failed a probe" in stats[0].down_reason
        assert stats[0].failed == 2 and stats[1].served == 4 and stats[1].retried == 2 and router.lost == 0
        assert [s.outstanding_tokens for s in stats] == [0, 0] and [s.in_flight for s in stats] == [0, 0]
    finally:
        hanging.release.set()
    # the abandoned call answers late: its tokens are not counted
    for thread in threading.enumerate():
        if thread.name == "router-engine-0":
            thread.join(timeout=60)
    assert router.stats()[0].tokens == 0


# ---- failover ----

def test_an_engine_that_dies_mid_run_is_taken_out_and_its_requests_are_retried_exactly(tiny, caplog):
    dying, healthy = Dying(EmbeddedEngine(copy.deepcopy(tiny)), after=5), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([dying, healthy])
    prompts, params = PROMPTS * 2, PARAMS * 2
    sessions = [f"rollout-{i}" for i in range(len(prompts))]
    with caplog.at_level(logging.WARNING, logger="tracerl.router"):
        gens = router.generate(prompts, params, session_ids=sessions)
    assert dying.dead() and "taken out of rotation" in caplog.text
    assert_equal_to_reference(gens, EmbeddedEngine(tiny).generate(prompts, params))
    stats = router.stats()
    assert not stats[0].live and "engine process died" in stats[0].down_reason
    assert stats[0].failed == stats[1].retried == 3 and stats[1].served == 8 and router.lost == 0   # by tokens: 37/47
    assert router.metrics()["perf/engines_live"] == 1.0
    # the dead engine's sessions moved: their next turns go to the live engine
    assert_equal_to_reference(router.generate(prompts, params, session_ids=sessions), gens)
    assert router.stats()[1].served == 16


def test_tokens_already_streamed_to_the_caller_are_not_replayed_but_raised(tiny):
    dying, healthy = Dying(EmbeddedEngine(copy.deepcopy(tiny)), after=3), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([dying, healthy])
    heard = []
    with pytest.raises(EngineFailure, match="already reached the caller's listener"):
        router.generate([[1, 2], [3, 4]], SHORT, on_token=lambda i, t: heard.append(i))
    assert router.lost == 1 and router.stats()[0].failed == 1 and not router.stats()[0].live
    assert heard.count(1) == 3                                # the healthy engine's request was served in full


def test_a_hung_engine_times_out_is_taken_out_and_the_other_serves_every_request(tiny):
    hanging, healthy = Hanging(EmbeddedEngine(copy.deepcopy(tiny))), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([hanging, healthy], timeout_s=1.0)
    heard: list[tuple[int, int]] = []
    try:
        started = time.monotonic()
        gens = router.generate(PROMPTS, PARAMS, on_token=lambda i, t: heard.append((i, t)))
        assert 1.0 <= time.monotonic() - started < 30
        assert_equal_to_reference(gens, EmbeddedEngine(tiny).generate(PROMPTS, PARAMS))
        stats = router.stats()
        assert not stats[0].live and "no token for 1 s" in stats[0].down_reason and stats[0].failed == 2
        assert stats[1].served == 4 and stats[1].retried == 2 and stats[0].in_flight == 0
    finally:
        hanging.release.set()
    # the abandoned call wakes up and samples, but the router refuses its tokens: the caller heard each reply once
    assert hanging.ended.wait(timeout=60)
    assert sorted(heard) == sorted((i, t) for i, g in enumerate(gens) for t in g.token_ids)
    assert router.stats()[0].tokens == 0


def test_a_hung_request_with_no_engine_left_to_retry_on_is_raised_as_lost(tiny):
    router = Router([Hanging(EmbeddedEngine(tiny))], timeout_s=0.5)
    with pytest.raises(EngineFailure, match="failed a probe; no other live engine to retry on"):
        router.generate([[1, 2]], SHORT)
    assert router.lost == 1 and router.metrics()["perf/requests_lost_total"] == 1.0
    router.engines[0].release.set()


@pytest.mark.parametrize("streamed", [False, True])
def test_time_paused_for_a_weight_update_does_not_count_toward_the_timeout(two_engines, streamed):
    router = Router(two_engines, timeout_s=0.5)
    router.pause()
    result = []
    on_token = (lambda i, t: None) if streamed else None
    waiting = threading.Thread(target=lambda: result.append(router.generate([[1, 2], [3, 4]], SHORT, on_token)))
    waiting.start()
    time.sleep(2.0)                                           # four timeouts, paused (a probe would hang and fail)
    assert all(s.live for s in router.stats())
    router.resume()
    waiting.join(timeout=60)
    assert [len(g.token_ids) for g in result[0]] == [3, 3] and all(s.live for s in router.stats())


def test_bad_input_goes_back_to_the_caller_and_takes_no_engine_out(two_engines):
    router = Router(two_engines)
    with pytest.raises(ValueError, match="temperature"):
        router.generate([[1, 2]], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="3 prompts but 1 session ids"):
        router.generate([[1], [2], [3]], SHORT, session_ids=["a"])
    # an id outside the vocabulary fails inside the engine (not a ValueError): the engine is probed, answers, and
    # stays in rotation; the retry fails the same way, and the request is raised as lost
    with pytest.raises(EngineFailure, match="IndexError"):
        router.generate([[10**6]], SHORT)
    assert all(s.live for s in router.stats()) and router.lost == 1
    assert len(router.generate([[1, 2]], SHORT)[0].token_ids) == 3


def test_with_every_engine_dead_the_caller_gets_a_clear_error(tiny):
    router = Router([Dying(EmbeddedEngine(tiny), after=0), Dying(EmbeddedEngine(tiny), after=0)])
    with pytest.raises(EngineFailure, match="could not be served; request 0: engine 0 failed: RuntimeError: engine "
                                            "process died; retried, then engine 1 failed"):
        router.generate([[1, 2]], SHORT)
    assert [s.live for s in router.stats()] == [False, False]
    with pytest.raises(EngineFailure, match="no live engine.*engine 0 out.*engine process died"):
        router.generate([[1, 2]], SHORT)
    with pytest.raises(EngineFailure, match="no live engine"):
        router.update_weights({}, version=1)
    assert router.lost == 2
    router.engines[1].revive()                 # with no engine live, a rejoining one sets the version
    router.rejoin(1, tiny.state_dict(), version=1)
    assert router.version == 1 and router.generate([[1, 2]], SHORT)[0].policy_versions == [1] * 3


# ---- the control plane ----

def test_pause_update_resume_reach_live_engines_only_and_a_rejoining_engine_loads_the_weights_first(tiny):
    dying, healthy = Dying(EmbeddedEngine(copy.deepcopy(tiny)), after=2), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([dying, healthy])
    router.update_weights(tiny.state_dict(), version=1)
    assert dying.control == ["pause", "update_weights", "resume"] and router.version == 1
    router.generate([[1, 2], [3, 4]], SHORT)                  # engine 0 dies; its request is retried on engine 1
    state = {k: v + 0.01 for k, v in tiny.state_dict().items()}
    router.update_weights(state, version=2)
    assert dying.control == ["pause", "update_weights", "resume"]          # nothing reached the dead engine
    assert router.version == 2 and healthy.version == 2 and dying.engine.version == 1
    assert all(g.policy_versions == [2] * 3 for g in router.generate([[1, 2], [3, 4]], SHORT))
    dying.revive()
    with pytest.raises(ValueError, match="rejoin at version 1 but the live engines are at 2"):
        router.rejoin(0, tiny.state_dict(), version=1)
    router.rejoin(0, state, version=2)
    assert torch.equal(dying.engine.model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    gens = router.generate([[1, 2], [3, 4]], SHORT)
    assert [s.served for s in router.stats()][0] == 1 and all(g.policy_versions == [2] * 3 for g in gens)


@pytest.mark.parametrize("call", ["sampler_state", "load_sampler_state", "update_weights"])
def test_an_engine_dead_since_its_last_request_is_taken_out_by_the_next_control_call_and_the_others_go_on(tiny, call):
    """What a step's end asks of every engine (a checkpoint's sampler streams, a resume's, the weight push) finds an
    engine that died after its last request, while no request has failed on it and it is still marked live: the
    engine is taken out, the call answers for the others, and requests go on without loss."""
    dying, healthy = Dying(EmbeddedEngine(copy.deepcopy(tiny)), after=float("inf")), EmbeddedEngine(copy.deepcopy(tiny))
    router = Router([dying, healthy])
    router.generate([[1, 2], [3, 4]], SHORT)
    assert [s.served for s in router.stats()] == [1, 1]
    dying.after = dying.sampled                                # dies between requests
    assert router.stats()[0].live
    if call == "sampler_state":
        streams = router.sampler_state()
        assert streams[0] is None and torch.equal(streams[1], healthy.sampler_state())
    elif call == "load_sampler_state":
        stream = EmbeddedEngine(tiny, seed=7).sampler_state()
        router.load_sampler_state([stream, stream])
        assert torch.equal(healthy.sampler_state(), stream)
    else:
        router.update_weights(tiny.state_dict(), version=1)
        assert router.version == 1
    assert not router.stats()[0].live and router.stats()[1].live
    first = "pause" if call == "update_weights" else call      # a weight update pauses every engine first
    assert router.stats()[0].down_reason == f"{first} failed: RuntimeError: engine process died"
    assert len(router.generate([[1, 2], [3, 4]], SHORT)) == 2 and router.lost == 0


def test_update_weights_reaches_every_engine_and_stamps_the_new_version(two_engines):
    router = Router(two_engines)
    state = {k: v + 0.01 for k, v in two_engines[0].model.state_dict().items()}
    router.update_weights(state, version=5)
    assert router.version == 5 and all(e.version == 5 for e in two_engines)
    for engine in two_engines:
        assert torch.equal(engine.model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    gens = router.generate([[1, 2], [3, 4]], SHORT, session_ids=["a", "b"])
    assert all(g.policy_versions == [5] * 3 for g in gens)


def test_a_failed_load_still_resumes_every_engine_and_takes_none_out(two_engines):
    router = Router(two_engines)
    with pytest.raises(ValueError, match="missing keys"):
        router.update_weights({}, version=1)
    assert all(e._running.is_set() for e in two_engines)     # no engine left paused (a leaked pause hangs)
    assert all(s.live for s in router.stats())
    with pytest.raises(ValueError, match="at least one engine"):
        Router([])


def test_results_come_back_in_request_order_equal_to_one_engine_alone(two_engines, tiny):
    router = Router(two_engines)
    routed = router.generate(PROMPTS, PARAMS, session_ids=[f"s{i}" for i in range(len(PROMPTS))])
    assert [s.served for s in router.stats()] == [2, 2]
    assert_equal_to_reference(routed, EmbeddedEngine(tiny).generate(PROMPTS, PARAMS))
