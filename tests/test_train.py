# The main job end to end, through its real command line: a short run on a tiny model writes every
# artefact a user reads (metrics, TensorBoard, plot, traces, checkpoints), resumes, and traces a sample token
# by token (the flags it refuses: test_config.py).
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import actor
import algo
import config
import data
import engines
import invariants
import models
import rollout
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = ["--recipe", "math", "--model", "tiny-qwen3", "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "2", "--rollout.max_tokens", "6", "--run.threads", "1"]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "out")
    done = run_cli(*TINY_RUN, "--steps", "2", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_a_short_run_writes_metrics_plot_tensorboard_traces_and_checkpoint(tiny_run):
    out, stdout = tiny_run
    assert "step    1/2 | reward" in stdout and "step    2/2 | reward" in stdout
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("rollout/reward", "rollout/accuracy", "rollout/response_length", "perf/tokens_per_s",
                "mismatch/logprob_diff_mean", "actor/loss", "actor/grad_norm", "gate/kept"):
        assert key in records[0], key
    # synchronous on-policy: the trainer's recompute matches the engine's behavior logprobs
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)
    assert os.path.getsize(os.path.join(out, "metrics.png")) > 10_000
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tensorboard")))
    assert sorted(os.listdir(os.path.join(out, "traces"))) == ["step_000001.jsonl", "step_000002.jsonl"]
    assert os.path.isdir(os.path.join(out, "checkpoints", "final"))
    assert json.load(open(os.path.join(out, "config.json")))["run"]["model"] == "tiny-qwen3"
    # the final checkpoint is full by default (test_resume_continues_from_the_checkpoint resumes it), timed and sized
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["final_checkpoint"] == "full" and summary["final_checkpoint_s"] > 0
    assert summary["final_checkpoint_bytes"] == folder_bytes(os.path.join(out, "checkpoints", "final")) > 0
    assert f"checkpoint final (full): {summary['final_checkpoint_bytes'] / 1e9:.3g} GB in" in stdout


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_a_weights_final_checkpoint_is_a_model_folder_with_the_actors_final_logits_and_none_writes_nothing(tmp_path):
    """--train.final_checkpoint weights: the policy alone, a folder transformers loads and `train.py eval` evaluates,
    whose logits equal (max |diff| = 0, fp32) those of the full checkpoint the same run wrote at the same step
    (--train.save_every stays full). REINFORCE with every reply cut at max_tokens penalised (-1) gives a gradient, so
    the weights moved and the comparison is armed: the untrained model's logits differ."""
    import transformers
    out = str(tmp_path / "weights")
    done = run_cli(*TINY_RUN, "--steps", "2", "--out", out, "--train.final_checkpoint", "weights",
                   "--train.save_every", "2", "--algo.estimator", "reinforce", "--algo.stop_penalty", "-1")
    assert done.returncode == 0, done.stderr[-3000:]
    final, full = (os.path.join(out, "checkpoints", name) for name in ("final", "step_000002"))
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["final_checkpoint"] == "weights" and summary["final_checkpoint_bytes"] == folder_bytes(final)
    assert not {actor.CHECKPOINT_STATE, actor.RUN_STATE} & set(os.listdir(final))      # no optimizer, no run state
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    base = models.resolve_model("tiny-qwen3")
    trained, untrained = models.load_model(base), models.load_model(base)
    trained.load_state_dict(torch.load(os.path.join(full, actor.CHECKPOINT_STATE), weights_only=True)["model"])
    ids = models.load_tokenizer(final)("What is 12 plus 30? The answer is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = [m(ids).logits for m in (loaded, trained, untrained)]
    assert (logits[0] - logits[1]).abs().max().item() == 0.0
    assert (logits[0] - logits[2]).abs().max().item() > 1e-6, "armed: training moved the weights"
    evaluated = run_cli("eval", final, "--recipe", "math", "--eval.prompts", "2", "--rollout.max_tokens", "6")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout.splitlines()[-1])["eval/prompts"] == 2.0

    out = str(tmp_path / "none")
    done = run_cli(*TINY_RUN, "--steps", "1", "--out", out, "--train.final_checkpoint", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "checkpoints"))
    assert json.load(open(os.path.join(out, "summary.json")))["final_checkpoint_bytes"] == 0


