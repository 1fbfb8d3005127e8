# Cheap attacks on the loopback server, over real HTTP against a real server on a real EmbeddedEngine (tiny models):
# a PNG decompression bomb (a few KB of request, gigapixels decoded), slowloris (half-sent requests held open),
# a flood of idle connections, one session's flood of requests whose bodies never come, a JSON body of millions of
# tiny values, one session's backlog of hung-up requests starving the others, a client that hangs up mid-reply,
# a malformed Authorization header whose key ends up in a log, and forced tool calls whose patterns grow the
# grammar's lexer with every token. Each is refused in the wire's own format where a reply is possible, and the
# server keeps serving. Limits are the server's constructor parameters, set small here so the attacks take seconds.
import base64
import contextlib
import json
import logging
import re
import select
import socket
import struct
import threading
import time
import tracemalloc
import urllib.error
import urllib.parse
import urllib.request
import zlib

import anthropic
import openai
import pytest

import data
import invariants
import models
from engines import SamplingParams, constraints
from loopback import LoopbackServer
from rollout import EmbeddedEngine


@contextlib.contextmanager
def serving(engine=None, **limits):
    """A started LoopbackServer on a tiny Qwen3 (or `engine`), stopped on exit."""
    tok = models.bpe_tokenizer()
    engine = engine or EmbeddedEngine(models.tiny_model("qwen3", seed=0), tokenizer=tok)
    server = LoopbackServer(engine, tok, template=data.CHATML_TEMPLATE, **limits)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def openai_client(info, **options):
    return openai.OpenAI(base_url=info.base_url, api_key=info.api_key, max_retries=0, **options)


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (EOF or reset), without waiting."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536, socket.MSG_PEEK) == b""
    except ConnectionError:
        return True


