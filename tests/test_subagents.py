# A sub-agent of Claude Code's, run unchanged as the claude_code recipe runs it (`claude -p`, jailed) with two of its
# documented settings changed: --tools names its sub-agent tool, Agent, beside Bash, Read and Edit, and --bare is left
# out (it leaves that tool out). Through the real server, wires and ledger, a scripted episode (test_compaction's
# ScoredScript: each token given a tiny real model's logprob, so the trainer has something to recompute): the main
# line hands the bug to a sub-agent in the foreground (Agent with run_in_background false, so the main line waits and
# the order of requests is fixed: main, sub-agent, sub-agent, main...), the sub-agent reads the module and answers in
# two lines where the bug is, the main line is given that answer as the tool's result (Claude Code frames it and
# indents each line), edits, tests and answers. The ledger: the sub-agent's requests (its own system prompt) are a
# side line, one row holding both of its turns; its answer is in what the main line is given next, so under the
# default rule ("feeding": ChatSession.feeds_main_line) it trains with the rollout's reward; "none" leaves it out and
# "all" keeps it. Armed: the same side line with its answer a word off does not feed the main line, and does not
# train. Every sampled token is trainable exactly once (armed: the sub-agent's row counted twice fails) and the
# trainer's recompute of every row, the side line's included, is within the suite's tolerance (and not at another
# temperature).
# Codex's sub-agent, run as the codex recipe runs it (`codex exec`) with its agents on (Codex's default, which the
# recipe's short prompt turns off): the main agent spawns one (spawn_agent), which runs beside it, and waits for it
# (wait_agent with the id Codex made); the sub-agent reads the module and answers; Codex hands the answer back in
# JSON. Codex's sub-agent has the main agent's system prompt, so only the thread Codex names on its requests
# (loopback.client_thread) keeps it off the main line: armed, without it the two agents' requests share the main line
# and seal each other's turns, the sub-agent counted in no side line.
# Claude Code's sub-agent in the background (its default, run_in_background true): the main line goes on at once and
# the two agents' requests interleave; `claude -p` waits for the sub-agent, and its report comes back in a
# <task-notification> on whichever main-line request follows it (mid-episode, or one more after the answer): either
# way a side line that feeds the main line, and every token trains once.
import dataclasses
import re

import pytest

import loopback
from agents.harness import call, demonstration_edit
from engines import SamplingParams
from recipes import claude_code, codex, swe_fix
from tests.test_compaction import ScoredScript, trains_once_at_its_logprobs
from tests.test_harnesses import probe, run_episodes

SUBAGENT_TOOL = "Agent"


def with_subagents(self, ctx, ws) -> list[str]:
    """The recipe's arguments with Claude Code's sub-agent tool added to its --tools, and without --bare (which leaves
    that tool out)."""
    arguments = claude_code.ClaudeCodeAgent.arguments(self, ctx, ws)
    arguments[arguments.index("--tools") + 1] += f",{SUBAGENT_TOOL}"
    return [argument for argument in arguments if argument != "--bare"]


def test_a_claude_code_sub_agent_is_a_side_line_whose_answer_feeds_the_main_line_and_trains_once(
        qwen3_dir, closed_sessions):
    engine, task = ScoredScript(qwen3_dir), swe_fix.tasks("train", 0)[0]
    tokenizer = engine.tokenizer
    module, line, _, _ = demonstration_edit(task)
    answer = f"The bug in {module} is on this line:\n{line.strip()}"      # two lines: Claude Code indents each
    delegate = call(SUBAGENT_TOOL, {"description": "Find the bug", "prompt": f"Read {module} and say which line has "
                                    "the bug.", "subagent_type": "general-purpose", "run_in_background": False})
    fix = claude_code.script(task)[1:]                               # edit, test, answer
    engine.replies = [delegate, call("Read", {"file_path": module}), answer, *fix]
    agent_cls = type("Probe", (probe(claude_code, short_prompt=True),), {"arguments": with_subagents})
    turns = 3 + len(fix)
    (rollout,), failures, _ = run_episodes(claude_code, engine, tokenizer, agent_cls, [task],
                                           SamplingParams(temperature=0.7, max_tokens=256), 16384, turns)
    assert failures == {} and engine.replies == []                  # every scripted reply asked for
    session, = closed_sessions
    served = session.served_in_order()
    prompts = [tokenizer.decode(g.prompt_ids) for g in served]
    print(f"prompt ids per turn {[len(g.prompt_ids) for g in served]}, rows "
          f"{[(row.line, len(row.token_ids), row.num_trainable) for row in rollout.rows]}, reward {rollout.reward:.2f}")
    # the sub-agent's two requests (turns 2 and 3: its system prompt, not the main line's) are one side line; the main
    # line's next prompt carries its answer as the tool's result, and the main line goes on to fix the bug
    main, side = session.main_line, session.side_lines
    assert main.order == [0, *range(3, turns)] and [s.order for s in side] == [[1, 2]]
    assert rollout.side_lines == 1 and rollout.side_turns == 2 and rollout.num_turns == turns - 2
    handed_back = prompts[3][prompts[3].rindex("<tool_response>"):]
    print(f"  the main line's next tool result: {handed_back!r}")
    assert answer not in prompts[3] and " ".join(answer.split()) in " ".join(handed_back.split())
    assert "Subagent hand-back" in handed_back and rollout.reward == 1.0
    assert session.feeds_main_line(side[0])
    # the default trains it: the main line's row, then the sub-agent's (its second prompt as context, its two
    # replies the only trainable tokens)
    assert [(row.line, row.seal_reason) for row in rollout.rows] == [("main", ""), ("side-1", "")]
    side_row = rollout.rows[1]
    assert side_row.token_ids == served[2].prompt_ids + served[2].token_ids
    trained = [t for t, trainable in zip(side_row.token_ids, side_row.trainable) if trainable]
    assert trained == served[1].token_ids + served[2].token_ids
    assert [row.line for row in session.record("all")[0]] == ["main", "side-1"]
    assert [row.line for row in session.record("none")[0]] == ["main"]
    # armed: the sub-agent's answer a word off is no longer in the main line's prompt, and it does not train
    said = side[0].generations[-1]
    side[0].generations[-1] = dataclasses.replace(said, token_ids=tokenizer.encode(answer.replace("this", "that")))
    assert not session.feeds_main_line(side[0]) and [row.line for row in session.record("feeding")[0]] == ["main"]
    side[0].generations[-1] = said
    # every sampled token trainable exactly once; armed: the sub-agent's row counted twice fails
    trains_once_at_its_logprobs(rollout, side_row, qwen3_dir)


