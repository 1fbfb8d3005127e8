# Per-request sampling (invariant 3, forward consistency, on invariant 2's per-token record): an agent may send
# its own temperature/top_p/top_k, min_p, logit_bias, repetition/frequency/presence penalties and a grammar on
# either wire, and an Env may change SamplingParams between turns; the engine samples with them, every token
# records the sampling that drew it, and the trainer recomputes each token's logprob with exactly that sampling,
# the penalties and grammar from the row's own ids.
# The trainer's own mismatch metric is then ~1e-6; recomputing without a field (what a trainer that ignores the
# record does) is off by a clear margin, which shows each trap is armed.
import dataclasses
import json
import math

import anthropic
import openai
import pytest
import torch

import actor
import agents
import config
import data
import invariants
import models
import train
from engines import SamplingParams, constraints
from loopback import LoopbackServer
from rollout import EmbeddedEngine
from trainer import recompute
from test_actor import rows_from

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
        at_run_sampling = recompute.sequence_logprobs(policy.model, batch.input_ids, batch.attention_mask,
                                                      RUN_TEMPERATURE)
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
    cfg = config.parse_config(["--recipe", "math", "--model", tiny_dir, "--rollout.temperature", str(RUN_TEMPERATURE),
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


# ---- min_p, logit_bias, the three penalties and a grammar: each honoured by the engine, recomputed by the trainer
# A near-uniform random model hides a wrong penalty (its logits are ~0.16 apart, so dividing them by 1.6 moves a
# logprob by ~0.01), so these tests sample from a sharpened copy: the same tiny model with its final norm scaled.

SHARPEN = 15.0
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
BIASED_IDS = tuple(range(10, 400, 3))     # every third id of the tiny vocabulary: half boosted, half banned
FIELDS = {   # each field alone, at a strength a real client might send
    "min_p": {"min_p": 0.25},
    "logit_bias": {"logit_bias": tuple((t, 4.0 if t % 2 else -math.inf) for t in BIASED_IDS)},
    "repetition_penalty": {"repetition_penalty": 1.6},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "presence_penalty": {"presence_penalty": 1.5},
    "constraint": {"constraint": constraints.json_schema_spec(WEATHER)},
}
# prompts that repeat ids, so the repetition penalty sees them before the reply starts
FIELD_PROMPTS = [[5, 17, 33, 17, 5, 91], [7, 8, 7, 8], [100, 101, 102, 103, 104]]


def sharp_model_dir(folder: str, head_dim: int = 16) -> str:
    """The tiny Qwen3 (tied embeddings) with its final norm scaled by SHARPEN, saved with its tokenizer in `folder`:
    logits ~2.4 apart instead of ~0.16, so a field's effect on a sampled token's logprob is far above fp32 noise."""
    model = models.tiny_model("qwen3", head_dim=head_dim)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.save_pretrained(folder)
    models.bpe_tokenizer().save_pretrained(folder)
    return folder


def without(field: str, s: invariants.Sampling) -> invariants.Sampling:
    """The trap: the recorded sampling with `field` back at its default (what a trainer that ignores it uses)."""
    plain = dataclasses.replace(s, **{field: getattr(invariants.UNSAMPLED, field)})
    stateful = invariants.uses_penalties(plain) or plain.constraint is not None
    return plain if stateful else dataclasses.replace(plain, generation_start=-1)


def field_batches(rows: list[invariants.Segment], field: str, tokenizer, vocab_size: int):
    """The batch of the engine's rows, and the same batch with `field` stripped from every token's sampling."""
    stripped = [dataclasses.replace(row, sampling=[without(field, s) for s in row.sampling]) for row in rows]
    batches = [invariants.build_batch(r, [1.0] * len(r), pad_id=0,
                                      grammar_masks=constraints.mask_replayer(tokenizer, vocab_size))
               for r in (rows, stripped)]
    invariants.check_token_identity(batches[0], rows)
    return batches


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory) -> str:
    return sharp_model_dir(str(tmp_path_factory.mktemp("sharp")))


@pytest.fixture(scope="module")
def sharp_policy(sharp_dir):
    return actor.Actor(sharp_dir, actor.ActorConfig(precision="fp32", micro_batch_size=4), total_steps=1)


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_is_sampled_with_and_recomputed_at_and_stripping_it_is_seen(field, sharp_dir, sharp_policy):
    tok = models.load_tokenizer(sharp_dir)
    engine = EmbeddedEngine(models.load_model(sharp_dir), tokenizer=tok)
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=3, **FIELDS[field])
    gens = engine.generate(FIELD_PROMPTS, params)
    value = FIELDS[field][field]
    value = constraints.bind(value, [tok.eos_token_id]) if field == "constraint" else value   # bound to its stop id
    for prompt, gen in zip(FIELD_PROMPTS, gens):
        assert getattr(gen.sampling, field) == value                       # recorded as sampled
        stateful = field.endswith("penalty") or field == "constraint"
        assert gen.sampling.generation_start == (len(prompt) if stateful else -1)
    batch, stripped = field_batches(rows_from(gens), field, tok, sharp_policy.model.config.vocab_size)
    recorded_gap = gap(sharp_policy.recompute_logprobs(batch), batch)
    trap = gap(sharp_policy.recompute_logprobs(stripped), batch)
    print(f"{field}: max |behavior - recompute| {recorded_gap:.2e}; with {field} stripped {trap:.3f}")
    assert recorded_gap < 1e-5 and trap > 0.05