def request_head(info, path: str, body: bytes, extra: str = "") -> bytes:
    url = urllib.parse.urlparse(info.base_url)
    return (f"POST {url.path}{path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {info.api_key}\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def read_reply(sock: socket.socket) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one whole reply on a raw socket."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(rest)


# ---- a PNG decompression bomb --------------------------------------------------------------------

def png(width: int, height: int) -> bytes:
    """A black 1-bit PNG of width x height, written row by row through zlib: a 13000x13000 one is ~27 KB of file
    and 169 megapixels decoded; it is never held decoded here."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    squeeze, row, idat = zlib.compressobj(9), b"\0" * (1 + (width + 7) // 8), []   # filter byte 0, then the pixels
    idat += [squeeze.compress(row) for _ in range(height)]
    idat.append(squeeze.flush())
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def vlm_server():
    tok = models.bpe_tokenizer()
    engine = EmbeddedEngine(models.tiny_model("qwen2_5_vl", seed=0), tokenizer=tok)
    server = LoopbackServer(engine, tok, template=data.CHATML_TEMPLATE, image_processor=models.tiny_image_processor())
    server.start()
    yield server
    server.stop()


def ask_with_images(server, wire: str, pngs: list[bytes]):
    """One turn holding `pngs`, on a new session over `wire`; returns (the session, the SDK's reply or error)."""
    info = server.create_session(sampling=SamplingParams(max_tokens=2))
    encoded = [base64.b64encode(p).decode() for p in pngs]
    try:
        if wire == "openai":
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{e}"}} for e in encoded]
            return info, openai_client(info).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, *parts]}])
        parts = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": e}} for e in encoded]
        client = anthropic.Anthropic(base_url=info.session_url, api_key=info.api_key, max_retries=0)
        return info, client.messages.create(model="policy", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What?"}, *parts]}])
    except (openai.APIStatusError, anthropic.APIStatusError) as error:
        return info, error


def trace_segments(info) -> list:
    request = urllib.request.Request(info.trace_url, headers={"Authorization": f"Bearer {info.api_key}"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())["segments"]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_png_decompression_bomb_is_refused_from_its_header_in_the_wires_format(vlm_server, wire):
    bomb = png(13000, 13000)
    assert len(bomb) < 40_000                                   # a few KB of request, 169 megapixels decoded
    info, refusal = ask_with_images(vlm_server, wire, [bomb])
    assert isinstance(refusal, openai.BadRequestError if wire == "openai" else anthropic.BadRequestError), refusal
    body = refusal.body if wire == "openai" else refusal.body["error"]
    assert body["type"] == "invalid_request_error" and "13000x13000" in body["message"], body
    assert "pixels" in body["message"] and trace_segments(info) == []          # nothing recorded
    _, reply = ask_with_images(vlm_server, wire, [png(56, 56)])          # and the server goes on serving images
    assert not isinstance(reply, Exception), reply


def test_images_each_under_the_bound_are_refused_when_the_request_holds_too_many_pixels(vlm_server):
    # five different images, each at most the per-image bound, together over the per-request one
    info, refusal = ask_with_images(vlm_server, "openai", [png(4096, 4096 - k) for k in range(5)])
    assert isinstance(refusal, openai.BadRequestError), refusal
    assert "per request" in refusal.body["message"] and trace_segments(info) == []


# ---- slowloris and idle connections --------------------------------------------------------------

def test_half_sent_requests_and_idle_keep_alive_connections_are_closed_and_others_are_served():
    with serving(idle_timeout_s=0.5) as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2))
        head = request_head(info, "/chat/completions", b"{}")
        attackers = [socket.create_connection((server.host, server.port)) for _ in range(50)]
        for sock in attackers:
            sock.sendall(head[:20])
        kept_alive = socket.create_connection((server.host, server.port))    # a whole request, then silence
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        kept_alive.sendall(request_head(info, "/chat/completions", body))
        assert read_reply(kept_alive)[0] == 200
        reply = openai_client(info).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content is not None                  # served during the attack
        deadline, sent = time.monotonic() + 15, 20
        while not all(is_closed(sock) for sock in attackers + [kept_alive]) and time.monotonic() < deadline:
            for sock in attackers:           # one more byte each: trickling must not keep a connection open
                with contextlib.suppress(OSError):
                    sock.sendall(head[sent:sent + 1])
            sent, _ = sent + 1, time.sleep(0.1)
        held = sum(not is_closed(sock) for sock in attackers)
        assert held == 0, f"{held} of {len(attackers)} half-sent requests still held after 15 s"
        assert is_closed(kept_alive), "an idle keep-alive connection was still open after 15 s"
        for sock in attackers + [kept_alive]:
            sock.close()


def test_a_flood_of_idle_connections_is_capped_and_a_client_still_gets_served():
    with serving(max_connections=8) as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2))
        silent = [socket.create_connection((server.host, server.port)) for _ in range(30)]
        reply = openai_client(info).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content is not None
        deadline = time.monotonic() + 10
        while sum(not is_closed(sock) for sock in silent) > 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = sum(not is_closed(sock) for sock in silent)
        assert held <= 8, f"{held} idle connections held open, over the server's cap of 8"
        for sock in silent:
            sock.close()


