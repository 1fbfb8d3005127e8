# bench/long_episode.py — a long coding-harness episode on a real engine: 30 turns or more with compaction on the
# way, the prompt ids the engine computed against the prompt ids it was sent, and the seconds a turn, on the embedded
# engine and on vLLM's CPU build. The figures are a CPU's (a tiny Qwen3 on this machine's cores), and say so.
#
# Claude Code or Codex (--harness) runs unchanged and jailed, as its recipe runs it (on its defaults: the whole prompt
# a GPU run sends, tens of thousands of ids for Claude Code; --short-prompt for the CPU recipe's), against the
# loopback server, its wires and ledger, over a real engine. The episode is a script: COMMANDS commands that each print
# LINES numbered lines, then the swe_fix demonstration (read the module, edit its bug away, run its tests, answer).
# The session's context is sized so that the recipe's compaction threshold falls at about a third of the commands'
# output: the harness compacts (a summary request, then a new, shorter prompt) and goes on, and compacts again when
# its conversation grows past the threshold once more. A summary request is known by the harness's instruction in it
# and answered with a summary; every other request takes the script's next reply.
#
# The engine's work is real: each turn it prefills the prompt the harness sent (less what its prefix cache already
# holds under the session's salt) and decodes as many tokens as the scripted reply has (ignore_eos), and the reply it
# returns is the script's ids (a tiny model does not write thirty turns of tool calls). So the next prompt shares
# with the engine's cache the previous prompt but not the previous reply: the computed prefill is an upper bound, by
# one reply a turn (a few dozen ids), on what a policy writing those replies would cost.
#
# Per turn: prompt ids, ids the engine took from its prefix cache, ids it computed, reply ids, the engine's seconds
# (prefill and decode), the turn's seconds (the previous turn's end to this one's: the harness, its tools and the
# server included), and whether the turn was a summary request. The summary: turns, compactions, prompt ids sent and
# computed (and their ratio), seconds a turn, and the ledger's checks of the rollout (rows, seals, every reply
# trainable exactly once).
#
#   python bench/long_episode.py --engine embedded --out /tmp/long-embedded.json
#   python bench/long_episode.py --engine vllm --out /tmp/long-vllm.json         (vLLM's CPU build)
#   python bench/long_episode.py --harness codex --engine embedded --out /tmp/long-codex-embedded.json
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import invariants  # noqa: E402
import models  # noqa: E402
from agents import ChatAgentRunner  # noqa: E402
from agents.harness import call  # noqa: E402
from engines import Generation, SamplingParams, per_prompt  # noqa: E402
from engines.harvest import ScriptEngine  # noqa: E402
from recipes import claude_code, codex, swe_fix  # noqa: E402


@dataclasses.dataclass
class HarnessEpisode:
    """What the episode needs of a harness beyond its recipe."""
    recipe: object               # its recipe module (AgentRunner.agent_cls, script)
    command: object              # a command's call in its tool format
    summary_request: str         # its compaction instruction, which marks a summary request
    first_prompt: tuple          # its first prompt's ids, about: on its defaults, and short (the context's sizing)


HARNESSES = {
    "claude_code": HarnessEpisode(claude_code, lambda cmd: call("Bash", {"command": cmd, "description": "Count"}),
                                  "CRITICAL: Respond with TEXT ONLY", (31_000, 3_000)),
    "codex": HarnessEpisode(codex, lambda cmd: call("exec_command", {"cmd": cmd}),
                            "You are performing a CONTEXT CHECKPOINT COMPACTION", (24_000, 3_500)),
}
SUMMARY = "<analysis>Counts printed so far.</analysis>\n<summary>square.py has a bug; nothing edited yet.</summary>"
MAX_TOKENS = 256


@dataclasses.dataclass
class Turn:
    prompt_ids: int
    cached_ids: int             # taken from the engine's prefix cache
    computed_ids: int           # prefilled: prompt_ids - cached_ids
    reply_ids: int
    engine_s: float             # the engine's generate call: prefill and decode
    turn_s: float               # since the previous turn's reply (the first: since the episode began)
    summary_request: bool


class ForcedEngine(ScriptEngine):
    """ScriptEngine's replies (streamed as a server expects; SUMMARY to a summary request), each turn's work done by a
    real engine: the prompt prefilled, as many tokens decoded as the reply has. Counts each turn (`turns`)."""

    def __init__(self, engine, tokenizer, replies: list[str], summary_request: str):
        super().__init__(tokenizer, engine.max_model_len)
        self.engine, self.replies, self.summary_request = engine, list(replies), summary_request
        self.turns: list[Turn] = []
        self.last = time.perf_counter()

    def generate(self, prompts, params, on_token=None, images=None, **_) -> list[Generation]:
        prompt = list(prompts[0])
        summary_request = self.summary_request in self.tokenizer.decode(prompt[-4096:])
        if summary_request:
            self.replies.insert(0, SUMMARY)
        gen, = super().generate(prompts, params, on_token)
        start = time.perf_counter()
        work, = self.engine.generate([prompt], dataclasses.replace(per_prompt(1, params)[0][0], ignore_eos=True,
                                                                   max_tokens=len(gen.token_ids), stop=(),
                                                                   stop_token_ids=()))
        end = time.perf_counter()
        cached = min(work.cached_prompt_tokens, len(prompt))
        self.turns.append(Turn(len(prompt), cached, len(prompt) - cached, len(gen.token_ids), round(end - start, 4),
                               round(end - self.last, 4), summary_request))
        self.last = end
        return [dataclasses.replace(gen, cached_prompt_tokens=cached)]


