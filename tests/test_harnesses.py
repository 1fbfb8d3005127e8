# The coding harnesses people use, unchanged, as the codex and claude_code recipes run them (agents/harness.py):
# `codex exec` and `claude -p`, each a jailed process against its rollout's loopback session, streaming, through
# multi-turn tool episodes on swe_fix's repositories, with the tiny models taught their tool formats on their own
# requests (harvested once). Every sampled token is trainable exactly once (the ledger's check, shown armed); the
# seals of each turn are printed and asserted; the trainer's recompute of every sampled token (actor.Actor, fp32, the
# batch train.py builds) is within the suite's tolerance of the engine's, and a recompute at another temperature is
# not (armed); the grade is the hidden tests on what the harness left; no process of a rollout's tree outlives it and
# its directory is gone. On its defaults (the settings the CPU models shorten the prompt with, left out), each
# harness sends its whole prompt (tens of thousands of ids) through the session turn after turn. Claude Code's
# package declares node >= 22; its CLI is a native executable that runs where no Node is found at all.
import dataclasses
import json
import os
import subprocess
import tempfile

import pytest

import actor
import invariants
import models
from agents import harness
from engines import SamplingParams
from engines.harvest import ScriptEngine
from invariants import check_sampled_once
from recipes import claude_code, codex, swe_fix
from recipes.code_exec import run_hidden_tests
from rollout import EmbeddedEngine
from wires import parse_hermes_tool_calls
from tests.test_process import processes_holding

RECIPES = {"codex": codex, "claude_code": claude_code}
PARITY_TOL = 1e-4                 # |behavior - recompute| (the fp32 CPU path; bench/compat_matrix.py's tolerance)
# at temperature T a logprob is log_softmax(z / T): logits that differ by d move it by up to 2 d / T, so fp32's noise in
# the logits (~1e-5 over a 3,000-id prompt) is ten times larger in the logprobs sampled at 0.1, and the tolerance too
SEEN: dict[str, dict] = {}        # task id -> what a probe kept of its rollout (its workspace, its output)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def taught(request):
    """A recipe, its taught tiny model behind a real engine, and the trainer that recomputes its tokens."""
    recipe = RECIPES[request.param]
    path = recipe.taught_model()
    policy = actor.Actor(path, actor.ActorConfig(precision="fp32"), total_steps=1)
    return recipe, EmbeddedEngine(models.load_model(path)), models.load_tokenizer(path), policy


def agent_class(recipe):
    return recipe.AgentRunner.agent_cls


def probe(recipe, **attributes):
    """The recipe's agent, keeping its workspace and output for the test before the directory goes."""
    def grade(self, ctx, ws, run):
        SEEN[ctx.task.task_id] = {"ws": ws, "stdout": run.stdout}
        return agent_class(recipe).grade(self, ctx, ws, run)
    return type("Probe", (agent_class(recipe),), {"grade": grade, **attributes})


def run_episodes(recipe, engine, tokenizer, agent_cls, tasks, sampling: SamplingParams, max_length: int = 1 << 16,
                 max_turns: int = 6):
    """The recipe's runner over `agent_cls`, every request's wire and stream flag recorded at the server."""
    runner = type("Runner", (recipe.AgentRunner,), {"agent_cls": agent_cls})(engine, tokenizer, max_turns=max_turns,
                                                                              max_length=max_length)
    requests, body = [], runner.server._body

    async def recorded(request, optional=False):
        value = await body(request, optional)
        requests.append((request.path.rsplit("/", 1)[-1], value.get("stream")))
        return value
    runner.server._body = recorded
    try:
        return runner.run(tasks, [f"g{i}" for i in range(len(tasks))], sampling), runner.failures, requests
    finally:
        runner.server.stop()


def turns_per_row(row: invariants.Segment) -> int:
    """The turns a row holds: its runs of trainable (sampled) ids, each a reply (context always lies between)."""
    return sum(t and (i == 0 or not row.trainable[i - 1]) for i, t in enumerate(row.trainable))


def sealed_turns(rollout) -> list[bool]:
    """Per turn, whether its prompt sealed the record: the first turn of every row after the first."""
    return [k == 0 and i > 0 for i, row in enumerate(rollout.rows) for k in range(turns_per_row(row))]


def tool_turns(tokenizer, rollout) -> int:
    """The turns whose reply the session parsed into tool calls."""
    return sum(bool(parse_hermes_tool_calls(tokenizer.decode(g.token_ids, skip_special_tokens=True), "c")
                    .get("tool_calls")) for g in rollout.generations)


def recompute_gap(policy, rows, temperature: float | None = None) -> float:
    """max |behavior - trainer recompute| over the rows' sampled tokens (the batch train.py builds); `temperature`
    replaces every token's recorded one first (the trap: another distribution than the one sampled from)."""
    if temperature is not None:
        rows = [dataclasses.replace(r, sampling=[dataclasses.replace(s, temperature=temperature) if t else s
                                                 for s, t in zip(r.sampling, r.trainable)]) for r in rows]
    batch = invariants.build_batch(rows, [1.0] * len(rows), pad_id=models.bpe_tokenizer().pad_token_id)
    recomputed = policy.recompute_logprobs(batch)
    return (recomputed - batch.behavior_logprobs)[batch.loss_mask > 0].abs().max().item()


