# loopback.py — the OpenAI (chat completions, responses) / Anthropic wire server over token-exact chat sessions.
#
# Owns: `LoopbackServer` and its HTTP plumbing: routes, keys, bounds on cheap clients, streaming; the standalone
# server (`python loopback.py --model ...`). What a turn records, and when it seals, is session.py's.
#
# `LoopbackServer` serves ChatSessions over HTTP, one session per rollout under /s/<id>/v1 with its own key:
# OpenAI chat completions, OpenAI responses and Anthropic messages (streaming or not; count_tokens too) all decode
# (wires/__init__.py, wires/responses.py, wires/anthropic.py) to the same canonical messages, through the same ChatSession.turn, so
# token accounting does not depend on the wire. A session's key reaches only its own session's routes. Opening (POST
# /sessions) and closing (DELETE /s/<id>) a session over HTTP is the operator's act, done with the server's admin key
# (made per server, or the operator's); a session's key is refused there, so an agent holding one cannot sample the
# policy outside its rollout. The admin key never reaches an agent (a ChatContext carries its session's URL and key
# only).
# Bad input is refused with a 4xx in the wire's own format before anything reaches the session, so nothing is
# recorded; every error page (aiohttp's own 404, 405 and parse errors included) is that JSON.
# Work is bounded before it is done: the body's size, the time it may take to arrive and the JSON values it may
# expand to (wires.max_json_values, counted before json.loads builds any; parsed off the loop), a prompt's text
# against the context before it is rendered, an image's pixels from its header before it is decoded (per image and
# per request); sessions opened over HTTP expire when idle and are capped. Cheap clients are bounded too: a
# connection must send each request head within idle_timeout_s (slowloris) and is closed when idle that long; past
# max_connections the oldest idle one is closed. A session's HTTP turns run one at a time, and the ones waiting hold
# no worker thread: one session's backlog delays another session's turn by at most the one turn it is generating
# (they share the engine's batch), and past max_session_requests awaiting their body, waiting or generating it gets
# a 429 with a Retry-After before its body is awaited, its connection closed: one session's connections never hold
# more than its share, so none of them pushes another session's newcomer out. A request whose client hangs up while
# it waits is dropped, never generated; one whose client hangs up mid-reply stops sampling at the next token and is
# dropped whole (session.TurnCut). No header value (a key) is ever logged or quoted in an error page. The one header
# a turn reads is the sub-agent a harness names (client_thread), which keeps its requests to lines of their own.
# A session's context (prompt and reply) is at most the model's position limit (the default, read from the
# engine's max_model_len); a prompt past it is refused in the wire's own words, the ones harnesses compact their
# conversation on (wires.ContextLengthExceeded: OpenAI's code context_length_exceeded, Anthropic's "prompt is too
# long"), streamed or not; a request without max_tokens gets the rest of the context, at most the server's max_tokens.
# Text is text: a special-token string inside a message reaches the model as characters (data.encode_text).
# Streaming sends each token's text as it is sampled. Images reach a VLM processed
# once per session, their pads expanded, and recorded with the row. Standalone (`python loopback.py
# --model ...`) it serves one model behind an EmbeddedEngine and opens sessions on `POST /sessions` (with the admin
# key it prints at start, or the operator's from TRACERL_LOOPBACK_ADMIN_KEY), so an agent author can check token
# capture before training (`GET /s/<id>/view`: the session's tokens as trainer/viewer.py's page). Never: computes rewards or
# trains.
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from aiohttp import web, web_protocol
from jinja2 import TemplateError

import data
import invariants
import models
import wires
from engines import SamplingParams
from rollout import EmbeddedEngine
from router import EngineFailure
from session import Budget, ChatSession, ContextOverflow, TurnCut, context_length, session_trace
from trainer import viewer
from wires import CALL_OPENING
from wires import anthropic as wire_anthropic
from wires import responses as wire_responses

log = logging.getLogger("tracerl.loopback")


# ---- the server ---------------------------------------------------------------------------------

@dataclass
class SessionInfo:
    session_id: str
    api_key: str                   # send as `Authorization: Bearer <key>` (OpenAI) or `x-api-key` (Anthropic)
    base_url: str                  # http://HOST:PORT/s/<id>/v1 — OpenAI(base_url=...)
    session_url: str               # http://HOST:PORT/s/<id> — Anthropic(base_url=...); DELETE it (admin key) to close
    trace_url: str                 # http://HOST:PORT/s/<id>/trace — the session's segments, token by token
    view_url: str                  # http://HOST:PORT/s/<id>/view — the same, as a page (trainer/viewer.py)