def build_engine(kind: str, context: int):
    """A tiny Qwen3 (head_dim 32, the smallest vLLM's CPU attention runs) behind the embedded engine or vLLM."""
    path = models.tiny_model_dir("qwen3", head_dim=32)
    if kind == "embedded":
        from rollout import EmbeddedEngine
        return EmbeddedEngine(models.load_model(path), tokenizer=models.load_tokenizer(path)), path
    from engines.vllm_engine import VLLMEngine
    return VLLMEngine(path, seed=0, dtype="float32", transfer="rpc", enforce_eager=True, max_model_len=context), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["embedded", "vllm"], required=True)
    parser.add_argument("--harness", choices=sorted(HARNESSES), default="claude_code")
    parser.add_argument("--commands", type=int, default=26, help="commands before the demonstration")
    parser.add_argument("--lines", type=int, default=300, help="numbered lines each command prints")
    parser.add_argument("--short-prompt", action="store_true", help="the CPU recipe's short prompt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    harness = HARNESSES[args.harness]
    agent_cls = type("LongEpisodeAgent", (harness.recipe.AgentRunner.agent_cls,), {"short_prompt": args.short_prompt})
    task = swe_fix.tasks("train", 0)[0]
    commands = [harness.command(f"seq {k * args.lines + 1} {(k + 1) * args.lines}") for k in range(args.commands)]
    replies = [*commands, *harness.recipe.script(task)]
    # the context: the harness's first prompt (on its defaults Claude Code's 30,543 ids, Codex's 23,876), a third of the
    # commands' output (a line about 4 ids, a call about 40), then a reply and the recipe's room above its threshold
    first = harness.first_prompt[args.short_prompt]
    context = min(first + args.commands // 3 * (args.lines * 4 + 40) + MAX_TOKENS + agent_cls.compaction_room,
                  1 << 16)
    engine, path = build_engine(args.engine, context)
    tokenizer = models.load_tokenizer(path)
    forced = ForcedEngine(engine, tokenizer, replies, harness.summary_request)
    runner = type("LongEpisodeRunner", (ChatAgentRunner,), {"agent_cls": agent_cls})(
        forced, tokenizer, max_turns=2 * len(replies), max_length=context, step_timeout_s=120.0)
    started = time.perf_counter()
    forced.last = started
    try:
        rollouts = runner.run([task], ["long"], SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))
    finally:
        runner.server.stop()
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    episode_s = time.perf_counter() - started
    turns = forced.turns
    rollout = rollouts[0] if rollouts else None
    checks = {"failures": runner.failures}
    if rollout is not None:
        invariants.check_sampled_once(rollout.rows, rollout.generations)    # raises if a reply trains twice or never
        checks.update(rows=len(rollout.rows), sealed_rows=sum(bool(r.seal_reason) for r in rollout.rows),
                      lines=sorted({r.line for r in rollout.rows}), reward=rollout.reward,
                      truncated=rollout.truncated, sampled_once=True)
    sent, computed = sum(t.prompt_ids for t in turns), sum(t.computed_ids for t in turns)
    summary = {
        "bench": "long_episode", "device": "cpu", "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "engine": args.engine, "harness": f"{agent_cls.harness.name} {agent_cls.harness.version}",
        "prompt": "short (the CPU recipe's)" if args.short_prompt else "full (the harness's defaults)",
        "model": "tiny Qwen3 (2 layers, hidden 64, head_dim 32), fp32", "context": context,
        "compaction_threshold": context - MAX_TOKENS - agent_cls.compaction_room,
        "turns": len(turns), "compactions": sum(t.summary_request for t in turns),
        "script_replies_left": len(forced.replies),
        "prompt_ids_sent": sent, "prompt_ids_computed": computed, "computed_fraction": round(computed / max(sent, 1), 4),
        "reply_ids": sum(t.reply_ids for t in turns), "max_prompt_ids": max((t.prompt_ids for t in turns), default=0),
        "episode_s": round(episode_s, 2), "s_per_turn": round(episode_s / max(len(turns), 1), 3),
        "engine_s_per_turn": round(sum(t.engine_s for t in turns) / max(len(turns), 1), 4),
        "rollout": checks, "per_turn": [dataclasses.asdict(t) for t in turns],
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_turn"}, indent=1))


if __name__ == "__main__":
    main()
