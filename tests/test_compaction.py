# Compaction mid-episode, in both coding harnesses run unchanged as their recipes run them (Claude Code `claude -p`,
# Codex `codex exec`), through the real server, wires and ledger. A scripted episode (ScriptEngine's replies, each
# token given a tiny real model's logprob, so the trainer has something to recompute) grows past the compaction
# threshold the recipe sets from the session's context: two commands print 300 lines each and a third a word; the
# harness sends its summary request (the conversation so far with its instruction last: Claude Code's appended to the
# last user turn under the same system prompt and tools, Codex's a user message of its own with no tools), the script
# answers with a summary, and the harness goes on from a new, shorter prompt carrying the summary to read, edit and
# test the module. The ledger: the summary request opens as the main conversation does, so it is the main line's
# (session.py's routing) and seals the turns before it; the summary is a segment of its own, trained with the
# rollout's reward; the continuation seals it in turn. Every sampled token is trainable exactly once (the check shown
# armed: it fails when the summary is counted twice), the trainer's recompute is within the suite's tolerance (and
# not at another temperature), and the session's page shows the three segments and both seals. Without the recipe's
# threshold the same episode has no compaction (its fourth reply, the summary, ends it as an answer): the recipe's
# settings, not the context, make the harness compact here.
import dataclasses
import types
from collections.abc import Callable

import pytest

import torch
from selenium.webdriver.support.ui import Select

import actor
import models
from agents.harness import HarnessAgent, call
from engines import SamplingParams, per_prompt, recorded_sampling
from engines.harvest import ScriptEngine
from engines.processing import processed_logprobs
from invariants import adjusts_logits, check_sampled_once
from recipes import claude_code, codex, swe_fix
from session import session_trace
from tests.test_harnesses import PARITY_TOL, probe, recompute_gap, run_episodes, sealed_turns
from tests.test_viewer import browser, js_errors, open_page  # noqa: F401 (browser: the page's fixture)
from trainer import viewer

SUMMARY = "<analysis>Three counts printed.</analysis>\n<summary>square.py has a bug; nothing edited yet.</summary>"


@dataclasses.dataclass
class Compacting:
    """A harness's compacting episode: its recipe, its command tool, the threshold the session's context is sized
    for, and how its summary request and its prompt after compaction open."""
    recipe: types.ModuleType
    command: Callable[[str], str]
    threshold: int
    summary_request: str
    continued: str


# Each threshold lies between what the harness counts before its third request (its second prompt, 3,513 ids for
# Claude Code and 3,789 for Codex, and the second count's output) and before its fourth (its third prompt, 4,751 and
# 5,094 ids), and above every prompt after compaction; the context (threshold + max_tokens + compaction_room) holds
# the fourth prompt and Claude Code's summary request, 8,750 ids
HARNESSES = {
    "claude_code": Compacting(claude_code, lambda cmd: call("Bash", {"command": cmd, "description": "Count"}), 4600,
                              "CRITICAL: Respond with TEXT ONLY",
                              "This session is being continued from a previous conversation"),
    "codex": Compacting(codex, lambda cmd: call("exec_command", {"cmd": cmd}), 4500,
                        "You are performing a CONTEXT CHECKPOINT COMPACTION",
                        "Another language model started to solve this problem"),
}


class ScoredScript(ScriptEngine):
    """ScriptEngine's replies, each token with a real model's logprob of it at the request's recorded sampling (the
    model run over the prompt and the reply): rows the trainer's recompute checks token by token, so a token recorded
    in another context than the one it was scored in (a misplaced seal) shows as a gap."""

    def __init__(self, path: str):
        super().__init__(models.load_tokenizer(path))
        self.model = models.load_model(path)

    def generate(self, prompts, params, on_token=None, images=None, **_):
        gen, = super().generate(prompts, params, on_token)
        sampling = recorded_sampling(per_prompt(1, params)[0][0], len(gen.prompt_ids))
        assert not adjusts_logits(sampling)                  # the trainer's processed distribution is these steps alone
        with torch.no_grad():
            logits = self.model(torch.tensor([gen.prompt_ids + gen.token_ids])).logits[0, len(gen.prompt_ids) - 1:-1]
        logprobs = processed_logprobs(logits, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        chosen = logprobs.gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0].tolist()
        return [dataclasses.replace(gen, behavior_logprobs=chosen, sampling=sampling)]


