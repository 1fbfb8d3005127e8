# bench/rollout_profile.py — tracerl's rollout phase against one raw vLLM generate call, side by side, and where the
# rollout's time goes.
#
# One process, two engines on the same model, alive together: raw vLLM (`vllm.LLM`) and tracerl's VLLMEngine (vLLM's
# AsyncLLM, with sleep mode on a GPU, as train.py builds it). Each round takes the math recipe's prompts of one RL step
# (rendered as train.py renders them: data.render_prompt_ids through the recipe's runner) and runs, in an order that
# rotates from round to round so drift falls on every side alike:
#   raw_n      one `LLM.generate` over the step's prompts, SamplingParams(n=samples)
#   raw_rows   one `LLM.generate` over every row (each prompt `samples` times: what tracerl's runner and TRL's
#              colocated engine send)
#   tracerl    train.py's rollout phase (time/rollout_s): the recipe's AgentRunner.run through router.Router (env
#              threads, chat template, the token ledger, grading), then invariants.check_sampled_once; and beside it
#              the engine's sleep and wake_up, which a GPU run pays once a step around the actor's train
# Both do the same work: every reply runs to --max-tokens (vLLM's ignore_eos; tracerl's SamplingParams.ignore_eos),
# the same temperature, the sampled token's processed logprob returned (logprobs=0), nothing detokenized in the
# engine, flat logprobs, each engine's prefix cache emptied before each of its rounds (train.py's weight push empties
# it, TRL's weight sync too). The tokens are counted, and a round whose replies were not all --max-tokens long is
# flagged. After the timed rounds, one more round of each side runs instrumented: perf_counter spans around the calls
# the token passes through (the runner's env calls, chat template and ledger; the router; VLLMEngine's request
# records; vLLM's add_request, its client's output decoding and output processing), from which a phase table whose
# rows add up to the round's time. The generation's physical bound on an H200 is bench/limits.py's.
#
#   python bench/rollout_profile.py --preset cpu --out /tmp/profile.json        (vLLM's CPU build, a tiny Qwen3)
#   python bench/rollout_profile.py --preset h200 --model DIR --out profile.json  (DIR: e.g. bench/shapes.py's)
import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import torch  # noqa: E402

import agents  # noqa: E402
import algo  # noqa: E402
import data  # noqa: E402
import invariants  # noqa: E402
import limits  # noqa: E402
import models  # noqa: E402
from engines import vllm_engine  # noqa: E402
from rollout import SamplingParams  # noqa: E402
from router import Router  # noqa: E402

PRESETS = {   # cpu: a tiny random Qwen3 on vLLM's CPU build; h200: one RL step of bench/vs_trl.py's h200 preset
    "cpu": dict(prompts=4, samples=4, max_tokens=16, max_length=160, rounds=2, temperature=0.7),
    "h200": dict(prompts=32, samples=8, max_tokens=256, max_length=512, rounds=4, temperature=0.7),
}
SIDES = ("raw_n", "raw_rows", "tracerl")


# ---- spans: seconds inside wrapped calls ------------------------------------------------------------------------

class Spans:
    """Per name: the seconds spent inside the wrapped calls, their count, the first start and the last end
    (perf_counter). Wrappers are installed for one instrumented round and removed after it. A coroutine's calls
    overlap on their loop (each one's seconds include the others' turns), so for those `inside` gives the window
    from the first start to the last end instead of a sum."""

    def __init__(self):
        self.total = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.first, self.last = {}, {}
        self.overlapping: set[str] = set()
        self._undo = []

    def add(self, name: str, start: float, end: float) -> None:
        self.total[name] += end - start
        self.calls[name] += 1
        self.first.setdefault(name, start)
        self.last[name] = end

    def wrap(self, owner, attr: str, name: str, key=None) -> None:
        """Time every call of owner.attr (an instance's, a class's or a module's); `key(args)` may suffix the name.
        An attribute this vLLM version lacks is skipped (its rows then read 0)."""
        original = getattr(owner, attr, None)
        if original is None:
            return

        def label(args):
            return name if key is None else f"{name}.{key(args)}"
        if asyncio.iscoroutinefunction(original):
            self.overlapping.add(name)

            @functools.wraps(original)
            async def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.add(label(args), start, time.perf_counter())
        else:
            @functools.wraps(original)
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.add(label(args), start, time.perf_counter())
        own = attr in getattr(owner, "__dict__", {})
        try:
            setattr(owner, attr, timed)
        except (AttributeError, TypeError):     # an object that takes no attributes (slots): not timed
            return
        self._undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def unwrap(self) -> None:
        while self._undo:
            self._undo.pop()()

    def inside(self, leave_out: tuple[str, ...]) -> dict[str, float]:
        """Seconds per name (a coroutine's: its window, named so), but those left out."""
        return {(f"{name} (first start to last end)" if name in self.overlapping else name):
                (self.last[name] - self.first[name] if name in self.overlapping else self.total[name])
                for name in sorted(self.total) if name not in leave_out}