def test_one_sessions_bodiless_requests_past_its_share_are_refused_and_another_sessions_turn_is_served():
    with serving(max_connections=16, max_session_requests=4) as server:
        flood, other = (server.create_session(sampling=SamplingParams(max_tokens=2)) for _ in range(2))
        head = request_head(flood, "/chat/completions", b" " * 1000)[:-1000]    # Content-Length 1000, no body
        sockets = []
        for _ in range(24):               # more than the server's connections, every one awaiting a body
            sockets.append(socket.create_connection((server.host, server.port)))
            with contextlib.suppress(OSError):
                sockets[-1].sendall(head)
        refusals: dict = {}
        def open_(sock) -> bool:          # neither refused nor closed to make room (a refusal is read, then EOF)
            return sock not in refusals and not is_closed(sock)
        deadline = time.monotonic() + 10  # until the server has refused (and closed) all but the session's share
        while sum(map(open_, sockets)) > 4 and time.monotonic() < deadline:
            for sock in select.select([s for s in sockets if s not in refusals], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    if sock.recv(1, socket.MSG_PEEK):
                        refusals[sock] = read_reply(sock)
        reply = openai_client(other, timeout=30).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content is not None     # another session's newcomer is served
        held = sum(map(open_, sockets))
        assert held <= 4, f"{held} of the flooding session's bodiless requests held open, over its share of 4"
        assert refusals, "the flooding session was never told why its requests were refused"
        for status, headers, body in refusals.values():
            assert status == 429 and int(headers["retry-after"]) >= 1 and headers["connection"] == "close"
            assert body["error"]["type"] == "rate_limit_error" and "4 requests" in body["error"]["message"]
        for sock in sockets:
            sock.close()


# ---- a body of millions of tiny values ------------------------------------------------------------

@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_wide_json_body_is_refused_before_it_is_built_and_another_session_is_served(wire):
    with serving() as server:
        wide, other = (server.create_session(sampling=SamplingParams(max_tokens=2)) for _ in range(2))
        body = b'{"model": "policy", "max_tokens": 2, "messages": [' + b",".join([b"0"] * 2_000_000) + b"]}"
        path = "/chat/completions" if wire == "openai" else "/messages"
        tracemalloc.start()               # every thread's Python allocations, the server's included
        try:
            base = tracemalloc.get_traced_memory()[0]
            with socket.create_connection((server.host, server.port)) as sock:
                sock.sendall(request_head(wide, path, body))
                models_list = openai_client(other, timeout=60).models.list()     # served while the body is parsed
                status, _, reply = read_reply(sock)
            grown = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert models_list.data[0].id == "policy"
        # the 4 MiB body itself is read once or twice; built, its 2 M values cost over 100 MB
        assert grown < 24 * 2**20, f"refusing a 4 MiB body of 2 M values grew the server by {grown / 2**20:.0f} MiB"
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply   # the wire's format
        assert (reply["type"] == "error") if wire == "anthropic" else ("type" not in reply)
        assert "JSON values" in reply["error"]["message"], reply
        # armed: a body of the same size whose values are few (one long text) is parsed and served
        long_text = json.dumps({"model": "policy", "max_tokens": 2,
                                "messages": [{"role": "user", "content": "0," * 2_000_000}]}).encode()
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request_head(wide, path, long_text))
            status, _, reply = read_reply(sock)
        too_long = reply["error"].get("code") == "context_length_exceeded" if wire == "openai" else \
            reply["error"]["message"].startswith("prompt is too long")
        assert status == 400 and too_long, reply       # parsed and decoded: refused only for its length


# ---- one session's backlog -----------------------------------------------------------------------

