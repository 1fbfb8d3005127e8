# Score centering (trainer/centering.py, arXiv 2609.20807): the loss's gradient is the paper's estimator A (s_a - mu),
# mu the sampler-expected score with the tail modeled proportionally, checked against a reference written here from
# the formula over the whole vocabulary, also far off-policy (alpha 1e5, where an fp32 head loses it); the sampler's
# top-k heads are recorded with each sampled token (invariant 2) through both paths a token takes (an Env runner and a
# chat session, over several turns and a seal), reach the TrainBatch unchanged and line up with the trainer's
# recompute; a run with it is refused where it would train wrong, and trains end to end.
import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import config
import data
import invariants
import models
from agents import Env, EnvRunner, Result, user_turns
from engines import SamplingParams
from rollout import EmbeddedEngine
from session import ChatSession
from trainer import centering, recompute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = 4


# ---- the loss: the paper's estimator, against a reference from its formula ----

def reference_gradient(z: torch.Tensor, a: torch.Tensor, A: torch.Tensor, log_q: torch.Tensor,
                       head: torch.Tensor) -> torch.Tensor:
    """d/dz of the score-centered objective estimate, per position, from the paper's definitions over the whole
    vocabulary: p = softmax(z), s_v = d log p_v / dz = e_v - p, the sampler's distribution modeled as q on the head H
    and alpha p off it with alpha = (1 - Q_H) / (1 - P_H), mu = sum_v q_hat_v s_v, and the estimate A (s_a - mu)."""
    n, vocab = z.shape
    p = torch.softmax(z, -1)
    eye = torch.eye(vocab, dtype=z.dtype)
    grads = []
    for i in range(n):
        scores = eye - p[i]                                   # [V, V]: row v is s_v
        in_head = torch.zeros(vocab, dtype=torch.bool)
        in_head[head[i]] = True
        q_head = torch.zeros(vocab, dtype=z.dtype)
        q_head[head[i]] = log_q[i, head[i]].exp()
        alpha = (1 - q_head.sum()) / (1 - p[i][in_head].sum())
        q_hat = torch.where(in_head, q_head, alpha * p[i])
        mu = q_hat @ scores
        grads.append(A[i] * (scores[a[i]] - mu))
    return torch.stack(grads)


def loss_gradient(z: torch.Tensor, a: torch.Tensor, A: torch.Tensor, log_q: torch.Tensor,
                  head: torch.Tensor) -> torch.Tensor:
    """-d(loss)/dz of centering.centered_policy_loss on one row of n tokens, the sampler's head given as its ids."""
    z = z.clone().requires_grad_(True)
    log_p = torch.log_softmax(z, -1)
    sampled = log_p.gather(-1, a[:, None])[:, 0][None]                       # [1, n]
    loss, _ = centering.centered_policy_loss(sampled, log_p.gather(-1, head)[None], log_q.gather(-1, head)[None],
                                             sampled.detach(), A[None], torch.ones(1, len(a), dtype=z.dtype))
    loss.sum().backward()
    return -z.grad


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(0)
    n, vocab = 6, 12
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64)                 # the live policy's logits
    log_q = torch.log_softmax(z + 0.7 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)   # a stale one
    a = torch.multinomial(log_q.exp(), 1, generator=g)[:, 0]
    A = torch.randn(n, generator=g, dtype=torch.float64)
    return z, a, A, log_q


def test_the_losss_gradient_is_the_papers_centered_estimator_with_a_proportional_tail(case):
    z, a, A, log_q = case
    head = log_q.topk(K, -1).indices
    expected = reference_gradient(z, a, A, log_q, head)
    assert torch.allclose(loss_gradient(z, a, A, log_q, head), expected, atol=1e-12, rtol=0)
    # negative controls: the plain REINFORCE score, and a head of another policy version, give other gradients
    uncentered = torch.stack([A[i] * (torch.eye(z.shape[1], dtype=z.dtype)[a[i]] - torch.softmax(z[i], -1))
                              for i in range(len(a))])
    assert (uncentered - expected).abs().max() > 1e-2
    other = torch.log_softmax(z + 2.0 * torch.randn(z.shape, generator=torch.Generator().manual_seed(1),
                                                     dtype=z.dtype), -1)
    assert (loss_gradient(z, a, A, other, other.topk(K, -1).indices) - expected).abs().max() > 1e-2