# ---- the install ---------------------------------------------------------------------------------------------------

def test_both_harnesses_are_installed_at_their_pins_and_claude_code_runs_without_node(capsys):
    harness.check_installed()                                     # both --version, as the jail runs them
    assert f"codex {harness.CODEX.version}" in capsys.readouterr().out
    entry = harness.CLAUDE_CODE.host_entry()
    with open(entry, "rb") as f:
        assert f.read(4) == b"\x7fELF"                            # a native executable, not a Node script
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run([entry, "--version"], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/nonexistent", "HOME": home})
    assert done.returncode == 0 and done.stdout.startswith(harness.CLAUDE_CODE.version), done.stderr
    codex_entry = harness.CODEX.host_entry()                      # Codex's is Node's to run (its shim)
    assert codex_entry.endswith("bin/codex.js") and harness.CODEX.argv()[0] == harness.JAIL_NODE


def test_every_demonstrated_edit_fixes_its_bug_and_only_its_line():
    for task in swe_fix.tasks("train", 0) + swe_fix.tasks("test", 0):
        label = json.loads(task.label)
        name, tests = label["name"], [(tuple(a), e) for a, e in label["tests"]]
        module, line, fixed, test = harness.demonstration_edit(task)
        source = label["files"][module]
        assert source.count(line) == 1 and test in label["files"] and line != fixed
        assert run_hidden_tests(source.replace(line, fixed), name, tests)[0] == 3       # the fix passes them all
        assert run_hidden_tests(source, name, tests)[0] < 3                             # the bug does not


# ---- multi-turn tool episodes on the taught models -----------------------------------------------------------------

def test_each_harness_runs_unchanged_streaming_through_tool_episodes_and_every_sampled_token_trains_once(taught):
    recipe, engine, tokenizer, policy = taught
    tasks = swe_fix.tasks("train", 0) + swe_fix.tasks("test", 0)    # every bug
    sampling = SamplingParams(temperature=0.1, max_tokens=256, seed=0)   # sampled, so the recompute means something
    rollouts, failures, requests = run_episodes(recipe, engine, tokenizer, probe(recipe, short_prompt=True), tasks,
                                                sampling)
    assert failures == {} and len(rollouts) == len(tasks)
    generation_requests = [stream for route, stream in requests if route in ("responses", "messages")]
    assert generation_requests and all(generation_requests)       # every turn streamed
    for task, rollout in zip(tasks, rollouts):
        seals = sealed_turns(rollout)
        print(f"{recipe.__name__} {task.task_id}: {rollout.num_turns} turns ({tool_turns(tokenizer, rollout)} tool "
              f"calls), sealed per turn {seals}, reward {rollout.reward:.2f}, info {rollout.info}")
        # a tool call, its result, and on (or a sampled reply cut at max_tokens ended it, truncated: test above)
        assert (rollout.num_turns >= 3 or rollout.truncated) and len(seals) == rollout.num_turns
        assert seals == [False] * rollout.num_turns               # each turn's prompt extends the record
        assert rollout.info["tests_passed"] == rollout.reward
        check_sampled_once(rollout.rows, rollout.generations)
        with pytest.raises(ValueError, match="sampled-once violated"):                       # armed
            check_sampled_once(rollout.rows, rollout.generations[:-1])
        gap, trap = recompute_gap(policy, rollout.rows), recompute_gap(policy, rollout.rows, temperature=1.4)
        print(f"  max |behavior - recompute| {gap:.2e}; recomputed at temperature 1.4: {trap:.2e}")
        assert gap <= PARITY_TOL / sampling.temperature < trap
        top = os.path.dirname(SEEN[task.task_id]["ws"].work)
        assert processes_holding(top) == [] and not os.path.exists(top)
    # read, edit, test, then the answer: the episode taught, which a sampled reply may leave (a patch that fails)
    complete = sum(tool_turns(tokenizer, r) >= 3 and r.num_turns >= 4 for r in rollouts)
    print(f"{recipe.__name__}: {complete} of {len(rollouts)} episodes read, edited, tested and answered")
    assert complete >= len(rollouts) * 2 // 3


# ---- an episode cut short: a reply at max_tokens, a full context ---------------------------------------------------

def test_a_reply_cut_at_max_tokens_or_a_full_context_ends_the_episode_truncated_and_graded_and_other_exits_fail(
        taught):
    # Both harnesses exit 1 when the model's reply is cut at its token limit or the prompt outgrows the context: the
    # episode ended there (truncated, graded on what the harness left), which is the policy's doing and is trained on,
    # not a failed process. A sampled reply of the taught model that runs to max_tokens did this in the suite.
    recipe, _, tokenizer, _ = taught
    task = swe_fix.tasks("train", 0)[0]
    engine = ScriptEngine(tokenizer)
    for sampling, max_length in [(SamplingParams(max_tokens=20), 1 << 16), (SamplingParams(max_tokens=256), 1000)]:
        engine.replies = recipe.script(task)
        rollouts, failures, _ = run_episodes(recipe, engine, tokenizer, probe(recipe, short_prompt=True), [task],
                                             sampling, max_length)
        assert failures == {} and len(rollouts) == 1
        rollout, = rollouts
        finishes = [g.finish_reason for g in rollout.generations]
        print(f"{recipe.__name__}, max_tokens {sampling.max_tokens}, context {max_length}: finishes {finishes}, "
              f"reward {rollout.reward:.2f}, truncated {rollout.truncated}")
        assert rollout.truncated and rollout.reward < 1.0          # the fix never applied: the bug's tests fail
        assert rollout.reward == rollout.info["tests_passed"]
        assert finishes[-1:] == ["length"] if max_length > 1000 else finishes == []    # cut, or never sampled
        check_sampled_once(rollout.rows, rollout.generations)
    # any other non-zero exit still fails the rollout (here the harness refuses an unknown flag)
    engine.replies = recipe.script(task)
    bad_flag = probe(recipe, short_prompt=True)
    bad_flag.arguments = lambda self, ctx, ws: [*agent_class(recipe).arguments(self, ctx, ws), "--no-such-flag"]
    rollouts, failures, _ = run_episodes(recipe, engine, tokenizer, bad_flag, [task], SamplingParams(max_tokens=256))
    assert rollouts == [] and failures == {"process_exit": 1}


# ---- an episode past its budget --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, own_turn_limit", [("codex", False), ("claude_code", True), ("claude_code", False)])
def test_a_harness_at_its_rollouts_budget_ends_its_episode_truncated_and_graded(name, own_turn_limit):
    # The demonstration takes four replies; the budget here is two turns. The session answers a request past it as a
    # reply cut at its token limit with no token, and each harness ends its episode on that (Codex fails its turn and
    # exits 1 at once; Claude Code retries a cut reply a few times, each answered at once, then reports
    # max_output_tokens), an exit its recipe's accepts_exit takes: graded and truncated, never retried until the
    # deadline (as a 429 would be) nor a failed rollout (as a 400 would be). Claude Code is also given the turn budget
    # as its own --max-turns (the recipe's flags), which counts the same model calls: it stops there itself, exits 1
    # with terminal_reason max_turns, and that episode is graded too (it failed its rollout before).
    recipe, tokenizer = RECIPES[name], models.bpe_tokenizer()
    task = swe_fix.tasks("train", 0)[0]
    engine = ScriptEngine(tokenizer)
    engine.replies = recipe.script(task)
    agent_cls = probe(recipe, short_prompt=True)
    if name == "claude_code" and not own_turn_limit:
        def arguments(self, ctx, ws):
            flags = agent_class(recipe).arguments(self, ctx, ws)
            at = flags.index("--max-turns")
            return flags[:at] + flags[at + 2:]
        agent_cls.arguments = arguments
    rollouts, failures, requests = run_episodes(recipe, engine, tokenizer, agent_cls, [task],
                                                SamplingParams(max_tokens=256), max_turns=2)
    generating = [route for route, _ in requests if route in ("responses", "messages")]
    print(f"{name} (own turn limit: {own_turn_limit}) at a 2-turn budget: {len(generating)} requests, failures "
          f"{failures}, {[(len(r.generations), r.truncated, r.reward) for r in rollouts]}")
    assert failures == {} and len(rollouts) == 1
    rollout, = rollouts
    assert len(rollout.generations) == 2 and rollout.truncated and rollout.reward == rollout.info["tests_passed"]
    assert 2 <= len(generating) <= 6          # a few requests past the budget at most, each answered at once
    check_sampled_once(rollout.rows, rollout.generations)


# ---- on its defaults: the whole prompt ----------------------------------------------------------------------------

def test_each_harness_on_its_defaults_sends_its_whole_prompt_through_the_session_turn_after_turn(taught):
    recipe, _, tokenizer, _ = taught
    task = swe_fix.tasks("train", 0)[0]
    engine = ScriptEngine(tokenizer)
    engine.replies = recipe.script(task)
    rollouts, failures, requests = run_episodes(recipe, engine, tokenizer, probe(recipe, short_prompt=False), [task],
                                                SamplingParams(max_tokens=1024))
    assert failures == {} and len(rollouts) == 1
    rollout, = rollouts
    prompt_ids = [len(g.prompt_ids) for g in rollout.generations]
    print(f"{recipe.__name__} on its defaults: prompt ids per turn {prompt_ids}, sealed per turn "
          f"{sealed_turns(rollout)}")
    assert rollout.num_turns == 4 and engine.replies == [] and prompt_ids[0] > 15_000
    assert rollout.reward == 1.0                                   # the demonstrated fix, applied by the harness
    check_sampled_once(rollout.rows, rollout.generations)