def test_trace_prints_every_token_with_its_provenance(tiny_run):
    out, _ = tiny_run
    done = run_cli("trace", out, "--step", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["pos", "id", "text", "ver", "temp", "behavior", "trainer", "is_w", "advantage",
                                "loss", "reason"]
    record = json.loads(open(os.path.join(out, "traces", "step_000001.jsonl")).readline())
    assert len(lines) == 2 + len(record["token_ids"])
    assert {"context", "trained"} <= set(record["mask_reason"])
    sampled = [t for t, r in enumerate(record["mask_reason"]) if r == "trained"]
    assert all(record["policy_version"][t] == 0 for t in sampled)
    assert max(abs(record["behavior_logprob"][t] - record["trainer_logprob"][t]) for t in sampled) < 1e-4
    assert "error" in run_cli("trace", out, "--step", "99").stderr


def test_resume_continues_from_the_checkpoint(tiny_run, tmp_path):
    out, _ = tiny_run
    resumed = str(tmp_path / "resumed")
    done = run_cli(*TINY_RUN, "--steps", "3", "--out", resumed, "--train.resume",
                   os.path.join(out, "checkpoints", "final"))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(resumed, "metrics.jsonl"))]
    # the recipe takes 2 optimizer steps per RL step: after RL step 3 the policy is at version 6
    assert [r["step"] for r in records] == [3] and records[0]["actor/version"] == 6