def test_a_head_covering_the_vocabulary_centers_exactly_and_the_expectation_is_the_covariance(case):
    """With the whole vocabulary in the head the tail guard gives alpha = 1 and mu = sum_v q_v s_v exactly; then the
    estimate's expectation over a ~ q is Cov_q(A, s), while plain REINFORCE's adds E_q[A] mu (the drift the paper
    removes)."""
    z, _, _, log_q = case
    vocab = z.shape[1]
    head = torch.arange(vocab).expand(len(z), vocab)
    A_of = torch.linspace(-1.0, 2.0, vocab, dtype=z.dtype)               # an advantage per next token
    for i in range(len(z)):
        q = log_q[i].exp()
        ids = torch.arange(vocab)
        grads = loss_gradient(z[i].expand(vocab, vocab), ids, A_of, log_q[i].expand(vocab, vocab), head[:1].expand(
            vocab, vocab))
        expected_value = q @ grads                                          # E_{a ~ q}
        scores = torch.eye(vocab, dtype=z.dtype) - torch.softmax(z[i], -1)
        mu = q @ scores
        covariance = q @ (A_of[:, None] * (scores - mu)) - (q @ A_of) * (q @ (scores - mu))
        assert torch.allclose(expected_value, covariance, atol=1e-12)
        plain = q @ (A_of[:, None] * scores)
        assert (plain - covariance).abs().max() > 1e-3                      # the trap is armed: the drift is there


def far_off_policy(alpha: float, n: int = 4, vocab: int = 50) -> tuple[torch.Tensor, ...]:
    """fp32 logits [n, vocab] whose head (ids 0..K-1, logits near 12) holds all but 0.6 / alpha of the live mass,
    and a sampler that put 0.4 on that head: alpha = (1 - Q_H) / (1 - P_H) as asked. Sampled: head and tail ids."""
    g = torch.Generator().manual_seed(7)
    head = 12.0 + torch.randn(n, K, generator=g, dtype=torch.float64)
    tail = torch.randn(n, vocab - K, generator=g, dtype=torch.float64)
    p_tail = 0.6 / alpha         # tail logits shifted so that logsumexp(tail) - logsumexp(all) = log p_tail
    shift = math.log(p_tail / (1 - p_tail)) + torch.logsumexp(head, -1) - torch.logsumexp(tail, -1)
    z = torch.cat([head, tail + shift[:, None]], -1).float()
    w = torch.rand(n, K, generator=g, dtype=torch.float64) + 0.1
    log_q = torch.full((n, vocab), -40.0, dtype=torch.float64)
    log_q[:, :K] = torch.log(0.4 * w / w.sum(-1, keepdim=True))
    a = torch.tensor([0, 1, K + 3, K + 20])[:n]
    return z, a, torch.linspace(-1.0, 1.0, n, dtype=torch.float64), log_q