def trains_once_at_its_logprobs(rollout, row, model_dir: str) -> None:
    """Every sampled token of `rollout` trainable exactly once (armed: `row` counted twice fails the check), and the
    trainer's recompute of every row within the suite's tolerance (armed: at temperature 1.4 it is not)."""
    check_sampled_once(rollout.rows, rollout.generations)
    with pytest.raises(ValueError, match="sampled-once violated"):
        check_sampled_once([*rollout.rows, row], rollout.generations)
    policy = actor.Actor(model_dir, actor.ActorConfig(precision="fp32"), total_steps=1)
    gap, trap = recompute_gap(policy, rollout.rows), recompute_gap(policy, rollout.rows, temperature=1.4)
    print(f"  max |behavior - recompute| {gap:.2e}; recomputed at temperature 1.4: {trap:.2e}")
    assert gap <= PARITY_TOL < trap


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_a_harness_compacts_mid_episode_its_summary_is_a_sealed_segment_of_its_own_and_every_token_trains_once(
        name, qwen3_dir, tmp_path, browser, closed_sessions):  # noqa: F811
    harness = HARNESSES[name]
    recipe = harness.recipe
    context = harness.threshold + 256 + recipe.AgentRunner.agent_cls.compaction_room     # max_tokens 256
    engine, task = ScoredScript(qwen3_dir), swe_fix.tasks("train", 0)[0]
    tokenizer = engine.tokenizer
    commands = [harness.command(command) for command in ("seq 1 300", "seq 301 600", "echo counted")]
    script = [*commands, SUMMARY, *recipe.script(task)]

    def episode():
        engine.replies = list(script)
        rollouts, failures, _ = run_episodes(recipe, engine, tokenizer, probe(recipe, short_prompt=True), [task],
                                             SamplingParams(temperature=0.7, max_tokens=256), context, len(script))
        assert failures == {} and len(rollouts) == 1
        return rollouts[0], closed_sessions[-1]
    # armed: without the recipe's threshold the harness does not compact in this context, and the summary it is never
    # asked for ends the episode as its answer, the bug unfixed
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HarnessAgent, "compaction_threshold", lambda self, ctx: None)
        plain, _ = episode()
    assert plain.num_turns == 4 and sealed_turns(plain) == [False] * 4 and plain.reward < 1
    rollout, session = episode()
    assert engine.replies == []                                                   # every scripted reply asked for
    served = session.served_in_order()
    prompts = [tokenizer.decode(g.prompt_ids) for g in served]
    seals = sealed_turns(rollout)
    print(f"{name}, context {context}: prompt ids per turn {[len(g.prompt_ids) for g in served]}, sealed per turn "
          f"{seals}, rows {[(row.line, row.seal_reason, len(row.token_ids)) for row in rollout.rows]}, reward "
          f"{rollout.reward:.2f}")
    # turns 1-3 the commands, 4 the summary request, 5-8 the continuation: read, edit, test, answer (the fix applied)
    assert [harness.summary_request in p for p in prompts] == [False] * 3 + [True] + [False] * 4
    assert [harness.continued in p for p in prompts] == [False] * 4 + [True] * 4
    assert len(served[4].prompt_ids) < len(served[2].prompt_ids) and "nothing edited yet." in prompts[4]
    assert rollout.num_turns == len(script) and rollout.reward == 1.0 and rollout.side_lines == 0
    # the ledger: the summary request seals the commands' segment, the continuation seals the summary's
    assert seals == [False] * 3 + [True, True] + [False] * 3
    assert [row.line for row in rollout.rows] == ["main"] * 3 and [bool(r.seal_reason) for r in rollout.rows] == \
        [True, True, False]
    # the summary's row: its request's prompt as context, then the summary, its only trainable tokens
    summary_row = rollout.rows[1]
    assert summary_row.token_ids == served[3].prompt_ids + served[3].token_ids
    trained = [t for t, trainable in zip(summary_row.token_ids, summary_row.trainable) if trainable]
    assert trained == served[3].token_ids and tokenizer.decode(trained, skip_special_tokens=True) == SUMMARY
    # every sampled token trainable exactly once (armed: the summary's row counted twice fails), recomputed in tolerance
    trains_once_at_its_logprobs(rollout, summary_row, qwen3_dir)
    # the session's page: the three segments, each token one element, the two seals noted
    trace = session_trace(session, tokenizer)
    page = tmp_path / "session.html"
    page.write_text(viewer.render(viewer.session_page(trace)))
    open_page(browser, str(page))
    Select(browser.find_element("id", "show")).select_by_value("sealed")
    cards = browser.find_elements("css selector", "#rows .row")
    assert [len(card.find_elements("css selector", ".tok")) for card in cards] == \
        [len(row.token_ids) for row in rollout.rows]
    notes = [card.find_elements("css selector", ".seal-note") for card in cards]
    assert [len(n) for n in notes] == [1, 1, 0] and all("sealed" in n[0].text for n in notes[:2])
    assert js_errors(browser) == []