def test_the_engine_ends_a_constrained_row_on_a_stop_id_once_its_grammar_is_complete(sharp_dir):
    tok = models.load_tokenizer(sharp_dir)
    engine = EmbeddedEngine(models.load_model(sharp_dir), tokenizer=tok)
    gens = engine.generate(FIELD_PROMPTS, SamplingParams(max_tokens=60, seed=1, **FIELDS["constraint"]))
    for gen in gens:
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == tok.eos_token_id
        reply = json.loads(tok.decode(gen.token_ids[:-1]))
        assert set(reply) == {"city", "unit"} and reply["unit"] in ("c", "f") and len(reply["city"]) <= 12
    free = engine.generate(FIELD_PROMPTS, SamplingParams(max_tokens=60, seed=1))     # armed: unconstrained it is not
    assert not any(tok.decode(g.token_ids).startswith('{"city": ') for g in free)


def test_each_turn_is_penalised_from_its_own_generation_start(sharp_dir, sharp_policy):
    """Two turns of one conversation with frequency and presence penalties: vLLM counts only a turn's own output
    (its output ids; the earlier turns are its prompt), and so does the trainer, from each token's recorded
    generation_start. Trap: counting the first turn's reply as the second turn's output too."""
    tok = models.load_tokenizer(sharp_dir)
    engine = EmbeddedEngine(models.load_model(sharp_dir), tokenizer=tok)
    params = SamplingParams(temperature=0.9, max_tokens=10, seed=2, frequency_penalty=1.5, presence_penalty=0.5,
                            stop_token_ids=(9999,))
    ledger = invariants.TokenLedger("r0", "g")
    prompt = FIELD_PROMPTS[0]
    for _ in range(2):
        gen = engine.generate([prompt], params)[0]
        ledger.extend_or_seal(prompt)
        ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling)
        assert gen.sampling.generation_start == len(prompt)
        prompt = prompt + gen.token_ids + [7, 8, 9]          # the reply and a tool's output, as context
    batch = invariants.build_batch(ledger.rows(), [1.0], pad_id=0)
    assert [(run.start, run.end) for run in batch.runs[0]] == [(6, 16), (19, 29)]
    recorded_gap = gap(sharp_policy.recompute_logprobs(batch), batch)
    batch.runs[0][1].sampling = dataclasses.replace(batch.runs[0][1].sampling, generation_start=6)
    trap = gap(sharp_policy.recompute_logprobs(batch), batch)
    print(f"two turns: gap {recorded_gap:.2e}; the second turn counted from the first's start {trap:.3f}")
    assert recorded_gap < 1e-5 and trap > 0.05