class ThreadedScript(ScoredScript):
    """ScoredScript's replies, a script per agent: a prompt that holds `main_words` (the task) is the main agent's,
    any other the sub-agent's, whichever order their requests come in. A reply may be a function of the prompt's text
    (for an id the harness made)."""

    def __init__(self, path: str, main_words: str, scripts: dict[str, list]):
        super().__init__(path)
        self.main_words, self.scripts = main_words, scripts

    def generate(self, prompts, params, on_token=None, images=None, **kwargs):
        text = self.tokenizer.decode(prompts[0])       # one at a time: a session's turns are (ChatSession.lock)
        script = self.scripts["main" if self.main_words in text else "sub"]
        reply = script.pop(0) if script else ""
        self.replies = [reply(text) if callable(reply) else reply]
        return super().generate(prompts, params, on_token, images, **kwargs)


def with_codex_agents(self, ctx, ws) -> dict[str, str]:
    """The recipe's Codex settings with Codex's agents on (its default; the recipe's short prompt turns them off)."""
    files = codex.CodexAgent.settings(self, ctx, ws)
    config = files["codex/config.toml"]
    assert "[agents]\nenabled = false" in config
    return {**files, "codex/config.toml": config.replace("[agents]\nenabled = false", "[agents]\nenabled = true")}