def trainer_gradient(z: torch.Tensor, a: torch.Tensor, A: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """-d(loss)/dz through the trainer's own head (recompute's chunked head on fp32 logits: an identity output
    projection, so its logits are z exactly) and centering.centered_policy_loss, in the actor's fp32 tensors."""
    z = z.clone().requires_grad_(True)
    projection = torch.nn.Linear(z.shape[1], z.shape[1], bias=False)
    projection.weight.data = torch.eye(z.shape[1])
    ids = torch.cat([a[:, None], torch.arange(K).expand(len(a), K)], -1)
    out = recompute._chunked_head_logprobs(z, projection, ids, 1.0, 1.0, -1, 0.0, with_entropy=True)
    sampled = out[None, :, 0].float()
    loss, _ = centering.centered_policy_loss(sampled, out[None, :, 1:-1], log_q[None, :, :K].float(),
                                             sampled.detach(), A[None].float(), torch.ones(1, len(a)))
    loss.sum().backward()
    return -z.grad.double()


@pytest.mark.parametrize("alpha", [1.0, 1e5])
def test_far_off_policy_the_centered_gradient_keeps_its_accuracy(alpha):
    """At alpha = 1e5 the coefficients q_v - alpha p_v are ~1e5 and cancel to an order-1 gradient: the trainer's head
    (fp64 over fp32 logits) keeps it within 1e-6 of the fp64 reference, relative. Trap: the same loss on an fp32
    head log-softmax is off by more than 1e-4 there."""
    z, a, A, log_q = far_off_policy(alpha)
    head = torch.arange(K).expand(len(a), K)
    p_tail = 1 - torch.softmax(z.double(), -1)[:, :K].sum(-1)
    assert torch.allclose((1 - log_q[:, :K].exp().sum(-1)) / p_tail, torch.tensor(alpha, dtype=torch.float64),
                          rtol=1e-3)
    expected = reference_gradient(z.double(), a, A, log_q, head)
    scale = float(expected.abs().max())
    assert float((trainer_gradient(z, a, A, log_q) - expected).abs().max()) <= 1e-6 * scale
    if alpha > 1:
        fp32_head = loss_gradient(z, a, A.float(), log_q.float(), head).double()
        assert float((fp32_head - expected).abs().max()) > 1e-4 * scale


def test_empty_head_slots_and_ids_the_live_policy_excludes_add_nothing():
    live = torch.tensor([[-0.5, -1.5, -float("inf"), -3.0]], dtype=torch.float64)
    behavior = torch.tensor([[-0.4, -1.2, -2.5, -float("inf")]], dtype=torch.float64)
    c = centering.head_coefficients(live, behavior)
    assert c[0, 3] == 0 and c[0, 2] == pytest.approx(np.exp(-2.5))        # empty slot; q only (p = 0 there)
    assert torch.isfinite(c).all()


# ---- recording: the engine's heads, per sampled token, to the TrainBatch ----

class TwoTurnEnv(Env):
    def __init__(self):
        self.turn = 0

    def step(self, action_text: str) -> Result:
        self.turn += 1
        return Result(1.0, user_turns(["more"]), terminated=self.turn >= 2)


@pytest.fixture(scope="module")
def tok():
    return models.bpe_tokenizer()


@pytest.fixture(scope="module")
def model():
    return models.tiny_model("qwen3", seed=0)


def heads_at_sampled(batch: invariants.TrainBatch) -> tuple[np.ndarray, np.ndarray]:
    sampled = batch.loss_mask.bool()
    return batch.top_ids[sampled].numpy(), batch.top_behavior_logprobs[sampled].numpy()


def engine_heads(gens) -> tuple[np.ndarray, np.ndarray]:
    tops = [top[:K] for g in gens for top in g.top_logprobs]
    return np.array([[t for t, _ in top] for top in tops]), np.array([[lp for _, lp in top] for top in tops],
                                                                     dtype=np.float32)


def trainer_heads(model, batch: invariants.TrainBatch, shift: int = 0) -> torch.Tensor:
    with torch.no_grad():
        _, _, heads = recompute.forward_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.temperature, top_p=batch.top_p, top_k=batch.top_k,
            min_p=batch.min_p, positions=batch.loss_mask.bool(), candidates=batch.top_ids.roll(shift, 1))
    return heads