MAX_BODY_BYTES = 32 * 2**20            # a request body larger than this is refused with a 413
BODY_ABANDONED = web.RequestKey("body_abandoned", bool)   # set when the rest of a body will never be read
ADMIN_KEY_ENV = "TRACERL_LOOPBACK_ADMIN_KEY"   # the standalone server's admin key, when the operator sets one
ADMIN_KEY_RULE = "an admin key must be at least 16 printable ASCII characters without spaces (a header carries it)"


def admin_key_is_valid(key: str) -> bool:
    return len(key) >= 16 and key.isascii() and key.isprintable() and len(key.split()) == 1


def _presented_key(request: web.BaseRequest) -> str:
    """The key a request presents, as 'Authorization: Bearer <key>' (RFC 7235: the scheme is case-insensitive) or
    'x-api-key: <key>'; "" for none, and for one that is not ASCII text (no key of ours)."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    key = credentials.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    return key if key.isascii() else ""


def _wire_of(request: web.BaseRequest) -> str:
    """Which wire's error format a request gets: Anthropic's on its messages routes (count_tokens too), OpenAI's
    everywhere else (the Responses API's errors before a stream are OpenAI's error JSON too)."""
    return "anthropic" if "/v1/messages" in request.path else "openai"


def client_thread(request: web.BaseRequest) -> str:
    """The sub-agent a harness names on its request (wires.TurnOptions.thread: the session routes its requests to lines
    of their own): Claude Code's x-claude-code-agent-id; on a Codex request that names a parent thread, its own
    thread_id in x-codex-turn-metadata (the parent's id, for metadata it cannot read). "" for the agent the harness
    started with, and for any client that names none."""
    headers = request.headers
    if "x-codex-parent-thread-id" in headers:
        try:
            return str(json.loads(headers.get("x-codex-turn-metadata", ""))["thread_id"])
        except (ValueError, TypeError, KeyError):
            return f"parent:{headers['x-codex-parent-thread-id']}"
    return headers.get("x-claude-code-agent-id", "")


def _error_response(wire: str, error: wires.WireError, headers=None) -> web.Response:
    return web.json_response(error.body(wire), status=error.status, headers=headers)


# Headers, not only bodies, are parsed into log lines and error pages: no header value is ever logged or echoed
# (a malformed `Authorization` line would carry the session's key), so the access log has no header field.
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf'


@dataclass
class _Lane:
    """Where a session's HTTP turns wait for the one before them, and the Responses they stored."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # waiting here holds no worker thread
    in_flight: int = 0             # requests awaiting their body, waiting or generating (max_session_requests)
    responses: wire_responses.ResponseStore = field(default_factory=wire_responses.ResponseStore)


IN_LANE = web.RequestKey("in_lane", _Lane)    # the session whose max_session_requests this request counts against


class _Connection(web_protocol.RequestHandler):
    """aiohttp's connection handler, bounded for cheap clients. A connection must deliver a whole request head within
    `idle_timeout_s` of opening (aiohttp's keep-alive clock, the same length, runs from each reply on); past
    `max_connections`, the oldest connection not serving a request is closed to make room (a new one when all are
    serving). Its own error pages (a request it cannot parse: a bad request line, header or chunk) are JSON in the
    wire's error format, and neither they nor the log quote the bytes that failed."""

    def __init__(self, manager, *, loop, idle_timeout_s: float, max_connections: int):
        super().__init__(manager, loop=loop, keepalive_timeout=idle_timeout_s, access_log_format=ACCESS_LOG_FORMAT)
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
        self.requests, self.serving = 0, 0     # request heads received; handlers running (kept by the middleware)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._loop.call_later(self.idle_timeout_s, lambda: self.requests or self.force_close())
        open_ = [c for c in self._manager.connections if c.transport is not None]   # not closing yet; oldest first
        if len(open_) > self.max_connections:
            idle = [c for c in open_ if c is not self and not c.serving]
            (idle[0] if idle else self).force_close()

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        if status >= 500:   # a failure of ours, with its traceback
            log.error("loopback: error serving %s %s", request.method, request.path, exc_info=exc)
            error = wires.WireError(status, "internal error", "api_error")
        else:               # the parser's message quotes the offending line (a header's value: a key); its first
            reason = str(getattr(exc, "message", None) or message or status).split(":")[0].strip()   # words only
            log.warning("loopback: refused an unparsable request (%d): %s", status, reason)
            error = wires.WireError(status, f"{reason} (the offending line is not quoted back)")
        if request.writer.output_size > 0:
            raise ConnectionError("a reply was already under way; the connection is dropped")
        response = _error_response(_wire_of(request), error)
        response.force_close()
        return response


class LoopbackServer:
    """OpenAI (chat completions and responses) and Anthropic HTTP wires over ChatSessions, on an aiohttp loop in a
    background thread.
    engine.generate runs in a thread pool, so the loop keeps serving other sessions while one generates.
    Concurrent sessions' turns share the engine's batch (EmbeddedEngine batches concurrent callers)."""

    def __init__(self, engine, tokenizer, template: str | None = None, model_name: str = "policy",
                 host: str = "127.0.0.1", port: int = 0, max_length: int | None = None, image_processor=None,
                 body_timeout_s: float = 60.0, session_ttl_s: float = 3600.0, max_open_sessions: int = 1024,
                 idle_timeout_s: float = 30.0, max_connections: int = 512, max_session_requests: int = 8,
                 admin_key: str | None = None, max_tokens: int | None = None):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        # Opening and closing sessions over HTTP needs this key: the operator's, or one made here for this server alone
        # (its owner reads it from .admin_key). It is no session's key, and no agent is handed it.
        if admin_key is not None and not admin_key_is_valid(admin_key):
            raise ValueError(ADMIN_KEY_RULE)
        self.admin_key = admin_key or f"sk-loopback-admin-{secrets.token_urlsafe(32)}"
        self.image_processor = image_processor     # a VLM's (models.load_image_processor); None = text only
        self.model_name, self.host, self.port = model_name, host, port
        # A session's context (prompt and reply) is at most max_length: by default the most the engine serves, its
        # model's position limit, and never more (a prompt past it is refused, never served). A request that does
        # not set max_tokens gets the rest of the context, at most max_tokens (None: no bound beyond the context).
        self.max_length = context_length(engine, max_length)
        if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None (the rest of the context), got "
                             f"{max_tokens!r}")
        self.max_tokens = max_tokens
        self.body_timeout_s = body_timeout_s       # a request body that takes longer to arrive is refused (408)
        self.max_body_values = wires.max_json_values(self.max_length)   # a body with more is refused before parsing
        # Sessions opened over HTTP (POST /sessions) have no owner in this process to close them: they expire
        # after session_ttl_s without a request, and at most max_open_sessions are open at once (429 beyond).
        # Sessions made by create_session() belong to their caller (a runner), which closes them for the ledger.
        self.session_ttl_s, self.max_open_sessions = session_ttl_s, max_open_sessions
        # Cheap clients: a connection gets idle_timeout_s to deliver each request head (slowloris) and to stay open
        # idle; past max_connections the oldest idle one is closed (the default leaves room under a 1024-descriptor
        # ulimit). A session's HTTP turns run one at a time; over max_session_requests waiting or generating, a
        # request is refused with a 429 and a Retry-After.
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
        self.max_session_requests = max_session_requests
        self._sessions: dict[str, tuple[ChatSession, str, _Lane]] = {}   # id -> (session, api key, its HTTP turns)
        self._http_sessions: set[str] = set()      # the ids opened over HTTP
        self._registry_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="loopback-generate")
        # traces, pages and request bodies are read here, never behind turns
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="loopback-read")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (called from synchronous code) --

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port."""
        ready, failure = threading.Event(), []
        self._thread = threading.Thread(target=self._serve, args=(ready, failure), name="loopback-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"loopback server could not listen on {self.host}:{self.port}: {failure[0]}")
        return self.port

    def _serve(self, ready: threading.Event, failure: list) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        for method, path, handler in [("GET", "/s/{sid}/v1/models", self._models),
                                      ("POST", "/s/{sid}/v1/chat/completions", self._chat),
                                      ("POST", "/s/{sid}/v1/messages", self._messages),
                                      ("POST", "/s/{sid}/v1/responses", self._responses),
                                      ("POST", "/s/{sid}/v1/messages/count_tokens", self._count_tokens),
                                      ("GET", "/s/{sid}/trace", self._trace),
                                      ("GET", "/s/{sid}/view", self._view),
                                      ("POST", "/sessions", self._open),
                                      ("DELETE", "/s/{sid}", self._close)]:
            app.router.add_route(method, path, handler)
        # handler_cancellation: a client that hangs up cancels its handler, so a turn still waiting leaves its queue
        runner, listening = web.AppRunner(app, handler_cancellation=True), None
        try:
            self._loop.run_until_complete(runner.setup())
            def protocol() -> _Connection:
                return _Connection(runner.server, loop=self._loop, idle_timeout_s=self.idle_timeout_s,
                                   max_connections=self.max_connections)
            listening = self._loop.run_until_complete(self._loop.create_server(protocol, self.host, self.port))
            self.port = listening.sockets[0].getsockname()[1]
        except Exception as error:        # reported by start(), which would otherwise wait forever
            failure.append(error)
        ready.set()
        if failure:
            return
        self._loop.run_forever()
        listening.close()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = None
        self._executor.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    # -- the session registry --

    def create_session(self, rollout_id: str | None = None, group_id: str = "", sampling: SamplingParams | None = None,
                       max_length: int | None = None, given: list[dict] | None = None,
                       budget: Budget | None = None) -> SessionInfo:
        """Open a session for its caller, who closes it (close_session hands back its ledger); it never expires.
        `given`: the task's messages, the same for every session of the group (its samples share their prompt's KV:
        engines/prefix_cache.py). `budget`: what its rollout may sample in all (session.Budget; None: no bound beyond
        the context)."""
        return self._new_session(rollout_id, group_id, sampling, max_length, over_http=False, given=given,
                                 budget=budget)

    def _new_session(self, rollout_id: str | None, group_id: str, sampling: SamplingParams | None,
                     max_length: int | None, over_http: bool, given: list[dict] | None = None,
                     budget: Budget | None = None) -> SessionInfo:
        if self._thread is None:
            raise RuntimeError("start() the server before creating sessions: their URLs carry the bound port")
        session_id = secrets.token_hex(8)
        api_key = f"sk-loopback-{secrets.token_urlsafe(24)}"
        context = max_length or self.max_length
        session = ChatSession(self.engine, self.tokenizer, rollout_id or session_id, group_id, self.template,
                              sampling or self._sampling(context), context, self.image_processor, given,
                              budget)
        with self._registry_lock:
            if over_http:
                self._expire_idle()
                if len(self._http_sessions) >= self.max_open_sessions:
                    raise wires.WireError(429, f"{len(self._http_sessions)} sessions are open, this server's limit; "
                                               f"close one (DELETE /s/<id>) or wait for idle ones to expire after "
                                               f"{self.session_ttl_s:.0f} s", "rate_limit_error")
                self._http_sessions.add(session_id)
            self._sessions[session_id] = (session, api_key, _Lane())
        session_url = f"http://{self.host}:{self.port}/s/{session_id}"
        return SessionInfo(session_id, api_key, f"{session_url}/v1", session_url, f"{session_url}/trace",
                           f"{session_url}/view")

    def _sampling(self, context: int) -> SamplingParams:
        """A session's default sampling: a reply may take the rest of its context, at most the server's max_tokens
        (what the APIs do for a request without max_tokens; Anthropic's always sets it)."""
        return SamplingParams(max_tokens=min(self.max_tokens or context, context))

    def close_session(self, session_id: str) -> ChatSession:
        """Forget the session (its URLs answer 404 from now on) and hand back its ChatSession and ledger."""
        with self._registry_lock:
            if session_id not in self._sessions:
                raise KeyError(f"no open session {session_id!r}; open sessions: {sorted(self._sessions)[:5]}")
            self._http_sessions.discard(session_id)
            return self._sessions.pop(session_id)[0]

    def _expire_idle(self) -> None:
        """Forget HTTP-opened sessions idle (no request, no turn running) for longer than session_ttl_s. Call
        with the registry lock held."""
        now = time.monotonic()
        for session_id in list(self._http_sessions):
            session, _, lane = self._sessions[session_id]
            if not lane.in_flight and not session.lock.locked() and now - session.last_used > self.session_ttl_s:
                self._http_sessions.discard(session_id)
                del self._sessions[session_id]

    # -- request plumbing --

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every refusal in the wire's own JSON error format: ours (WireError), the router's (404, 405), a turn no
        engine could serve (503: the SDKs retry it, and the session recorded nothing) and, as a last resort, an
        unexpected error (500, logged with its traceback). It also tells the connection a request is being served."""
        connection = request.protocol
        connection.requests += 1
        connection.serving += 1
        try:
            return await handler(request)
        except wires.WireError as error:
            headers = {"Retry-After": "1"} if error.status == 429 else None   # the SDKs wait this long, then retry
            response = _error_response(_wire_of(request), error, headers)
            if request.get(BODY_ABANDONED):
                response.force_close()    # the connection's byte stream is unusable: close it after this reply
        except EngineFailure as error:   # no engine could serve the turn (counted by the router); nothing committed
            log.warning("loopback: %s %s: %s", request.method, request.path, error)
            response = _error_response(_wire_of(request), wires.WireError(
                503, f"no engine could serve this turn; retry it (nothing was recorded): {str(error)[:300]}",
                "api_error"))
        except web.HTTPException as error:
            if error.status < 400:
                raise
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status, "api_error")
            headers = {k: v for k, v in error.headers.items() if k in ("Allow",)}
            message = f"{error.reason}: {request.method} {request.path}" + \
                (f" (allowed: {headers['Allow']})" if "Allow" in headers else "")
            response = _error_response(_wire_of(request), wires.WireError(error.status, message, kind), headers)
        except Exception as error:
            log.exception("loopback: unexpected error serving %s %s", request.method, request.path)
            response = _error_response(_wire_of(request), wires.WireError(
                500, f"internal error: {type(error).__name__}: {str(error)[:200]}", "api_error"))
        finally:
            connection.serving -= 1
            if (lane := request.get(IN_LANE)) is not None:     # counted from its body's wait (_body) to here
                lane.in_flight -= 1
        return response

    def _authorize(self, request: web.Request) -> tuple[ChatSession, _Lane]:
        session_id = request.match_info["sid"]
        with self._registry_lock:
            self._expire_idle()
            entry = self._sessions.get(session_id)
        if entry is None:
            raise wires.WireError(404, f"no session {session_id!r} on this server (closed, expired, or never "
                                       "created); create one with POST /sessions (the admin key) or "
                                       "LoopbackServer.create_session", "not_found_error")
        if not hmac.compare_digest(_presented_key(request).encode(), entry[1].encode()):
            raise wires.WireError(401, f"wrong or missing API key for session {session_id!r}; send this session's "
                                       "key as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                  "authentication_error")
        entry[0].last_used = time.monotonic()      # any authorized request keeps a session alive
        return entry[0], entry[2]

    def _authorize_admin(self, request: web.Request) -> None:
        """Opening and closing sessions: the admin key only. Checked before anything else is read, so a client
        without it learns nothing (not even which sessions exist)."""
        key = _presented_key(request)
        how = ("send this server's admin key as 'Authorization: Bearer <key>' or 'x-api-key: <key>' (python "
               f"loopback.py prints it at start, or takes it from {ADMIN_KEY_ENV})")
        if not key:
            raise wires.WireError(401, f"opening or closing a session needs the admin key; {how}",
                                  "authentication_error")
        if not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise wires.WireError(403, f"this key cannot open or close sessions, which needs the admin key (a "
                                       f"session's key reaches only its own session's routes); {how}",
                                  "permission_error")

    async def _body(self, request: web.Request, lane: _Lane | None = None, optional: bool = False) -> dict:
        """The request's JSON body, parsed off the loop. A session's request (`lane`) counts against its
        max_session_requests from now until it is answered: past them it is refused before its body is awaited, and
        its connection closed, so one session's connections awaiting bodies that never come hold at most its share
        of the server's, and never push another session's newcomer out (_Connection)."""
        if lane is not None:
            if lane.in_flight >= self.max_session_requests:
                self._abandon_body(request)
                raise wires.WireError(429, f"this session already has {lane.in_flight} requests awaiting their "
                                           f"body, waiting or generating, this server's limit (its turns run one at "
                                           f"a time); retry when one is answered", "rate_limit_error")
            lane.in_flight += 1
            request[IN_LANE] = lane
        try:
            async with asyncio.timeout(self.body_timeout_s):     # in this task: a body already here is read at once
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise wires.WireError(413, f"the request body is over this server's limit of {MAX_BODY_BYTES // 2**20} "
                                       "MiB; send smaller images or a shorter conversation",
                                  "request_too_large") from None
        except asyncio.TimeoutError:
            self._abandon_body(request)
            raise wires.WireError(408, f"the request body did not arrive within {self.body_timeout_s:.0f} s; send it "
                                       "whole", "timeout_error") from None
        except web.RequestPayloadError as error:       # a corrupt Content-Encoding, a broken chunk
            self._abandon_body(request)
            raise wires.WireError(400, f"the request body could not be read: {str(error).strip()}") from None
        except ConnectionResetError:                    # the client hung up mid-body: nobody is left to answer
            raise wires.WireError(400, "the client closed the connection before sending the whole body") from None
        if optional and not raw.strip():
            return {}
        # off the loop (json.loads holds the GIL, but only for what max_json_values lets through; the structure
        # check runs in slices), so another session's request is answered meanwhile
        return await asyncio.get_running_loop().run_in_executor(self._reads, wires.parse_body, raw,
                                                                self.max_body_values)

    @staticmethod
    def _abandon_body(request: web.Request) -> None:
        """Give up on the rest of a body that stalled or cannot be decoded: mark it ended, so aiohttp does not
        wait for (or re-raise on) it after the reply, and have the reply close the connection."""
        request.content.feed_eof()
        request[BODY_ABANDONED] = True

    async def _turn(self, session: ChatSession, lane: _Lane, request: wires.WireRequest,
                    on_token=None) -> wires.ChatTurn:
        """One turn of the session, after the ones before it. A client that hangs up while its turn waits cancels it
        (nothing generated); one that hangs up while it generates stops its sampling at the next token, and the turn
        is dropped whole (session.TurnCut: nothing recorded, counted in session.cut_turns), as vLLM's server aborts
        a disconnected request: a harness killed mid-reply no longer keeps the engine sampling toward the whole
        context. The next turn waits until the engine has let go of it."""
        hung_up = threading.Event()
        return await self._in_lane(lane, request, session.turn, request.messages, request.tools, request.sampling,
                                   on_token, request.options, hung_up, hung_up=hung_up)

    async def _in_lane(self, lane: _Lane, request: wires.WireRequest, work, *args, hung_up=None):
        """`work(*args)` on a worker thread after the session's requests before it (turns, token counts: both read
        the record), waiting in the lane without holding a thread (counted against max_session_requests since its
        body: _body). A prompt over the context is refused naming the request's prompt field."""
        try:
            async with lane.lock:
                generating = asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
                try:
                    return await asyncio.shield(generating)
                except asyncio.CancelledError:            # the client hung up
                    if hung_up is not None:
                        hung_up.set()
                    await asyncio.wait([generating])      # the lane stays held until the engine has let go
                    if not generating.cancelled() and isinstance(generating.exception(), TurnCut):
                        log.info("loopback: %s", generating.exception())
                    raise
        except ContextOverflow as error:        # in the wire's own words, which harnesses compact their context on
            raise wires.ContextLengthExceeded(error.prompt_tokens, error.context, str(error),
                                              request.prompt_field) from None
        except (ValueError, TemplateError) as error:   # a bad image, a template that refuses
            raise wires.WireError(400, str(error)) from None

    async def _stream(self, request: web.Request, session: ChatSession, lane: _Lane,
                      wire_request: wires.WireRequest,
                      stream: wires.LiveStream) -> web.StreamResponse:
        """Serve one turn as server-sent events, text sent as its tokens are sampled. Nothing is sent before
        the first token, so a request refused by the session is still a plain 4xx. A client that hangs up cuts the
        turn (_turn), and this handler ends once the engine has let go of it."""
        loop = asyncio.get_running_loop()
        sampled: asyncio.Queue = asyncio.Queue()

        def on_token(prompt_ids: list[int], token_id: int, call_prefix: str) -> None:   # on the engine's thread
            loop.call_soon_threadsafe(sampled.put_nowait, (prompt_ids, token_id, call_prefix))

        job = asyncio.ensure_future(self._turn(session, lane, wire_request, on_token))
        job.add_done_callback(lambda done: done.cancelled() or done.exception())   # retrieved even if we hang up
        opening = CALL_OPENING if wire_request.options.tool_choice in ("required", "named") else ""
        live, response = wires.LiveText(self.tokenizer, wire_request.sampling.stop, opening), None
        try:
            while not (job.done() and sampled.empty()):
                arrival = asyncio.ensure_future(sampled.get())
                try:
                    await asyncio.wait({arrival, job}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:    # the client hung up: no task is left waiting on the queue
                    arrival.cancel()
                    raise
                if not arrival.done():
                    arrival.cancel()
                    continue
                prompt_ids, token_id, call_prefix = arrival.result()
                if response is None:
                    response = await self._open_stream(request, stream.start(prompt_ids))
                await self._send(response, stream.push(live, token_id, call_prefix))
            try:
                turn = job.result()
            except Exception as error:
                if response is None:      # nothing sent yet: a plain error reply (the middleware formats it)
                    raise
                if isinstance(error, EngineFailure):
                    log.warning("loopback: a streamed turn lost its engine after its first token: %s", error)
                    error = wires.WireError(503, "the engine serving this turn failed; retry it (nothing was "
                                                 "recorded)", "api_error")
                elif not isinstance(error, wires.WireError):
                    log.error("loopback: a streamed turn failed after its first token", exc_info=error)
                    error = wires.WireError(500, f"internal error: {type(error).__name__}", "api_error")
                await self._send(response, stream.failure(error))
                return response
            if response is None:          # a retry answered from the record: no token was sampled live
                response = await self._open_stream(request, stream.start(turn.generation.prompt_ids))
            await self._send(response, stream.finish(turn, live.rest(turn.message["content"])))
            if stream.done_marker:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as hang_up:   # a write failed, or the handler was
            job.cancel()                                                    # cancelled: the client is gone
            await asyncio.wait([job])
            if isinstance(hang_up, asyncio.CancelledError):
                raise
        # aiohttp needs a response even when nobody is left to read it (it is never sent on a closed connection)
        return response if response is not None else web.Response(status=499)

    async def _open_stream(self, request: web.Request, first_events: list) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await self._send(response, first_events)
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, events: list[tuple[str | None, dict]]) -> None:
        for name, event in events:
            head = f"event: {name}\n" if name else ""
            await response.write(f"{head}data: {json.dumps(event)}\n\n".encode())

    # -- endpoints --

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                              "owned_by": "tracerl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session, lane = self._authorize(request)
        wire_request = wires.decode_openai(await self._body(request, lane), session.sampling)
        wire_request.options.thread = client_thread(request)
        reply_id = f"chatcmpl-{secrets.token_hex(8)}"
        if wire_request.stream:
            stream = wires.OpenAIStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, lane, wire_request, stream)
        turn = await self._turn(session, lane, wire_request)
        return web.json_response(wires.openai_reply(turn, wire_request, self.tokenizer, self.model_name, reply_id))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session, lane = self._authorize(request)
        wire_request = wire_anthropic.decode_anthropic(await self._body(request, lane), session.sampling,
                                                      session.text_bound)
        wire_request.options.thread = client_thread(request)
        reply_id = f"msg_{secrets.token_hex(12)}"
        if wire_request.stream:
            stream = wire_anthropic.AnthropicStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, lane, wire_request, stream)
        turn = await self._turn(session, lane, wire_request)
        return web.json_response(wire_anthropic.anthropic_reply(turn, wire_request, self.model_name, reply_id))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        session, lane = self._authorize(request)
        decoded = wire_responses.decode_responses(await self._body(request, lane), session.sampling, lane.responses,
                                                  session.text_bound)
        decoded.request.options.thread = client_thread(request)
        reply_id = f"resp_{secrets.token_hex(12)}"
        if decoded.request.stream:
            stream = wire_responses.ResponsesStream(decoded, self.tokenizer, self.model_name, reply_id,
                                                    lane.responses)
            return await self._stream(request, session, lane, decoded.request, stream)
        turn = await self._turn(session, lane, decoded.request)
        reply = wire_responses.responses_reply(turn, decoded, self.tokenizer, self.model_name, reply_id)
        lane.responses.remember(reply_id, decoded, turn, reply["output"])
        return web.json_response(reply)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """POST /s/<id>/v1/messages/count_tokens: {"input_tokens": n}, the prompt a turn with this request would get
        (its line found, its record extended as a turn's would be), from the session's own rendering and encoding;
        nothing is generated or recorded. It waits in the session's lane, as a turn does (it reads the record)."""
        session, lane = self._authorize(request)
        wire_request = wire_anthropic.decode_anthropic_count(await self._body(request, lane), session.sampling,
                                                            session.text_bound)
        wire_request.options.thread = client_thread(request)
        ids = await self._in_lane(lane, wire_request, session.prompt_ids, wire_request.messages, wire_request.tools,
                                  wire_request.options)
        return web.json_response({"input_tokens": len(ids)})

    async def _trace(self, request: web.Request) -> web.Response:
        session = self._authorize(request)[0]
        trace = await asyncio.get_running_loop().run_in_executor(self._reads, session_trace, session, self.tokenizer)
        return web.json_response(trace)

    async def _view(self, request: web.Request) -> web.Response:
        """GET /s/<id>/view (the session's key, as for its trace): the trace as trainer/viewer.py's page, every token of
        every segment coloured and labelled, one HTML file to save and open."""
        session = self._authorize(request)[0]
        trace = await asyncio.get_running_loop().run_in_executor(self._reads, session_trace, session, self.tokenizer)
        return web.Response(text=viewer.render(viewer.session_page(trace)), content_type="text/html")

    async def _open(self, request: web.Request) -> web.Response:
        """POST /sessions (the admin key): an optional {temperature, max_tokens, max_length} body sets the session's
        defaults; the reply carries its id, key and URLs."""
        self._authorize_admin(request)
        body = await self._body(request, optional=True)
        wires.refuse_unknown_keys(body, {"temperature", "max_tokens", "max_length"})
        max_length = wires.number_field(body, "max_length", integer=True)
        wires.require(max_length is None or 1 < max_length <= self.max_length,
                      f"'max_length' must be an integer in [2, {self.max_length}] (the server's --max-length), "
                      f"got {max_length}")
        sampling = wires.sampling_from(self._sampling(max_length or self.max_length), body,
                                       max_tokens=wires.number_field(body, "max_tokens", integer=True))
        return web.json_response(asdict(self._new_session(None, "", sampling, max_length, over_http=True)))

    async def _close(self, request: web.Request) -> web.Response:
        """DELETE /s/<id> (the admin key: a session's own key can no more close a session than open one). The reply
        says what a rollout of the session trains (every line), after invariant 1's check of it: each sampled token
        trainable exactly once (invariants.check_sampled_once; a ledger that lost or doubled one answers 500)."""
        self._authorize_admin(request)
        try:
            session = self.close_session(request.match_info["sid"])
        except KeyError:                  # never opened, expired, or closed already
            raise wires.WireError(404, f"no open session {request.match_info['sid']!r} on this server",
                                  "not_found_error") from None
        with session.ledger_lock:         # a turn still generating commits before this read or after it
            rows, generations = session.record("all")
        invariants.check_sampled_once(rows, generations)
        return web.json_response({"session_id": request.match_info["sid"], "closed": True, "rows": len(rows),
                                  "trainable_tokens": sum(row.num_trainable for row in rows)})