def metrics_of(out: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_run_killed_after_step_k_resumes_to_the_same_step_k_plus_1(tmp_path):
    flags = [*TINY_RUN, "--steps", "3", "--train.save_every", "1"]
    whole = str(tmp_path / "whole")
    done = run_cli(*flags, "--out", whole)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = str(tmp_path / "killed")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.Popen([sys.executable, "train.py", *flags, "--out", killed], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = os.path.join(killed, "checkpoints", "step_000001")
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(checkpoint, actor.CHECKPOINT_MARKER)) and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)                  # no chance to flush or clean up
    run.wait()
    resumed = str(tmp_path / "resumed")
    done = run_cli(*flags, "--out", resumed, "--train.resume", checkpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    expected, got = metrics_of(whole)[1:], metrics_of(resumed)
    assert [r["step"] for r in got] == [2, 3]
    for want, have in zip(expected, got):        # the same tokens sampled, the same updates: every metric but time
        keys = {k for k in want if not k.startswith(("time/", "perf/"))}
        assert {k: have[k] for k in keys} == {k: want[k] for k in keys}
    final = [torch.load(os.path.join(folder, "checkpoints", "final", actor.CHECKPOINT_STATE), weights_only=True)
             for folder in (whole, resumed)]
    assert all(torch.equal(final[0]["model"][k], final[1]["model"][k]) for k in final[0]["model"])


def recipe_file(folder, name: str, runner: str) -> str:
    """A recipe of one's own, outside recipes/: the math recipe's defaults and tasks with `runner` as its runner."""
    path = folder / f"{name}.py"
    path.write_text("import train\n\nbase = train.load_recipe('math')\nDEFAULTS, tasks = base.DEFAULTS, base.tasks\n"
                    + runner)
    return str(path)


def test_a_runner_that_hands_on_a_token_twice_stops_the_run(tmp_path):
    duplicating = recipe_file(tmp_path, "duplicating", (
        "\n\nclass AgentRunner(base.AgentRunner):\n"
        "    def run(self, tasks, group_ids, sampling):\n"
        "        rollouts = super().run(tasks, group_ids, sampling)\n"
        "        rollouts[0].rows.append(rollouts[0].rows[0])   # a runner bug: one row handed on twice\n"
        "        return rollouts\n"))
    done = run_cli(*[f if f != "math" else duplicating for f in TINY_RUN], "--steps", "1", "--out",
                   str(tmp_path / "out"))
    assert done.returncode != 0 and "sampled-once violated" in done.stderr
    assert not os.path.getsize(os.path.join(tmp_path, "out", "metrics.jsonl"))     # nothing was trained on it
    plain = recipe_file(tmp_path, "plain", "AgentRunner = base.AgentRunner\n")     # a recipe by path runs
    assert run_cli(*[f if f != "math" else plain for f in TINY_RUN], "--steps", "1", "--out",
                   str(tmp_path / "plain")).returncode == 0


def test_the_run_logs_the_truncated_episodes_apart_from_the_replies_cut_at_max_tokens(tmp_path):
    """rollout/truncated_frac: episodes the turn or length budget ended before their env did; hit_max_tokens_frac:
    episodes with a reply cut at max_tokens. Here the env ends the episodes of one prompt of two and leaves the
    other's open (one turn allowed: the budget ends them), and each rollout says what it did (agent/ metrics): which
    env left it open, and whether the engine cut a reply at max_tokens."""
    budget_ends_half = recipe_file(tmp_path, "budget_ends_half", (
        "\n\nOPEN = base.tasks('train', 0)[0].task_id     # the first prompt of step 1\n\n\n"
        "class HalfOpen(base.MathEnv):\n"
        "    def reset(self, task):\n"
        "        self.open = task.task_id == OPEN\n"
        "        return super().reset(task)\n\n"
        "    def step(self, action_text):\n"
        "        result = super().step(action_text)\n"
        "        result.terminated = not self.open\n"
        "        result.info['left_open'] = float(self.open)\n"
        "        return result\n\n\n"
        "class AgentRunner(base.AgentRunner):\n"
        "    env_cls = HalfOpen\n\n"
        "    def run(self, tasks, group_ids, sampling):\n"
        "        rollouts = super().run(tasks, group_ids, sampling)\n"
        "        for r in rollouts:\n"
        "            r.info['cut_at_max_tokens'] = float(any(g.finish_reason == 'length' for g in r.generations))\n"
        "        return rollouts\n"))
    out = str(tmp_path / "out")
    done = run_cli(*[f if f != "math" else budget_ends_half for f in TINY_RUN], "--steps", "1", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = metrics_of(out)
    assert record["rollout/truncated_frac"] == record["agent/left_open"] == 0.5
    assert record["rollout/hit_max_tokens_frac"] == record["agent/cut_at_max_tokens"]
    assert record["rollout/hit_max_tokens_frac"] != record["rollout/truncated_frac"]


def test_the_trace_shows_each_tokens_actual_share_of_the_loss(tmp_path):
    out = str(tmp_path / "out")
    done = run_cli(*TINY_RUN, "--steps", "1", "--out", out, "--train.minibatches", "2", "--train.trace_rows", "100",
                   "--algo.loss_agg", "seq_mean_token_sum_norm")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = metrics_of(out)
    rows = [json.loads(line) for line in open(os.path.join(out, "traces", "step_000001.jsonl"))]
    assert len({r["rollout_id"] for r in rows}) == record["rollout/count"]          # every row was traced
    total = sum(sum(r["loss_contribution"]) for r in rows)
    # actor/loss is the mean over the two minibatches' losses: the contributions add up to both losses
    assert total == pytest.approx(2 * record["actor/loss"], rel=1e-5, abs=1e-9)
    for r in rows:                             # only trained tokens contribute
        assert all(c == 0.0 for c, why in zip(r["loss_contribution"], r["mask_reason"]) if why != "trained")


def test_minibatch_metrics_average_over_the_minibatches_that_ran(tmp_path):
    cfg = config.parse_config([*TINY_RUN, "--train.minibatches", "2", "--train.trace_rows", "0"])
    model_path = models.resolve_model("tiny-qwen3")
    tok = models.load_tokenizer(model_path)
    runner = train.load_recipe("math").AgentRunner(rollout.EmbeddedEngine(models.load_model(model_path), seed=1), tok,
                                                   max_length=cfg["rollout"].max_length)
    rollouts = runner.run(data.arithmetic_tasks(2, seed=0), ["only-group"] * 2,
                          engines.SamplingParams(max_tokens=6, seed=0))
    rows = [(r, row) for r in rollouts for row in r.rows]
    assert len(train.minibatch_indices([r.group_id for r, _ in rows], 2)) == 1     # one group: one minibatch
    os.makedirs(tmp_path / "traces")
    policy = actor.Actor(model_path, cfg["actor"], total_steps=2)
    metrics = train.train_on_rows(cfg, policy, None, tok, rows, str(tmp_path), 0)
    sampled = sum(row.num_trainable for _, row in rows)
    assert metrics["actor/kept_tokens"] == sampled       # not halved by a minibatch that never ran


def test_the_step_trains_on_rewards_shaped_by_the_replies_lengths(tmp_path):
    """--algo.stop_penalty and --algo.overlong_buffer reach the advantages train_on_rows trains: under REINFORCE
    (advantage = reward) a rollout whose reply ran into max_tokens trains at stop_penalty (< 0 replaces the reward),
    and one that stopped at its reward less DAPO's overlong punishment of its reply's length."""
    cfg = config.parse_config([*TINY_RUN, "--algo.estimator", "reinforce", "--algo.stop_penalty", "-1.0",
                              "--algo.overlong_buffer", "4", "--algo.overlong_penalty", "0.5",
                              "--rollout.max_tokens", "8", "--train.trace_rows", "100"])
    model_path = models.resolve_model("tiny-qwen3")
    tok = models.load_tokenizer(model_path)
    runner = train.load_recipe("math").AgentRunner(rollout.EmbeddedEngine(models.load_model(model_path), seed=1), tok,
                                                   max_length=cfg["rollout"].max_length)
    stops = tuple(range(0, len(tok), 8))        # an eighth of the ids stop a reply: some stop, some run to 8 tokens
    sampled = runner.run(data.arithmetic_tasks(4, seed=0), [f"g{i // 2}" for i in range(4)],
                         engines.SamplingParams(max_tokens=8, seed=0, stop_token_ids=stops))
    rows = [(r, row) for r in sampled for row in r.rows]
    os.makedirs(tmp_path / "traces")
    train.train_on_rows(cfg, actor.Actor(model_path, cfg["actor"], total_steps=1), None, tok, rows, str(tmp_path), 0)
    by_id = {r.rollout_id: r for r in sampled}
    traced = [json.loads(line) for line in open(tmp_path / "traces" / "step_000001.jsonl")]
    assert {t["rollout_id"] for t in traced} == set(by_id)
    for t in traced:
        r = by_id[t["rollout_id"]]
        longest = max(len(g.token_ids) for g in r.generations)
        want = -1.0 if r.max_tokens_turns else r.reward - 0.5 * max(longest - 4, 0) / 4
        trained = [a for a, why in zip(t["advantage"], t["mask_reason"]) if why != "context"]
        assert trained == pytest.approx([want] * len(trained), abs=1e-6), (t["rollout_id"], longest)
    cut = [r.max_tokens_turns > 0 for r in sampled]
    longest = [max(len(g.token_ids) for g in r.generations) for r in sampled]
    assert any(cut) and not all(cut), "armed: replies that stopped and replies cut at max_tokens"
    assert any(n > 4 and not c for n, c in zip(longest, cut)), "armed: a reply that stopped inside the buffer"


def test_the_run_counts_the_prefill_computed_and_taken_from_the_engines_prefix_cache():
    """rollout/prefill_tokens is the prompt tokens the engine computed per rollout, rollout/prefill_cached_frac the
    share of all prompt tokens it took from its prefix cache instead: a multi-turn episode's later turns take every
    position of the turn before; an engine without the cache computes them all."""
    import agents

    class Chat(agents.Env):
        def step(self, action_text: str) -> agents.Result:
            return agents.Result(0.0, "<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n",
                                 terminated=False)
    task = data.Task("t0", [{"role": "user", "content": "Tell me about the sea."}], "")
    params = engines.SamplingParams(max_tokens=6, seed=0, stop_token_ids=(9999,))
    model = models.tiny_model("qwen3", seed=0)
    for budget in (rollout.PREFIX_CACHE_BYTES, 0):
        engine = rollout.EmbeddedEngine(model, prefix_cache_bytes=budget)
        runner = type("ChatRunner", (agents.EnvRunner,), {"env_cls": Chat})(engine, models.bpe_tokenizer(),
                                                                            max_turns=3)
        rollouts = runner.run([task, task], ["g0", "g0"], params)
        gens = [g for r in rollouts for g in r.generations]
        metrics = train.rollout_metrics(rollouts, {})
        prompt_tokens = sum(len(g.prompt_ids) for g in gens)
        cached = sum(g.cached_prompt_tokens for g in gens)
        assert len(gens) == 6 and metrics["rollout/prefill_tokens"] == (prompt_tokens - cached) / 2
        assert metrics["rollout/prefill_cached_frac"] == cached / prompt_tokens
        if budget:     # each later turn took all of its turn before but the last sampled id
            assert [g.cached_prompt_tokens for g in rollouts[0].generations[1:]] == [
                len(g.prompt_ids) + len(g.token_ids) - 1 for g in rollouts[0].generations[:-1]]
        else:
            assert cached == 0


def test_minibatches_hold_whole_groups():
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    parts = train.minibatch_indices(groups, 2)
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = [invariants.Segment(f"r{i}", g, 0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [-1, 0, 0],
                               [invariants.UNSAMPLED] * 3)
            for i, g in enumerate(groups)]
    batch = invariants.build_batch(rows, [float(i) for i in range(8)], pad_id=0)
    sub = invariants.select_rows(batch, parts[1])
    assert sub.group_ids == ["c", "c", "d", "d"] and torch.equal(sub.input_ids, batch.input_ids[4:])


# ---- the flags that add a reference, a teacher or a correction: each shows an effect only its flag has -----------

def scored_run(tmp_path, *flags: str) -> tuple[list[dict], list[list[dict]]]:
    """Two steps of a recipe of its own: the math recipe with a reward that differs between a group's samples (a
    hash of the reply) on the odd-numbered prompts, and 0 for every sample of the even-numbered ones (a flat group:
    no policy gradient, and dropped by the zero-variance filter). Each step's prompts are one of each, in that
    order (groups g0 flat, g1 scored). A learning rate of 1e-3 moves the tiny policy visibly in one step.
    Returns the metrics and the traced rows of each step."""
    scored = recipe_file(tmp_path, "scored", (
        "EVEN = {task.task_id for task in base.tasks('train', 0)[::2]}\n\n\n"
        "class ScoredEnv(base.MathEnv):\n"
        "    def reset(self, task):\n"
        "        self.scored = task.task_id not in EVEN\n"
        "        return super().reset(task)\n\n"
        "    def step(self, action_text):\n"
        "        result = super().step(action_text)\n"
        "        result.reward = sum(map(ord, action_text)) % 101 / 100 if self.scored else 0.0\n"
        "        return result\n\n\n"
        "class AgentRunner(base.AgentRunner):\n"
        "    env_cls = ScoredEnv\n"))
    out = str(tmp_path / "out")
    done = run_cli(*[f if f != "math" else scored for f in TINY_RUN], "--steps", "2", "--actor.lr", "1e-3",
                   "--out", out, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [[json.loads(line) for line in open(os.path.join(out, "traces", f"step_{step:06d}.jsonl"))]
              for step in (1, 2)]
    return metrics_of(out), traces


def trained(row: dict, key: str) -> list[float]:
    """A traced row's `key` at the tokens it trained on."""
    return [value for value, why in zip(row[key], row["mask_reason"]) if why == "trained"]


def k3(logprobs: list[float], ref_logprobs: list[float]) -> list[float]:
    """Per token, the k3 estimate of KL(policy || reference) the trainer computes."""
    return algo.kl_divergence(torch.tensor(logprobs), torch.tensor(ref_logprobs), "k3").tolist()


def test_kl_to_the_reference_as_a_loss_term(tmp_path):
    """--algo.kl_coef: the reference is the initial policy (no KL at step 1); after a step it is not, and each token
    of a flat group, which has no policy gradient, adds exactly kl_coef * k3 / its minibatch's tokens to the loss
    (token_mean); without the flag they add nothing (their advantage is 0)."""
    records, traces = scored_run(tmp_path, "--algo.kl_coef", "0.05")
    assert records[0]["kl/k3_to_reference"] < 1e-9 and records[1]["kl/k3_to_reference"] > 1e-4
    assert records[1]["actor/kl_ref"] > 1e-4
    flat = [row for row in traces[1] if row["group_id"] == "s1-g0"]
    tokens = sum(len(trained(row, "advantage")) for row in flat)   # the group is the step's first minibatch:
    for row in flat:                                                # its loss is taken at the traced logprobs
        assert set(trained(row, "advantage")) == {0.0}
        expected = [0.05 * kl / tokens for kl in k3(trained(row, "trainer_logprob"), trained(row, "reference_logprob"))]
        assert trained(row, "loss_contribution") == pytest.approx(expected, rel=1e-4)
        assert min(expected) > 0


def test_kl_as_a_reward_penalises_each_token_by_the_kl_still_to_come(tmp_path):
    """--algo.kl_in_reward with reinforce: a token's advantage is its rollout's reward less kl_coef times the k3 of
    it and every later token (algo.kl_reward_penalty), so consecutive advantages differ by kl_coef * k3 of the
    token; at step 1 the policy is the reference and every advantage is the reward."""
    records, traces = scored_run(tmp_path, "--algo.estimator", "reinforce", "--algo.kl_in_reward", "true",
                                 "--algo.kl_coef", "0.05")
    assert records[0]["kl/k3_to_reference"] == 0.0 and records[1]["kl/k3_to_reference"] > 1e-4
    for row in traces[0]:
        assert trained(row, "advantage") == pytest.approx([row["reward"]] * len(trained(row, "advantage")))
    penalties = []
    for row in traces[1]:
        advantages = trained(row, "advantage")
        kl = k3(trained(row, "trainer_logprob"), trained(row, "reference_logprob"))
        assert [b - a for a, b in zip(advantages, advantages[1:])] == pytest.approx(
            [0.05 * x for x in kl[:-1]], rel=1e-3, abs=1e-7)
        assert advantages[-1] == pytest.approx(row["reward"] - 0.05 * kl[-1], abs=1e-6)
        penalties.append(row["reward"] - advantages[0])
    assert min(penalties) > 1e-5


def test_on_policy_distillation_takes_its_advantages_from_the_teacher(tmp_path):
    """--algo.estimator on_policy_distill with a teacher that is not the student (another seed of the tiny
    model): every sampled token's advantage is kl_coef * (teacher - student logprob), whatever the reward (a flat
    group learns as much as a scored one)."""
    teacher = models.tiny_model_dir("qwen3", seed=1)
    records, traces = scored_run(tmp_path, "--algo.estimator", "on_policy_distill", "--algo.kl_coef", "0.5",
                                 "--run.ref_model", teacher)
    assert all(r["kl/k3_to_reference"] > 1e-2 for r in records)        # the teacher differs from the student
    for row in traces[0] + traces[1]:
        gap = [t - s for t, s in zip(trained(row, "reference_logprob"), trained(row, "trainer_logprob"))]
        assert trained(row, "advantage") == pytest.approx([0.5 * g for g in gap], rel=1e-5, abs=1e-7)
        assert max(map(abs, gap)) > 1e-2
    assert {row["group_id"] for row in traces[0]} == {"s0-g0", "s0-g1"}


def test_token_level_is_correction_truncates_each_tokens_weight_and_flat_groups_are_filtered(tmp_path):
    """--correction.level token --correction.mode trunc: each trained token's IS weight is min(pi_prox / mu,
    high). A trainer in bf16 beside the fp32 engine gives a real train/inference mismatch (as a bf16 vLLM beside
    an fp32 trainer on a GPU); with high 1.0 the tokens the trainer finds likelier are truncated to 1 and the others
    keep their ratio, so the weights are neither all 1 nor all the ratio. --algo.filter_zero_variance drops each
    step's flat group before training."""
    records, traces = scored_run(tmp_path, "--actor.precision", "bf16", "--correction.level", "token",
                                 "--correction.mode", "trunc", "--correction.high", "1.0",
                                 "--algo.filter_zero_variance", "true")
    for step, (record, rows) in enumerate(zip(records, traces)):
        assert record["rollout/filtered_rows"] == 2 and {row["group_id"] for row in rows} == {f"s{step}-g1"}
        assert record["is/mismatch_abs_log_ratio"] > 1e-5 and 0 < record["is/is_clipped_frac"] < 1
        ratios = [math.exp(p - b) for row in rows
                  for p, b in zip(trained(row, "trainer_logprob"), trained(row, "behavior_logprob"))]
        weights = [w for row in rows for w in trained(row, "is_weight")]
        assert weights == pytest.approx([min(ratio, 1.0) for ratio in ratios], rel=1e-6)
        assert min(weights) < 1 - 1e-5 and max(ratios) > 1 + 1e-5


def test_the_chat_agent_recipe_trains_through_the_openai_sdk(tmp_path):
    out = str(tmp_path / "chat")
    flags = [f if f != "math" else "chat_math" for f in TINY_RUN]
    done = run_cli(*flags, "--steps", "2", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/count"] == 4 for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)   # engine and trainer agree through HTTP


# ---- failing closed on the sandbox ------------------------------------------------------------------------------

def test_recipes_that_run_model_code_are_known():
    runs = {name for name in ("math", "tool_use", "code_exec", "geo3k", "geo3k_chat", "swe_fix", "chat_math")
            if train.runs_model_code(train.load_recipe(name))}
    assert runs == {"code_exec", "geo3k", "geo3k_chat", "swe_fix"}


def test_a_run_that_would_execute_model_code_unjailed_stops_unless_the_loss_is_accepted(monkeypatch, capsys):
    from agents import sandbox
    monkeypatch.setattr(sandbox, "_VERIFIED", None)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)           # a machine without bubblewrap
    monkeypatch.delenv(sandbox.ACCEPT_ENV, raising=False)
    recipe = train.load_recipe("code_exec")
    with pytest.raises(SystemExit, match="refuses to run model code without namespaces, syscall_filter"):
        train.check_sandbox(recipe)
    assert "NOT enforced: namespaces" in capsys.readouterr().out         # what holds and what does not, printed
    monkeypatch.setenv(sandbox.ACCEPT_ENV, "namespaces,syscall_filter")
    train.check_sandbox(recipe)                                          # accepted by name: the run goes on
    train.check_sandbox(train.load_recipe("math"))                       # runs no model code: nothing to check
