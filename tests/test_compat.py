# Eight agent libraries from PyPI, unchanged, against the loopback server, on their defaults and with each option they
# expose switched on one at a time (bench/compat_matrix.py's CASES: openai-agents, pydantic-ai, langchain-openai +
# langgraph, smolagents, litellm, the anthropic SDK's tool-use loop; on the Responses wire, the openai SDK's
# responses.create loop and the Agents SDK's OpenAIResponsesModel). Every case: the library finishes its episode
# (no refusal, no error) and the option reached the wire, or, where the server refuses the option by design
# (truncation 'auto'), it is refused with its reason and nothing is generated; every request that carried the
# option shows its effect; every sampled token is trainable exactly once; the seals per turn are reported; the
# trainer's recompute of each token at its recorded sampling equals the engine's behavior logprob (invariant 3), and
# where the option changed the sampling, the recompute at the session's plain sampling does not (the trap is armed).
# The model is a tiny Qwen3 taught what each library sends (one per module, one server). The checks themselves, the
# Responses wire's included, are shown to fail on a broken episode first.
import dataclasses

import pytest

import invariants
from bench import compat_matrix as cm


@pytest.fixture(scope="module")
def bench():
    built = cm.build_bench()
    yield built
    built.server.stop()


# ---- the checks can fail ----

def test_the_checks_catch_a_lost_token_a_wrong_sampling_a_wrong_effect_and_a_refusal(bench):
    case = next(c for c in cm.CASES if c.name == "litellm:default")
    episode = cm.play(bench, case)
    rows, generations = episode.session.ledger.rows(), episode.session.generations
    assert not episode.error and len(generations) == 2, episode.error
    invariants.check_sampled_once(rows, generations)
    with pytest.raises(ValueError, match="sampled-once violated"):        # a turn lost between engine and rows
        invariants.check_sampled_once(rows, generations[:1])
    assert cm.recompute_gap(bench, rows) <= cm.PARITY_TOL
    hotter = [dataclasses.replace(r, sampling=[dataclasses.replace(s, temperature=2.0) if t else s
                                              for s, t in zip(r.sampling, r.trainable)]) for r in rows]
    assert cm.recompute_gap(bench, hotter) > cm.PARITY_TOL   # another distribution
    called, answered = episode.exchanges                                  # a tool call, then a text answer
    assert cm.EFFECTS["tool_call"](called) == "" and cm.EFFECTS["tool_call"](answered) != ""
    assert cm.EFFECTS["no_tool_call"](called) != "" and cm.EFFECTS["json"](answered) != ""
    off_argmax = dataclasses.replace(generations[1], token_ids=[generations[1].token_ids[0] ^ 1,
                                                                *generations[1].token_ids[1:]])
    assert cm.greedy_effect(bench.policy, [off_argmax]) != ""
    refused = dataclasses.replace(episode, exchanges=[dataclasses.replace(called, status=400, reply={
        "error": {"message": "tool_choice must be 'auto'"}})], error="BadRequestError")
    assert cm.judge(bench, case, refused).verdict == "refused"


def test_the_responses_checks_catch_a_missing_effect(bench):
    case = next(c for c in cm.CASES if c.name == "openai-responses:default")
    episode = cm.play(bench, case)
    generations = episode.session.served_in_order()
    assert not episode.error and len(generations) == 2, episode.error
    called, answered = episode.exchanges                                  # a function_call item, then a message
    assert cm._reply_calls(called) == ["get_time"] and cm._reply_text(answered) == episode.answer
    assert cm.EFFECTS["one_call"](called) == "" and cm.EFFECTS["json"](answered) != ""
    assert cm.EFFECTS["stream"](called) != ""                            # one JSON body, not events
    cut = called.reply["usage"]["output_tokens"] - 1                      # more tokens than it asked for, not cut
    assert cm.EFFECTS["bounded"](dataclasses.replace(called, body={**called.body, "max_output_tokens": cut})) != ""
    offered = dataclasses.replace(called, body={**called.body, "tools": cm.WEB_SEARCH_TOOLS})   # listed nothing
    assert cm.EFFECTS["dropped"](offered) != ""
    instructed = dataclasses.replace(called, body={**called.body, "instructions": "Tell the time."})
    assert cm.TURN_EFFECTS["instructions"](bench.tokenizer, instructed, generations[0], []) != ""
    chained = cm.TURN_EFFECTS["chained"]                                  # the resent history extends turn 0
    assert chained(bench.tokenizer, answered, generations[1], generations[:1]) == ""
    assert chained(bench.tokenizer, answered, generations[1], generations[1:]) != ""


# ---- every (library, option) ----

@pytest.mark.parametrize("case", cm.CASES, ids=lambda c: c.name)
def test_library_option_runs_unchanged_trains_each_sampled_token_once_and_recomputes_its_sampling(bench, case,
                                                                                                 record_property):
    result = cm.run_case(bench, case)
    record_property("seals_per_turn", result.seals)
    print(f"{case.name}: {result.verdict} ({result.detail}); turns {result.turns}, seals per turn {result.seals}, "
          f"max |behavior - recompute| {result.parity}, trap {result.trap}")
    if case.refused:                # refused by design: the server's 400 says why, and nothing was generated
        assert result.verdict == "refused" and case.refused in result.detail, f"{result.verdict}: {result.detail}"
        assert result.turns == 0
        return
    assert result.verdict in ("honoured", "no-op"), f"{result.verdict}: {result.detail}"
    assert result.turns >= 1 and result.effect == "", result.effect
    assert result.sampled_once == "", result.sampled_once
    assert result.parity <= cm.PARITY_TOL, f"the trainer recomputes {result.parity} away from the engine"
    if result.trap is not None:     # the option added to how tokens were drawn: without it the recompute must miss
        assert result.trap > cm.PARITY_TOL, f"recorded {result.changed}, yet stripping them moves the recompute by " \
                                            f"{result.trap} only"