# ---- standalone: serve one model until interrupted ---------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve a model on token-exact OpenAI (chat completions, responses) and Anthropic wires. Open a "
                    "session with `POST /sessions` and the admin key, point an SDK at its base_url with its api_key, "
                    "read what the trainer would see at its trace_url (as a page at <session_url>/view), close it "
                    "with `DELETE /s/<id>` and the admin key (its reply: the rows and trainable tokens a rollout of it "
                    "trains, each sampled token checked trainable exactly once).")
    parser.add_argument("--model", required=True, help="a model folder, or one of " + ", ".join(models.MODEL_NAMES))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--template", choices=["chatml", "model"], default="model",
                        help="chat template: the model's own (default) or tracerl's ChatML")
    parser.add_argument("--max-length", type=int, default=None,
                        help="most tokens a session's context may hold, prompt and reply (default: the model's "
                             "position limit, the most it may be given)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="most tokens of a reply whose request does not set max_tokens (default: the rest of the "
                             "context, as the APIs do)")
    parser.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV) or None,
                        help=f"the key that opens and closes sessions (default: ${ADMIN_KEY_ENV}, else a new one, "
                             f"printed at start); prefer the variable: a command line is visible to other users")
    args = parser.parse_args()
    if args.admin_key is not None and not admin_key_is_valid(args.admin_key):
        parser.error(ADMIN_KEY_RULE)          # before the model loads
    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = EmbeddedEngine(models.load_model(path).to(device), tokenizer=tokenizer)   # sessions share its batch
    template = data.CHATML_TEMPLATE if args.template == "chatml" else None
    try:
        server = LoopbackServer(engine, tokenizer, template, args.model, args.host, args.port, args.max_length,
                                models.load_image_processor(path), admin_key=args.admin_key, max_tokens=args.max_tokens)
    except ValueError as error:           # a context past the model's position limit, a max_tokens below 1
        parser.error(str(error))
    port = server.start()
    print(f"context: {server.max_length} tokens a session (the model's position limit: {engine.max_model_len})",
          flush=True)
    # printed once, and only a key made here: an operator's own stays out of the log
    print(f"admin key (POST /sessions, DELETE /s/<id>; never give it to an agent): "
          f"{'the one given' if args.admin_key else server.admin_key}", flush=True)
    print(f"tracerl loopback serving {args.model} at http://{args.host}:{port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