class HoldingEngine(EmbeddedEngine):
    """The real engine; a prompt that holds 'HOLD' waits for `gate` before it is generated, and is counted."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer=tokenizer)
        self.gate, self.held, self._count = threading.Event(), 0, threading.Lock()

    def generate(self, prompts, params, on_token=None, images=None):
        if "HOLD" in self.tokenizer.decode(prompts[0]):
            with self._count:
                self.held += 1
            assert self.gate.wait(60), "the test never opened the gate"
        return super().generate(prompts, params, on_token, images=images)


def test_a_session_that_floods_and_hangs_up_neither_starves_another_nor_generates_its_backlog():
    tok = models.bpe_tokenizer()
    engine = HoldingEngine(models.tiny_model("qwen3", seed=0), tok)
    with serving(engine, max_session_requests=4) as server:
        try:
            flood, other = (server.create_session(sampling=SamplingParams(max_tokens=2)) for _ in range(2))
            sockets = []
            for k in range(80):             # more requests than the server has generation threads
                body = json.dumps({"messages": [{"role": "user", "content": f"HOLD {k}"}]}).encode()
                sockets.append(socket.create_connection((server.host, server.port)))
                sockets[-1].sendall(request_head(flood, "/chat/completions", body))
            # the other session's turn is served while the flooding session's first turn is still held
            reply = openai_client(other, timeout=30).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content is not None
            # every request over the session's cap is refused at once, in the wire's format, with a Retry-After
            answered = {}
            deadline = time.monotonic() + 20
            while len(answered) < 76 and time.monotonic() < deadline:
                for sock in select.select([s for s in sockets if s not in answered], [], [], 0.2)[0]:
                    answered[sock] = read_reply(sock)
            assert len(answered) == 76 and engine.held == 1
            for status, headers, body in answered.values():
                assert status == 429 and int(headers["retry-after"]) >= 1
                assert body["error"]["type"] == "rate_limit_error" and "one at a time" in body["error"]["message"]
            for sock in sockets:            # the flooding client hangs up on everything still waiting
                sock.close()
            deadline = time.monotonic() + 30       # until the server has seen the hang-ups: one turn left, held
            while server._sessions[flood.session_id][2].in_flight > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            engine.gate.set()
            deadline = time.monotonic() + 30
            while server._sessions[flood.session_id][2].in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server._sessions[flood.session_id][2].in_flight == 0
            # only the turn already generating ran, and stopped at its first token (dropped whole, as cut); the three
            # queued behind it left with their clients
            session = server._sessions[flood.session_id][0]
            assert engine.held == 1 and session.turns == 0 and session.cut_turns == 1
        finally:
            engine.gate.set()


# ---- a client that hangs up mid-reply -------------------------------------------------------------

class TokenCountingEngine(EmbeddedEngine):
    """The real engine, counting every token it samples (cut replies included, which no Generation reports)."""
    sampled = 0

    def _record(self, row, *drawn):
        self.sampled += 1
        super()._record(row, *drawn)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_a_client_that_hangs_up_mid_reply_stops_its_sampling_and_the_turn_is_dropped_whole(stream):
    tok = models.bpe_tokenizer()
    engine = TokenCountingEngine(models.tiny_model("qwen3", seed=0), tokenizer=tok)
    with serving(engine) as server:
        # a harness without max_tokens: the reply may take the whole context, and no end token stops it
        info = server.create_session(sampling=SamplingParams(max_tokens=4000, ignore_eos=True, seed=3))
        ask = [{"role": "user", "content": "Tell me a long story."}]
        body = json.dumps({"model": "policy", "messages": ask, "stream": stream}).encode()
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request_head(info, "/chat/completions", body))
            deadline = time.monotonic() + 60
            while engine.sampled < 16:    # mid-reply: counted in tokens, not seconds
                assert time.monotonic() < deadline, "the reply never started"
                time.sleep(0.005)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # a reset, as a kill
        at_hang_up = engine.sampled
        session, _, lane = server._sessions[info.session_id]
        deadline = time.monotonic() + 120
        while lane.in_flight:             # until the server has let go of the turn
            assert time.monotonic() < deadline, "the turn whose client hung up was still running after 120 s"
            time.sleep(0.01)
        after = engine.sampled - at_hang_up
        assert after <= 32, f"the engine sampled {after} tokens for a client that had hung up"
        # dropped whole: nothing of it in the record, counted as cut
        assert session.turns == 0 and trace_segments(info) == [] and session.cut_turns == 1
        # the server keeps serving: the same conversation is sampled afresh and recorded token-exact
        reply = openai_client(info).chat.completions.create(model="policy", messages=ask, max_tokens=8,
                                                            extra_body={"return_token_ids": True})
        segments = trace_segments(info)
        assert len(segments) == 1 and session.turns == 1
        sampled = [t for t, trainable in zip(segments[0]["token_ids"], segments[0]["trainable"]) if trainable]
        assert sampled == reply.model_extra["token_ids"] and len(sampled) == 8


# ---- keys never reach a log -----------------------------------------------------------------------

def test_a_malformed_authorization_header_never_puts_the_key_in_a_log_or_a_reply(caplog, capfd):
    caplog.set_level(logging.DEBUG)
    with serving() as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2))
        key, path = info.api_key, urllib.parse.urlparse(info.base_url).path + "/models"
        replies = []
        for header in [f"Authorization: Bearer {key}\x01", f"Authorization Bearer {key}",
                       f"Authorization: Bearer {key}{'A' * 9000}", f"x-api-key: {key}\x7f",
                       f"Authorization: Bearer {key}\r\n folded"]:
            with socket.create_connection((server.host, server.port)) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n".encode())
                status, _, body = read_reply(sock)
                assert status == 400 and body["error"]["type"] == "invalid_request_error"
                replies.append(json.dumps(body))
        # well-formed requests, one carrying the key where nobody should (access logs print some headers)
        for header in [f"Authorization: Bearer {key}", f"x-api-key: {key}\r\nUser-Agent: {key}\r\nReferer: {key}",
                       "Authorization: Bearer wrong"]:
            with socket.create_connection((server.host, server.port)) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n".encode())
                replies.append(json.dumps(read_reply(sock)[2]))
        assert openai_client(info).models.list().data[0].id == "policy"       # the server still serves
    logged = "\n".join(logging.Formatter().format(record) for record in caplog.records)
    assert any(record.name == "aiohttp.access" for record in caplog.records)     # the access log did run
    assert key not in logged, "the session's key was written to a log"
    assert key not in capfd.readouterr().err, "the session's key was printed to stderr"
    assert not any(key in reply for reply in replies), "a reply echoed the session's key"


# ---- references that multiply: a request costs what its bytes may expand to ------------------------------
# Each attack is a few KB to a MB of request whose references (Anthropic's tool_reference, the Responses API's
# item_reference) or text would build hundreds of MB before any bound was checked. The server runs in this process,
# so its memory is read here: the peak RSS over the attack (Linux resets the peak on writing 5 to clear_refs).

GROWTH_BOUND_MB = 96          # each attack grew the server by 345-528 MB before its refusal


def peak_growth_mb(work):
    """(work()'s result or the exception it raised, this process's peak RSS over it less its RSS before, in MB)."""
    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) for line in lines if line.startswith(field)) // 1024
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")
    before = status("VmRSS:")
    try:
        outcome = work()
    except Exception as error:
        outcome = error
    return outcome, status("VmHWM:") - before


def anthropic_client(info):
    return anthropic.Anthropic(base_url=info.session_url, api_key=info.api_key, max_retries=0)


def context_text(info) -> str:
    return "".join(t for s in trace_segments(info) for t, m in zip(s["tokens"], s["trainable"]) if not m)


SEARCH = {"name": "ToolSearch", "description": "Fetches deferred tools.", "input_schema": {"type": "object"}}


def found(references: int) -> list[dict]:
    """A conversation in which a tool search answers with `references` tool_reference blocks naming 'Huge'."""
    return [{"role": "user", "content": "Find the tool."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "tool_reference", "tool_name": "Huge"}] * references}]}]


def test_tool_references_past_the_context_are_refused_before_they_expand_and_a_few_are_served_exactly():
    with serving() as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2))
        huge = {"name": "Huge", "description": "d" * 120 * 1024, "input_schema": {"type": "object"},
                "defer_loading": True}
        ask = dict(model="policy", max_tokens=2, tools=[SEARCH, huge], messages=found(1500))
        assert len(json.dumps(ask)) < 200_000                     # 1,500 references: 184 MB of definitions
        refusal, grown = peak_growth_mb(lambda: anthropic_client(info).messages.create(**ask))
        assert isinstance(refusal, anthropic.BadRequestError), refusal
        assert refusal.body["error"]["message"].startswith("prompt is too long: "), refusal.body
        assert grown < GROWTH_BOUND_MB, f"the server grew {grown} MB to refuse 1,500 tool references"
        assert trace_segments(info) == []                         # nothing recorded
        # the positive control: a few references to a short definition, each where it stands, token-exact
        small = {**huge, "description": "Edits a notebook cell."}
        ask = dict(model="policy", max_tokens=2, tools=[SEARCH, small], messages=found(3))
        counted = anthropic_client(info).messages.count_tokens(**{k: v for k, v in ask.items() if k != "max_tokens"})
        reply = anthropic_client(info).messages.create(**ask)
        assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
        definition = '<function>{"description": "Edits a notebook cell.", "name": "Huge", "parameters": {"type": ' \
                     '"object"}}</function>'
        assert "<functions>\n" + "\n".join([definition] * 3) + "\n</functions>" in context_text(info)


def test_count_tokens_past_the_context_is_refused_as_too_long_having_encoded_about_twice_the_context():
    # 1.04 M characters that encode about one token each: under the characters a context can hold (65,536 tokens
    # of at most 16 characters), so only encoding tells; it was answered 1,017,903 tokens, 15 times the context
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789!@#$%^&*()_+-=[]{};:,.<>/?"
    text = "".join(alphabet[(k * k + 7 * k) % len(alphabet)] for k in range(1_040_000))
    with serving() as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2))
        client = anthropic_client(info)
        refusal, grown = peak_growth_mb(lambda: client.messages.count_tokens(
            model="policy", messages=[{"role": "user", "content": text}]))
        assert isinstance(refusal, anthropic.BadRequestError), refusal
        assert refusal.body["error"]["message"].startswith("prompt is too long: "), refusal.body
        assert grown < GROWTH_BOUND_MB, f"the server grew {grown} MB to count 1.04 M characters"
        # the positive control: a prompt long enough to be counted in pieces first, inside the context, is counted
        # exactly: the turn's own prompt, and the tokenizer's encoding of its rendering
        info = server.create_session(sampling=SamplingParams(max_tokens=2), max_length=4096)
        inside = [{"role": "user", "content": "the cat sat on the mat. " * 120}]
        counted = anthropic_client(info).messages.count_tokens(model="policy", messages=inside).input_tokens
        reply = anthropic_client(info).messages.create(model="policy", max_tokens=2, messages=inside)
        rendered = data.render_prompt_text(server.tokenizer, inside, None, data.CHATML_TEMPLATE, True)
        assert 2 * len(rendered) > 4096 and counted == reply.usage.input_tokens == \
            len(server.tokenizer.encode(rendered, add_special_tokens=False))


def test_item_references_past_the_context_are_refused_before_they_expand_and_a_few_are_served_exactly():
    with serving() as server:
        info = server.create_session(sampling=SamplingParams(max_tokens=2, seed=0))
        client = openai_client(info)
        long_text = {"type": "object", "properties": {"t": {"type": "string", "minLength": 2000}}, "required": ["t"]}
        stored = client.responses.create(model="policy", input="Write at length.", max_output_tokens=8000, text={
            "format": {"type": "json_schema", "name": "long", "schema": long_text, "strict": True}})
        item = stored.output[-1]
        size = len(item.content[0].text)                          # a reply of over 2,000 characters
        references = 1_300_000 // 48                             # a 1.3 MB body of references to one reply
        assert references * size > 40 * server.max_length * 16   # 40 times what a context can hold
        body = json.dumps({"model": "policy", "max_output_tokens": 2,
                           "input": [{"type": "item_reference", "id": item.id}] * references}).encode()
        post = urllib.request.Request(f"{info.base_url}/responses", body, {
            "Authorization": f"Bearer {info.api_key}", "Content-Type": "application/json"})
        # sent raw: the SDK takes 44 s of the client's own CPU to prepare 27,000 items
        refusal, grown = peak_growth_mb(lambda: urllib.request.urlopen(post))
        assert isinstance(refusal, urllib.error.HTTPError) and refusal.code == 400, refusal
        error = json.loads(refusal.read())["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input", error
        assert grown < GROWTH_BOUND_MB, f"the server grew {grown} MB to refuse {references} item references"
        # the positive control: the reply referenced twice (two assistant items: one assistant message), then a
        # question, served token-exact
        ask = [{"type": "item_reference", "id": item.id}] * 2 + [{"role": "user", "content": "Again?"}]
        reply = client.responses.create(model="policy", max_output_tokens=2, input=ask)
        messages = [{"role": "assistant", "content": item.content[0].text * 2}, {"role": "user", "content": "Again?"}]
        rendered = data.render_prompt_text(server.tokenizer, messages, None, data.CHATML_TEMPLATE, True)
        assert reply.usage.input_tokens == len(data.encode_text(server.tokenizer, rendered))


# ---- the prefix cache: what one session's cached_tokens tell of another's prompt ----------------------------

PIN_SYSTEM = "You are a careful assistant. Remember what the user tells you and never repeat it."
CANDIDATE_PINS = [f"{d}{(37 * d + 11) % 1000:03d}" for d in range(10)]   # first digits differ: so do first tokens


def pin_messages(pin: str) -> list[dict]:
    return [{"role": "system", "content": PIN_SYSTEM}, {"role": "user", "content": f"My PIN is {pin}. Keep it."}]


def cached_tokens(client, messages: list[dict]) -> tuple[int, list[int]]:
    """(cached_tokens, the prompt's ids) of one request."""
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=2, seed=0,
                                           extra_body={"return_token_ids": True})
    return reply.usage.prompt_tokens_details.cached_tokens, reply.model_extra["prompt_token_ids"]


