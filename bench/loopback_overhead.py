# bench/loopback_overhead.py — what the loopback server costs over calling the engine directly.
#
# The same requests (one chat turn per session, fixed seeds, so both sides sample the same tokens) go
# (a) straight to the engine, one thread per session into one EmbeddedEngine, and (b) through the stock
# AsyncOpenAI SDK over HTTP to loopback sessions backed by the same kind of engine. Reported per concurrency
# level: throughput ratio (loopback / direct), the added latency per request at p50 and p99, and the time to
# the first token at p50: the engine's first per-token callback (direct) against the first streamed chunk
# through the SDK (loopback streams each token as it is sampled).
#
#   python bench/loopback_overhead.py [--model tiny-qwen3] [--sessions 1 64] [--max-tokens 16] [--rounds 3]
import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from openai import AsyncOpenAI  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402
from loopback import LoopbackServer  # noqa: E402
from rollout import EmbeddedEngine, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def direct(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], list[float]]:
    """Every session's request from its own thread, straight into the engine. Returns the wall time,
    each request's latency and each request's time to its first token."""
    latencies, first = [0.0] * len(prompts), [0.0] * len(prompts)

    def one(i):
        t = time.perf_counter()

        def on_token(_, token_id):
            first[i] = first[i] or time.perf_counter() - t
        engine.generate([prompts[i]], SamplingParams(max_tokens=max_tokens, seed=i, stop_token_ids=(-1,)), on_token)
        latencies[i] = time.perf_counter() - t
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, first


async def through_loopback(server, messages: list[list[dict]], max_tokens: int,
                           stream: bool) -> tuple[float, list[float], list[float]]:
    """Every session's request through the OpenAI SDK, all sessions concurrently; with `stream`, the first
    times are those of each stream's first chunk (sent when the first token is sampled)."""
    sessions = [server.create_session(sampling=SamplingParams(max_tokens=max_tokens, seed=i, stop_token_ids=(-1,)))
                for i in range(len(messages))]
    latencies, first = [0.0] * len(messages), [0.0] * len(messages)
    clients = [AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in sessions]
    # each client connects before the clock starts (an agent's first request also pays for its connection and
    # the SDK's set-up, which is the agent's cost, not the server's)
    await asyncio.gather(*(client.models.list() for client in clients))

    async def one(i):
        client = clients[i]
        t = time.perf_counter()
        reply = await client.chat.completions.create(model=server.model_name, messages=messages[i], stream=stream)
        if stream:
            async for _ in reply:
                first[i] = first[i] or time.perf_counter() - t
        latencies[i] = time.perf_counter() - t
        await client.close()
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(messages))))
    elapsed = time.perf_counter() - start
    for s in sessions:
        server.close_session(s.session_id)
    return elapsed, latencies, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny-qwen3", help="model name or folder (models.resolve_model)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64], help="concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (no early stop)")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions per level; the median is reported")
    args = parser.parse_args()

    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    engine = EmbeddedEngine(models.load_model(path))
    server = LoopbackServer(engine, tokenizer)
    server.start()
    print(f"loopback overhead on {args.model}: {args.max_tokens} tokens per reply, median of {args.rounds} rounds")
    print(f"{'sessions':>8} {'direct req/s':>13} {'loopback req/s':>15} {'ratio':>6} "
          f"{'added p50 ms':>13} {'added p99 ms':>13} {'first token p50 ms: direct':>27} {'streamed':>9}")
    for n in args.sessions:
        messages = [[{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}] for i in range(n)]
        prompts = [data.render_prompt_ids(tokenizer, m) for m in messages]
        rows = []
        for _ in range(args.rounds):
            direct_s, direct_lat, direct_first = direct(engine, prompts, args.max_tokens)
            loop_s, loop_lat, _ = asyncio.run(through_loopback(server, messages, args.max_tokens, stream=False))
            _, _, streamed_first = asyncio.run(through_loopback(server, messages, args.max_tokens, stream=True))
            rows.append((n / direct_s, n / loop_s,
                         1e3 * (percentile(loop_lat, 0.5) - percentile(direct_lat, 0.5)),
                         1e3 * (percentile(loop_lat, 0.99) - percentile(direct_lat, 0.99)),
                         1e3 * percentile(direct_first, 0.5), 1e3 * percentile(streamed_first, 0.5)))
        d, lo, p50, p99, first_direct, first_streamed = (statistics.median(col) for col in zip(*rows))
        print(f"{n:>8} {d:>13.1f} {lo:>15.1f} {lo / d:>6.2f} {p50:>13.1f} {p99:>13.1f} "
              f"{first_direct:>27.1f} {first_streamed:>9.1f}")
    server.stop()


if __name__ == "__main__":
    main()
