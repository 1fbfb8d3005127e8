# Every workload recipe runs two RL steps on this CPU through the real command line (train.py), on the model it
# would use here or a tiny one, with its real agent: geo3k with a VLM, the python tool and the sandbox (Env and
# OpenAI-SDK forms), multi-turn tool use, code execution graded by hidden tests (a gymnasium env), LLM-as-judge with
# a frozen judge, on-policy distillation from a frozen teacher, and the agent ecosystem's own pieces (an OpenAI
# Agents SDK Agent with a function tool, a verifiers environment, a reasoning-gym task set), and the coding harnesses
# people use, unchanged (Codex's `codex exec`, Claude Code's `claude -p`, each a jailed process). Held-out evaluation
# (--eval.every, and `train.py eval CHECKPOINT`) runs through the same command line. train.py checks every
# rollout's sampled tokens are trainable exactly once (invariants.check_sampled_once), so each run proves it.
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2", "--run.threads", "1",
         "--steps", "2"]


def train(out: str, *args: str, timeout: int = 900) -> tuple[list[dict], str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "train.py", *args, *SMALL, "--out", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    records = [r for r in records if r["step"] > 0]          # step 0: the held-out evaluation before training
    assert [r["step"] for r in records] == [1, 2], done.stdout[-2000:]
    return records, done.stdout


@pytest.fixture(scope="module")
def geo3k_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("geo3k") / "out")
    return out, *train(out, "--recipe", "geo3k")


def test_geo3k_says_it_is_a_pipeline_run_and_names_its_model_and_data(geo3k_run):
    _, _, stdout = geo3k_run
    assert "a PIPELINE run, not a learning run" in stdout and "tiny-qwen2.5-vl-geo3k" in stdout
    assert "geo3k data: the synthetic geo3k (" in stdout and "512 train diagrams drawn with PIL" in stdout


def test_geo3k_rollouts_call_the_python_tool_and_train_on_what_was_sampled(geo3k_run):
    _, records, _ = geo3k_run
    assert all(r["rollout/count"] == 4 for r in records)
    assert sum(r["agent/tool_calls"] for r in records) > 0              # the model called python in the sandbox
    assert all(r["rollout/turns"] > 1 for r in records)                 # ... and saw its output in a next turn
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