def test_an_env_runner_records_each_tokens_engine_head_and_the_trainer_reads_the_same_ids(model, tok):
    runner = type("Runner", (EnvRunner,), {"env_cls": TwoTurnEnv})(EmbeddedEngine(model), tok, max_turns=3)
    tasks = [data.Task("t0", [{"role": "user", "content": "Say hi."}], "")]
    (rollout,) = runner.run(tasks, ["g"], SamplingParams(temperature=0.7, max_tokens=5, top_logprobs=K, seed=3))
    assert len(rollout.generations) == 2
    invariants.check_sampled_once(rollout.rows, rollout.generations)
    batch = invariants.build_batch(rollout.rows, [1.0], pad_id=0)
    invariants.check_token_identity(batch, rollout.rows)
    ids, logprobs = heads_at_sampled(batch)
    expected_ids, expected_logprobs = engine_heads(rollout.generations)
    assert np.array_equal(ids, expected_ids) and np.array_equal(logprobs, expected_logprobs)
    # the engine's head logprobs are the trainer's, read at the same ids from the distribution that drew the token
    sampled = batch.loss_mask.bool()
    assert torch.allclose(trainer_heads(model, batch)[sampled], batch.top_behavior_logprobs[sampled].double(),
                          atol=1e-5)
    assert (trainer_heads(model, batch, shift=1)[sampled] - batch.top_behavior_logprobs[sampled]).abs().max() > 0.1


def test_a_chat_session_records_its_runs_head_over_turns_and_a_seal_and_answers_each_client_its_own(model, tok):
    session = ChatSession(EmbeddedEngine(model), tok, "r", template=data.CHATML_TEMPLATE,
                          sampling=SamplingParams(max_tokens=5, seed=0, top_logprobs=K))
    first = [{"role": "user", "content": "hi"}]
    reply = session.turn(first).message
    asked_two = session.turn(first + [reply, {"role": "user", "content": "more"}],
                             sampling=SamplingParams(max_tokens=5, top_logprobs=2))
    assert asked_two.extended and {len(top) for top in asked_two.generation.top_logprobs} == {2}
    edited = first + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "more"}]
    assert not session.turn(edited, sampling=SamplingParams(max_tokens=5)).extended
    rows, gens = session.ledger.rows(), session.generations
    assert len(rows) == 2 and len(gens) == 3 and all(len(top) == K for g in gens for top in g.top_logprobs)
    invariants.check_sampled_once(rows, gens)
    batch = invariants.build_batch(rows, [1.0, 1.0], pad_id=0)
    invariants.check_token_identity(batch, rows)
    ids, logprobs = heads_at_sampled(batch)
    expected_ids, expected_logprobs = engine_heads(gens)
    assert np.array_equal(ids, expected_ids) and np.array_equal(logprobs, expected_logprobs)
    # negative control: a head altered between engine and rows is caught
    tampered = copy.deepcopy(rows)
    t = tampered[1].trainable.index(True)
    tampered[1].top_behavior_logprobs[t, 0] -= 0.5
    with pytest.raises(ValueError, match="top-k heads"):
        invariants.check_sampled_once(tampered, gens)
    with pytest.raises(ValueError, match="top-k heads"):
        invariants.check_token_identity(batch, tampered)


def test_the_ledger_refuses_a_token_without_its_head_and_records_nothing_when_off(tok):
    ledger = invariants.TokenLedger("r")
    ledger.extend_or_seal([1, 2])
    ledger.append_sampled([3], [-0.1], [0], invariants.UNSAMPLED)
    assert ledger.segments[0].top_ids is None                     # off: no cost
    with pytest.raises(ValueError, match="lacks the engine's top logprobs"):
        ledger.append_sampled([4], [-0.1], [0], invariants.UNSAMPLED, top=[[(4, -0.1)]], top_k=K)
    ledger = invariants.TokenLedger("r")
    ledger.extend_or_seal([1, 2])
    with pytest.raises(ValueError, match="top 4 logprobs of every sampled token"):
        ledger.append_sampled([3], [-0.1], [0], invariants.UNSAMPLED, top=None, top_k=K)


