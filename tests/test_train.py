# The main job end to end, through its real command line: a short run on a tiny model writes every
# artefact a user reads (metrics, TensorBoard, plot, traces, checkpoints), resumes, traces a sample token
# by token, and refuses bad flags before anything loads.
import json
import os
import subprocess
import sys

import pytest
import torch

import invariants
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


def test_trace_prints_every_token_with_its_provenance(tiny_run):
    out, _ = tiny_run
    done = run_cli("trace", out, "--step", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["pos", "id", "text", "ver", "behavior", "trainer", "is_w", "advantage", "loss",
                                "reason"]
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


@pytest.mark.parametrize("flags, reason", [
    (["--no.such_flag", "1"], "unrecognized arguments"),
    (["--rollout.top_p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--rollout.samples_per_prompt", "1"], "samples_per_prompt"),
    (["--algo.kl_in_reward", "true", "--algo.kl_coef", "0.1"], "silently ignored"),
    (["--correction.level", "token", "--correction.high", "0.9"], "high"),
    (["--rollout.temperature", "0"], "temperature"),
    (["--train.minibatches", "3"], "minibatches"),
    (["--recipe", "nope"], "unknown recipe"),
    (["--steps", "many"], "invalid"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, reason, tmp_path):
    out = str(tmp_path / "never")
    done = run_cli(*flags, "--out", out, timeout=60)
    assert done.returncode != 0 and reason in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(out)


def test_help_lists_every_flag_with_its_default():
    done = run_cli("--help", timeout=60)
    assert done.returncode == 0
    for section, cls in train.config_sections().items():
        for name in cls.__dataclass_fields__:
            assert f"--{section}.{name}" in done.stdout
    assert "(default: smollm2)" in done.stdout


def test_minibatches_hold_whole_groups():
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    parts = train.minibatch_indices(groups, 2)
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = [invariants.Segment(f"r{i}", g, 0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [-1, 0, 0],
                               [invariants.UNSAMPLED] * 3)
            for i, g in enumerate(groups)]
    batch = invariants.build_batch(rows, [float(i) for i in range(8)], pad_id=0)
    sub = train.select_rows(batch, parts[1])
    assert sub.group_ids == ["c", "c", "d", "d"] and torch.equal(sub.input_ids, batch.input_ids[4:])


@pytest.mark.parametrize("flags", [
    ["--algo.kl_coef", "0.05"],                                                   # KL to the reference as a loss
    ["--algo.estimator", "reinforce", "--algo.kl_in_reward", "true", "--algo.kl_coef", "0.05"],  # KL as a reward
    ["--algo.estimator", "on_policy_distill", "--algo.kl_coef", "1.0", "--run.ref_model", "tiny-qwen3"],
    ["--correction.level", "token", "--correction.mode", "trunc", "--correction.high", "2.0",
     "--algo.filter_zero_variance", "true"],
])
def test_reference_distillation_and_correction_paths_run_end_to_end(flags, tmp_path):
    out = str(tmp_path / "out")
    done = run_cli(*TINY_RUN, "--steps", "1", "--out", out, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    if "--algo.kl_coef" in flags:
        assert record["kl/k3_to_reference"] >= 0


def test_the_chat_agent_recipe_trains_through_the_openai_sdk(tmp_path):
    out = str(tmp_path / "chat")
    flags = [f if f != "math" else "chat_math" for f in TINY_RUN]
    done = run_cli(*flags, "--steps", "2", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/count"] == 4 for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)   # engine and trainer agree through HTTP
