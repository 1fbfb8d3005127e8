# Per-request sampling (invariants 2 and 3): an agent may send its own temperature/top_p/top_k on either wire,
# and an Env may change SamplingParams between turns; the engine samples with them, every token records the
# sampling that drew it, and the trainer recomputes each token's logprob with exactly that sampling. The
# trainer's own mismatch metric is then ~1e-6; recomputing at the run's temperature over the full vocabulary
# (what a trainer that ignores the record does) is off by nats, which shows the trap is armed.
import anthropic
import openai
import pytest
import torch

import actor
import agents
import data
import invariants
import models
import train
from loopback import LoopbackServer
from rollout import EmbeddedEngine, SamplingParams

RUN_TEMPERATURE = 1.0      # the run's own sampling; the agents below override it per request


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return models.tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return actor.Actor(tiny_dir, actor.ActorConfig(precision="fp32", micro_batch_size=4), total_steps=1)


def gap(recomputed: torch.Tensor, batch: invariants.TrainBatch) -> float:
    return (recomputed - batch.behavior_logprobs)[batch.loss_mask.bool()].abs().max().item()


def assert_recomputed_at_the_recorded_sampling(policy, batch: invariants.TrainBatch, what: str) -> None:
    """The actor's recompute matches the behavior logprobs; the run's sampling over the full vocabulary (a
    trainer that ignores the record) does not: the trap is armed."""
    recorded_gap = gap(policy.recompute_logprobs(batch), batch)
    with torch.no_grad():
        at_run_sampling = actor.sequence_logprobs(policy.model, batch.input_ids, batch.attention_mask, RUN_TEMPERATURE)
    print(f"{what}: max |logprob gap| at the recorded sampling {recorded_gap:.2e}, at the run's sampling "
          f"{gap(at_run_sampling, batch):.2f}")
    assert recorded_gap < 1e-5 and gap(at_run_sampling, batch) > 0.5


def batch_of(rollouts: list[agents.Rollout]) -> tuple[invariants.TrainBatch, list]:
    rows = [(r, row) for r in rollouts for row in r.rows]
    batch = invariants.build_batch([row for _, row in rows], [1.0] * len(rows), pad_id=0)
    invariants.check_token_identity(batch, [row for _, row in rows])
    return batch, rows


def test_sdk_requests_with_their_own_sampling_are_recomputed_at_it(tiny_dir, policy, tmp_path):
    tok = models.load_tokenizer(tiny_dir)
    server = LoopbackServer(EmbeddedEngine(models.load_model(tiny_dir), tokenizer=tok), tok,
                            template=data.CHATML_TEMPLATE)
    server.start()
    try:
        rollouts = []
        # OpenAI: temperature and top_p per request, changing between turns of one conversation
        info = server.create_session("openai-rollout", "g", SamplingParams(RUN_TEMPERATURE, max_tokens=8))
        client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
        messages = [{"role": "user", "content": "count to three"}]
        for k, (temperature, top_p) in enumerate([(0.3, 1.0), (0.7, 0.8), (1.6, 0.5)]):
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=k,
                                                   temperature=temperature, top_p=top_p)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]
        # Anthropic: temperature and top_k
        second = server.create_session("anthropic-rollout", "g", SamplingParams(RUN_TEMPERATURE, max_tokens=8))
        claude = anthropic.Anthropic(base_url=second.session_url, api_key=second.api_key, max_retries=0)
        claude.messages.create(model="policy", max_tokens=8, extra_body={"temperature": 0.5, "top_k": 5},
                               messages=[{"role": "user", "content": "count to three"}])
        for session_info in (info, second):
            session = server.close_session(session_info.session_id)
            rows = session.ledger.rows()
            invariants.check_sampled_once(rows, session.generations)
            rollouts.append(agents.Rollout(session.ledger.rollout_id, "g", "t", rows, 1.0, 1.0, session.turns, False,
                                           generations=session.generations))
    finally:
        server.stop()
    batch, rows = batch_of(rollouts)
    recorded = {(round(t, 4), round(p, 4), k) for t, p, k, m in zip(batch.temperature.flatten().tolist(),
                                                                    batch.top_p.flatten().tolist(),
                                                                    batch.top_k.flatten().tolist(),
                                                                    batch.loss_mask.flatten().tolist()) if m}
    assert recorded == {(0.3, 1.0, -1), (0.7, 0.8, -1), (1.6, 0.5, -1), (0.5, 1.0, 5)}   # each token's own
    assert_recomputed_at_the_recorded_sampling(policy, batch, "SDK per-request sampling")
    # and the trainer's own metric, through the real training path, reads the exact agreement
    cfg = train.parse_config(["--recipe", "math", "--model", tiny_dir, "--rollout.temperature", str(RUN_TEMPERATURE),
                              "--train.trace_rows", "0"])
    (tmp_path / "traces").mkdir()
    metrics = train.train_on_rows(cfg, actor.Actor(tiny_dir, cfg["actor"], total_steps=1), None, tok, rows,
                                  str(tmp_path), 0)
    assert metrics["mismatch/logprob_diff_max"] < 1e-5 and metrics["mismatch/k3_kl"] < 1e-9


class ColderEachTurn(agents.Env):
    """Three turns; after each, the env asks for a colder, truncated sampling for the next one."""
    schedule = [{"temperature": 0.4, "top_k": 7}, {"temperature": 0.2, "top_p": 0.6}]

    def reset(self, task):
        self.turn = 0
        return task.messages

    def step(self, action_text: str) -> agents.Result:
        self.turn += 1
        if self.turn == 3:
            return agents.Result(reward=1.0)
        return agents.Result(reward=0.0, observation="\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n",
                             terminated=False, sampling_params=self.schedule[self.turn - 1])


class ColderRunner(agents.EnvRunner):
    env_cls = ColderEachTurn


def test_env_sampling_overrides_are_recomputed_at_each_turns_sampling(tiny_dir, policy):
    tok = models.load_tokenizer(tiny_dir)
    runner = ColderRunner(EmbeddedEngine(models.load_model(tiny_dir), seed=3), tok, max_turns=3)
    tasks = data.arithmetic_tasks(2, seed=0)
    rollouts = runner.run(tasks, ["g0", "g1"], SamplingParams(RUN_TEMPERATURE, max_tokens=6))
    assert len(rollouts) == 2 and all(r.num_turns == 3 for r in rollouts)
    for r in rollouts:
        assert [g.sampling for g in r.generations] == [invariants.Sampling(RUN_TEMPERATURE),
                                                       invariants.Sampling(0.4, 1.0, 7),
                                                       invariants.Sampling(0.2, 0.6, 7)]   # overrides add up
        invariants.check_sampled_once(r.rows, r.generations)
    batch, _ = batch_of(rollouts)
    assert_recomputed_at_the_recorded_sampling(policy, batch, "Env sampling overrides")


def test_a_sampled_token_outside_the_trainers_nucleus_keeps_a_finite_logprob():
    logits = torch.tensor([[3.0, 2.999, -1.0, -2.0]])
    alone = invariants.processed_logprobs(logits, 1.0, top_p=0.45)
    assert torch.isinf(alone[0, 1])                 # armed: by its own logits the trainer would cut token 1
    kept = invariants.processed_logprobs(logits, 1.0, top_p=0.45, keep=torch.tensor([1]))
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    assert torch.allclose(kept.exp().sum(), torch.tensor(1.0))
