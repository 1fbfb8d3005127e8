# The training job's command line (config.py): every field a flag with its default in --help, bad flags and
# combinations refused before anything loads, and the run's context resolved against the model's position limit.
import os

import pytest

import algo
import config
import models
import train
from test_train import TINY_RUN, run_cli


@pytest.mark.parametrize("flags, reason", [
    (["--no.such_flag", "1"], "unrecognized arguments"),
    (["--rollout.top_p", "1.5"], "top_p must be in (0, 1]"),
    (["--rollout.samples_per_prompt", "1"], "samples_per_prompt"),
    (["--algo.kl_in_reward", "true", "--algo.kl_coef", "0.1"], "silently ignored"),
    (["--correction.level", "token", "--correction.high", "0.9"], "high"),
    (["--rollout.temperature", "0"], "temperature"),
    (["--train.minibatches", "3"], "minibatches"),
    (["--recipe", "nope"], "unknown recipe"),
    (["--steps", "many"], "invalid"),
    (["--run.sandbox_accept", "namespace"], "unknown protections ['namespace']"),
    (["--rollout.max_length", "-1"], "rollout.max_length must be > 0, or 0 for the model's position limit"),
    (["--algo.dual_clip", "0.5"], "dual_clip must be 0 (off) or a finite bound > 1"),
    (["--algo.overlong_buffer", "1000"], "overlong_buffer (1000) is longer than rollout.max_tokens"),
    (["--correction.gating", "binary_kl", "--correction.seq_gate", "geo"], "seq_gate 'geo' would be ignored"),
    (["--train.final_checkpoint", "optimizer"], "train.final_checkpoint must be one of ('full', 'weights', 'none')"),
    (["--train.final_checkpoint", "weights", "--actor.lora_rank", "4"], "under LoRA only the adapter trains"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, reason, tmp_path, capsys):
    """train.main as the command line calls it, in this process (the command line's own exit status and stderr:
    the next test): a refusal that names its reason, and no run folder."""
    out = str(tmp_path / "never")
    with pytest.raises(SystemExit) as refused:
        train.main([*flags, "--out", out])
    said = f"{refused.value.code}\n{capsys.readouterr().err}"
    assert refused.value.code not in (0, None) and reason in said, said[-2000:]
    assert not os.path.exists(out)


def test_a_context_past_the_models_position_limit_is_refused_naming_both_before_the_run_starts(tmp_path):
    out = str(tmp_path / "never")
    done = run_cli(*TINY_RUN, "--rollout.max_length", "70000", "--steps", "1", "--out", out)
    assert done.returncode != 0 and "rollout.max_length (70000)" in done.stderr, done.stderr[-2000:]
    assert "position limit (65536 positions" in done.stderr and not os.path.exists(out)


def test_the_run_context_defaults_to_the_models_position_limit():
    tiny, smollm2 = models.resolve_model("tiny-qwen3"), models.resolve_model("smollm2")
    assert config.RolloutConfig().max_length == 0                      # the model's, whichever it is
    assert config.resolve_context(config.RolloutConfig(), tiny).max_length == 65536
    assert config.resolve_context(config.RolloutConfig(), smollm2).max_length == 8192
    assert config.resolve_context(config.RolloutConfig(max_length=256), tiny).max_length == 256
    with pytest.raises(SystemExit, match=r"rollout.max_length \(8193\) is above the model's position limit \(8192"):
        config.resolve_context(config.RolloutConfig(max_length=8193), smollm2)
    with pytest.raises(SystemExit, match="rollout.max_tokens"):
        config.resolve_context(config.RolloutConfig(max_tokens=70000), tiny)


def test_help_lists_every_flag_with_its_default():
    done = run_cli("--help", timeout=60)
    assert done.returncode == 0
    for section, cls in config.config_sections().items():
        for name in cls.__dataclass_fields__:
            assert f"--{section}.{name}" in done.stdout
    assert "(default: smollm2)" in done.stdout
    # a choice list named in a field's comment is printed as the names it holds, not as the constant's name
    assert "one of ESTIMATORS" not in done.stdout and "one of LR_SCHEDULES" not in done.stdout
    assert "one of full, weights, none" in " ".join(done.stdout.split())
    assert f"one of {', '.join(algo.ESTIMATORS)}" in " ".join(done.stdout.split())