# ---- configuration ----

@pytest.mark.parametrize("flags, message", [
    (["--algo.score_centering", "21"], "an int in \\[1, 20\\]"),
    (["--algo.score_centering", "4", "--algo.estimator", "gspo"], "GSPO's rollout-level ratio"),
    (["--algo.score_centering", "4", "--algo.dual_clip", "3"], "set algo.dual_clip=0"),
    (["--algo.score_centering", "4", "--correction.level", "token"], "set correction.level off"),
])
def test_a_run_that_would_center_wrongly_is_refused_with_the_fix(flags, message, capsys):
    with pytest.raises(SystemExit):
        config.parse_config(flags)
    assert message.replace("\\", "") in capsys.readouterr().err


def test_the_option_is_in_help_and_a_batch_without_heads_is_refused():
    cfg = config.parse_config(["--algo.score_centering", "4"])
    assert cfg["algo"].score_centering == 4
    assert "--algo.score_centering" in config_help()
    segment = invariants.TokenLedger("r")
    segment.extend_or_seal([1, 2])
    segment.append_sampled([3], [-0.1], [0], invariants.UNSAMPLED)
    batch = invariants.build_batch(segment.rows(), [1.0], pad_id=0)
    with pytest.raises(ValueError, match="top 4 logprobs of every sampled token"):
        centering.batch_heads(batch, 4)


def config_help() -> str:
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return done.stdout


# ---- end to end ----
# Recipes of their own: the math tasks with a reward that differs between a group's samples (a hash of the reply),
# so the tiny policy has a gradient; the chat agent talks two turns through the OpenAI SDK and asks for 2 top
# logprobs of its own on the second (the session records the run's 5 all the same).

SCORED_ENV = """
class ScoredEnv(base.MathEnv):
    def step(self, action_text):
        result = super().step(action_text)
        result.reward = sum(map(ord, action_text)) % 101 / 100
        return result


class AgentRunner(base.AgentRunner):
    env_cls = ScoredEnv
"""

TWO_TURN_CHAT = """
from openai import AsyncOpenAI

from agents import ChatAgent, ChatAgentRunner, Result


class TwoTurns(ChatAgent):
    async def run(self, ctx):
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            messages = list(ctx.messages)
            first = await client.chat.completions.create(model=ctx.model_name, messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": "Again."}]
            second = await client.chat.completions.create(model=ctx.model_name, messages=messages, logprobs=True,
                                                          top_logprobs=2)
        assert {len(t.top_logprobs) for t in second.choices[0].logprobs.content} <= {0, 1, 2}
        reward = sum(map(ord, second.choices[0].message.content or "")) % 101 / 100
        return Result(reward=reward, score=reward)


class AgentRunner(ChatAgentRunner):
    agent_cls = TwoTurns
"""


@pytest.mark.parametrize("runner", [SCORED_ENV, TWO_TURN_CHAT], ids=["env_runner", "chat_session"])
def test_a_short_run_trains_with_score_centering(runner, tmp_path):
    recipe = tmp_path / "scored.py"
    recipe.write_text("import train\n\nbase = train.load_recipe('math')\nDEFAULTS, tasks = base.DEFAULTS, base.tasks\n"
                      + runner)
    out = str(tmp_path / "out")
    done = subprocess.run([sys.executable, "train.py", "--recipe", str(recipe), "--model", "tiny-qwen3",
                           "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
                           "--rollout.max_tokens", "6", "--rollout.max_turns", "2",   # the chat agent's two calls
                           "--run.threads", "1", "--steps", "2", "--actor.lr", "1e-3",
                           "--algo.score_centering", "5", "--out", out],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/count"] == 4 for r in records)
    assert all(np.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in records)
    assert all(r["mismatch/logprob_diff_max"] < 1e-4 for r in records)