def test_a_probe_of_candidate_pins_reads_the_same_cached_tokens_for_every_candidate():
    """Session B tells the model its PIN; session A, which never saw it, sends the same text with each candidate and
    reads usage.prompt_tokens_details.cached_tokens. A's own earlier probes share the system prompt and 'My PIN is'
    with each probe (a warm-up probe first, so even the first candidate finds them): every candidate must read the
    same count, B's own included. B's own next turn still takes its first turn from the cache."""
    with serving() as server:
        victim = openai_client(server.create_session(sampling=SamplingParams(max_tokens=4)))
        secret = pin_messages(CANDIDATE_PINS[6])
        first = victim.chat.completions.create(model="policy", messages=secret, max_tokens=4, seed=0,
                                               extra_body={"return_token_ids": True})
        attacker = openai_client(server.create_session(sampling=SamplingParams(max_tokens=2)))
        _, opening = cached_tokens(attacker, pin_messages("none"))   # the warm-up: A's own entry of the opening
        probes = {pin: cached_tokens(attacker, pin_messages(pin)) for pin in CANDIDATE_PINS}
        counts = {pin: cached for pin, (cached, _) in probes.items()}
        assert len(set(counts.values())) == 1, f"the cached counts single out a PIN: {counts}"
        # and that count is what A itself sent before: the opening up to the PIN, nothing of B's
        assert all(cached == invariants.common_prefix_len(opening, ids) for cached, ids in probes.values())
        # B's own second turn: its first turn's prompt and reply, all but the last sampled id, from the cache
        again = victim.chat.completions.create(
            model="policy", max_tokens=4, seed=1, extra_body={"return_token_ids": True},
            messages=[*secret, first.choices[0].message.model_dump(), {"role": "user", "content": "Thanks."}])
        assert again.usage.prompt_tokens_details.cached_tokens == \
            len(first.model_extra["prompt_token_ids"]) + len(first.model_extra["token_ids"]) - 1