def test_geo3k_trace_shows_the_image_tokens_as_context(geo3k_run):
    out, _, _ = geo3k_run
    done = subprocess.run([sys.executable, "train.py", "trace", out, "--step", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pads = [line.split() for line in done.stdout.splitlines() if '"<|image_pad|>"' in line]
    assert len(pads) >= 4 and all(parts[-1] == "context" for parts in pads)
    assert any(line.split()[-1] == "trained" for line in done.stdout.splitlines()[2:])


def test_geo3k_through_the_openai_sdk_calls_tools_over_http(tmp_path):
    records, _ = train(str(tmp_path / "out"), "--recipe", "geo3k_chat")
    # concurrent sessions batch by arrival, so sampling is not seeded here: a rollout may be dropped for a counted
    # reason (the tiny model can sample its image placeholder), never silently
    failed = [sum(v for k, v in r.items() if k.startswith("rollout/failed_")) for r in records]
    assert [r["rollout/count"] for r in records] == [4 - failed[0], 4 - (failed[1] - failed[0])]
    assert sum(r["rollout/count"] for r in records) >= 6
    assert sum(r["agent/tool_calls"] for r in records) > 0
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


@pytest.mark.parametrize("recipe, key", [
    ("tool_use", "agent/tool_calls"),
    ("code_exec", "agent/tests_passed"),        # a gymnasium.Env, driven as it is
    ("judge", "agent/judge_unreadable"),
])
def test_each_workload_recipe_runs_two_steps_on_a_tiny_model(recipe, key, tmp_path):
    records, _ = train(str(tmp_path / "out"), "--recipe", recipe, "--model", "tiny-qwen3",
                       "--rollout.max_tokens", "24")
    assert all(r["rollout/count"] == 4 and key in r for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


def test_an_openai_agents_sdk_agent_calls_its_function_tool_through_train_py(tmp_path):
    records, stdout = train(str(tmp_path / "out"), "--recipe", "agents_sdk")
    assert "agents_sdk: a PIPELINE run" in stdout
    assert all(r["rollout/count"] == 4 for r in records) and sum(r["agent/tool_calls"] for r in records) > 0
    assert max(r["rollout/turns"] for r in records) > 1 and all(r["rollout/seals_per_rollout"] == 0 for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


@pytest.mark.parametrize("recipe, keys", [
    ("verifiers_env", {"agent/correct_answer", "agent/boxed", "agent/num_turns"}),   # the rubric's functions
    ("reasoning_gym", {"agent/answered"}),
])
def test_an_environment_librarys_recipe_runs_two_steps_on_a_tiny_model(recipe, keys, tmp_path):
    records, _ = train(str(tmp_path / "out"), "--recipe", recipe, "--model", "tiny-qwen3", "--rollout.max_tokens", "8")
    assert all(r["rollout/count"] == 4 and keys <= set(r) for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


@pytest.mark.parametrize("recipe", ["codex", "claude_code"])
def test_a_coding_harness_unchanged_trains_two_steps_on_the_cpu(recipe, tmp_path):
    records, stdout = train(str(tmp_path / "out"), "--recipe", recipe)
    assert f"{recipe}: a PIPELINE run" in stdout
    # the pipeline's figures, step by step: rollouts kept (a sampled reply can make a harness exit: counted), turns,
    # seals, the reward (swe_fix's hidden tests), sampled tokens, the engine/trainer gap, the step's time
    failed = [sum(v for k, v in r.items() if k.startswith("rollout/failed_")) for r in records]
    for r in records:
        print(f"{recipe} step {r['step']}: {r['rollout/count']:.0f} rollouts, {r['rollout/turns']:.2f} turns, "
              f"{r['rollout/seals_per_rollout']:.2f} seals, reward {r['rollout/reward']:.2f}, "
              f"{r['rollout/sampled_tokens']:.0f} sampled tokens, lp diff max {r['mismatch/logprob_diff_max']:.1e}, "
              f"{r['time/step_s']:.1f} s")
    assert [r["rollout/count"] for r in records] == [4 - failed[0], 4 - (failed[1] - failed[0])]
    assert sum(r["rollout/count"] for r in records) >= 6
    # multi-turn: tool calls, then an answer (at temperature 1 a sampled call may fail, or the model answer early)
    assert all(r["rollout/turns"] > 1 and "agent/tests_passed" in r for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)


def test_distillation_runs_two_steps_against_the_teacher_without_reward(tmp_path):
    records, stdout = train(str(tmp_path / "out"), "--recipe", "distill")
    assert all(r["rollout/reward"] == 0.0 and r["kl/k3_to_reference"] > 0 for r in records)


def test_eval_every_logs_held_out_pass_at_k_before_and_during_training_and_eval_reads_a_checkpoint(tmp_path):
    out = str(tmp_path / "out")
    flags = ["--recipe", "math", "--model", "tiny-qwen3", "--rollout.max_tokens", "6", "--eval.every", "2",
             "--eval.prompts", "3", "--eval.samples", "2", "--eval.top_k", "-1"]
    records, stdout = train(out, *flags)
    assert "eval at step 0: pass@1" in stdout and "eval at step 2: pass@1" in stdout
    before = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][0]
    assert before["step"] == 0 and {"eval/pass@1", "eval/pass@2"} <= set(before)
    assert "eval/pass@1" in records[-1] and 0.0 <= records[-1]["eval/pass@1"] <= records[-1]["eval/pass@2"] <= 1.0
    done = subprocess.run([sys.executable, "train.py", "eval", os.path.join(out, "checkpoints", "final"),
                           "--recipe", "math", "--eval.prompts", "3", "--rollout.max_tokens", "6"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["eval/prompts"] == 3.0
    refused = subprocess.run([sys.executable, "train.py", "--recipe", "math", "--eval.samples", "0"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "eval.samples" in refused.stderr


def test_pass_at_k_is_the_unbiased_estimator():
    import train
    assert train.pass_at_k(4, 0, 1) == 0.0 and train.pass_at_k(4, 4, 1) == 1.0
    assert train.pass_at_k(4, 1, 1) == 0.25 and train.pass_at_k(4, 1, 4) == 1.0
    assert abs(train.pass_at_k(5, 2, 2) - (1 - 3 / 10)) < 1e-12          # 1 - C(3,2)/C(5,2)