def nested(obj, path: str):
    """obj.a.b.c, or None where this vLLM version has no such attribute."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


# ---- the two sides ------------------------------------------------------------------------------------------------

def step_rows(tasks: list, prompts: int, samples: int, step: int) -> tuple[list, list[str]]:
    """The tasks of RL step `step` as train.py's sync loop picks them, each `samples` times, and their group ids."""
    picked = [tasks[(step * prompts + i) % len(tasks)] for i in range(prompts)]
    group_ids = [f"s{step}-g{i}" for i in range(prompts) for _ in range(samples)]
    return [t for t in picked for _ in range(samples)], group_ids


class Raw:
    """vllm.LLM with the engine arguments tracerl's engine takes, and the same sampling."""

    def __init__(self, folder: str, engine_kwargs: dict, seed: int):
        import vllm
        self.vllm = vllm
        self.llm = vllm.LLM(folder, seed=seed, logprobs_mode="processed_logprobs", **engine_kwargs)

    def params(self, n: int, temperature: float, max_tokens: int):
        return self.vllm.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                        logprobs=0, detokenize=False, flat_logprobs=True)

    def run(self, prompt_ids: list[list[int]], params) -> int:
        """One generate call; returns the tokens sampled."""
        prompts = [self.vllm.TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    def instrument(self, spans: Spans) -> None:
        spans.wrap(self.llm, "_run_engine", "raw.engine_loop")
        spans.wrap(nested(self.llm, "llm_engine.output_processor"), "process_outputs", "raw.process_outputs")
        spans.wrap(nested(self.llm, "llm_engine.engine_core.decoder"), "decode", "raw.decode_outputs")


class Ours:
    """train.py's rollout engine, router and the math recipe's runner, as its GPU loop runs them."""

    def __init__(self, folder: str, engine_kwargs: dict, seed: int, gpu: bool, tokenizer, max_length: int):
        self.engine = vllm_engine.VLLMEngine(folder, seed=seed, transfer="ipc" if gpu else "rpc", sleep_mode=gpu,
                                             **engine_kwargs)
        self.gpu, self.tokenizer = gpu, tokenizer
        self.router = Router([self.engine])
        self.runner = agents.load_recipe("math").AgentRunner(self.router, tokenizer, max_length=max_length)

    def reset_cache(self) -> None:
        self.engine._call(self.engine._llm.reset_prefix_cache())

    def run(self, tasks: list, group_ids: list[str], sampling: SamplingParams) -> tuple[float, int, dict]:
        """train.py's rollout phase, then (on a GPU) the engine's sleep and wake_up, and the batch the trainer
        would build from it; returns when the rollout phase began (perf_counter), the tokens sampled and each
        part's seconds."""
        start = time.perf_counter()
        rollouts = self.runner.run(tasks, group_ids, sampling)
        for r in rollouts:       # train.py's invariant 1 at run time, inside its rollout phase
            invariants.check_sampled_once(r.rows, r.generations)
        seconds = {"rollout_phase": time.perf_counter() - start}
        if self.gpu:
            for name, call in (("sleep", self.engine.sleep), ("wake_up", self.engine.wake_up)):
                t0 = time.perf_counter()
                call()
                seconds[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.build_batch(rollouts)
        seconds["build_batch"] = time.perf_counter() - t0
        return start, sum(len(g.token_ids) for r in rollouts for g in r.generations), seconds

    def build_batch(self, rollouts: list) -> invariants.TrainBatch:
        """What train.train_on_rows does with the rows before the trainer sees them (train.py counts it outside
        time/rollout_s): advantages, the padded batch, the token-identity check."""
        rows = [(r, row) for r in rollouts for row in r.rows]
        segs = [row for _, row in rows]
        advantages = algo.rollout_advantages([r.reward for r, _ in rows], [r.group_id for r, _ in rows],
                                             [r.rollout_id for r, _ in rows], "grpo")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = invariants.build_batch(segs, advantages, pad_id=pad)
        invariants.check_token_identity(batch, segs)
        return batch

    def instrument(self, spans: Spans) -> None:
        llm = self.engine._llm
        spans.wrap(self.router, "generate", "router.generate")
        spans.wrap(self.engine, "generate", "engine.generate")
        spans.wrap(vllm_engine._Request, "take", "engine.take_outputs")
        spans.wrap(vllm_engine._Request, "generation", "engine.generation")
        spans.wrap(llm, "add_request", "vllm.add_request")
        spans.wrap(nested(llm, "output_processor"), "process_outputs", "vllm.process_outputs")
        spans.wrap(nested(llm, "engine_core.decoder"), "decode", "vllm.decode_outputs")
        spans.wrap(self.runner, "_call_all", "env", key=lambda args: args[1])      # init, reset, step (threads)
        spans.wrap(self.runner, "_to_rollout", "runner.to_rollout")
        spans.wrap(data, "render_prompt_ids", "runner.chat_template")
        spans.wrap(invariants.TokenLedger, "extend_or_seal", "ledger.extend_or_seal")
        spans.wrap(invariants.TokenLedger, "append_sampled", "ledger.append_sampled")
        spans.wrap(invariants, "check_sampled_once", "ledger.check_sampled_once")
        spans.wrap(self.tokenizer, "decode", "runner.decode_text")


# ---- the phase tables of the instrumented round --------------------------------------------------------------------

def ours_phases(spans: Spans, start: float, seconds: dict[str, float]) -> dict:
    """tracerl's round as consecutive phases that add up to it (the runner's rollout phase, then sleep and wake),
    and, inside the phases, what the threads did (seconds summed over calls; vLLM's client runs on the engine's
    loop thread while the runner waits)."""
    router0, router1 = spans.first["router.generate"], spans.last["router.generate"]
    engine0, engine1 = spans.first["engine.generate"], spans.last["engine.generate"]
    submit0, taken = spans.first["vllm.add_request"], spans.last["engine.take_outputs"]
    end = start + seconds["rollout_phase"]
    checked = spans.total["ledger.check_sampled_once"]
    timeline = {
        "runner: envs made and reset, chat template, ledgers opened": router0 - start,
        "router: placement, the engine's thread": engine0 - router0,
        "engine: request records, checks, submission begun": submit0 - engine0,
        "vLLM: first request submitted to last output taken": taken - submit0,
        "engine: Generation objects (versions, logprobs)": engine1 - taken,
        "router: results, counters": router1 - engine1,
        "runner: ledger appends, replies decoded, env steps (grading), rollouts": end - router1 - checked,
        "invariants.check_sampled_once": checked,
        "engine sleep": seconds.get("sleep", 0.0),
        "engine wake_up": seconds.get("wake_up", 0.0),
    }
    return {"timeline_s": timeline, "total_s": sum(timeline.values()),
            "inside_s": spans.inside(("router.generate", "engine.generate")),
            "calls": dict(spans.calls), "build_batch_s": seconds["build_batch"]}


def raw_phases(spans: Spans, start: float, total: float) -> dict:
    loop0, loop1 = spans.first["raw.engine_loop"], spans.last["raw.engine_loop"]
    timeline = {"raw: inputs processed, requests added": loop0 - start,
                "raw: engine loop (generation, outputs)": loop1 - loop0,
                "raw: after the loop": start + total - loop1}
    return {"timeline_s": timeline, "total_s": total, "inside_s": spans.inside(("raw.engine_loop",)),
            "calls": dict(spans.calls)}


# ---- the run ------------------------------------------------------------------------------------------------------

def model_folder(args, gpu: bool) -> str:
    if args.model:
        return args.model
    if args.preset != "cpu":
        raise SystemExit("--preset h200 needs --model DIR (e.g. `python bench/shapes.py qwen3-1.7b DIR --tokenizer "
                         "SMOLLM2_DIR`)")
    return models.tiny_model_dir("qwen3", head_dim=64 if gpu else 32)    # vLLM's CPU attention needs head_dim >= 32


def main() -> None:
    parser = argparse.ArgumentParser(description="tracerl's rollout phase against raw vLLM, side by side")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default="", help="a model folder (default for --preset cpu: a tiny Qwen3)")
    for name in ("prompts", "samples", "max_tokens", "max_length", "rounds"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=0, help=f"default: the preset's {name}")
    parser.add_argument("--temperature", type=float, default=0.0, help="default: the preset's")
    parser.add_argument("--engine-memory", type=float, default=0.3, help="each engine's share of the GPU (train.py's "
                                                                          "--rollout.engine_memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=0, help="seconds for the whole run (0: no limit): rounds "
                        "that would not fit are left out, the summary is still written")
    parser.add_argument("--out", default="", help="the JSON summary (also printed)")
    args = parser.parse_args()
    started = time.time()
    cfg = {k: getattr(args, k) or v for k, v in PRESETS[args.preset].items()}
    gpu = torch.cuda.is_available()
    if args.preset == "h200" and not gpu:
        raise SystemExit("--preset h200 needs a CUDA GPU; on a CPU run --preset cpu")
    device = torch.cuda.get_device_name() if gpu else "cpu"
    import vllm
    folder = model_folder(args, gpu)
    tokenizer = models.load_tokenizer(folder)
    shape = limits.Shape.of(folder)
    tasks = agents.load_recipe("math").tasks("train", args.seed)
    P, S, L, T = cfg["prompts"], cfg["samples"], cfg["max_tokens"], cfg["temperature"]
    rows = P * S
    engine_kwargs = dict(dtype="bfloat16" if gpu else "float32", gpu_memory_utilization=args.engine_memory,
                         max_model_len=cfg["max_length"], enforce_eager=not gpu)
    print(f"rollout_profile: {folder}, {P} prompts x {S} samples x {L} tokens, {cfg['rounds']} rounds", flush=True)
    t0 = time.perf_counter()
    ours = Ours(folder, engine_kwargs, args.seed, gpu, tokenizer, cfg["max_length"])
    raw = Raw(folder, engine_kwargs, args.seed)
    startup_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()                 # as train.py does after its start-up
    sampling = SamplingParams(T, 1.0, -1, L, ignore_eos=True)       # train.py's, with --rollout.ignore_eos true
    raw_n, raw_rows = raw.params(S, T, L), raw.params(1, T, L)

    def one(side: str, step: int) -> tuple[float, float, int, dict]:
        """One side's round at RL step `step`'s prompts: (its start on perf_counter's clock, seconds, tokens
        sampled, tracerl's parts)."""
        group_tasks, group_ids = step_rows(tasks, P, S, step)
        if side == "tracerl":
            ours.reset_cache()
            start, tokens, parts = ours.run(group_tasks, group_ids, sampling)
            return start, parts["rollout_phase"], tokens, parts
        raw.llm.reset_prefix_cache()
        ids = [data.render_prompt_ids(tokenizer, t.messages) for t in group_tasks]
        start = time.perf_counter()
        tokens = raw.run(ids[::S], raw_n) if side == "raw_n" else raw.run(ids, raw_rows)
        return start, time.perf_counter() - start, tokens, {}

    t0 = time.time()
    for side in SIDES:          # warm-up, at prompts no measured round uses
        one(side, cfg["rounds"] + 1)
    round_s = time.time() - t0

    def time_for(seconds: float) -> bool:   # 30 s kept for the engines' shutdown and the summary
        return not args.budget_s or time.time() + seconds + 30 <= started + args.budget_s

    rounds = []
    for r in range(cfg["rounds"]):
        if rounds and not time_for(2 * round_s):          # one instrumented round still to come
            print(f"--budget-s: {len(rounds)} of {cfg['rounds']} rounds", flush=True)
            break
        record = {}
        for side in SIDES[r % 3:] + SIDES[:r % 3]:        # who goes first rotates
            _, seconds, tokens, parts = one(side, r)
            record[side] = {"s": seconds, "tokens": tokens, **{k: v for k, v in parts.items() if k != "rollout_phase"}}
        rounds.append(record)
        print(f"round {r + 1}: " + ", ".join(f"{side} {record[side]['s']:.3f} s" for side in SIDES), flush=True)

    # the summary of the timed rounds, written before the instrumented ones run
    expected = rows * L
    fixed = all(rec[side]["tokens"] == expected for rec in rounds for side in SIDES)
    if not fixed:
        print(f"WARNING: not every reply ran to {L} tokens: the sides did unequal work; see rounds[].tokens",
              flush=True)
    median = {side: statistics.median(rec[side]["s"] for rec in rounds) for side in SIDES}
    if gpu:
        median["sleep_wake"] = statistics.median(rec["tracerl"]["sleep"] + rec["tracerl"]["wake_up"] for rec in rounds)
    with_sleep = median["tracerl"] + median.get("sleep_wake", 0.0)
    prompt_lens = [len(data.render_prompt_ids(tokenizer, t.messages)) for t in step_rows(tasks, P, 1, 0)[0]]
    bound = limits.generation_bound_s(shape, prompt_lens, S, L)
    result = {
        "what": "tracerl's rollout phase (train.py's time/rollout_s, + the engine's sleep and wake_up on a GPU) "
                "against one raw vllm.LLM.generate over the same prompts; ratio > 1: tracerl slower",
        "preset": args.preset, "config": cfg, "model": folder, "shape": vars(shape), "rows": rows,
        "tokens_per_round": expected, "fixed_lengths": fixed, "prompt_tokens_mean": sum(prompt_lens) / len(prompt_lens),
        "device": device, "vllm": vllm.__version__, "torch": torch.__version__,
        "startup_s": startup_s, "rounds_run": len(rounds), "rounds": rounds, "median_s": median,
        "tokens_per_s": {side: expected / median[side] for side in SIDES},
        "tracerl_over_raw": {f"{what} / {side}": value / median[side] for side in ("raw_n", "raw_rows")
                             for what, value in (("rollout_phase", median["tracerl"]),
                                                 ("rollout_phase_with_sleep_wake", with_sleep))},
        # each round's own ratio (its sides ran seconds apart), the median over rounds: drift cancels
        "tracerl_over_raw_per_round_median": {
            f"rollout_phase_with_sleep_wake / {side}": statistics.median(
                (rec["tracerl"]["s"] + rec["tracerl"].get("sleep", 0.0) + rec["tracerl"].get("wake_up", 0.0))
                / rec[side]["s"] for rec in rounds) for side in ("raw_n", "raw_rows")},
        "within_5pct_of_raw_n": with_sleep <= 1.05 * median["raw_n"],
        "phases_instrumented_round": {},
        "limits": {"generation_bound_s": bound, **{f"{side}_x_bound": median[side] / bound for side in SIDES},
                   "sleep_wake_bound_s": limits.phase_bounds(shape, prompt_lens, S, L, 0, 0)["sleep_wake"],
                   "constants": limits.CONSTANTS},
    }
    write(result, args.out)

    # one instrumented round per side (not among the timed ones: the spans cost a little)
    phases = result["phases_instrumented_round"]
    try:
        for side in SIDES if time_for(round_s) else ():
            spans = Spans()
            try:
                (ours if side == "tracerl" else raw).instrument(spans)
                start, seconds, _, parts = one(side, 0)
            finally:
                spans.unwrap()
            try:
                phases[side] = (ours_phases(spans, start, parts) if side == "tracerl"
                                else raw_phases(spans, start, seconds))
            except KeyError as missing:      # a call this vLLM version does not make: the totals still stand
                phases[side] = {"error": f"no span {missing}", "inside_s": spans.inside(()), "total_s": seconds}
    except Exception as error:  # noqa: BLE001 - the timed rounds' summary stands; say what broke
        phases["error"] = f"{type(error).__name__}: {error}"
    finally:
        ours.engine.shutdown()
        raw.llm.llm_engine.engine_core.shutdown()
    write(result, args.out)
    print(json.dumps(result, indent=1))


def write(result: dict, path: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