def test_a_groups_samples_share_the_task_prompt_and_nothing_a_sibling_sampled():
    """Sessions of one prompt group given the same task: a sibling's first request, the task as given, takes the
    task prompt's KV another sibling computed; a request that goes beyond the task (here, a sibling's sampled reply
    guessed exactly) takes nothing of the sibling's, and a session of another group takes nothing either."""
    task = [{"role": "user", "content": "What is 17 times 3? Think step by step."}]
    with serving() as server:
        def session(group: str):
            return openai_client(server.create_session(group_id=group, sampling=SamplingParams(max_tokens=6),
                                                       given=task))
        first = session("g1").chat.completions.create(model="policy", messages=task, max_tokens=6, seed=0,
                                                      extra_body={"return_token_ids": True})
        prompt = len(first.model_extra["prompt_token_ids"])
        assert cached_tokens(session("g1"), task)[0] == prompt - 1                  # the task prompt, shared
        guess = [*task, first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        assert cached_tokens(session("g1"), guess)[0] == 0                          # the sibling's reply: not reachable
        assert cached_tokens(session("g2"), task)[0] == 0                           # another group: nothing


# ---- a forced tool call whose patterns' automaton grows with every token the model writes ------------------

def growing_pattern(tool: int, request: int = 0) -> str:
    """A regex whose lexer states remember where the vowels and the s/t stood in the last 20-odd letters: each new
    window of text the model writes, and each token a mask step tries from it, is a new state of the automaton
    (about 100 a token, 0.5 kB each). `request` makes another spec of the same cost."""
    return f"^[a-z]*[aeiou][a-z]{{{15 + tool % 8}}}[a-z]*[st][a-z]{{{9 + (tool + request) % 4}}}$"


def pattern_tools(patterns: list[str]) -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{i}", "strict": True, "parameters": {
        "type": "object", "properties": {"k": {"type": "string", "pattern": p}}, "required": ["k"]}}}
        for i, p in enumerate(patterns)]