def test_a_codex_sub_agent_runs_beside_the_main_agent_on_a_line_of_its_own_and_trains_once(qwen3_dir, closed_sessions):
    task = swe_fix.tasks("train", 0)[0]
    module, line, _, _ = demonstration_edit(task)
    answer = f"The bug in {module} is on this line:\n{line.strip()}"     # two lines: JSON writes the break as \n
    main_words = task.messages[-1]["content"]

    def wait(text: str) -> str:                       # wait_agent on the id spawn_agent answered with
        return call("wait_agent", {"targets": [re.findall(r'"agent_id":"([^"]+)"', text)[-1]]})
    agent_cls = type("Probe", (probe(codex, short_prompt=True),), {"settings": with_codex_agents})

    def episode():
        scripts = {"main": [call("spawn_agent", {"message": f"Read {module} and say which line has the bug."}), wait,
                            *codex.script(task)[1:]],                 # edit, test, answer
                   "sub": [call("exec_command", {"cmd": f"cat {module}"}), answer]}
        engine = ThreadedScript(qwen3_dir, main_words, scripts)
        (rollout,), failures, _ = run_episodes(codex, engine, engine.tokenizer, agent_cls, [task],
                                               SamplingParams(temperature=0.7, max_tokens=256), 16384, 8)
        assert failures == {} and scripts == {"main": [], "sub": []}     # every scripted reply asked for
        return engine.tokenizer, rollout, closed_sessions[-1]
    # armed: without the thread Codex names, the sub-agent's first request joins the main line by the system prompt
    # they share, and from then on each agent's request seals the other's turns (two seals at least, however their
    # requests interleave); no side line is counted, so no side-line rule can leave the sub-agent out
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loopback, "client_thread", lambda request: "")
        _, threadless, _ = episode()
    assert threadless.side_lines == 0 and sum(bool(row.seal_reason) for row in threadless.rows) >= 2
    assert {row.line for row in threadless.rows} == {"main"} and threadless.num_turns == 7
    tokenizer, rollout, session = episode()
    main, side = session.main_line, session.side_lines
    prompts = [tokenizer.decode(gen.prompt_ids) for gen in main.generations]
    print(f"main line's turns {main.order}, the sub-agent's {[s.order for s in side]}, rows "
          f"{[(row.line, len(row.token_ids), row.num_trainable) for row in rollout.rows]}, reward {rollout.reward:.2f}")
    # the main line: spawn, wait, edit, test, answer, one row unsealed; the sub-agent's two turns a side line, done
    # before the main line's turn after the wait (wait_agent returns once the sub-agent is done)
    assert main.turns == 5 and [s.turns for s in side] == [2] and side[0].order[-1] < main.order[2]
    assert rollout.side_lines == 1 and rollout.side_turns == 2 and rollout.num_turns == 5 and rollout.reward == 1.0
    assert [(row.line, row.seal_reason) for row in rollout.rows] == [("main", ""), ("side-1", "")]
    # wait_agent's result hands the answer back as a JSON string: it feeds the main line in that form, not as written
    given = prompts[2][prompts[2].rindex("<tool_response>"):]
    print(f"  wait_agent's result: {given!r}")
    assert "\\n" in given and " ".join(answer.split()) not in " ".join(given.split())
    assert session.feeds_main_line(side[0]) and [row.line for row in session.record("none")[0]] == ["main"]
    side_row = rollout.rows[1]
    assert [t for t, trainable in zip(side_row.token_ids, side_row.trainable) if trainable] == \
        side[0].generations[0].token_ids + side[0].generations[1].token_ids
    # armed: the answer a word off is not what the main line was given
    said = side[0].generations[-1]
    side[0].generations[-1] = dataclasses.replace(said, token_ids=tokenizer.encode(answer.replace("this", "that")))
    assert not session.feeds_main_line(side[0])
    side[0].generations[-1] = said
    trains_once_at_its_logprobs(rollout, side_row, qwen3_dir)


def test_a_claude_code_sub_agent_in_the_background_interleaves_with_the_main_line_and_its_report_feeds_it(
        qwen3_dir, closed_sessions):
    task = swe_fix.tasks("train", 0)[0]
    module, line, _, _ = demonstration_edit(task)
    answer = f"The bug in {module} is on this line:\n{line.strip()}"
    delegate = call(SUBAGENT_TOOL, {"description": "Find the bug", "prompt": f"Read {module} and say which line has "
                                    "the bug.", "subagent_type": "general-purpose", "run_in_background": True})
    # the main line: delegate, edit, test, answer; and a last reply for the request the report comes back on, asked
    # for only when the report comes after the answer
    scripts = {"main": [delegate, *claude_code.script(task)[1:], "The sub-agent found the same line."],
               "sub": [call("Read", {"file_path": module}), answer]}
    engine = ThreadedScript(qwen3_dir, task.messages[-1]["content"], scripts)
    agent_cls = type("Probe", (probe(claude_code, short_prompt=True),), {"arguments": with_subagents})
    (rollout,), failures, _ = run_episodes(claude_code, engine, engine.tokenizer, agent_cls, [task],
                                           SamplingParams(temperature=0.7, max_tokens=256), 16384, 8)
    assert failures == {} and scripts["sub"] == [] and scripts["main"] in ([], ["The sub-agent found the same line."])
    session, = closed_sessions
    main, side = session.main_line, session.side_lines
    prompts = [engine.tokenizer.decode(gen.prompt_ids) for gen in main.generations]
    print(f"main line's turns {main.order}, the sub-agent's {[s.order for s in side]}, rows "
          f"{[(row.line, len(row.token_ids), row.num_trainable) for row in rollout.rows]}, reward {rollout.reward:.2f}")
    # launched in the background: the tool's result on the main line is the launch (the report comes as a notification)
    assert "you'll get a completion notification" in prompts[1][prompts[1].rindex("<tool_response>"):]
    assert [s.turns for s in side] == [2] and side[0].thread and rollout.reward == 1.0
    assert [(row.line, row.seal_reason) for row in rollout.rows] == [("main", ""), ("side-1", "")]
    # the report, verbatim in a <task-notification>, is in a later main-line prompt: it feeds the main line
    reported = next(p for p in prompts if "<task-notification>" in p)
    assert f"<result>{answer}</result>" in reported and session.feeds_main_line(side[0])
    said = side[0].generations[-1]
    side[0].generations[-1] = dataclasses.replace(said, token_ids=engine.tokenizer.encode(answer.replace("this",
                                                                                                         "that")))
    assert not session.feeds_main_line(side[0])          # armed: a report a word off does not feed it
    side[0].generations[-1] = said
    trains_once_at_its_logprobs(rollout, rollout.rows[1], qwen3_dir)
