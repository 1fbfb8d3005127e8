# The async runtime on a real Ray cluster on this machine (CPU): engines in their own processes, the streaming
# pool's admission rule, weight updates in the middle of requests (a dense engine keeps them: partial rollouts; an
# MoE engine drains them), an engine killed mid-run, eta = 0 against the synchronous loop, launch.sh's one-node
# cluster, and FSDP2 trainer ranks on two Ray nodes of this machine. Ray runs with few CPUs and a 100 MB object
# store.
import copy
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import ray
import torch
from transformers import DynamicCache

import actor
import algo
import config
import critic
import invariants
import models
import runtime
import train
from engines import Generation, SamplingParams
from engines import processing, r3
from rollout import EmbeddedEngine
from router import Router
from trainer import recompute
from test_actor import FSDP_CONFIG, FSDP_LENGTHS, FSDP_PROMPT, make_batch, max_abs_diff, on_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a reward the tiny random model earns about half the time, so advantages are non-zero and the weights move
PARITY_RECIPE = '''import train
from agents import Env, EnvRunner, Result

base = train.load_recipe("math")
DEFAULTS, tasks = base.DEFAULTS, base.tasks


class ParityEnv(Env):
    def step(self, action_text):
        reward = float(len(action_text) % 2)
        return Result(reward=reward, score=reward)


class AgentRunner(EnvRunner):
    env_cls = ParityEnv
'''


