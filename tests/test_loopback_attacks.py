# Cheap attacks on the loopback server, over real HTTP against a real server on a real EmbeddedEngine (tiny models):
# a PNG decompression bomb (a few KB of request, gigapixels decoded), slowloris (half-sent requests held open),
# a flood of idle connections, one session's backlog of hung-up requests starving the others, and a malformed
# Authorization header whose key ends up in a log. Each is refused in the wire's own format where a reply is
# possible, and the server keeps serving. Limits are the server's constructor parameters, set small here so the
# attacks take seconds.
import base64
import contextlib
import json
import logging
import select
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
import zlib

import anthropic
import openai
import pytest

import data
import invariants
import models
from engines import SamplingParams
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
            # only the turn already generating ran; the three queued behind it left with their clients
            assert engine.held == 1 and server._sessions[flood.session_id][0].turns == 1
        finally:
            engine.gate.set()


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
