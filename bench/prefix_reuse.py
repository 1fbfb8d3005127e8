# bench/prefix_reuse.py — what an agent episode's prefill costs with the engine's prefix cache, and without it.
#
# A coding harness (Codex CLI, Claude Code) sends its whole context every turn, each turn the last one plus the
# model's reply and a tool result. Here: one episode of `--turns` turns whose first prompt is `--first` ids (a
# system prompt, tools and files read), each later prompt the last one, the reply it got (`--reply` tokens, the stop
# id banned so every reply has that length) and a tool result of `--tool` ids; one request at a time, as one agent
# sends them. On each engine (the embedded engine on the CPU, vLLM's CPU build), on the same tiny model (head_dim 32,
# the smallest vLLM's CPU attention runs), two engines side by side: the prefix cache on, and off (EmbeddedEngine
# prefix_cache_bytes=0; vLLM enable_prefix_caching=False), each running the episode, turn by turn in alternation so
# that a busy moment of a shared machine slows both. Reported per turn and mode: prompt tokens, those taken from the
# cache, those computed, the time to the first token (the prefill and one step), the turn's wall time (prefill and
# decode) and the CPU seconds of the processes doing its work; then the totals, and off / on. A warm-up request
# (sharing no id with the episode) runs first on each engine. Every turn carries the episode's own prefix-cache salt,
# as a session's turns do (engines/prefix_cache.py: a session reuses its own turns only), so "on" is what a session
# keeps under that rule, and "off" what its turns cost without reuse.
#
#   python bench/prefix_reuse.py [--engines embedded vllm] [--first 30000] [--turns 10]
#                                [--out docs/prefix-reuse-cpu.json]
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")     # GiB; the tiny model's KV is 1 KiB a position

import psutil  # noqa: E402
import torch  # noqa: E402

import models  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else platform.machine()


class Timed:
    """An engine and the processes that do its work (this one, and the engine core and workers vLLM spawned for
    it), whose CPU seconds a turn is charged: a machine shared with other work stretches wall time more than CPU."""

    def __init__(self, kind: str, path: str, reuse: bool, max_len: int):
        here = psutil.Process()
        before = {p.pid for p in here.children(recursive=True)}
        if kind == "embedded":
            self.engine = EmbeddedEngine(models.load_model(path), **({} if reuse else {"prefix_cache_bytes": 0}))
        else:
            from engines.vllm_engine import VLLMEngine
            self.engine = VLLMEngine(path, dtype="float32", transfer="rpc", enforce_eager=True, prefix_caching=reuse,
                                     max_model_len=max_len)
        self.processes = [here] + [p for p in here.children(recursive=True) if p.pid not in before]

    def cpu_s(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.processes)

    def turn(self, number: int, prompt: list[int], params: SamplingParams) -> tuple[dict, list[int]]:
        """One turn: its counts and times, and the reply's ids."""
        first: list[float] = []

        def heard(index: int, token_id: int) -> None:
            if not first:
                first.append(time.perf_counter())
        cpu, t0 = self.cpu_s(), time.perf_counter()
        gen = self.engine.generate([prompt], params, heard)[0]
        wall, cpu = time.perf_counter() - t0, self.cpu_s() - cpu
        return ({"turn": number, "prompt_tokens": len(prompt), "cached_prompt_tokens": gen.cached_prompt_tokens,
                 "computed_prompt_tokens": len(prompt) - gen.cached_prompt_tokens, "reply_tokens": len(gen.token_ids),
                 "first_token_s": round(first[0] - t0, 3), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)},
                gen.token_ids)


def episodes(kind: str, path: str, args, vocab: int) -> dict[str, list[dict]]:
    """The same episode with the prefix cache on and off, turn by turn in alternation (so a busy moment of the
    machine slows both): per mode, each turn's counts and times."""
    ids = torch.Generator().manual_seed(0)
    stop = vocab - 1
    first = torch.randint(3, stop, (args.first,), generator=ids).tolist()
    tools = [torch.randint(3, stop, (args.tool,), generator=ids).tolist() for _ in range(args.turns)]
    max_len = args.first + args.turns * (args.tool + args.reply) + args.reply + 64
    engines = {mode: Timed(kind, path, mode == "on", max_len) for mode in ("on", "off")}
    for timed in engines.values():     # a warm-up that shares no id with the episode
        timed.engine.generate([[stop - 1] + first[1:64]], SamplingParams(max_tokens=4))
    # each reply is --reply tokens (its stop id banned), so both modes' prompts have the same lengths; the engine's
    # own random stream: vLLM 0.32's CPU build fails a seeded request whose prompt it prefills in chunks (its CPU
    # generator has no offset to rewind)
    params = SamplingParams(temperature=1.0, max_tokens=args.reply, stop_token_ids=(stop,),
                            logit_bias=((stop, -math.inf),), cache_salt="rollout:bench-episode")
    prompts, turns = {mode: first for mode in engines}, {mode: [] for mode in engines}
    for turn in range(args.turns):
        for mode in (("on", "off") if turn % 2 else ("off", "on")):
            record, reply = engines[mode].turn(turn + 1, prompts[mode], params)
            turns[mode].append(record)
            prompts[mode] = prompts[mode] + reply + tools[turn]          # the reply, then the tool's result
            print(f"  {kind} {mode}: {json.dumps(record)}", file=sys.stderr, flush=True)
    for timed in engines.values():
        if kind == "vllm":
            timed.engine.shutdown()
    return turns


def totals(turns: list[dict]) -> dict:
    return {key: round(sum(t[key] for t in turns), 3)
            for key in ("prompt_tokens", "cached_prompt_tokens", "computed_prompt_tokens", "first_token_s", "wall_s",
                        "cpu_s")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=["embedded", "vllm"], choices=["embedded", "vllm"])
    parser.add_argument("--first", type=int, default=30000, help="ids in the first prompt")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tool", type=int, default=400, help="ids of each tool result")
    parser.add_argument("--reply", type=int, default=64, help="tokens of each reply")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "prefix-reuse-cpu.json"))
    args = parser.parse_args()
    path = models.tiny_model_dir("qwen3", head_dim=32)
    vocab = models.load_model(path).config.vocab_size
    results = {}
    for kind in args.engines:
        turns = episodes(kind, path, args, vocab)
        results[kind] = {mode: {"turns": turns[mode], "total": totals(turns[mode])} for mode in ("on", "off")}
        on, off = results[kind]["on"]["total"], results[kind]["off"]["total"]
        timed = ("first_token_s", "wall_s", "cpu_s")
        later = {mode: {key: sum(t[key] for t in turns[mode][1:]) for key in timed} for mode in turns}
        results[kind]["off_over_on"] = {
            "computed_prompt_tokens": round(off["computed_prompt_tokens"] / max(on["computed_prompt_tokens"], 1), 2),
            **{key: round(off[key] / on[key], 2) for key in timed},
            **{f"{key}_after_turn_1": round(later["off"][key] / later["on"][key], 2) for key in timed}}
        print(f"{kind}: {json.dumps(results[kind]['off_over_on'])}", file=sys.stderr, flush=True)
    tree = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    summary = {"command": "python bench/prefix_reuse.py " + " ".join(sys.argv[1:]), "tree": tree.stdout.strip(),
               "model": "tiny qwen3 (2 layers, hidden 64, 4 heads of 32, 2 KV heads), fp32",
               "machine": f"{cpu_name()}, {os.cpu_count()} cores",
               "first_prompt_tokens": args.first, "turns": args.turns, "tool_result_tokens": args.tool,
               "reply_tokens": args.reply, **results}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"prefix_reuse: summary in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
