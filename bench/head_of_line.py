# bench/head_of_line.py — what one long reply costs everybody else's turns.
#
# N loopback sessions talk to one engine through the stock AsyncOpenAI SDK over HTTP. One session asks for a
# reply `--hog` times longer than everybody else's; the others each hold a multi-turn conversation meanwhile.
# Reported: the latency of the others' turns (p50, p99, max) and the long reply's own time. An engine that runs
# a batch to completion makes every turn that just missed the batch wait for the long reply; an engine that
# admits new requests between decode steps (continuous batching) does not.
#
#   python bench/head_of_line.py [--model tiny-qwen3] [--sessions 64] [--max-tokens 8] [--hog 50] [--turns 3]
import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from openai import AsyncOpenAI  # noqa: E402

import models  # noqa: E402
from loopback import LoopbackServer  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(server, sessions: int, max_tokens: int, hog: int, turns: int) -> tuple[list[float], float]:
    """Session 0 asks once for hog * max_tokens tokens; sessions 1.. each take `turns` turns of max_tokens.
    Returns the others' per-turn latencies and the long reply's latency."""
    infos = [server.create_session(sampling=SamplingParams(max_tokens=max_tokens * (hog if i == 0 else 1), seed=i,
                                                           stop_token_ids=(-1,)))   # no early stop: full lengths
             for i in range(sessions)]
    clients = [AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in infos]
    await asyncio.gather(*(client.models.list() for client in clients))    # connected before the clock starts
    latencies: list[float] = []

    async def converse(i: int) -> float:
        messages = [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]
        for turn in range(1 if i == 0 else turns):
            if i and not turn:
                await asyncio.sleep(0.05)          # the long request is already in flight when the others start
            t = time.perf_counter()
            reply = await clients[i].chat.completions.create(model=server.model_name, messages=messages)
            elapsed = time.perf_counter() - t
            if i:
                latencies.append(elapsed)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"and {turn} more?"}]
        return elapsed
    hog_latency, *_ = await asyncio.gather(*(converse(i) for i in range(sessions)))
    for client, info in zip(clients, infos):
        await client.close()
        server.close_session(info.session_id)
    return latencies, hog_latency


def main() -> None:
    parser = argparse.ArgumentParser(description="p99 latency of N-1 sessions while one asks for a long reply")
    parser.add_argument("--model", default="tiny-qwen3", help="model name or folder (models.resolve_model)")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions, the long one included")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per reply of the ordinary sessions")
    parser.add_argument("--hog", type=int, default=50, help="the long reply is this many times longer")
    parser.add_argument("--turns", type=int, default=3, help="turns per ordinary session")
    args = parser.parse_args()

    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    server = LoopbackServer(EmbeddedEngine(models.load_model(path), tokenizer=tokenizer), tokenizer)
    server.start()
    asyncio.run(run(server, 4, args.max_tokens, 1, 1))       # warm-up: first forwards, first connections
    others, hog = asyncio.run(run(server, args.sessions, args.max_tokens, args.hog, args.turns))
    server.stop()
    print(f"head-of-line on {args.model}: {args.sessions} sessions, {args.turns} turns of {args.max_tokens} tokens "
          f"each, one reply of {args.hog * args.max_tokens} tokens")
    print(f"others' turn latency ms: p50 {1e3 * percentile(others, 0.5):.0f}  p99 {1e3 * percentile(others, 0.99):.0f}"
          f"  max {1e3 * max(others):.0f}  ({len(others)} turns); the long reply: {1e3 * hog:.0f} ms")


if __name__ == "__main__":
    main()
