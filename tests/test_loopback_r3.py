# Invariant 3 (R3) across a weight update between two turns of one trajectory, over the real loopback server (real
# HTTP, the openai SDK) and the embedded engine: an MoE engine drains on an update, so each turn has one version and
# routes a fresh forward at that version computed for every position it saw. The second turn's tokens were drawn
# under the new weights' routes at the positions the first turn forwarded, so no one route per position serves both
# turns: the ledger seals there (reason route_version) and each segment replays its own turn exactly. A dense
# model's turns, and an MoE's turns at one version, stay one segment. The rule is the ledger's, so the Env runner's
# trajectories (the other path to a ledger, no HTTP) seal the same way.
import copy

import openai
import pytest
import torch

import agents
import data
import invariants
import models
import train
from engines import SamplingParams
from loopback import LoopbackServer
from rollout import EmbeddedEngine
from trainer.recompute import sequence_logprobs
from test_rollout import _moe_pair, _perturbed

TURN = 12                # sampled tokens a turn
NEVER = (9999,)          # a stop id past the vocabulary: every turn samples TURN tokens


def _two_turns(old, new, update: bool) -> tuple[list[invariants.Segment], list]:
    """Two turns of one session over HTTP (the client echoes the first reply), the engine loaded with `new` as
    version 1 between them when `update`. Returns the ledger's rows and the session's generations."""
    tokenizer = models.bpe_tokenizer()
    engine = EmbeddedEngine(copy.deepcopy(old), version=0, tokenizer=tokenizer)
    server = LoopbackServer(engine, tokenizer, template=data.CHATML_TEMPLATE)
    server.start()
    try:
        info = server.create_session(sampling=SamplingParams(stop_token_ids=NEVER))
        client = openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        for turn in range(2):
            if turn and update:
                engine.update_weights(new.state_dict(), version=1)
            reply = client.chat.completions.create(model="policy", messages=messages, seed=turn, max_tokens=TURN,
                                                   temperature=0.9)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        session = server.close_session(info.session_id)
    finally:
        server.stop()
    assert [len(g.token_ids) for g in session.generations] == [TURN, TURN]
    rows = session.ledger.rows()
    invariants.check_sampled_once(rows, session.generations)   # each sampled token trained once, sealed or not
    return rows, session.generations


def _gap(model, row: invariants.Segment, version: int | None = None) -> float:
    """max |behavior - trainer| over the row's trainable tokens (those of `version` only, if given), the trainer
    replaying the row's routes (none for a dense model)."""
    batch = invariants.build_batch([row], [1.0], pad_id=0)
    invariants.check_token_identity(batch, [row])
    with torch.no_grad():
        lp = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperature, routes=batch.routes,
                               top_p=batch.top_p, top_k=batch.top_k, min_p=batch.min_p)
    mask = batch.loss_mask.bool() & ((batch.policy_versions == version) if version is not None else True)
    return (lp - batch.behavior_logprobs)[mask].abs().max().item()


@pytest.fixture(scope="module")
def moe():
    return _moe_pair()


def test_an_update_between_turns_seals_and_each_segment_replays_its_turn_with_its_own_routes(moe):
    old, new = moe
    rows, (first, second) = _two_turns(old, new, update=True)
    assert first.policy_versions == [0] * TURN and second.policy_versions == [1] * TURN
    assert [r.seal_reason for r in rows] == ["route_version", ""]
    sealed, reopened = rows
    assert reopened.token_ids[:len(sealed.token_ids)] == sealed.token_ids          # it carries the whole context
    assert not any(reopened.trainable[:len(sealed.token_ids)])                     # as context, never trained again
    cut = len(first.routes)                    # the positions the first turn forwarded, which the second saw anew
    assert (second.routes[:cut] != first.routes).any()                             # the trap is armed
    assert (sealed.routes[:cut] == first.routes).all() and (reopened.routes[:len(second.routes)] == second.routes).all()
    # each segment's trainable tokens replay exactly at their version's weights with the segment's routes
    gaps = _gap(old, sealed), _gap(new, reopened)
    print(f"sealed segments: turn 1 {gaps[0]:.1e}, turn 2 {gaps[1]:.1e}")
    assert max(gaps) <= 1e-5
    # the negative control: one segment holding both turns (the ledger before this seal) keeps the first turn's
    # routes where it forwarded (first writer wins), and those miss the second turn's tokens
    unsealed = copy.deepcopy(reopened)
    unsealed.routes[:cut] = first.routes
    gap = _gap(new, unsealed)
    print(f"one unsealed segment: turn 2 {gap:.1e}")
    assert gap > 1e-3


def test_without_an_update_the_turns_stay_one_segment_and_its_routes_replay_both(moe):
    old, _ = moe
    rows, (first, second) = _two_turns(old, None, update=False)
    assert first.policy_versions + second.policy_versions == [0] * 2 * TURN
    (row,) = rows
    assert row.seal_reason == "" and sum(row.trainable) == 2 * TURN
    assert _gap(old, row) <= 1e-5


def test_a_dense_models_turns_across_an_update_stay_one_segment():
    """No routes, nothing to seal for: each turn's tokens replay at their own version's weights in one row."""
    old = models.tiny_model("qwen3", seed=0)
    new = _perturbed(old)
    rows, (first, second) = _two_turns(old, new, update=True)
    assert first.routes is None and first.policy_versions + second.policy_versions == [0] * TURN + [1] * TURN
    (row,) = rows
    assert row.seal_reason == "" and row.routes is None
    assert _gap(old, row, version=0) <= 1e-5 and _gap(new, row, version=1) <= 1e-5
    assert _gap(old, row, version=1) > 1e-3                    # the update did move the second turn's distribution


def test_an_env_runner_trajectory_across_an_update_seals_the_same_way(moe):
    """The env's step runs between the turns: it loads the new weights, as a trainer's push can land there."""
    old, new = moe
    tokenizer = models.bpe_tokenizer()
    engine = EmbeddedEngine(copy.deepcopy(old), version=0, tokenizer=tokenizer)

    class Push(agents.Env):
        def step(self, action_text: str) -> agents.Result:
            engine.update_weights(new.state_dict(), version=1)
            return agents.Result(0.0, "<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n",
                                 terminated=False)
    runner = type("PushRunner", (agents.EnvRunner,), {"env_cls": Push})(engine, tokenizer, max_turns=2)
    task = data.Task("t0", [{"role": "user", "content": "Tell me about the sea."}], "")
    (rollout,) = runner.run([task], ["g0"], SamplingParams(temperature=0.9, max_tokens=TURN, seed=0,
                                                           stop_token_ids=NEVER))
    first, second = rollout.generations
    assert first.policy_versions == [0] * TURN and second.policy_versions == [1] * TURN
    assert [r.seal_reason for r in rollout.rows] == ["route_version", ""]
    metrics = train.rollout_metrics([rollout], {})
    assert metrics["rollout/seals_per_rollout"] == metrics["rollout/seals_route_version_per_rollout"] == 1.0
    invariants.check_sampled_once(rollout.rows, rollout.generations)
    assert _gap(old, rollout.rows[0]) <= 1e-5 and _gap(new, rollout.rows[1]) <= 1e-5