@pytest.fixture(scope="module")
def parity_recipe(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("recipe") / "parity.py"
    path.write_text(PARITY_RECIPE)
    return str(path)


def tiny_flags(recipe: str, steps: int) -> list[str]:
    return ["--recipe", recipe, "--model", "tiny-qwen3", "--steps", str(steps), "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "2", "--rollout.max_tokens", "12", "--run.threads", "1",
            "--train.minibatches", "1", "--actor.lr", "1e-3", "--runtime.object_store_mb", "100"]


def run_cli(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def metrics_of(out: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


# ---- the admission rule, without Ray ---------------------------------------------------------------------

class FakeRunner:
    """Rollouts whose tokens carry the policy steps trained when they started and when they ended (a partial
    rollout), after a random delay; rewards all equal in about a third of the groups (filtered)."""

    def __init__(self, seed: int):
        self.rng, self.steps, self.failures, self.lock = random.Random(seed), 0, {}, threading.Lock()

    def run(self, tasks, group_ids, sampling):
        with self.lock:
            delay, flat = self.rng.uniform(0.0, 0.02), self.rng.random() < 0.3
        start = self.steps
        time.sleep(delay)
        out = []
        for i, g in enumerate(group_ids):
            gen = Generation([1], [2, 3], [0.0, 0.0], [start, self.steps], None, "length")
            out.append(SimpleNamespace(group_id=g, rollout_id=f"{g}-{i}", reward=0.0 if flat else float(i % 2),
                                       generations=[gen]))
        return out


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_the_pool_admits_no_rollout_that_would_be_trained_more_than_eta_steps_late(eta):
    runner, B, G = FakeRunner(eta), 3, 2
    pool = runtime.RolloutPool(runner, list(range(100)), SamplingParams(), B, G, eta, filter_zero_variance=True,
                               steps=25)
    for step in range(25):
        rollouts, m = pool.take()
        assert len({r.group_id for r in rollouts}) == B and len(rollouts) == B * G   # filtered groups were refilled
        hist = runtime.staleness_metrics(rollouts, step, eta)
        assert hist["runtime/staleness_over"] == 0, (step, hist)
        assert all(step - min(r.generations[0].policy_versions) <= eta for r in rollouts)
        if eta and step < 24:   # the engines never wait for the trainer: the next steps' groups are in flight
            assert m["runtime/queue_running"] + m["runtime/queue_finished"] >= 1
        runner.steps = step + 1
        pool.trained_step(step + 1)
    assert pool.filtered > 0
    assert pool.running == 0 and not pool.groups        # nothing was started that no step would train


# ---- a rollout that straddles a weight update, across processes ------------------------------------------

def _processed(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return processing.processed_logprobs(logits.float(), temperature, 1.0, -1)


def test_a_rollout_straddling_a_weight_update_carries_each_tokens_own_version_and_logprob():
    path = models.resolve_model("tiny-qwen3")
    old = models.load_model(path)
    new = copy.deepcopy(old)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cfg = runtime.RuntimeConfig(mode="ray", engines=1, object_store_mb=100)
    rt = runtime.start(cfg, runtime.embedded_engine, lambda i: (path, 0, 1), version=0)
    try:
        router = Router(rt.proxies)
        assert router.max_model_len == rt.proxies[0].max_model_len == 65536      # the engine actor's, read once
        rt.push_weights(router, {k: v for k, v in old.state_dict().items()}, 0)
        prompt, T = [11, 12, 13, 14], 0.9
        result, heard = [], []
        params = SamplingParams(temperature=T, max_tokens=300, seed=5, stop_token_ids=(9999,))
        worker = threading.Thread(target=lambda: result.extend(
            router.generate([prompt], params, on_token=lambda i, t: heard.append(t))))
        worker.start()
        while len(heard) < 8:                                  # tokens stream back: the request is under way
            time.sleep(0.002)
        sync = rt.push_weights(router, new.state_dict(), 1)   # pause (request kept), load, version 1, resume
        worker.join(timeout=120)
        gen = result[0]
        assert sync["runtime/weight_sync_bytes"] > 0 and sync["runtime/weight_sync_ipc_engines"] == 0
        # the weights crossed the engine's gloo channel and landed bit for bit
        landed = ray.get(rt.proxies[0].handle.__ray_call__.remote(lambda actor: actor.engine.model.state_dict()))
        assert rt.proxies[0].channel.backend == "gloo"
        assert all(torch.equal(landed[name], tensor) for name, tensor in new.state_dict().items())
        with pytest.raises(ValueError, match="at least one token"):   # a bad request is the caller's error, across
            router.generate([[]], params)                              # processes too: the engine stays in rotation
        assert router.metrics()["perf/engines_live"] == 1
        # a caller that does not listen is sent the result alone: no token messages cross the processes
        quiet = rt.proxies[0].handle.generate.remote([prompt], [replace(params, max_tokens=4)], [[]], None)
        replies = [ray.get(ref) for ref in quiet]
        assert [kind for kind, _ in replies] == ["done"] and replies[0][1][0].policy_versions == [1] * 4
    finally:
        runtime.stop(rt)
    n1 = gen.policy_versions.count(0)
    assert 1 <= n1 < 300 and gen.policy_versions == [0] * n1 + [1] * (300 - n1)
    assert heard == gen.token_ids                                     # every token was streamed, in order

    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        lp_old = _processed(old(ids).logits[0, len(prompt) - 1:-1], T).gather(-1, ids[0, len(prompt):, None])[:, 0]
        lp_new = _processed(new(ids).logits[0, len(prompt) - 1:-1], T).gather(-1, ids[0, len(prompt):, None])[:, 0]
    behavior = torch.tensor(gen.behavior_logprobs)
    assert (behavior[:n1] - lp_old[:n1]).abs().max() <= 1e-4          # each token against its own version
    assert (behavior[n1:] - lp_new[n1:]).abs().max() <= 1e-4
    assert (behavior[n1:] - lp_old[n1:]).abs().max() > 1e-3           # and only its own

    # the trap is armed: an engine that kept the old KV cache after the update would have reported this logprob
    # for the first token after the swap, which the check above would refuse
    cache = DynamicCache()
    prefix = ids[:, :len(prompt) + n1]
    with torch.no_grad():
        old(input_ids=prefix[:, :-1], past_key_values=cache, use_cache=True)
        stale = new(input_ids=prefix[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
    stale_lp = _processed(stale, T)[gen.token_ids[n1]]
    assert abs(stale_lp.item() - lp_new[n1].item()) > 1e-4
    assert abs(stale_lp.item() - behavior[n1].item()) > 1e-4


def test_a_caller_that_stops_listening_stops_the_engine_in_another_process():
    def count_sampled_tokens(actor) -> None:   # in the engine actor (a nested function travels by value)
        """Count every token the actor's engine samples for a listener (actor.sampled_tokens)."""
        sample, actor.sampled_tokens = actor.engine.generate, 0

        def generate(prompts, params, on_token=None, images=None):
            def counted(row, token_id):
                actor.sampled_tokens += 1
                on_token(row, token_id)
            return sample(prompts, params, on_token=counted if on_token else None, images=images)
        actor.engine.generate = generate

    path = models.resolve_model("tiny-qwen3")
    rt = runtime.start(runtime.RuntimeConfig(mode="ray", engines=1, object_store_mb=100), runtime.embedded_engine,
                       lambda i: (path, 0, 1), version=0)
    try:
        proxy = rt.proxies[0]
        ray.get(proxy.handle.__ray_call__.remote(count_sampled_tokens))
        heard = []

        def hang_up_after_16(row, token_id):       # a loopback client that hung up: its listener raises
            heard.append(token_id)
            if len(heard) == 16:
                raise ConnectionResetError("the client hung up")
        params = SamplingParams(max_tokens=3000, seed=1, stop_token_ids=(9999,))   # never stops on its own
        with pytest.raises(ConnectionResetError):
            proxy.generate([[11, 12, 13]], params, on_token=hang_up_after_16)
        deadline = time.monotonic() + 300
        while ray.get(proxy.handle.__ray_call__.remote(lambda actor: actor._in_flight)) and time.monotonic() < deadline:
            time.sleep(0.05)
        sampled = ray.get(proxy.handle.__ray_call__.remote(lambda actor: actor.sampled_tokens))
        assert 16 <= sampled <= 16 + 256, f"the engine sampled {sampled} tokens for a caller that had gone"
        # the engine serves the next request whole, and a caller that listens to the end is never cancelled
        assert len(proxy.generate([[11, 12, 13]], replace(params, max_tokens=40), on_token=lambda i, t: None)
                   .pop().token_ids) == 40
    finally:
        runtime.stop(rt)


def test_r3_routes_cross_processes_and_a_weight_push_waits_for_the_request_in_flight():
    """R3 across processes: a tiny MoE engine in its own actor returns every forwarded position's experts through
    Ray; a weight push while a request runs waits for it to finish (an MoE engine drains on an update), so all its
    tokens keep the old version and all its routes are the old weights'; the trainer here, replaying them on the
    old weights, gives every token its behavior logprob. Trap: the new weights' routes break that parity."""
    path = models.tiny_model_dir("qwen3_moe")
    old = models.load_model(path)
    new = copy.deepcopy(old)
    torch.manual_seed(1)
    with torch.no_grad():
        for router_layer in r3.moe_routers(new):
            router_layer.weight.add_(2.0 * torch.randn_like(router_layer.weight))
    rt = runtime.start(runtime.RuntimeConfig(mode="ray", engines=1, object_store_mb=100), runtime.embedded_engine,
                       lambda i: (path, 0, 1), version=0)
    prompt, T = [11, 12, 13, 14, 15], 0.9
    try:
        router, heard, result = Router(rt.proxies), [], []
        params = SamplingParams(temperature=T, max_tokens=300, seed=3, stop_token_ids=(9999,))
        worker = threading.Thread(target=lambda: result.extend(
            router.generate([prompt], params, on_token=lambda i, t: heard.append(t))))
        worker.start()
        while len(heard) < 6:
            time.sleep(0.002)
        rt.push_weights(router, new.state_dict(), 1)
        worker.join(timeout=120)
    finally:
        runtime.stop(rt)
    gen = result[0]
    n1 = gen.policy_versions.count(0)
    assert len(heard) == n1 == 300                  # drained: every token at the version it started at
    ids = torch.tensor([prompt + gen.token_ids])

    def routes_of(model):
        with r3.capture_routes(model) as captured, torch.no_grad():
            model(input_ids=ids)
        return captured[-1][:-1].numpy()
    old_routes, new_routes = routes_of(old), routes_of(new)
    assert gen.routes.shape == old_routes.shape
    assert (old_routes != new_routes).any()                         # armed: the update moves routes
    assert (gen.routes == old_routes).all()                         # every position's, from the old weights

    def replayed(routes):
        replay = torch.from_numpy(routes).long()[None]
        with torch.no_grad():
            lp = recompute.sequence_logprobs(old, ids, torch.ones_like(ids), T,
                                             routes=torch.cat([replay, torch.full_like(replay[:, :1], -1)], 1))
        return (lp[0, len(prompt):len(prompt) + n1] - torch.tensor(gen.behavior_logprobs[:n1])).abs().max().item()
    assert replayed(gen.routes) <= 1e-5
    assert replayed(new_routes) > 1e-3


FAILING_RECIPE = PARITY_RECIPE.replace("class AgentRunner(EnvRunner):", """class OddFails(ParityEnv):
    def step(self, action_text):
        if len(action_text) % 2:
            raise RuntimeError("the environment broke")
        return super().step(action_text)


class AgentRunner(EnvRunner):""").replace("env_cls = ParityEnv", "env_cls = OddFails")


def test_runner_actors_count_each_failure_once_however_many_groups_run_at_once(tmp_path):
    """Two runner actors, four groups at once (two per actor, on its threads): the group's failure counts are the
    failed episodes, each once, and every other episode comes back as a rollout."""
    recipe = tmp_path / "failing.py"
    recipe.write_text(FAILING_RECIPE)
    path = models.resolve_model("tiny-qwen3")
    rt = runtime.start(runtime.RuntimeConfig(mode="ray", engines=1, object_store_mb=100, runners=2),
                       runtime.embedded_engine, lambda i: (path, 0, 1), version=0)
    try:
        group = rt.start_runners(runtime.RuntimeConfig(mode="ray", runners=2), str(recipe), path, 0,
                                 dict(max_turns=1, max_length=256, step_timeout_s=60))
        tasks = train.load_recipe(str(recipe)).tasks("train", 0)[:4]
        sampling = SamplingParams(temperature=1.0, max_tokens=12)
        results = [None] * 4
        workers = [threading.Thread(target=lambda g=g: results.__setitem__(
            g, group.run([tasks[g]] * 4, [f"g{g}"] * 4, sampling))) for g in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
        kept = sum(len(r) for r in results)
        failures = group.failures
        assert set(failures) == {"step_error"} and kept + failures["step_error"] == 16
        assert 0 < kept < 16                                 # armed: some episodes failed, some did not
    finally:
        runtime.stop(rt)


# ---- whole runs ----------------------------------------------------------------------------------------------

def test_eta_0_reproduces_the_synchronous_run_on_the_same_seed(parity_recipe, tmp_path):
    """Through the runtime with the agent on the driver's threads, and in a runner actor: the same metrics."""
    flags = tiny_flags(parity_recipe, 3)
    done = run_cli(*flags, "--out", str(tmp_path / "sync"))
    assert done.returncode == 0, done.stderr[-3000:]
    sync = metrics_of(str(tmp_path / "sync"))
    assert any(r["actor/grad_norm"] > 0 for r in sync)                 # the weights do move between steps
    for name, extra in [("ray", []), ("runner", ["--runtime.runners", "1"])]:
        done = run_cli(*flags, "--out", str(tmp_path / name), "--runtime.mode", "ray", "--runtime.eta", "0", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        ray_run = metrics_of(str(tmp_path / name))
        assert [r["step"] for r in ray_run] == [1, 2, 3]
        for want, have in zip(sync, ray_run):
            keys = {k for k in want if not k.startswith(("time/", "perf/"))}
            assert {k: have[k] for k in keys} == {k: want[k] for k in keys}, name
            assert have["runtime/staleness_0"] == 4 and have["runtime/engine0_idle_frac"] <= 1


def test_async_eta_1_with_partial_rollouts_runs_30_steps_within_eta(parity_recipe, tmp_path):
    """Two engines and two runner actors (the agents in processes of their own, each with its own router)."""
    out = str(tmp_path / "async")
    done = run_cli(*tiny_flags(parity_recipe, 30), "--out", out, "--runtime.mode", "ray", "--runtime.eta", "1",
                   "--runtime.engines", "2", "--runtime.runners", "2", "--correction.level", "token",
                   "--correction.max_staleness", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics_of(out)
    assert [r["step"] for r in records] == list(range(1, 31))
    # every request went through the runner actors' routers (the driver's router only pauses and pushes), and
    # the engines' busy clocks saw them
    last = records[-1]
    assert last["perf/engine0/served_total"] + last["perf/engine1/served_total"] >= 30 * 4
    assert last["perf/engines_live"] == 2
    assert min(r["runtime/engine_idle_frac"] for r in records[1:]) < 1
    assert all(r["runtime/staleness_over"] == 0 and r["actor/staleness_max"] <= 1 for r in records)
    assert all(r["gate/drop_stale"] == 0 for r in records)               # admission, not the gate, bounded it
    assert sum(r["runtime/staleness_1"] for r in records) > 0            # the trainer did train on older rollouts
    assert sum(r["runtime/multi_version_rollouts"] for r in records) > 0  # and on rollouts that straddled a push
    assert all(r["runtime/weight_sync_bytes"] > 0 for r in records)
    trace = run_cli("trace", out)
    assert trace.returncode == 0, trace.stderr
    record = json.loads(open(os.path.join(out, "traces", "step_000030.jsonl")).readline())
    versions = {v for v, why in zip(record["policy_version"], record["mask_reason"]) if why != "context"}
    assert versions and all(record["trainer_version"] - 1 <= v <= record["trainer_version"] for v in versions)


def test_killing_an_engine_mid_run_leaves_the_run_going_with_the_failure_counted(parity_recipe, tmp_path):
    out = str(tmp_path / "killed")
    argv = [*tiny_flags(parity_recipe, 12), "--out", out, "--runtime.mode", "ray", "--runtime.eta", "1",
            "--runtime.engines", "2", "--correction.level", "token", "--correction.max_staleness", "1"]
    errors = []

    def main():
        try:
            train.main(argv)
        except BaseException as error:
            errors.append(error)
    run = threading.Thread(target=main)
    run.start()
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 300
    while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.kill(ray.get_actor("tracerl-engine-1"))
    run.join(timeout=400)
    assert not run.is_alive() and not errors, errors
    records = metrics_of(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    last = records[-1]
    assert records[0]["perf/engines_live"] == 2 and last["perf/engines_live"] == 1   # taken out of rotation
    assert last["perf/requests_lost_total"] == 0                        # every request found the live engine
    assert last["perf/engine0/retried_total"] == last["perf/engine1/failed_total"]   # what failed was retried
    assert all(r["rollout/count"] == 4 for r in records)
    assert records[-1]["actor/version"] == 12


def test_an_engine_dead_before_a_checkpoint_is_taken_out_and_the_checkpoint_names_the_stream_it_lacks(
        tmp_path, capsys):
    """An engine actor killed after its last request and before the save: no request has failed on it, so the
    router still marks it live when the checkpoint asks every engine for its sampler stream. The checkpoint is
    written without that stream and says so (in the run state and on stdout), the engine is taken out, the run
    goes on with the other, and a resume from that checkpoint restores the stream it has and starts the missing
    engine's afresh, saying so."""
    path = models.resolve_model("tiny-qwen3")
    rt = runtime.start(runtime.RuntimeConfig(mode="ray", engines=2, object_store_mb=100), runtime.embedded_engine,
                       lambda i: (path, i, 1), version=0)
    params = SamplingParams(max_tokens=3, stop_token_ids=(9999,))
    try:
        router = Router(rt.proxies)
        assert len(router.generate([[11, 12, 13], [14, 15, 16]], params)) == 2    # both engines served
        handle = rt.proxies[1].handle
        ray.kill(handle)
        deadline = time.monotonic() + 60
        while True:                          # asked directly, not through the proxy: the router hears nothing
            try:
                ray.get(handle.busy_seconds.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "the killed actor still answers"
            time.sleep(0.05)
        assert router.stats()[1].live                      # dead, but marked live: what the save used to trip on
        run_state = train.run_state_at(2, router)
        assert run_state["engine_sampler"][0] is not None and run_state["engine_sampler"][1] is None
        assert list(run_state["engine_sampler_missing"]) == [1]
        assert "EngineDied" in run_state["engine_sampler_missing"][1]
        assert "checkpoint at step 2 lacks the sampler stream of engine 1" in capsys.readouterr().out
        assert not router.stats()[1].live and router.stats()[0].live
        # the run goes on: requests are served by engine 0, the next weights reach it, the next save succeeds
        assert len(router.generate([[11, 12, 13]] * 3, params)) == 3
        weights = models.load_model(path).state_dict()
        rt.push_weights(router, weights, 1)
        assert router.version == 1 and router.stats()[1].failed == 0
        assert train.run_state_at(3, router)["engine_sampler_missing"] == run_state["engine_sampler_missing"]
        assert router.metrics()["perf/requests_lost_total"] == 0
    finally:
        runtime.stop(rt)
    # the checkpoint file round-trips; a resume restores engine 0's stream and starts engine 1's afresh
    torch.save(run_state, tmp_path / "run_state.pt")
    saved = torch.load(tmp_path / "run_state.pt", weights_only=True)
    model = models.load_model(path)
    fresh = [EmbeddedEngine(copy.deepcopy(model), seed=10 + i) for i in range(2)]
    seeded = fresh[1].sampler_state()
    resumed = Router(fresh)
    assert train.resume_run(saved, resumed) == 2
    assert torch.equal(fresh[0].sampler_state(), saved["engine_sampler"][0])
    assert torch.equal(fresh[1].sampler_state(), seeded)
    assert "engine 1 starts a fresh sampler stream" in capsys.readouterr().out


def test_async_without_is_correction_or_with_a_tighter_gate_is_refused():
    base = ["--model", "tiny-qwen3", "--runtime.mode", "ray", "--runtime.eta", "1"]
    with pytest.raises(SystemExit):
        config.parse_config(base)
    with pytest.raises(SystemExit):
        config.parse_config(base + ["--correction.level", "token"])       # max_staleness 0 < eta * minibatches
    cfg = config.parse_config(base + ["--correction.level", "token", "--correction.max_staleness", "2"])
    assert cfg["runtime"].eta == 1
    with pytest.raises(SystemExit):        # trainer ranks are Ray actors: the sync loop has none
        config.parse_config(["--model", "tiny-qwen3", "--runtime.trainer_ranks", "2"])
    with pytest.raises(SystemExit):        # not one of Ray's placement strategies
        config.parse_config(base + ["--correction.level", "token", "--correction.max_staleness", "2",
                                    "--runtime.trainer_placement", "spread"])
    with pytest.raises(SystemExit):        # runner actors are Ray actors too
        config.parse_config(["--model", "tiny-qwen3", "--runtime.runners", "2"])


def test_launch_sh_starts_a_one_node_cluster_and_trains_on_it(parity_recipe, tmp_path):
    out = str(tmp_path / "cluster")
    env = {**os.environ, "RAY_START_ARGS": "--num-cpus 3 --object-store-memory 100000000"}
    done = subprocess.run(["./launch.sh", "cluster", *tiny_flags(parity_recipe, 2), "--out", out,
                           "--runtime.engines", "2", "--runtime.eta", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "launch.sh: Ray cluster at 127.0.0.1:" in done.stdout
    assert [r["step"] for r in metrics_of(out)] == [1, 2]
    assert metrics_of(out)[-1]["perf/engines_live"] == 2


def test_two_fsdp2_trainer_ranks_in_ray_actors_train_the_actor_and_the_critic_as_one_process_does(parity_recipe,
                                                                                                   tmp_path):
    """--runtime.trainer_ranks 2 with gae: the actor and its critic as two FSDP2 ranks (gloo), each a Ray actor
    holding an actor shard and a critic shard, each step's rollouts dealt between them; every actor, critic and
    rollout metric equals the one-process run's on the same seed (up to the ranks' summation order), and the
    checkpoint holds the critic."""
    flags = [*tiny_flags(parity_recipe, 2), "--algo.estimator", "gae", "--critic.lr", "1e-3", "--runtime.mode", "ray",
             "--runtime.eta", "0"]
    for out, ranks in (("one", "1"), ("two", "2")):
        done = run_cli(*flags, "--out", str(tmp_path / out), "--runtime.trainer_ranks", ranks)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = metrics_of(str(tmp_path / "one")), metrics_of(str(tmp_path / "two"))
    assert [r["step"] for r in two] == [1, 2] and any(r["actor/grad_norm"] > 0 for r in one)
    assert [r["critic/version"] for r in two] == [1.0, 2.0] and all(r["critic/grad_norm"] > 0 for r in one)
    assert any(r["actor/prefix_tokens_saved"] > 0 for r in one)       # one process computes shared prompts once,
    assert all(r["actor/prefix_tokens_saved"] == 0 for r in two)      # FSDP2 ranks do not: the results still agree
    for want, have in zip(one, two):
        for key in [k for k in want if k.startswith(("actor/", "critic/", "rollout/", "mismatch/", "gate/"))
                    and k != "actor/prefix_tokens_saved"]:
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    trace = [json.loads(line) for line in open(os.path.join(tmp_path / "two", "traces", "step_000002.jsonl"))]
    assert trace and all(len(row["loss_contribution"]) == len(row["token_ids"]) for row in trace)
    assert os.path.exists(tmp_path / "two" / "checkpoints" / "final" / critic.CRITIC_FOLDER / actor.CHECKPOINT_MARKER)


# ---- trainer ranks on two Ray nodes ----------------------------------------------------------------------------

@pytest.fixture
def two_ray_nodes():
    """A Ray cluster of two nodes on this machine (a head and a worker, each its own raylet with one CPU), joined
    as train.py joins one. The file's other tests start and stop a Ray of their own, so none is connected here."""
    from ray.cluster_utils import Cluster
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20,
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        runtime.connect(runtime.RuntimeConfig(address=cluster.address))
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ranks_are_dealt_whole_groups_where_the_loss_counts_a_groups_tokens():
    """prompt_mean_token_mean weighs a token by its group's kept tokens, which one rank must hold: the deal keeps
    groups whole then, and whole rollouts (a finer balance) otherwise."""
    batch = make_batch([14, 6, 10, 5, 9, 7], 3, vocab=50)          # groups g0 {0, 1}, g1 {2, 3}, g2 {4, 5}
    group = SimpleNamespace(ranks=[0, 1])
    by_group = runtime.TrainerGroup._deal(group, batch, whole_groups=True)
    assert sorted(by_group) == [[0, 1], [2, 3, 4, 5]]
    by_rollout = runtime.TrainerGroup._deal(group, batch)
    assert any({batch.group_ids[b] for b in rows} & {batch.group_ids[b] for b in other}
               for rows, other in [by_rollout]), "armed: rollouts alone split a group over the ranks"


def test_trainer_ranks_on_two_ray_nodes_meet_at_rank_0s_node_and_train_as_one_process_does(two_ray_nodes):
    """Two gloo ranks forced onto two nodes (STRICT_SPREAD) rendezvous at rank 0's node; two steps on the same
    batches give the one-process actor's metrics, per-token losses and weights. A placement the cluster cannot
    hold fails within its timeout, naming what was asked; shutdown gives the placement groups back."""
    from ray.util.placement_group import placement_group_table
    path = models.tiny_model_dir("qwen3")
    group = runtime.TrainerGroup(2, path, FSDP_CONFIG, total_steps=2, seed=0, cpus=1, gpus=0,
                                 placement="STRICT_SPREAD")
    try:
        nodes = [node for node, _, _ in ray.get([r.locate.remote() for r in group.ranks])]   # asked inside each rank
        single = actor.Actor(path, FSDP_CONFIG, total_steps=2, seed=0)
        for step in range(2):
            batch, same = (make_batch(FSDP_LENGTHS, FSDP_PROMPT, single.model.config.vocab_size, seed=step,
                                      version=step) for _ in range(2))
            args = (algo.AlgoConfig(estimator="reinforce"), invariants.CorrectionConfig(), step)
            have = group.train_step(batch, on_policy(batch, group), *args)
            want = single.train_step(same, on_policy(same, single), *args)
            assert want.metrics["actor/grad_norm"] > 0 and have.metrics.keys() == want.metrics.keys()
            for key, value in want.metrics.items():
                assert have.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
            assert (have.loss_contribution - want.loss_contribution).abs().max() <= 1e-6
        assert group.version == single.version == 2
        assert max_abs_diff(group.export_weights(), single.export_weights()) <= 1e-5

        with pytest.raises(RuntimeError, match=r"3 trainer ranks of \{'CPU': 1, 'GPU': 0\} each \(placement "
                                               r"STRICT_SPREAD\) were not placed within 2 s"):
            runtime.TrainerGroup(3, path, FSDP_CONFIG, total_steps=2, seed=0, cpus=1, gpus=0,
                                 placement="STRICT_SPREAD", ready_timeout_s=2)
    finally:
        group.shutdown()
    assert len(set(nodes)) == 2 and set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert [g["state"] for g in placement_group_table().values()] == ["REMOVED", "REMOVED"]