def test_forced_tools_whose_patterns_grow_the_lexer_stop_at_its_state_bound_and_a_few_patterns_replay_exactly():
    with serving() as server:
        tok = server.tokenizer
        info = server.create_session(sampling=SamplingParams(max_tokens=8, seed=0))
        # a hostile model: the string never closes (its quotes banned), so every token walks new lexer states; a
        # spec's grammar kept them for every later row of it, and each distinct spec its own (256 cached)
        never_close = {str(i): -100 for i in range(len(tok)) if '"' in tok.decode([i]) or "\\" in tok.decode([i])}

        def attacks() -> list:
            outcomes = []
            for request in range(4):
                try:
                    outcomes.append(openai_client(info, timeout=600).chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "Call a tool."}], max_tokens=3000,
                        tools=pattern_tools([growing_pattern(i, request) for i in range(120)]),
                        tool_choice="required", logit_bias=never_close, seed=0))
                except openai.APIStatusError as error:
                    outcomes.append(error)
            return outcomes
        outcomes, grown = peak_growth_mb(attacks)
        # 1,269 MB before the bound; the 13,229-token prompt of 120 tools costs 50-81 MB of it alone (tool_choice none)
        assert grown < 256, f"the server grew {grown} MB sampling 4 forced calls of 120 tools"
        for refusal in outcomes:
            assert isinstance(refusal, openai.BadRequestError), refusal
            assert "MAX_LEXER_STATES" in refusal.message, refusal.message
        assert trace_segments(info) == []                         # the cut turns are not recorded
        # the positive control: a few pattern-constrained tools, forced, sampled and replayed exactly
        info = server.create_session(sampling=SamplingParams(max_tokens=64, seed=0))
        patterns = ["^[a-z]{2,6}-[0-9]{3}$", "^(red|green|blue)$", growing_pattern(0)]
        reply = openai_client(info).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Call a tool."}], max_tokens=64,
            tools=pattern_tools(patterns), tool_choice="required", seed=0)
        call = reply.choices[0].message.tool_calls[0].function
        assert re.fullmatch(patterns[int(call.name[1:])], json.loads(call.arguments)["k"]), call
        rows = server.close_session(info.session_id).ledger.rows()
        constrained = [(s.constraint, t) for r in rows for s, t in zip(r.sampling, r.token_ids) if s.constraint]
        spec = constrained[0][0]
        assert {c for c, _ in constrained} == {spec}
        masks = constraints.replay_masks(spec, tok, [t for _, t in constrained], server.engine.vocab_size)
        assert all(masks[k, t] for k, (_, t) in enumerate(constrained))
